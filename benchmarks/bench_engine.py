"""How fast is a simulated step? Ratios against baselines measured in the same run.

    python benchmarks/bench_engine.py [--repeats 3] [--steps 200] [--sizes 64,1000,1000000]
        [--worlds 2,8] [--scaling 2,8,64,256,1024] [--scaling-repeats 9] [--no-gloo] [--no-check]
        [--no-memory] [--no-default-check] [--quick] [--json PATH]

One *step* = every rank calls torch's ``allreduce_hook`` on its bucket and its future
resolves. Sections (each figure a median over ``--repeats`` interleaved repeats; a ratio
is the median of the ratios taken within each repeat, so machine load shared by both
sides of a ratio cancels out):

* **step** — per step, for each world W and bucket size n:
  ``floor``, the arithmetic alone in this process (clone each rank's bucket, divide it by
  W, fold the W buckets, write the result back into each); ``hook``, torch's own share
  (each rank's bucket and ``allreduce_hook`` on a process group that completes at once:
  what any simulator calling the real hook pays; ``hook/thr`` is then the least
  ``sim/thr`` such a simulator could show); ``simcluster``,
  ``SimCluster(W).run_hook(allreduce_hook, grads)`` on the gloo model (bitwise ring
  order); ``threaded PG``, torch's own ``multi_threaded_pg`` (one thread per rank, kept
  across steps: its best case); ``gloo``, W real gloo processes (time per hook call
  inside them).
* **scaling** — µs of CPU time per *rank-step* for 4096-element buckets from W=2 to 1024,
  gloo and NCCL models, every world measured in each of ``--scaling-repeats`` repeats (9:
  a max/min over five medians of 3 was decided by whichever cell the host's noise hit,
  docs/speed.md, stop 28); max/min over the worlds (flat = O(W·n) work per collective).
* **memory** — peak RSS growth of one step (``VmHWM``, in a fresh subprocess) over
  the gradients' bytes, at W=64 × 1M and W=8 × 4M.
* **check** — ``simcluster.checking.check.check_hook`` throughput (examples per second) for
  ``allreduce_hook``, ``fp16_compress_hook`` and ``powerSGD_hook`` with their default
  state and tolerance (failing hooks include shrinking).
* **default check** — wall time of the README's main job, ``simcluster check`` with no
  TARGET (every torch hook and the reference hooks, default example counts), run as a
  command in a fresh temporary directory (no example database to replay from).

Absolute times depend on the machine and its load; the ratios are the result.
``--json PATH`` writes every figure. ``--quick`` (a few seconds): tiny buckets at W=2
and 8, one repeat, no gloo, memory, check or default check.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from simcluster import SimCluster
from simcluster.fake.bucket import make_bucket

_T = "torch.distributed.algorithms.ddp_comm_hooks."
CHECK_HOOKS = [
    ("allreduce_hook", _T + "default_hooks:allreduce_hook", "none", "fp32"),
    ("fp16_compress_hook", _T + "default_hooks:fp16_compress_hook", "none", "fp16"),
    ("powerSGD_hook", _T + "powerSGD_hook:powerSGD_hook", "simcluster.checking.defaults:powersgd_state", "none"),
]


def median_time(fn: Callable[[], object], steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
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


# ----------------------------------------------------------------------------- one step
def bench_floor(world: int, n: int, steps: int) -> float:
    grads = grads_for(world, n)

    def step() -> None:
        buffers = [g.clone() for g in grads]
        for b in buffers:
            b.div_(world)
        acc = buffers[0].clone()
        for b in buffers[1:]:
            acc.add_(b)
        for b in buffers:
            b.copy_(acc)

    return median_time(step, steps)


class _InstantWork(dist.Work):
    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def get_future(self) -> torch.futures.Future:
        return self._future


class _InstantGroup(dist.ProcessGroup):
    """A process group whose all_reduce completes at once, leaving the tensor as it is."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(tensors)
        return _InstantWork(future)


