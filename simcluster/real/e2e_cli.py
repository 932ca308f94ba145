"""``simcluster e2e TARGET``: one real-DDP run on real processes, compared with the simulator.

::

    simcluster e2e TARGET [--state SPEC] [--world-size N] [--params SHAPES] [--steps K]
                          [--bucket-cap-mb X] [--seed S] [--backend gloo|nccl] [--timeout SECONDS]
                          [--isolate MOD[,MOD]] [--launcher none|torchrun]

Started directly, it starts ``--world-size`` real gloo processes on this machine
(:func:`simcluster.real.e2e.run_real`). Started by ``torchrun`` (``RANK``/``WORLD_SIZE``
in the environment), every process is one rank of the run (env:// rendezvous;
:mod:`simcluster.real.e2e_torchrun`). Either way it prints one line per step and rank
(the hook calls and a digest of every gradient, simulated ``=``/``≠`` real) and the verdict.
``--isolate`` is ``check``'s (the same option): modules every rank loads for itself with the
TARGET's — each simulated rank its own copy, each real rank a fresh one per run — so a hook
whose state lives in a helper module is judged as ``check --isolate`` judges it.
``--launcher torchrun`` is ``check``'s too: each real gloo rank runs with torchrun's variables
(``RANK``, ``LOCAL_RANK``, …, the single-node values ``check --launcher torchrun`` gives its
simulated ranks) and so does each simulated rank. Under torchrun the variables are the real
ones: rank 0 gathers every rank's and its simulation gives each simulated rank its real rank's.

Exit codes: **0** both sides agree bitwise (also *unconfirmed*: a one-rank group, or a simulated
mismatch where real gloo finished, see docs/e2e.md); **1** both sides failed alike (the hook's own failure, confirmed on the real
backend); **3** unsupported: the hook used what the simulator does not model (e.g.
``dist.monitored_barrier``; named with the user line, nothing compared — ``check``'s exit 3
for the same hook); **4** a fidelity bug of the simulator (the sides differ); **2** usage error;
**130** interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from simcluster.errors import UsageError
from simcluster.limits import BACKEND_NAMES, E2E_TIMEOUT

__all__ = ["add_parser", "e2e_command", "scenario_from_args", "exit_code"]

START_METHOD = "forkserver"
"""How the CLI starts real ranks: multiprocessing's fork server with torch and torch._dynamo
preloaded (a world of 2 in ~0.5 s; ``"subprocess"``: ~3 s idle, ~12 s on 2 loaded cores,
measured). The CLI's ``__main__`` (the console script, ``python -m simcluster``) has the
guard the fork server needs."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``e2e`` subcommand to the CLI's subparsers."""
    e2e = sub.add_parser("e2e", help="run a hook in real DDP on real processes and compare with the simulator")
    e2e.add_argument("target", metavar="TARGET")
    e2e.add_argument("--state", default="none", metavar="SPEC")
    e2e.add_argument("--world-size", type=int, default=None, metavar="N",
                     help="ranks (default 2; under torchrun: its WORLD_SIZE)")
    e2e.add_argument("--params", default="4x5,5", metavar="SHAPES", help="parameter shapes (default 4x5,5)")
    e2e.add_argument("--steps", type=int, default=3, metavar="K", help="DDP steps (default 3)")
    e2e.add_argument("--bucket-cap-mb", "--bucket-cap", dest="bucket_cap_mb", type=float, default=None, metavar="X",
                     help="DDP's bucket_cap_mb (default: DDP's)")
    e2e.add_argument("--gradient-as-bucket-view", action="store_true",
                     help="DDP(..., gradient_as_bucket_view=True) on both sides")
    e2e.add_argument("--ready-order", default=None, metavar="I,J,…",
                     help="the order the parameters' gradients become ready in backward, as parameter indices "
                          "(first ready first; default: reverse parameter order, as a plain stack); both sides follow it")
    e2e.add_argument("--seed", type=int, default=0, metavar="S", help="draws the gradients (default 0)")
    e2e.add_argument("--backend", default="gloo", choices=BACKEND_NAMES,
                     help="real backend and the simulator's model of it (nccl: under torchrun on GPUs)")
    e2e.add_argument("--timeout", type=float, default=E2E_TIMEOUT, metavar="SECONDS",
                     help=f"watchdog: the real run's limit (default {E2E_TIMEOUT:g})")
    from simcluster.cli import add_isolate_option, add_launcher_option

    add_isolate_option(e2e)
    add_launcher_option(e2e)
    return e2e


