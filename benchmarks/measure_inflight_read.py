"""Measure real gloo: what a read of a tensor an all_reduce has in flight sees.

Why: a hook that reads a tensor between posting its collective and waiting for it (a
quantisation scale whose MAX-reduce it never waited for) races gloo's worker thread; the
report of the wrong value it leads to names that read (docs/gloo-facts.md §15). This is
what the read sees on a real cluster.

    python benchmarks/measure_inflight_read.py

Per world size (2 and 3), every rank fills a 1000-element tensor with ``rank + 1``, posts
``all_reduce(t, op=MAX, async_op=True)``, at once reads ``t[0]``, then waits — 300 times,
rank 1 sleeping 2 ms every third time. One line per rank: the values its reads saw and in
how many iterations the ranks' reads disagreed (the right answer, after the wait, is the
world size; ``tally_race``'s "mean" column is not the point here).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from _gloo import gloo_world, spawn_worlds, tally_race

ITERATIONS = 300


def run(rank: int, world: int, port: int) -> None:
    seen = []
    with gloo_world(rank, world, port):
        for i in range(ITERATIONS):
            if rank == 1 and i % 3 == 0:
                time.sleep(0.002)
            t = torch.full((1000,), float(rank + 1))
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
            seen.append(t[0].item())  # the read while the all_reduce has t in flight
            work.wait()
        own = sum(v == rank + 1 for v in seen)
        reduced = sum(v == world for v in seen)
        print(f"world {world} rank {rank}: read its own value {own}/{ITERATIONS}, the reduced one "
              f"{reduced}/{ITERATIONS}", flush=True)
        tally_race(rank, world, seen, "reads")


if __name__ == "__main__":
    spawn_worlds(run, [(2, 29616), (3, 29617)])
