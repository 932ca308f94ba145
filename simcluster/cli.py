"""The ``simcluster`` command line: ``check`` hooks, ``explain`` one, ``e2e`` on real processes.

::

    simcluster check [TARGET ...] [--state SPEC] [--tolerance T] [--backend gloo|nccl|all]
                     [--world-sizes 1,2,3,4,8] [--steps K] [--examples N] [--seed S]
                     [--api current|legacy] [--json PATH] [--database DIR | --no-database]
                     [--properties P,Q] [--params SHAPES] [--subgroups] [--gradient-as-bucket-view] [--deadline SECONDS]
                     [--rng per_rank|same] [--launcher none|torchrun] [--isolate MOD[,MOD]] [--jobs N] [--quiet]
                     [--e2e [--e2e-examples N] [--e2e-timeout SECONDS]]
    simcluster e2e TARGET [--state SPEC] [--world-size N] [--params SHAPES] [--steps K]
                   [--bucket-cap-mb X] [--seed S] [--backend gloo|nccl] [--timeout SECONDS]
                   [--isolate MOD[,MOD]]
    simcluster explain TARGET [--world-size N] [--backend gloo|nccl] [--seed S] [--state SPEC]
                       [--isolate MOD[,MOD]] [--launcher none|torchrun] [--deadline SECONDS]
                       [--params SHAPES | --numel N] [--bucket-cap-mb X] [--steps K] [--api A]
                       [--network NET] [--timeline PATH.svg|.html] [--chrome-trace PATH.json]
                       [--range [--tolerance T] [--world-sizes LIST]]

``python -m simcluster`` is the same program. Exit codes:

* **0** — every property held (skipped rows do not count against it);
* **1** — a property failed: each failure is printed with its property, backend, shrunk
  counterexample and a one-line replay command;
* **2** — usage or load error (bad option, unknown module, no such attribute, not
  callable, file not found): one line on stderr, no traceback;
* **3** — simcluster itself broke (a bug of ours): the traceback is printed.
* **4** — ``check --e2e`` (and ``e2e``): a *fidelity bug of the simulator* — the simulation and
  real DDP on real gloo disagree (:mod:`simcluster.real.e2e`); it takes precedence over 1,
  since the simulated verdicts are then in doubt. ``e2e`` exits 1 when both sides failed alike,
  and 3 when the hook used what the simulator does not model (*unsupported*: nothing compared).
* **130** — interrupted (Ctrl-C, or a hook raised ``KeyboardInterrupt``): the run stops
  at once; ``--json`` still gets the reports finished so far.
* **143** — terminated (``SIGTERM`` to the command, a CI job's time limit): as 130, said as such.

Hooks run in a supervised child process (:mod:`simcluster.checking.supervisor`): a hook that
spins, blocks, sleeps, calls ``sys.exit``/``os._exit`` or kills its process is a
*liveness* failure of that hook (exit 1), reported with the rank, step, bucket, the
stuck code's stack and a replay command — never a hang, never exit 0. ``--deadline``
(default 60 s) bounds each example.

``check --jobs N`` (default: the CPUs this process may use) checks up to N rows at once,
each in a forked worker process (:mod:`simcluster.checking.row_pool`); the table, the
reports, ``--json`` and the exit code are those of ``--jobs 1`` (one row after another in
this process), whichever row finishes first. A worker that dies is an internal error
(exit 3), never a passing row.

With no TARGET, ``check`` runs :func:`simcluster.checking.defaults.default_entries` — every hook
torch ships plus the reference hooks of ``hooks/`` — each with its own state and
tolerance; ``--state``/``--tolerance``/``--api`` then do not apply.

Counterexamples are stored in a Hypothesis example database, by default
``.simcluster/examples`` under the current directory (commit it: later runs, CI included,
replay them first). ``--database DIR`` moves it, ``--no-database`` turns it off.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from simcluster.checking import ctrl_c
from simcluster.errors import SimClusterError, UnsupportedError, UsageError, first_line
from simcluster.limits import BACKEND_NAMES
from simcluster.checking.progress import ProgressLine
from simcluster.checking.report import PROPERTIES, CheckReport
from simcluster.engine.frames import short_path

__all__ = ["main", "console_main", "build_parser", "add_isolate_option", "DEFAULT_DATABASE", "CheckFunction"]

DEFAULT_DATABASE = ".simcluster/examples"
"""Where counterexamples are kept, relative to the current directory."""

CheckFunction = Callable[..., CheckReport]
"""``simcluster.checking.check.check_hook``'s shape: ``check(hook, *, target=…, state=…, …) -> CheckReport``."""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_FIDELITY, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 4, 130, 143
CHECK_WORLD_SIZES = "1,2,3,4,8"
"""``check --world-sizes``' default."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and exits 2, and an option is
    named in full: argparse would take ``check --world-size 2`` (``explain``'s spelling) as
    ``--world-sizes`` without a word, and a prefix that one day names two options would change
    meaning (an audit of hostile inputs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``simcluster`` (``check``, ``e2e`` and ``explain`` subcommands)."""
    parser = _Parser(prog="simcluster", description="Correctness checks for PyTorch DDP communication hooks.")
    sub = parser.add_subparsers(dest="command", metavar="{check,e2e,explain}", parser_class=_Parser)
    sub.required = True
    _add_check_parser(sub)

    from simcluster.real.e2e_cli import add_parser as add_e2e_parser

    add_e2e_parser(sub)
    _add_explain_parser(sub)
    return parser


