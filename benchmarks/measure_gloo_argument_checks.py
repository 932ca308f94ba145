"""What real gloo says to arguments a hook can get wrong: dtypes, roots, tags, layouts.

    python benchmarks/measure_gloo_argument_checks.py

Two gloo processes (``_gloo``); every case runs the same call on both ranks (so a case that
fails fails on both, and the world stays in step), then ``wait()``. One line per case from
rank 0: ``ok``, or where it failed (``call``/``wait``), the exception's type and its
message's first line. docs/gloo-facts.md ("Argument checks") records the answers; the
simulator's checks follow them (simcluster/fake/process_group.py).
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from _gloo import spawn_worlds

DTYPES = (torch.int16, torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64)


def _cases(rank: int, world: int) -> dict[str, Callable[[], Any]]:
    def t(dtype: torch.dtype = torch.float32, n: int = 4) -> torch.Tensor:
        return torch.ones(n).to(dtype)

    cases: dict[str, Callable[[], Any]] = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        cases[f"broadcast {name}"] = lambda d=dtype: dist.broadcast(t(d), 0, async_op=True)
        cases[f"all_gather {name}"] = lambda d=dtype: dist.all_gather([t(d) for _ in range(world)], t(d), async_op=True)
        cases[f"all_gather_into_tensor {name}"] = lambda d=dtype: dist.all_gather_into_tensor(
            t(d, 4 * world), t(d), async_op=True)
        cases[f"gather {name}"] = lambda d=dtype: dist.gather(
            t(d), [t(d) for _ in range(world)] if rank == 0 else None, 0, async_op=True)
        cases[f"scatter {name}"] = lambda d=dtype: dist.scatter(
            t(d), [t(d) for _ in range(world)] if rank == 0 else None, 0, async_op=True)
        cases[f"all_to_all {name}"] = lambda d=dtype: dist.all_to_all(
            [t(d) for _ in range(world)], [t(d) for _ in range(world)], async_op=True)
        cases[f"all_to_all_single {name}"] = lambda d=dtype: dist.all_to_all_single(
            t(d, 2 * world), t(d, 2 * world), async_op=True)
        cases[f"send/recv {name}"] = lambda d=dtype: (dist.isend(t(d), 1) if rank == 0 else dist.irecv(t(d), 0))
        cases[f"all_reduce {name}"] = lambda d=dtype: dist.all_reduce(t(d), async_op=True)
    for root in (world, -1):  # no rank is the root: no rank passes a list
        cases[f"broadcast src={root}"] = lambda r=root: dist.broadcast(t(), r, async_op=True)
        cases[f"reduce dst={root}"] = lambda r=root: dist.reduce(t(), r, async_op=True)
        cases[f"gather dst={root}"] = lambda r=root: dist.gather(t(), None, r, async_op=True)
        cases[f"scatter src={root}"] = lambda r=root: dist.scatter(t(), None, r, async_op=True)
    cases["send/recv tag=-3"] = lambda: (dist.isend(t(), 1, tag=-3) if rank == 0 else dist.irecv(t(), 0, tag=-3))
    noncontiguous = lambda: torch.zeros(3, 3).t()  # noqa: E731
    cases["send/recv non-contiguous"] = lambda: (dist.isend(noncontiguous(), 1) if rank == 0
                                                 else dist.irecv(noncontiguous(), 0))
    cases["all_to_all_single non-contiguous input"] = lambda: dist.all_to_all_single(
        torch.zeros(2 * world, 2), torch.zeros(2, 2 * world).t(), async_op=True)
    cases["all_to_all_single non-contiguous output"] = lambda: dist.all_to_all_single(
        torch.zeros(2, 2 * world).t(), torch.zeros(2 * world, 2), async_op=True)
    cases["all_to_all outputs of 2, inputs of 1"] = lambda: dist.all_to_all(
        [torch.zeros(2) for _ in range(world)], [torch.ones(1) for _ in range(world)], async_op=True)
    cases["all_to_all 3 inputs"] = lambda: dist.all_to_all(
        [torch.zeros(1) for _ in range(world)], [torch.ones(1) for _ in range(world + 1)], async_op=True)
    cases["reduce_scatter list too long"] = lambda: dist.reduce_scatter(
        t(), [t() for _ in range(world + 1)], async_op=True)
    for given, out in ((torch.float32, torch.float64), (torch.float16, torch.float32), (torch.int32, torch.int64),
                       (torch.uint8, torch.int8), (torch.bfloat16, torch.bool)):
        cases[f"all_gather_into_tensor {given} into {out}"] = lambda g=given, o=out: dist.all_gather_into_tensor(
            torch.zeros(4 * world, dtype=o), t(g), async_op=True)
    return cases


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    for name, case in _cases(rank, world).items():
        try:
            work = case()
        except Exception as exc:  # noqa: BLE001 - the answer
            outcome = f"call: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        else:
            try:
                if work is not None:
                    work.wait()
                outcome = "ok"
            except Exception as exc:  # noqa: BLE001 - the answer
                outcome = f"wait: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if rank == 0:
            print(f"{name:45s} {outcome}", flush=True)
        dist.all_reduce(torch.zeros(1))  # in step (not a barrier: gloo's re-raises an earlier failure)
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_worlds(run, [(2, 29671)])
