"""CPU instructions per simulated step: a speed measure that machine noise does not move.

    python benchmarks/count_instructions.py [--world 8] [--steps 100] [--n 64] [--launcher torchrun] [--empty]
    python benchmarks/count_instructions.py --check {allreduce,scaled_fp16,powersgd} [--examples 20]

Wall-clock timings on a shared VM swing by 2x from one minute to the next (CPU steal,
neighbours), so a 5 % change to the hot path cannot be seen in them. Instruction counts
can: this script re-runs itself under valgrind's callgrind with instrumentation off, warms
up, switches instrumentation on (``callgrind_control -i on``) for ``--steps`` calls of
``SimCluster.run_hook(allreduce_hook, ...)`` and off again, and prints instructions per
step — repeatable to about 0.3 %. ``--floor`` counts torch's own share instead (each
rank's ``allreduce_hook`` on a process group that completes at once, as
``bench_engine.py``'s ``hook`` column). ``--threaded`` counts torch's threaded test
process group (``multi_threaded_pg``, one thread per rank, as ``bench_engine.py``'s
``threadedPG`` column: a bucket made, ``allreduce_hook(None, bucket).wait()`` and the
benchmark's two barrier waits per rank-step), summed over all threads — the CPU work the
threaded group does, without the hand-over latency that dominates its wall time.
``--empty`` counts a run whose ranks do nothing (``SimCluster(W).run(lambda rank: None)``):
a run's fixed cost — engine, patches, the switches into and out of the ranks, the settings
audit's start and finish — which a W=2 step shares between two ranks (docs/speed.md, stop 29).
``--check HOOK`` counts a property search instead: ``check_hook`` of one of
:data:`CHECK_HOOKS` in this process (unsupervised: the search itself, no child process), seed 0,
``--examples`` per backend, and prints instructions per checked example — what target 4 of
the speed issue (the default ``simcluster check``) is made of, measured without the VM's
noise (docs/speed.md, stop 43).
Needs valgrind; about 15 s per run (about a minute with ``--check``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile


CHECK_HOOKS = {
    "allreduce": ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook", "group", "fp32"),
    "scaled_fp16": ("simcluster.hooks.reference:scaled_fp16_hook", "none", "fp16"),
    "powersgd": ("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook:powerSGD_hook",
                 "simcluster.checking.defaults:powersgd_state", "none"),
}
"""``--check`` rows: (target, state, tolerance), as the default ``simcluster check`` runs them."""


def _measured(args: argparse.Namespace) -> None:
    """The part that runs under callgrind."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.set_num_threads(1)
    if args.check:
        from simcluster.checking.check import check_hook

        target, state, tolerance = CHECK_HOOKS[args.check]
        check_hook(target, state=state, tolerance=tolerance, supervise=False, examples=3)  # imports, caches
        _instrumentation(True)
        report = check_hook(target, state=state, tolerance=tolerance, supervise=False, examples=args.examples)
        _instrumentation(False)
        print(f"CHECKED {report.examples}", file=sys.stderr)
        return
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(args.n, generator=gen) for _ in range(args.world)]
    if args.threaded:
        _measured_threaded(args, grads)
        return
    if args.floor:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_engine

        groups = [bench_engine._InstantGroup(r, args.world) for r in range(args.world)]

        def step() -> None:
            for rank in range(args.world):
                allreduce_hook(groups[rank], bench_engine._Bucket(grads[rank].clone())).wait()
    else:
        from simcluster import SimCluster

        cluster = SimCluster(args.world, seed=0, backend=args.backend, launcher=args.launcher)

        def nothing(rank: int) -> None:
            return None

        def step() -> None:
            if args.empty:
                cluster.run(nothing)
            else:
                cluster.run_hook(allreduce_hook, grads)
    for _ in range(20):
        step()
    _instrumentation(True)
    for _ in range(args.steps):
        step()
    _instrumentation(False)


def _instrumentation(on: bool) -> None:
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
                   check=True, capture_output=True)


def _measured_threaded(args: argparse.Namespace, grads: list) -> None:
    """torch's threaded process group under callgrind: rank 0 switches counting on and off
    while every rank thread waits at a barrier, so exactly ``--steps`` steps of all ranks count."""
    import threading

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.testing._internal.distributed import multi_threaded_pg

    from simcluster.fake.bucket import make_bucket

    warmup = 20
    barrier = threading.Barrier(args.world)
    store = dist.HashStore()
    multi_threaded_pg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=args.world, store=store)
        param = torch.nn.Parameter(torch.zeros(args.n))
        for i in range(warmup + args.steps + 1):
            if i in (warmup, warmup + args.steps):
                barrier.wait()
                if rank == 0:
                    _instrumentation(i == warmup)
                barrier.wait()
                if i == warmup + args.steps:
                    break
            bucket = make_bucket(0, [param], [grads[rank].clone()], is_last=True)
            barrier.wait()
            allreduce_hook(None, bucket).wait()
            barrier.wait()
        dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(args.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--n", type=int, default=64, help="bucket elements")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--floor", action="store_true", help="torch's own share of a step instead")
    parser.add_argument("--threaded", action="store_true",
                        help="torch's threaded test process group instead (all threads counted)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="the simulated backend model (simcluster only)")
    parser.add_argument("--launcher", choices=("none", "torchrun"), default="none",
                        help="SimCluster's launcher model (simcluster only)")
    parser.add_argument("--empty", action="store_true",
                        help="a run whose ranks do nothing instead of a hook step: the run's fixed cost (simcluster only)")
    parser.add_argument("--check", choices=sorted(CHECK_HOOKS),
                        help="count a property search of this hook instead (instructions per checked example)")
    parser.add_argument("--examples", type=int, default=20, help="--check: Hypothesis examples per backend")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        _measured(args)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("count_instructions: needs valgrind (callgrind) on PATH")
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", sys.executable, os.path.abspath(__file__),
               "--inside", "--world", str(args.world), "--n", str(args.n), "--steps", str(args.steps),
               "--backend", args.backend, "--launcher", args.launcher, "--examples", str(args.examples)]
    if args.check:
        command += ["--check", args.check]
    for flag in ("floor", "threaded", "empty"):
        if getattr(args, flag):
            command.append(f"--{flag}")
    with tempfile.TemporaryDirectory() as scratch:  # callgrind writes its output file into the cwd
        done = subprocess.run(command, cwd=scratch, capture_output=True, text=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        sys.exit(f"count_instructions: the run failed:\n{done.stderr[-2000:]}")
    if args.check:
        checked = int(re.search(r"CHECKED (\d+)", done.stderr).group(1))  # type: ignore[union-attr]
        print(f"check {args.check} ({CHECK_HOOKS[args.check][0]}), {args.examples} examples per backend: "
              f"{checked} examples checked, {int(found.group(1)) / 1e9:.3f} G instructions, "
              f"{int(found.group(1)) / checked / 1e6:.1f} M per checked example")
        return
    what = ("torch's share (hook floor)" if args.floor else
            "torch's threaded PG (all threads)" if args.threaded else f"simcluster ({args.backend} model{', launcher torchrun' if args.launcher != 'none' else ''})")
    per = "empty run" if args.empty else "step"
    print(f"{what}: world {args.world}, {'ranks doing nothing' if args.empty else f'{args.n}-element buckets'}: "
          f"{int(found.group(1)) / args.steps / 1e6:.3f} M instructions per {per}")


if __name__ == "__main__":
    main()