def _add_check_parser(sub: Any) -> None:
    """``simcluster check``'s options (docs/cli.md)."""
    check = sub.add_parser("check", help="check hooks against the DDP properties (no TARGET: the default set)")
    check.add_argument("targets", nargs="*", metavar="TARGET", help="package.module:name or path/to/file.py:name")
    check.add_argument("--state", default=None, metavar="SPEC",
                       help="none (default) | group | module:factory | file.py:factory "
                            "(factory(process_group) or factory(process_group, model))")
    check.add_argument("--tolerance", default=None, metavar="T",
                       help="none | exact | fp32 (default) | fp16 | bf16 | rtol=R,atol=A | scale=R | norm=R")
    check.add_argument("--backend", default="all", choices=(*BACKEND_NAMES, "all"))
    check.add_argument("--world-sizes", default=CHECK_WORLD_SIZES, metavar="LIST")
    check.add_argument("--params", default=None, metavar="SHAPES",
                       help="fix the parameters' shapes, e.g. 4x5,5,1000 (values, caps, orders still drawn)")
    check.add_argument("--subgroups", action="store_true",
                       help="also draw DDP on equal subgroups of the world, whatever the state")
    check.add_argument("--gradient-as-bucket-view", action="store_true",
                       help="run every drawn DDP with gradient_as_bucket_view=True (a hook whose owner requires it)")
    check.add_argument("--steps", type=int, default=3, metavar="K", help="DDP steps per example (default 3)")
    check.add_argument("--examples", type=int, default=50, metavar="N", help="Hypothesis examples per backend")
    check.add_argument("--seed", type=int, default=0, metavar="S", help="0 .. 2**32-1 (default 0)")
    check.add_argument("--deadline", default=None, metavar="SECONDS",
                       help="seconds one example may run before the hook is reported stuck (default 60)")
    check.add_argument("--api", default=None, choices=("current", "legacy"))
    check.add_argument("--rng", default="per_rank", choices=("per_rank", "same"),
                       help="each rank's torch/random/numpy seed: seed+rank (per_rank, default) or seed (same)")
    add_isolate_option(check)
    add_launcher_option(check)
    check.add_argument("--properties", default=None, metavar="LIST", help="comma-separated subset of properties")
    check.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    check.add_argument("--replay", default=None, metavar="TOKEN",
                       help="run only the counterexample a failure printed (its sc1.… token), bit for bit")
    db = check.add_mutually_exclusive_group()
    db.add_argument("--database", default=DEFAULT_DATABASE, metavar="DIR",
                    help=f"example database directory (default {DEFAULT_DATABASE})")
    db.add_argument("--no-database", action="store_true", help="do not read or write an example database")
    check.add_argument("--jobs", type=int, default=None, metavar="N",
                       help="rows checked at once, each in its own worker process (default: the CPUs this "
                            "process may use; 1: one after another in this process)")
    check.add_argument("--quiet", action="store_true", help="no progress line")
    check.add_argument("--e2e", action="store_true",
                       help="then run real DDP on real gloo processes for a few examples and compare (exit 4: "
                            "the simulator disagrees)")
    check.add_argument("--e2e-examples", type=int, default=None, metavar="N",
                       help="drawn scenarios per row for --e2e, besides every counterexample and edge case (default 2)")
    check.add_argument("--e2e-timeout", default=None, metavar="SECONDS",
                       help="for --e2e: seconds each side of a scenario may take before it is reported hung "
                            "(default 120; a hook that hangs real DDP costs this twice per scenario)")


def add_isolate_option(parser: argparse.ArgumentParser) -> None:
    """``--isolate MOD[,MOD]``, as ``check``, ``explain`` and ``e2e`` take it (one definition; the
    value is read by :func:`~simcluster.usercode.rank_local.parse_isolate`)."""
    parser.add_argument("--isolate", default=None, metavar="MOD[,MOD]",
                        help="more modules every simulated rank imports for itself (the TARGET's own always is)")


def add_launcher_option(parser: argparse.ArgumentParser) -> None:
    """``--launcher none|torchrun``, as ``check``, ``explain`` and ``e2e`` take it (one
    definition; the values are :data:`~simcluster.fake.launcher.LAUNCHERS`, SimCluster's
    ``launcher=``; ``e2e`` gives the variables to its real ranks too)."""
    from simcluster.fake.launcher import LAUNCHERS

    parser.add_argument("--launcher", default="none", choices=LAUNCHERS,
                        help="torchrun: each simulated rank's os.environ holds torchrun's variables (RANK, "
                             "LOCAL_RANK, WORLD_SIZE, ...) with its own values (with e2e, each real rank's too); "
                             "none (default): the caller's")


