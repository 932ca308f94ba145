"""Measure real gloo: does a poll right after posting answer complete?

Why: simcluster makes the first poll of each work or future a scheduler choice — look at
once (pending) or after the other ranks ran (maybe complete) — and the in-order schedule
looks at once (docs/gloo-facts.md §12). This is how often each answer happens for real.

    python benchmarks/measure_first_poll.py

Per world size (2 and 4), every rank posts 300 async all_reduces, alternately
of 4 and 100,000 float32, and right after each call returns asks ``work.is_completed()``,
then ``get_future().done()``, then ``done()`` of a ``then`` chained on it; then waits. Rank 1
sleeps 2 ms after every third iteration, so it is sometimes the last to post. One line
per rank: how many of the polls answered complete.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from _gloo import gloo_world, spawn_worlds

ITERATIONS = 300


def run(rank: int, world: int, port: int) -> None:
    counts = {"work.is_completed()": 0, "future.done()": 0, "then(...).done()": 0}
    with gloo_world(rank, world, port):
        for i in range(ITERATIONS):
            work = dist.all_reduce(torch.ones(4 if i % 2 else 100_000), async_op=True)
            counts["work.is_completed()"] += work.is_completed()
            future = work.get_future()
            counts["future.done()"] += future.done()
            counts["then(...).done()"] += future.then(lambda f: f.value()).done()
            work.wait()
            if rank == 1 and i % 3 == 0:
                time.sleep(0.002)
    answers = ", ".join(f"{name} {n}/{ITERATIONS}" for name, n in counts.items())
    print(f"world {world} rank {rank}: complete at the first poll: {answers}", flush=True)


if __name__ == "__main__":
    spawn_worlds(run, [(2, 29611), (4, 29612)])