def scenario_from_args(args: argparse.Namespace, world_size: int) -> Any:
    """The :class:`~simcluster.real.e2e.Scenario` the options describe (UsageError if invalid)."""
    from simcluster.limits import SEEDS, STEPS, WORLD_SIZES, check_deadline, check_int
    from simcluster.real.e2e import Scenario
    from simcluster.usercode.targets import parse_shapes

    if args.bucket_cap_mb is not None and not args.bucket_cap_mb > 0:
        raise UsageError(f"--bucket-cap-mb {args.bucket_cap_mb!r} must be > 0")
    check_deadline(args.timeout, "--timeout")
    shapes = parse_shapes(args.params)
    return Scenario(world_size=check_int("--world-size", world_size, *WORLD_SIZES),
                    shapes=shapes, steps=check_int("--steps", args.steps, *STEPS),
                    bucket_cap_mb=args.bucket_cap_mb, seed=check_int("--seed", args.seed, *SEEDS),
                    gradient_as_bucket_view=args.gradient_as_bucket_view,
                    ready_order=_ready_order(args.ready_order, len(shapes)))


def _ready_order(text: str | None, n: int) -> tuple[int, ...] | None:
    """``--ready-order 2,0,1``: parameter indices, a permutation of the ``--params`` (UsageError if not)."""
    if text is None:
        return None
    from simcluster.ddp.layout import ready_order_of

    try:
        order = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--ready-order {text!r}: expected comma-separated parameter indices, e.g. 1,0") from None
    try:
        return tuple(ready_order_of(order, n))
    except UsageError as exc:
        raise UsageError(f"--ready-order {text!r} for {n} parameters: {exc}") from None


def exit_code(result: Any) -> int:
    """0 agree (or unconfirmed), 1 both failed alike, 3 unsupported (the hook used what the
    simulator does not model: no verdict, as ``simcluster check`` says it), 4 fidelity bug
    (the CLI's exit codes)."""
    from simcluster.cli import EXIT_FAILED, EXIT_FIDELITY, EXIT_INTERNAL, EXIT_OK

    if result.verdict == "fidelity bug":
        return EXIT_FIDELITY
    if result.verdict == "unsupported":
        return EXIT_INTERNAL
    return EXIT_FAILED if result.hook_failed else EXIT_OK


def under_torchrun() -> bool:
    """True in a process torchrun started (it sets these for every rank)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def e2e_command(args: argparse.Namespace) -> int:
    """Run ``simcluster e2e`` (see the module docstring); returns the exit code."""
    from simcluster.usercode.rank_local import parse_isolate
    from simcluster.usercode.targets import load_state, load_target

    load_target(args.target)  # a bad TARGET, --state or --isolate: one line, exit 2, before any process starts
    load_state(args.state)
    isolate = parse_isolate(args.isolate)
    if under_torchrun():
        from simcluster.real.e2e_torchrun import torchrun_main

        return torchrun_main(args)
    if args.backend != "gloo":
        raise UsageError("--backend nccl needs GPUs and torchrun (one process per GPU): "
                         "torchrun --nproc-per-node P -m simcluster e2e TARGET --backend nccl")
    from simcluster.real.e2e import run_e2e, with_launcher

    scenario = with_launcher(scenario_from_args(args, 2 if args.world_size is None else args.world_size),
                             args.launcher)
    result = run_e2e(scenario, args.target, args.state, backend=args.backend, timeout=args.timeout,
                     start_method=START_METHOD, isolate=isolate)
    print(result.format())
    return exit_code(result)


if __name__ == "__main__":  # pragma: no cover
    from simcluster.cli import main

    sys.exit(main(["e2e", *sys.argv[1:]]))