def _add_explain_parser(sub: Any) -> None:
    """``simcluster explain``'s options (docs/cli.md)."""
    explain = sub.add_parser("explain", help="run a hook once on small gradients and show what it does")
    explain.add_argument("target", metavar="TARGET")
    explain.add_argument("--world-size", type=int, default=2, metavar="N")
    explain.add_argument("--backend", default="gloo", choices=BACKEND_NAMES)
    explain.add_argument("--seed", type=int, default=0, metavar="S")
    explain.add_argument("--state", default="none", metavar="SPEC")
    add_isolate_option(explain)
    add_launcher_option(explain)
    explain.add_argument("--numel", type=int, default=None, metavar="N", help="one parameter of N elements (one bucket)")
    explain.add_argument("--params", default=None, metavar="SHAPES",
                         help="parameter shapes, e.g. 4x5,5,1000 (default 2x2,3,3 with a 12-byte cap: three buckets)")
    explain.add_argument("--bucket-cap-mb", type=float, default=None, metavar="X", help="DDP's bucket_cap_mb")
    explain.add_argument("--steps", type=int, default=2, metavar="K", help="DDP steps (default 2: the rebuild)")
    explain.add_argument("--api", default="current", choices=("current", "legacy"))
    explain.add_argument("--network", default="ethernet25", metavar="NET",
                         help="ethernet25 (default) | ib200 | LATENCY_US,BANDWIDTH_GBIT for the α-β estimate")
    explain.add_argument("--timeline", default=None, metavar="PATH", help="draw the run to PATH.svg or PATH.html")
    explain.add_argument("--chrome-trace", default=None, metavar="PATH", help="write a Perfetto/Chrome trace (.json)")
    explain.add_argument("--range", action="store_true",
                         help="search the largest gradient magnitude the hook keeps finite and within --tolerance")
    explain.add_argument("--tolerance", default=None, metavar="T", help="for --range (default fp16)")
    explain.add_argument("--world-sizes", default=None, metavar="LIST", help="for --range (default 2,3,8)")
    explain.add_argument("--deadline", default=None, metavar="SECONDS",
                         help="seconds one step (one --range run) may take before the hook is reported stuck (default 60)")


