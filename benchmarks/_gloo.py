"""The shared part of the ``benchmarks/measure_*.py`` scripts that ask real gloo a question
directly, one process per rank started by ``torch.multiprocessing.spawn``: join a fresh gloo
world on localhost, run the cases, print one line per case and rank, leave.

A script defines ``run(rank, world, port)``, opens :func:`gloo_world` in it, and calls
:func:`spawn_worlds` under ``if __name__ == "__main__":`` (spawn re-imports the script in each
child). Run from the repository root as ``python benchmarks/measure_X.py``: the script's own
folder is then first on ``sys.path``, in the children too, so ``import _gloo`` finds this file.
(Measurements that need more than this, such as many jobs on one world or a parent that never
hangs, use :mod:`simcluster.real.gloo_runner` instead.)
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def gloo_world(rank: int, world: int, port: int) -> Iterator[None]:
    """This process as rank ``rank`` of a ``world``-rank gloo default group, rendezvous on
    ``127.0.0.1:port`` (env://); the group is destroyed when the block ends normally (a case
    that raises is caught by the script, so an escaping error is the script's own bug)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    yield
    dist.destroy_process_group()


def spawn_worlds(run: Callable[[int, int, int], None], worlds: Sequence[tuple[int, int]]) -> None:
    """For each ``(world, port)`` in turn: ``run(rank, world, port)`` in ``world`` fresh
    processes, one per rank; returns when every rank of every world has returned. Each world
    gets its own port, so a world still closing does not meet the next one's rendezvous."""
    for world, port in worlds:
        mp.spawn(run, args=(world, port), nprocs=world)


def call_and_wait(post: Callable[[], Any]) -> str | None:
    """Where an ``async_op=True`` collective fails: call ``post`` (it posts the collective and
    returns its work), then ``wait()`` on the work. ``None`` when both passed; else
    ``raised at call: TYPE: 'first line'`` or ``raised at wait: …`` — gloo refuses some
    inputs when the call is made and others only at ``wait()`` (docs/gloo-facts.md §8)."""
    where = "call"
    try:
        work = post()
        where = "wait"
        work.wait()
    except Exception as exc:  # noqa: BLE001 - the measurement
        return f"raised at {where}: {type(exc).__name__}: {str(exc).splitlines()[0]!r}"
    return None


def tally_race(rank: int, world: int, seen: list[float], what: str) -> None:
    """Print how a race went on this rank, where rank ``r`` contributes ``r + 1`` and the
    right answer is their mean: of this rank's values (``seen[i]``: iteration ``i``'s), how
    many were not the mean, and in how many iterations the ranks disagreed (gathered from
    every rank: call it inside :func:`gloo_world`, on every rank)."""
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, seen)
    mean = sum(range(1, world + 1)) / world
    wrong = sum(abs(v - mean) > 1e-6 for v in seen)
    disagree = sum(len({r[i] for r in everyone}) > 1 for i in range(len(seen)))
    print(f"world {world} rank {rank}: {wrong}/{len(seen)} {what} not the mean {mean}, ranks disagreed in "
          f"{disagree}/{len(seen)}; values seen: {sorted({round(v, 6) for v in seen})[:6]}", flush=True)
