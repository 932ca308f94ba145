"""Measure real gloo at world size 1: is an all_reduce's future complete when the call returns?

Why: simcluster's e2e comparison reports disagreements on one-rank groups as *unconfirmed*
(docs/e2e.md), because on real gloo this is a race whose outcome depends on machine load.

    python benchmarks/measure_world1.py [--iterations 2000] [--burners 0,2,4] [--deadlock-trials 6]

For each number of CPU burner processes (busy loops started alongside), one real gloo
process of world size 1 issues ``--iterations`` all_reduces of 1000 float32 and records
``fut.done()`` right after ``dist.all_reduce(..., async_op=True).get_future()`` returns.
Then ``--deadlock-trials`` runs of two all_reduces in flight whose callbacks each block on
another all_reduce (``fut.then(lambda f: dist.all_reduce(y, async_op=True).wait())``, as a
hook with two buckets would; 200 rounds), each bounded by a 10 s watchdog: a trial that
does not finish is a deadlock (two callbacks holding gloo's two worker threads).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def _done_at_return(rank: int, world_size: int, iterations: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1000)
    done = 0
    for _ in range(iterations):
        fut = dist.all_reduce(t, async_op=True).get_future()
        done += fut.done()
        fut.wait()
    return done / iterations


def _blocking_callbacks(rank: int, world_size: int, payload: None) -> str:
    import torch
    import torch.distributed as dist

    xs, ys = [torch.ones(1000), torch.ones(1000)], [torch.ones(10), torch.ones(10)]
    for _ in range(200):
        futs = [dist.all_reduce(x, async_op=True).get_future().then(
            lambda f, y=y: dist.all_reduce(y, async_op=True).wait()) for x, y in zip(xs, ys)]
        torch.futures.wait_all(futs)
    return "finished"


def _burn() -> None:
    while True:
        pass


def main() -> None:
    from simcluster.real.gloo_runner import GlooRunError, run_gloo

    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--burners", default="0,2,4")
    parser.add_argument("--deadlock-trials", type=int, default=6)
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}, load average at start: {os.getloadavg()}")
    for burners in [int(b) for b in args.burners.split(",")]:
        procs = [mp.Process(target=_burn, daemon=True) for _ in range(burners)]
        for p in procs:
            p.start()
        try:
            fraction = run_gloo(_done_at_return, 1, [args.iterations], timeout=120, start_method="forkserver")[0]
            hangs = 0
            started = time.monotonic()
            for _ in range(args.deadlock_trials):
                try:
                    run_gloo(_blocking_callbacks, 1, timeout=10, start_method="forkserver")
                except GlooRunError:
                    hangs += 1
            print(f"burners {burners}: future done when all_reduce returns in {fraction:.1%} of "
                  f"{args.iterations}; blocking callbacks deadlocked {hangs}/{args.deadlock_trials} trials "
                  f"({time.monotonic() - started:.0f} s)")
        finally:
            for p in procs:
                p.kill()
                p.join()


if __name__ == "__main__":
    main()