def main(argv: Sequence[str] | None = None, *, check: CheckFunction | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it).

    ``check`` replaces :func:`simcluster.checking.check.check_hook` (tests inject a fake).
    """
    with ctrl_c.remembering():  # a Ctrl-C whose KeyboardInterrupt was swallowed is raised again
        try:
            try:
                args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
            except SystemExit as exc:  # --help: argparse's own exit, the only one honoured
                return exc.code if isinstance(exc.code, int) else 0
            _import_holding_ctrl_c(args.command)
            code = _run_command(args, check)
            ctrl_c.raise_if_lost()  # pressed, swallowed, and no wait loop came after: still 130
            return code
        except SimClusterError as exc:  # usage and load errors: one line, no traceback
            print(f"simcluster: error: {first_line(exc) or type(exc).__name__}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt as exc:
            terminated = isinstance(exc, ctrl_c.Terminated)
            print("simcluster: terminated (SIGTERM)" if terminated else "simcluster: interrupted", file=sys.stderr)
            for note in getattr(exc, "__notes__", ()):
                print(note, file=sys.stderr)
            return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


def console_main() -> NoReturn:
    """The ``simcluster`` console script and ``python -m simcluster``: :func:`main`, in a
    process whose string hash seed is fixed (:func:`_run_again_with_a_fixed_hash_seed`),
    ended by :func:`_end_now` with its exit code."""
    if "PYTHONHASHSEED" not in os.environ:
        _run_again_with_a_fixed_hash_seed()
    _end_now(main())


def _end_now(code: int) -> NoReturn:
    """End this process with ``code``: exit handlers run and output is flushed, as at a normal
    exit, and the process ends without the interpreter's teardown.

    The teardown frees every module and object one by one — with torch, Hypothesis and
    torch's hook modules loaded, ~0.65 s of every command (measured: an import of them
    ending normally, 3.5 s; with exit handlers then ``os._exit``, 2.85 s), a fifth of a
    one-row ``check`` or a replay. Objects still alive then are not finalized (``__del__``),
    as Python does not promise either.

    It also does not wait for threads that are not daemons. Python waits for every such thread
    before it exits, and simcluster leaves none: one still running was started by the code under
    test where this process ran it — importing a TARGET, whose module started a thread that never
    ends — and a finished check then never exited (an audit of hostile hooks, 2026-12-07). Each
    is named on stderr (on a cluster it keeps its rank's process from ending too)."""
    left = sorted((t.name, _what_it_runs(t)) for t in threading.enumerate()  # by name: no start-up race decides
                  if t is not threading.main_thread() and not t.daemon and t.is_alive())
    for name, runs in left:
        print(f"simcluster: not waiting for thread {name!r} ({runs}), still running at exit: "
              "the code under test started it (a rank's process would not end either)", file=sys.stderr)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing more to say there
            stream.flush()
    os._exit(code)


def _what_it_runs(thread: threading.Thread) -> str:
    """``runs name (file:line)`` of a thread's target, or of its class's ``run``."""
    function = getattr(thread, "_target", None) or type(thread).run
    name = getattr(function, "__qualname__", None) or type(function).__name__
    code = getattr(function, "__code__", None)
    if code is None:  # a builtin, time.sleep: named by its module
        module = getattr(function, "__module__", None)
        return f"runs {module}.{name}" if module else f"runs {name}"
    return f"runs {name} ({short_path(code.co_filename)}:{code.co_firstlineno})"


def _run_again_with_a_fixed_hash_seed() -> NoReturn:
    """Replace this process by the same command with ``PYTHONHASHSEED=0``: Python seeds its
    string hashes at start-up, from OS entropy unless that variable is set, and the order of
    a set of strings follows them — a hook iterating one gave another verdict, and its replay
    another outcome, from one invocation to the next (an audit of hostile hooks, 2026-12-07).
    Set ``PYTHONHASHSEED`` yourself to run under another seed (docs/isolation.md)."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    os.execve(sys.executable, [sys.executable, "-m", "simcluster", *sys.argv[1:]], env)


def _run_command(args: argparse.Namespace, check: CheckFunction | None) -> int:
    """The subcommand's exit code."""
    if args.command == "explain":
        return _explain_command(args)
    if args.command == "e2e":
        from simcluster.real.e2e_cli import e2e_command

        return e2e_command(args)
    return _check_command(args, check)


def _import_holding_ctrl_c(command: str) -> None:
    """Import torch (and, for ``check``, Hypothesis and the supervisor) with Ctrl-C held back
    until they are loaded (:func:`simcluster.checking.ctrl_c.held_back`: why). User code is
    imported later, without holding anything: an import that spins must stay interruptible."""
    with ctrl_c.held_back():
        import torch  # noqa: F401 - loaded here for its side effect

        if command == "check":
            import simcluster.checking.check  # noqa: F401 - Hypothesis and the supervisor with it


# -- explain ----------------------------------------------------------------------------------

EXPLAIN_DEADLINE = 60.0
"""Seconds one step of an ``explain`` (or one run of a ``--range`` search) may take, as
``check``'s ``--deadline`` bounds one example."""


def _explain_command(args: argparse.Namespace) -> int:
    """``explain`` runs the hook in a supervised child too: a hook that spins, blocks or
    exits is reported (exit 1, with where it was and the stuck code's stack), never a hang;
    a ``sys.exit()`` in user code is the failing step's error (``record`` catches it)."""
    import torch  # noqa: F401 - imported once here, not in the child

    from simcluster.teaching.explain import explain_command
    from simcluster.limits import check_deadline
    from simcluster.checking.render import printed_output
    from simcluster.checking.supervisor import format_stack, run_supervised

    deadline = EXPLAIN_DEADLINE if args.deadline is None else check_deadline(args.deadline)

    def job(monitor: Any) -> tuple[int, str]:
        import io

        monitor.begin({"phase": "explain"})
        out = io.StringIO()
        with contextlib.redirect_stdout(out):  # handed back: the caller's stdout may be a capture
            code = explain_command(args, monitor)
        return code, out.getvalue()

    outcome = run_supervised(job, deadline=deadline)
    if isinstance(outcome.error, UnsupportedError):  # as check words it: no lesson rather than a wrong one
        what = _unmodelled("\n".join(getattr(outcome.error, "__notes__", ()))) or first_line(outcome.error)
        print(f"simcluster: cannot explain {args.target}: not modelled by the simulator: {what}", file=sys.stderr)
        return EXIT_INTERNAL
    if outcome.error is not None:
        raise outcome.error
    if outcome.death is not None:
        print(f"simcluster: explain {args.target}: {outcome.death.summary('the hook')}", file=sys.stderr)
        printed = printed_output(outcome.death.output, last=True)
        if printed:
            print("  what the hook printed in that step:\n" + "\n".join(f"    {line}" for line in printed.splitlines()),
                  file=sys.stderr)
        stack = format_stack(outcome.death.stacks)
        if stack:
            print("  the stuck code (outermost call first):\n" + stack, file=sys.stderr)
        return EXIT_FAILED
    code, text = outcome.value
    sys.stdout.write(text)
    return int(code)


# -- check ------------------------------------------------------------------------------------


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The options shared by every row, validated (UsageError → exit 2 before any work)."""
    from simcluster.limits import EXAMPLES, SEEDS, STEPS, check_database_dir, check_deadline, check_int, check_output_file
    from simcluster.checking.supervisor import DEFAULT_DEADLINE
    from simcluster.usercode.targets import parse_shapes, parse_world_sizes
    from simcluster.usercode.rank_local import parse_isolate

    props = None
    if args.properties is not None:
        props = tuple(p.strip() for p in args.properties.split(",") if p.strip())
        unknown = [p for p in props if p not in PROPERTIES]
        if unknown or not props:
            raise UsageError(f"--properties {args.properties!r}: choose from {', '.join(PROPERTIES)}")
    if args.json is not None:
        check_output_file("--json", args.json)
    if args.database is not None and not args.no_database:
        check_database_dir("--database", args.database)
    world_sizes = parse_world_sizes(args.world_sizes)
    if args.replay is not None and args.world_sizes != CHECK_WORLD_SIZES:
        from simcluster.checking.replay import decode_example

        replayed = decode_example(args.replay)[0].world_size
        if replayed not in world_sizes:
            raise UsageError(f"--replay: the token's example has world size {replayed}, not one of --world-sizes "
                             f"{args.world_sizes}")
    if args.e2e_examples is not None and not args.e2e:
        raise UsageError("--e2e-examples N: only with --e2e")
    if args.e2e_timeout is not None and not args.e2e:
        raise UsageError("--e2e-timeout SECONDS: only with --e2e")
    extra: dict[str, Any] = {"params": parse_shapes(args.params)} if args.params is not None else {}
    if args.subgroups:
        extra["subgroups"] = True
    if args.gradient_as_bucket_view:
        extra["gradient_as_bucket_view"] = True
    return extra | {
        "backends": BACKEND_NAMES if args.backend == "all" else (args.backend,),
        "world_sizes": world_sizes,
        "steps": check_int("--steps", args.steps, *STEPS),
        "examples": check_int("--examples", args.examples, *EXAMPLES),
        "seed": check_int("--seed", args.seed, *SEEDS),
        "deadline": DEFAULT_DEADLINE if args.deadline is None else check_deadline(args.deadline),
        "database": None if args.no_database else args.database,
        "properties": props,
        "replay": args.replay,
        "rng": args.rng,
        "launcher": args.launcher,
        "isolate": parse_isolate(args.isolate) or None,
    }


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One dict per hook to check: display name, target spec, state, tolerance, api, properties, skipped."""
    from simcluster.checking.tolerances import parse_tolerance

    if not args.targets:
        from simcluster.checking.defaults import default_entries

        given = [f"--{name}" for name in ("state", "tolerance", "api", "replay") if getattr(args, name) is not None]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise UsageError(f"{', '.join(given)} {verb} a TARGET: the default run uses each hook's own")

        return [
            {"name": e.name, "target": e.target, "state": e.state, "tolerance": e.tolerance, "api": e.api,
             "properties": e.properties, "backends": e.backends, "skipped": e.skipped}
            for e in default_entries()
        ]
    tolerance = parse_tolerance(args.tolerance or "fp32", what="--tolerance").describe()
    return [
        {"name": t, "target": t, "state": args.state or "none", "tolerance": tolerance, "api": args.api or "current",
         "properties": None, "backends": None, "skipped": None}
        for t in args.targets
    ]


def _load(rows: list[dict[str, Any]], deadline: float, isolate: tuple[str, ...] | None, per_rank: bool,
          separate: bool = False) -> None:
    """Load every hook and state before running anything: a bad TARGET exits 2 at once.

    Importing a TARGET runs its module's code, which may spin, exit or crash like a hook:
    it is first imported in a supervised child (bounded by ``deadline``); only a module
    that imported cleanly there is imported here. The default run's modules (torch's and
    simcluster's own) are imported here directly: supervising them would protect nothing
    and cost their import twice (~1.5 s of the default run, measured). A TARGET's hook is a
    :class:`~simcluster.usercode.rank_local.RankLocal`: each simulated rank gets its own copy of its
    module (and of the ``--isolate`` modules); the default run's hooks (``per_rank=False``:
    torch's and the reference hooks, which keep no module state) are shared. ``separate``
    (several TARGETs): none is imported here — each row's worker imports its own
    (:func:`_run_rows`)."""
    from simcluster.errors import TargetLoadError
    from simcluster.checking.supervisor import format_stack, run_supervised
    from simcluster.usercode.rank_local import RankLocal
    from simcluster.usercode.targets import load_state, load_target

    import torch  # noqa: F401 - imported once here, not in every child (it takes seconds)

    def load_all(monitor: Any = None) -> bool:
        if monitor is not None:
            monitor.begin({"phase": "loading the targets"})
        for row in rows:
            if row["skipped"] is None:
                row["hook"] = RankLocal(row["target"], isolate=isolate) if per_rank else load_target(row["target"])
                load_state(row["state"])  # loaded only to fail early; check_hook gets the spec string
        return True

    if per_rank:  # user code
        outcome = run_supervised(load_all, deadline=deadline)
        if outcome.error is not None:  # a load error (exit 2), or Ctrl-C while importing
            raise outcome.error
        if outcome.death is not None:
            frames = [line.strip() for line in format_stack(outcome.death.stacks).splitlines() if " in " in line]
            what = "" if outcome.death.kind == "deadline" else "the process "
            loaded = ", ".join(row["target"] for row in rows if row["skipped"] is None)
            raise TargetLoadError(f"importing {loaded}: {what}{outcome.death.detail}"
                                  + (f" (at {frames[-1]})" if frames else ""))
        if separate:
            # Not imported here: each row is checked in a process of its own that imports its
            # TARGET alone (_run_rows), as separate programs would — what one module's import
            # does to the process (torch.distributed.all_reduce replaced, say) reached every
            # other row (an audit of hostile hooks, 2026-12-07).
            for row in rows:
                row["hook"] = row["target"]
            return
    load_all()


def _check_command(args: argparse.Namespace, check: CheckFunction | None) -> int:
    options = _options(args)
    _jobs(args)  # a bad --jobs is exit 2 before any work
    if args.e2e:
        from simcluster.limits import E2E_TIMEOUT, check_deadline, check_int

        args.e2e_examples = 2 if args.e2e_examples is None else check_int("--e2e-examples", args.e2e_examples, 0, 100)
        args.e2e_timeout = E2E_TIMEOUT if args.e2e_timeout is None else check_deadline(args.e2e_timeout,
                                                                                        "--e2e-timeout")
    rows = _rows(args)
    # several TARGETs, checked for real: each row in a worker process of its own (_run_rows);
    # an injected checker (a test's double) gets the rows in this process, hooks loaded
    args.separate = check is None and bool(args.targets) and sum(row["skipped"] is None for row in rows) > 1
    _load(rows, options["deadline"], options["isolate"], per_rank=bool(args.targets), separate=args.separate)
    if check is None:
        from simcluster.checking.check import check_hook as check
    progress = ProgressLine(sys.stderr, enabled=not args.quiet)
    reports: list[CheckReport] = []
    try:
        internal = _run_rows(args, rows, options, check, progress, reports)
    except KeyboardInterrupt:
        progress.clear()
        _write_json(args, reports)
        raise
    progress.clear()
    e2e = None
    if args.e2e:
        from simcluster.real.e2e_check import e2e_for_rows

        try:
            e2e = e2e_for_rows(rows, reports, options, args.e2e_examples, progress, timeout=args.e2e_timeout)
        finally:  # Ctrl-C while real processes run: every world is closed by then
            progress.clear()
            if e2e is None:
                _write_json(args, reports)
    print(format_table(rows, reports, e2e))
    for report in reports:
        if report.status == "FAILED" and report.failures:
            print()
            print(report.format())
        elif report.warnings or report.notes:  # a passing row's report: its table line, what it noted and warned of
            print()
            print(f"{report.target}: " + ("notes and warnings (each shown once):" if report.notes and report.warnings
                                          else "notes:" if report.notes else "warnings (each shown once):"))
            print("\n".join([*(f"  note: {n}" for n in report.notes), *(f"  warning: {w}" for w in report.warnings)]))
    missed: list[str] = []
    if e2e is not None:
        print()
        print(e2e.format())
        missed = [line for r in reports if r.status != "FAILED" and (line := e2e.missed_line(r.target))]
        if missed:
            print("\n".join(missed))
    _write_json(args, reports, e2e)
    if not args.quiet:
        print(_timing_line(reports), file=sys.stderr)
    if internal:
        return EXIT_INTERNAL
    if e2e is not None and e2e.fidelity_bugs:
        return EXIT_FIDELITY  # the simulator's verdicts cannot be trusted: before the hook's verdict
    return EXIT_FAILED if missed or any(r.status == "FAILED" for r in reports) else EXIT_OK


def _timing_line(reports: list[CheckReport]) -> str:
    """Where the run's time went, for stderr: the rows' total and the slowest ones."""
    timed = sorted((r for r in reports if r.skipped is None), key=lambda r: -r.seconds)
    slowest = ", ".join(f"{r.target} {r.seconds:.1f} s" for r in timed[:3])
    return f"simcluster: rows took {sum(r.seconds for r in timed):.1f} s" + (f" (slowest: {slowest})" if slowest else "")


def _write_json(args: argparse.Namespace, reports: list[CheckReport], e2e: Any = None) -> None:
    """``--json``: every report; with ``--e2e`` each also gets ``"e2e"`` (the table's cell)."""
    if args.json is not None:
        dicts = [r.to_dict() | ({"e2e": e2e.column(r.target)} if e2e is not None else {}) for r in reports]
        try:
            Path(args.json).write_text(json.dumps(dicts, indent=2) + "\n")
        except OSError as exc:  # a full disk, a folder that is not there: the verdict is printed, the file is not
            raise UsageError(f"--json {args.json}: cannot write it ({exc.strerror or exc})") from None


def _run_rows(args: argparse.Namespace, rows: list[dict[str, Any]], options: dict[str, Any],
              check: CheckFunction, progress: ProgressLine, reports: list[CheckReport]) -> bool:
    """Check every row into ``reports`` (in row order); True if simcluster itself broke on one of them.

    ``--jobs 1`` (or a single row to check) runs the rows one after another here; more
    run them in parallel worker processes (:func:`_run_rows_in_workers`)."""
    jobs = _jobs(args)
    plans = [_plan(row, options) for row in rows]
    if (jobs > 1 or getattr(args, "separate", False)) and sum(isinstance(plan, dict) for plan in plans) > 1:
        # several TARGETs: each in a forked worker of its own, even one at a time (_load)
        return _run_rows_in_workers(args, rows, plans, check, progress, reports, jobs)
    internal = False
    for n, (row, plan) in enumerate(zip(rows, plans), 1):
        if isinstance(plan, CheckReport):
            reports.append(plan)
            continue
        progress.set_prefix(f"[{n}/{len(rows)}] {row['name']}")
        started = time.perf_counter()
        try:
            report = check(row["hook"], **plan, progress=progress)
        except UsageError:
            raise
        except KeyboardInterrupt as stop:  # which row first, then where its code was (as with --jobs N)
            stop.__notes__ = [f"simcluster: {row['name']} was being checked", *getattr(stop, "__notes__", ())]
            raise
        except Exception:  # noqa: BLE001 - a bug of ours: show it, keep checking the others
            progress.clear()
            note = _row_broke(row, traceback.format_exc())
            internal = True
            report = _broken_report(row, plan, time.perf_counter() - started, note)
        if not args.targets:
            report.target = row["name"]
        progress.finish(f"{report.status} ({report.seconds:.1f}s)")
        reports.append(report)
    return internal


def _jobs(args: argparse.Namespace) -> int:
    """``--jobs``, validated (exit 2 out of range); by default the CPUs this process may use."""
    from simcluster.limits import JOBS, check_int, default_jobs

    return default_jobs() if args.jobs is None else check_int("--jobs", args.jobs, *JOBS)


def _plan(row: dict[str, Any], options: dict[str, Any]) -> dict[str, Any] | CheckReport:
    """What checking ``row`` takes: ``check``'s keyword arguments (but ``progress``), or the
    report of a row that is not checked (skipped by the defaults, or for other backends)."""
    if row["skipped"] is not None:
        return CheckReport(target=row["name"], passed=True, properties=[], backends=[], skipped=row["skipped"])
    backends = tuple(b for b in options["backends"] if row["backends"] is None or b in row["backends"])
    if not backends:  # a row meant for other backends than the ones asked for
        return CheckReport(target=row["name"], passed=True, properties=[], backends=[],
                           skipped=f"checked under {', '.join(row['backends'])} only")
    kwargs = dict(options, backends=backends, target=row["target"], state=row["state"],
                  tolerance=row["tolerance"], api=row["api"])
    if row["properties"] is not None:
        kwargs["properties"] = row["properties"]
    for optional in ("replay", "isolate"):
        if kwargs[optional] is None:
            del kwargs[optional]
    return kwargs


def _row_broke(row: dict[str, Any], traceback_text: str) -> str:
    """Say on stderr why ``row``'s check gave no verdict (exit 3); the row's note.

    The hook used something the simulator does not model (an ``UnsupportedError``, e.g.
    ``dist.monitored_barrier``): one line naming it and the user line that called it. Any
    other exception is simcluster's own bug: its whole traceback. ``traceback_text`` is all
    either path has (a worker process sends only the text)."""
    unmodelled = _unmodelled(traceback_text)
    if unmodelled is not None:
        print(f"simcluster: cannot check {row['name']}: not modelled by the simulator: {unmodelled}", file=sys.stderr)
        sys.stderr.flush()
        return f"not modelled by the simulator: {unmodelled}"
    print(f"simcluster: internal error while checking {row['name']}:", file=sys.stderr)
    sys.stderr.write(traceback_text)
    sys.stderr.flush()
    return "internal error: see stderr"


def _unmodelled(traceback_text: str) -> str | None:
    """``what (rank r, at file:line in fn: code)`` when the root error in
    ``traceback_text`` is simcluster's ``UnsupportedError`` or one of its kinds (a
    ``SharedSettingError``: a rank changed a setting every simulated rank shares); else ``None``."""
    import re

    from simcluster import errors

    kinds = "|".join(sorted(cls.__name__ for cls in vars(errors).values()
                            if isinstance(cls, type) and issubclass(cls, errors.UnsupportedError)))
    found = re.search(rf"^simcluster\.errors\.(?:{kinds}): (.*)$", traceback_text, re.MULTILINE)
    if found is None:
        return None
    from simcluster.fake.cluster import CAUGHT_UNMODELLED

    where = re.search(r"^simcluster: raised in the supervised child \((.*)\)$", traceback_text, re.MULTILINE)
    caught = f"; {CAUGHT_UNMODELLED}" if CAUGHT_UNMODELLED in traceback_text else ""
    return found.group(1) + (f" ({where.group(1)})" if where else "") + caught


def _broken_report(row: dict[str, Any], plan: dict[str, Any], seconds: float, note: str) -> CheckReport:
    """The row of a check that broke (exit 3): failed, no property verdicts, ``note`` saying why."""
    return CheckReport(target=row["name"], passed=False, properties=[], backends=list(plan["backends"]),
                       notes=[note], seconds=seconds)


def _run_rows_in_workers(args: argparse.Namespace, rows: list[dict[str, Any]],
                         plans: list[dict[str, Any] | CheckReport], check: CheckFunction, progress: ProgressLine,
                         reports: list[CheckReport], jobs: int) -> bool:
    """``--jobs N``: up to ``jobs`` rows at a time, each in a forked worker
    (:mod:`simcluster.checking.row_pool`); results are put back in row order, so
    ``reports`` is what the in-process loop makes. Interrupted, ``reports`` holds the rows
    finished so far (in row order)."""
    from contextlib import closing
    from functools import partial

    from simcluster.checking.progress import PoolProgress
    from simcluster.checking.row_pool import Broken, run_tasks

    from simcluster.checking.check import prepare_to_fork

    prepare_to_fork()  # once here, not once per worker
    done: dict[int, CheckReport] = {n: plan for n, plan in enumerate(plans) if isinstance(plan, CheckReport)}
    todo = [n for n, plan in enumerate(plans) if isinstance(plan, dict)]
    tasks = [partial(check, rows[n]["hook"], **plans[n], progress=None) for n in todo]
    board = PoolProgress(progress, len(rows), done=len(done))
    started: dict[int, float] = {}

    def start(k: int) -> None:
        started[todo[k]] = time.perf_counter()
        board.started(todo[k] + 1, rows[todo[k]]["name"])

    internal = False
    try:  # closing: whatever stops this loop (Ctrl-C while printing included) kills every worker at once
        with closing(run_tasks(tasks, jobs=jobs, started=start, names=[rows[n]["name"] for n in todo])) as outcomes:
            for k, outcome in outcomes:
                n = todo[k]
                if isinstance(outcome, Broken):
                    progress.clear()
                    note = _row_broke(rows[n], outcome.detail)
                    internal = True
                    report = _broken_report(rows[n], plans[n], time.perf_counter() - started[n],  # type: ignore[arg-type]
                                            note)
                else:
                    report = outcome.value
                if not args.targets:
                    report.target = rows[n]["name"]
                board.finished(n + 1, rows[n]["name"], f"{report.status} ({report.seconds:.1f}s)")
                done[n] = report
    finally:
        reports.extend(done[n] for n in sorted(done))
    return internal


def _backend_status(report: CheckReport, backend: str) -> str:
    if report.skipped is not None:
        return "-"
    if backend not in report.backends:
        return "-"
    # a failure not tied to a backend (e.g. registration: backend "any") fails every column
    failed = sorted({f.property for f in report.failures if f.backend in (backend, "any")})
    if failed:
        return "FAIL:" + ",".join(failed)
    if not report.passed and not report.failures:
        return "error"
    return "ok"


def format_table(rows: list[dict[str, Any]], reports: list[CheckReport], e2e: Any = None) -> str:
    """The summary table: hook, state, tolerance, one status column per backend, examples;
    with ``e2e`` (:class:`simcluster.real.e2e_check.E2ESummary`) an ``e2e`` column too.

    Skipped rows follow the checked ones, with their reason. No wall-clock time: the report
    on stdout is the same, byte for byte, on every run of the same command (a time column
    made two replays of a deterministic hook differ: an audit of hostile hooks, 2026-12-07);
    times go to stderr (the progress lines and :func:`_timing_line`) and ``--json``.
    """
    head = ("hook", "state", "tolerance", "gloo", "nccl", "examples") + (("e2e",) if e2e is not None else ())
    body: list[tuple[str, ...]] = []
    skipped: list[tuple[str, str]] = []
    for row, report in zip(rows, reports):
        if report.skipped is not None:
            skipped.append((row["name"], report.skipped))
            continue
        state = row["state"].rpartition(":")[2] if ":" in row["state"] else row["state"]
        body.append((row["name"], state, row["tolerance"], _backend_status(report, "gloo"),
                     _backend_status(report, "nccl"), str(report.examples))
                    + ((e2e.column(row["name"]),) if e2e is not None else ()))
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{name}  SKIPPED: {reason}" for name, reason in skipped]
    failed = sum(r.status == "FAILED" for r in reports)
    checked = sum(r.skipped is None for r in reports)
    lines.append(f"{checked} checked, {failed} failed, {len(skipped)} skipped")
    return "\n".join(lines)