class _Bucket:
    """All ``allreduce_hook`` asks of a bucket: its buffer."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def bench_hook_floor(world: int, n: int, steps: int) -> float:
    """torch's own share of a step: each rank's buffer (a clone) and ``allreduce_hook``
    — its ``div_``, ``dist.all_reduce``'s front end, ``get_future``, ``then`` — on a group
    that completes at once, then ``wait``. No simulator that calls the real hook on every
    rank can spend less (the reduction itself is ``floor``'s)."""
    grads = grads_for(world, n)
    groups = [_InstantGroup(r, world) for r in range(world)]

    def step() -> None:
        for rank in range(world):
            allreduce_hook(groups[rank], _Bucket(grads[rank].clone())).wait()

    return median_time(step, steps)


def bench_sim(world: int, n: int, steps: int, backend: str = "gloo") -> float:
    grads = grads_for(world, n)
    cluster = SimCluster(world, seed=0, backend=backend)
    return median_time(lambda: cluster.run_hook(allreduce_hook, grads), steps, warmup=1 if world >= 256 else 3)


def bench_threaded_pg(world: int, n: int, steps: int) -> float:
    from torch.testing._internal.distributed import multi_threaded_pg

    grads = grads_for(world, n)
    store = dist.HashStore()
    barrier = threading.Barrier(world)
    times: list[float] = []
    excepthook = sys.excepthook  # each init_process_group wraps it to prefix "[rankN]: " to every line
    multi_threaded_pg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # per-thread group names, as torch's tests do
    try:
        def worker(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            param = torch.nn.Parameter(torch.zeros(n))
            samples = []
            for i in range(steps + 3):
                bucket = make_bucket(0, [param], [grads[rank].clone()], is_last=True)
                barrier.wait()
                start = time.perf_counter()
                allreduce_hook(None, bucket).wait()
                barrier.wait()
                if i >= 3:
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
        sys.excepthook = excepthook
    return times[0]


def gloo_worker(rank: int, world_size: int, payload: tuple[int, int]) -> float:
    """Runs inside a real gloo process: median time of one allreduce_hook call."""
    n, steps = payload
    grad = grads_for(world_size, n)[rank]
    param = torch.nn.Parameter(torch.zeros(n))
    samples = []
    for i in range(steps + 3):
        bucket = make_bucket(0, [param], [grad.clone()], is_last=True)
        dist.barrier()
        start = time.perf_counter()
        allreduce_hook(None, bucket).wait()
        if i >= 3:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_gloo(world: int, n: int, steps: int) -> float:
    from simcluster.real.gloo_runner import run_gloo

    return max(run_gloo(gloo_worker, world, [(n, steps)] * world, timeout=300.0))


def step_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"\n## step: µs per step, medians of {args.repeats} repeats (ratios: median of per-repeat ratios)")
    print(f"{'W':>4} {'n':>8} | {'floor':>8} {'hook':>8} {'simcluster':>10} {'threadedPG':>10} {'gloo':>8} | "
          f"{'sim/floor':>9} {'sim/hook':>8} {'sim/thr':>7} {'sim/gloo':>8} {'hook/thr':>8}")
    rows = []
    for world in _ints(args.worlds):
        for n in _ints(args.sizes):
            steps = args.steps if n < 100_000 else max(10, args.steps // 20)
            reps = []
            for _ in range(args.repeats):
                rep = {"floor": bench_floor(world, n, steps), "hook": bench_hook_floor(world, n, steps),
                       "simcluster": bench_sim(world, n, steps), "threaded_pg": bench_threaded_pg(world, n, steps)}
                rep["gloo"] = float("nan") if args.no_gloo else bench_gloo(world, n, steps)
                reps.append(rep)
            row = _summarise(reps, {"sim/floor": "floor", "sim/hook": "hook", "sim/threaded_pg": "threaded_pg",
                                    "sim/gloo": "gloo"})
            row["hook/threaded_pg"] = statistics.median(r["hook"] / r["threaded_pg"] for r in reps)
            row.update(world=world, n=n)
            rows.append(row)
            print(f"{world:>4} {n:>8} | {row['floor'] * 1e6:>8.0f} {row['hook'] * 1e6:>8.0f} "
                  f"{row['simcluster'] * 1e6:>10.0f} {row['threaded_pg'] * 1e6:>10.0f} {row['gloo'] * 1e6:>8.0f} | "
                  f"{row['sim/floor']:>9.2f} {row['sim/hook']:>8.2f} {row['sim/threaded_pg']:>7.2f} "
                  f"{row['sim/gloo']:>8.2f} {row['hook/threaded_pg']:>8.2f}", flush=True)
    return rows


def _summarise(reps: list[dict[str, float]], ratios: dict[str, str]) -> dict[str, Any]:
    row: dict[str, Any] = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    for name, base in ratios.items():
        row[name] = statistics.median(r["simcluster"] / r[base] for r in reps)
    row["samples"] = reps
    return row


# ----------------------------------------------------------------------------- scaling
def scaling_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    n = 4096
    print(f"\n## scaling: µs of CPU per rank-step, {n}-element buckets, worlds interleaved, medians of "
          f"{args.scaling_repeats} repeats")
    rows = []
    worlds = _ints(args.scaling)
    for backend in ("gloo", "nccl"):
        clusters = {w: (SimCluster(w, seed=0, backend=backend), grads_for(w, n)) for w in worlds}
        for cluster, grads in clusters.values():
            cluster.run_hook(allreduce_hook, grads)  # warm-up
        samples: dict[int, list[float]] = {w: [] for w in worlds}
        for _ in range(args.scaling_repeats):  # every world in each repeat: the load is shared alike
            for world, (cluster, grads) in clusters.items():
                steps = max(2, 2000 // world)
                start = time.process_time()
                for _ in range(steps):
                    cluster.run_hook(allreduce_hook, grads)
                samples[world].append((time.process_time() - start) / steps / world)
        per_world = {w: statistics.median(v) for w, v in samples.items()}
        spread = max(per_world.values()) / min(per_world.values())
        rows.append({"backend": backend, "n": n, "us_per_rank_step": {w: t * 1e6 for w, t in per_world.items()},
                     "max_over_min": spread, "step_s_at_max_world": per_world[max(per_world)] * max(per_world),
                     "samples": samples})
        cells = "  ".join(f"W={w}: {t * 1e6:.0f}" for w, t in per_world.items())
        print(f"{backend:>5}: {cells}  | max/min {spread:.2f}, one W={max(per_world)} step "
              f"{per_world[max(per_world)] * max(per_world):.2f} s", flush=True)
    return rows


# ----------------------------------------------------------------------------- memory
def _vm_hwm() -> int:
    """This process's peak RSS in bytes (``VmHWM``; unlike ``ru_maxrss``, which Linux carries
    over from the parent at fork, it starts afresh at exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: the best there is


def memory_child(world: int, n: int) -> None:
    """In a fresh process: peak RSS growth of one step over the gradients' bytes."""
    torch.set_num_threads(1)
    grads = grads_for(world, n)
    cluster = SimCluster(world, seed=0)
    warm = grads_for(world, 64)
    SimCluster(world, seed=0).run_hook(allreduce_hook, warm)  # imports and first-call set-up, tiny
    before = _vm_hwm()
    cluster.run_hook(allreduce_hook, grads)
    after = _vm_hwm()
    grad_bytes = world * n * 4
    print(json.dumps({"world": world, "n": n, "grad_bytes": grad_bytes, "peak_growth_bytes": after - before,
                      "peak_growth_over_grads": (after - before) / grad_bytes}))


def memory_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    print("\n## memory: peak RSS growth of one step (fresh process), over the gradients' bytes")
    rows = []
    for world, n in ((64, 1_000_000), (8, 4_000_000)):
        out = subprocess.run([sys.executable, __file__, "--memory-child", f"{world},{n}"], capture_output=True,
                             text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        if out.returncode != 0:
            print(f"W={world} n={n}: failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"W={world:>3} n={n:>8}: gradients {row['grad_bytes'] / 2**20:.0f} MiB, peak growth "
              f"{row['peak_growth_bytes'] / 2**20:.0f} MiB = {row['peak_growth_over_grads']:.2f}x", flush=True)
    return rows


# ----------------------------------------------------------------------------- check
def check_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from simcluster.checking.check import check_hook

    print("\n## check: simcluster.checking.check.check_hook throughput (default examples, both backends)")
    rows = []
    for name, target, state, tolerance in CHECK_HOOKS:
        with tempfile.TemporaryDirectory() as db:
            report = check_hook(target, state=state, tolerance=tolerance, database=db)
        rate = report.examples / report.seconds
        rows.append({"hook": name, "examples": report.examples, "seconds": report.seconds,
                     "examples_per_second": rate, "passed": report.passed})
        print(f"{name:>20}: {report.examples} examples in {report.seconds:.1f} s = {rate:.0f}/s "
              f"({'ok' if report.passed else 'FAIL, shrinking included'})", flush=True)
    return rows


def default_check_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    print("\n## default check: `simcluster check` (no TARGET) in a fresh directory, wall time")
    rows = []
    for extra in DEFAULT_CHECK_VARIANTS:
        with tempfile.TemporaryDirectory() as cwd:
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "simcluster", "check", "--quiet", "--json", "report.json",
                                  *extra], cwd=cwd, capture_output=True, text=True, timeout=900,
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            seconds = time.perf_counter() - start
            reports = json.loads(Path(cwd, "report.json").read_text()) if Path(cwd, "report.json").exists() else []
        checked = sum(1 for r in reports if r.get("skipped") is None)
        rows.append({"args": extra, "seconds": seconds, "exit_code": out.returncode, "rows_checked": checked})
        print(f"simcluster check {' '.join(extra) or '(defaults)'}: {seconds:.1f} s, {checked} rows checked, "
              f"exit {out.returncode}", flush=True)
    return rows


DEFAULT_CHECK_VARIANTS: list[list[str]] = [[], ["--jobs", "1"]]
"""Argument sets the default-check section runs: the README's main job as it is (rows on every CPU), and one row at a time."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sizes", default="64,1000,1000000")
    parser.add_argument("--worlds", default="2,8")
    parser.add_argument("--scaling", default="2,8,64,256,1024", help="worlds of the scaling section (\"\": skip it)")
    parser.add_argument("--scaling-repeats", type=int, default=9, help="repeats of the scaling section (its medians)")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-default-check", action="store_true", help="skip timing the no-TARGET simcluster check")
    parser.add_argument("--quick", action="store_true", help="tiny buckets at W=2, 8 only: a few seconds")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.memory_child:
        memory_child(*_ints(args.memory_child))
        return
    if args.quick:
        args.repeats, args.sizes, args.no_gloo, args.no_check, args.no_memory, args.scaling = 1, "64", True, True, True, ""
        args.no_default_check = True
    started = time.time()
    result: dict[str, Any] = {"torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                              "repeats": args.repeats, "scaling_repeats": args.scaling_repeats}
    result["step"] = step_rows(args)
    result["scaling"] = scaling_rows(args) if args.scaling else []
    result["memory"] = [] if args.no_memory else memory_rows(args)
    result["check"] = [] if args.no_check else check_rows(args)
    result["default_check"] = [] if args.no_default_check else default_check_rows(args)
    result["loadavg_end"] = os.getloadavg()
    result["seconds"] = time.time() - started
    print(f"\nload average {result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f} on {os.cpu_count()} cpus; "
          f"{result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
