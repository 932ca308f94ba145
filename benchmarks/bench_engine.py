"""How fast is a simulated step? Ratios against three baselines, same hook, same sizes.

    python benchmarks/bench_engine.py [--steps 200] [--sizes 64,1000,1000000] [--worlds 2,8] [--no-gloo]

For each world size W and bucket size n, one *step* = every rank calls torch's
``allreduce_hook`` on its bucket and its future resolves. Reported, per step (medians):

* **floor** — the arithmetic alone in this process: ``torch.stack(grads).sum(0)`` for
  the W buckets (what any simulation must at least compute);
* **simcluster** — ``SimCluster(W).run_hook(allreduce_hook, grads)``, deterministic engine;
* **threaded PG** — torch's own ``multi_threaded_pg`` (one thread per rank, free-running,
  threads kept across steps — its best case);
* **real gloo** — W gloo processes on 127.0.0.1 (run once per configuration through
  ``simcluster.gloo_runner``), the time per hook call inside the processes.

The last column set is the ratios: simcluster / floor, simcluster / threaded PG,
simcluster / gloo. Absolute times depend on the machine; the ratios are the result.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from simcluster import SimCluster
from simcluster.bucket import make_bucket


def median_time(fn: Callable[[], object], steps: int) -> float:
    for _ in range(min(10, steps)):
        fn()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def grads_for(world: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) for _ in range(world)]


def bench_floor(world: int, n: int, steps: int) -> float:
    grads = grads_for(world, n)
    return median_time(lambda: torch.stack(grads).sum(0), steps)


def bench_sim(world: int, n: int, steps: int) -> float:
    grads = grads_for(world, n)
    cluster = SimCluster(world, seed=0)
    return median_time(lambda: cluster.run_hook(allreduce_hook, grads), steps)


def bench_threaded_pg(world: int, n: int, steps: int) -> float:
    from torch.testing._internal.distributed import multi_threaded_pg

    grads = grads_for(world, n)
    store = dist.HashStore()
    barrier = threading.Barrier(world)
    times: list[float] = []
    multi_threaded_pg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # per-thread group names, as torch's tests do
    try:
        def worker(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            param = torch.nn.Parameter(torch.zeros(n))
            samples = []
            for i in range(steps + 10):
                bucket = make_bucket(0, [param], [grads[rank].clone()], is_last=True)
                barrier.wait()
                start = time.perf_counter()
                allreduce_hook(None, bucket).wait()
                barrier.wait()
                if i >= 10:
                    samples.append(time.perf_counter() - start)
            if rank == 0:
                times.append(statistics.median(samples))
            barrier.wait()
            dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        multi_threaded_pg._uninstall_threaded_pg()
    return times[0]


def gloo_worker(rank: int, world_size: int, payload: tuple[int, int]) -> float:
    """Runs inside a real gloo process: median time of one allreduce_hook call."""
    n, steps = payload
    grad = grads_for(world_size, n)[rank]
    param = torch.nn.Parameter(torch.zeros(n))
    samples = []
    for i in range(steps + 10):
        bucket = make_bucket(0, [param], [grad.clone()], is_last=True)
        dist.barrier()
        start = time.perf_counter()
        allreduce_hook(None, bucket).wait()
        if i >= 10:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_gloo(world: int, n: int, steps: int) -> float:
    from simcluster.gloo_runner import run_gloo

    return max(run_gloo(gloo_worker, world, [(n, steps)] * world, timeout=120.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sizes", default="64,1000,1000000")
    parser.add_argument("--worlds", default="2,8")
    parser.add_argument("--no-gloo", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'W':>2} {'n':>8} | {'floor':>9} {'simcluster':>10} {'threadedPG':>10} {'gloo':>9} | "
          f"{'sim/floor':>9} {'sim/thr':>7} {'sim/gloo':>8}")
    for world in [int(w) for w in args.worlds.split(",")]:
        for n in [int(s) for s in args.sizes.split(",")]:
            steps = args.steps if n < 100_000 else max(20, args.steps // 10)
            floor = bench_floor(world, n, steps)
            sim = bench_sim(world, n, steps)
            threaded = bench_threaded_pg(world, n, steps)
            gloo = float("nan") if args.no_gloo else bench_gloo(world, n, steps)
            print(
                f"{world:>2} {n:>8} | {floor * 1e6:>7.0f}us {sim * 1e6:>8.0f}us {threaded * 1e6:>8.0f}us "
                f"{gloo * 1e6:>7.0f}us | {sim / floor:>9.1f} {sim / threaded:>7.2f} {sim / gloo:>8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
