"""Measure real gloo: what a write to a tensor an all_reduce has in flight does.

Why: simcluster reports a hook that writes to a collective's tensor between posting it and
its completion (docs/gloo-facts.md §14); this is what that race does on a real cluster.

    python benchmarks/measure_inflight_write.py

Per world size (2 and 3), every rank fills a 1000-element tensor with ``rank + 1``, posts
``all_reduce(t, async_op=True)``, at once divides ``t`` by the world size in place, waits,
and keeps ``t[0]`` — 300 times, rank 1 sleeping 2 ms every third time. Had the division
come first, every result would be the mean of 1..world. One line per rank: how many results
were not, and in how many iterations the ranks disagreed.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from _gloo import gloo_world, spawn_worlds, tally_race

ITERATIONS = 300


def run(rank: int, world: int, port: int) -> None:
    results = []
    with gloo_world(rank, world, port):
        for i in range(ITERATIONS):
            if rank == 1 and i % 3 == 0:
                time.sleep(0.002)
            t = torch.full((1000,), float(rank + 1))
            work = dist.all_reduce(t, async_op=True)
            t.div_(world)  # the write while the all_reduce has t in flight
            work.wait()
            results.append(t[0].item())
        tally_race(rank, world, results, "results")


if __name__ == "__main__":
    spawn_worlds(run, [(2, 29614), (3, 29615)])
