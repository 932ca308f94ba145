"""Measure what real DDP's reducer makes of a hook's future by the *kind* of future it is.

DDP's Python-hook path reads the future's value as a Python object. A future Python made
(``torch.futures.Future()``, a ``then`` child) holds its value as one; a future C++ made —
a collective's own ``work.get_future()``, ``torch.futures.collect_all(...)`` — holds a C++
value (a tensor list, a list of futures), which that path refuses before any cast.

Real ``DistributedDataParallel`` (torch 2.13, CPU) over ``Linear(3, 1)`` on a real two-rank
gloo world (localhost), a fresh DDP per case, one ``forward``/``backward``. The hooks carry no annotations (DDP refuses any but its own).
Prints one line per case and rank: ``ok`` or the first line of what ``backward()`` raised.

Run: python benchmarks/measure_hook_future_kinds.py   (docs/ddp-facts.md, "Copy-back (measured)")
"""
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _gloo import gloo_world, spawn_worlds


def work_future_all_reduce(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()


def work_future_all_reduce_waited(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    fut.wait()
    return fut


def work_future_all_gather(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    outs = [torch.empty_like(bucket.buffer()) for _ in range(dist.get_world_size())]
    return dist.all_gather(outs, bucket.buffer(), async_op=True).get_future()


def work_future_barrier(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    return dist.barrier(async_op=True).get_future()


def collect_all_of_work(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    return torch.futures.collect_all([dist.all_reduce(bucket.buffer(), async_op=True).get_future()])


def then_returns_list(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value())


def then_returns_tensor(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def python_future_list(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result([bucket.buffer()])
    return fut


CASES: list[Callable[..., Any]] = [
    work_future_all_reduce, work_future_all_reduce_waited, work_future_all_gather, work_future_barrier,
    collect_all_of_work, then_returns_list, then_returns_tensor, python_future_list,
]


def run(rank: int, world: int, port: int) -> None:
    with gloo_world(rank, world, port):
        for case in CASES:
            model = DDP(torch.nn.Linear(3, 1))
            model.register_comm_hook(None, case)
            try:
                model(torch.ones(2, 3)).sum().backward()
                outcome = "ok"
            except Exception as exc:  # noqa: BLE001 - the outcome is what is measured
                outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            dist.barrier()
            print(f"world {world} rank {rank} {case.__name__}: {outcome}", flush=True)


if __name__ == "__main__":
    spawn_worlds(run, [(2, 29631)])
