"""The ``simcluster`` command line: ``check`` hooks, ``explain`` one.

::

    simcluster check [TARGET ...] [--state SPEC] [--tolerance T] [--backend gloo|nccl|all]
                     [--world-sizes 1,2,3,4,8] [--steps K] [--examples N] [--seed S]
                     [--api current|legacy] [--json PATH] [--database DIR | --no-database]
                     [--properties P,Q] [--rng per_rank|same] [--isolate MOD[,MOD]] [--quiet]
    simcluster explain TARGET [--world-size N] [--backend gloo|nccl] [--seed S] [--state SPEC]

``python -m simcluster`` is the same program. Exit codes:

* **0** — every property held (skipped rows do not count against it);
* **1** — a property failed: each failure is printed with its property, backend, shrunk
  counterexample and a one-line replay command;
* **2** — usage or load error (bad option, unknown module, no such attribute, not
  callable, file not found): one line on stderr, no traceback;
* **3** — simcluster itself broke (a bug of ours): the traceback is printed.

With no TARGET, ``check`` runs :func:`simcluster.defaults.default_entries` — every hook
torch ships plus the reference hooks of ``hooks/`` — each with its own state and
tolerance; ``--state``/``--tolerance``/``--api`` then do not apply.

Counterexamples are stored in a Hypothesis example database, by default
``.simcluster/examples`` under the current directory (commit it: later runs, CI included,
replay them first). ``--database DIR`` moves it, ``--no-database`` turns it off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from simcluster.errors import SimClusterError, UsageError
from simcluster.progress import ProgressLine
from simcluster.report import PROPERTIES, CheckReport

__all__ = ["main", "build_parser", "DEFAULT_DATABASE", "CheckFunction"]

DEFAULT_DATABASE = ".simcluster/examples"
"""Where counterexamples are kept, relative to the current directory."""

CheckFunction = Callable[..., CheckReport]
"""``simcluster.check.check_hook``'s shape: ``check(hook, *, target=…, state=…, …) -> CheckReport``."""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``simcluster`` (``check`` and ``explain`` subcommands)."""
    parser = _Parser(prog="simcluster", description="Correctness checks for PyTorch DDP communication hooks.")
    sub = parser.add_subparsers(dest="command", metavar="{check,explain}", parser_class=_Parser)
    sub.required = True

    check = sub.add_parser("check", help="check hooks against the DDP properties (no TARGET: the default set)")
    check.add_argument("targets", nargs="*", metavar="TARGET", help="package.module:name or path/to/file.py:name")
    check.add_argument("--state", default=None, metavar="SPEC",
                       help="none (default) | group | module:factory | file.py:factory")
    check.add_argument("--tolerance", default=None, metavar="T",
                       help="none | exact | fp32 (default) | fp16 | bf16 | rtol=R,atol=A")
    check.add_argument("--backend", default="all", choices=("gloo", "nccl", "all"))
    check.add_argument("--world-sizes", default="1,2,3,4,8", metavar="LIST")
    check.add_argument("--steps", type=int, default=3, metavar="K", help="DDP steps per example (default 3)")
    check.add_argument("--examples", type=int, default=50, metavar="N", help="Hypothesis examples per backend")
    check.add_argument("--seed", type=int, default=0, metavar="S")
    check.add_argument("--api", default=None, choices=("current", "legacy"))
    check.add_argument("--rng", default="per_rank", choices=("per_rank", "same"),
                       help="each rank's torch/random/numpy seed: seed+rank (per_rank, default) or seed (same)")
    check.add_argument("--isolate", default=None, metavar="MOD[,MOD]",
                       help="more modules every simulated rank imports for itself (the TARGET's own always is)")
    check.add_argument("--properties", default=None, metavar="LIST", help="comma-separated subset of properties")
    check.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    check.add_argument("--replay", default=None, metavar="TOKEN",
                       help="run only the counterexample a failure printed (its sc1.… token), bit for bit")
    db = check.add_mutually_exclusive_group()
    db.add_argument("--database", default=DEFAULT_DATABASE, metavar="DIR",
                    help=f"example database directory (default {DEFAULT_DATABASE})")
    db.add_argument("--no-database", action="store_true", help="do not read or write an example database")
    check.add_argument("--quiet", action="store_true", help="no progress line")

    explain = sub.add_parser("explain", help="run a hook once on small gradients and show what it does")
    explain.add_argument("target", metavar="TARGET")
    explain.add_argument("--world-size", type=int, default=2, metavar="N")
    explain.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    explain.add_argument("--seed", type=int, default=0, metavar="S")
    explain.add_argument("--state", default="none", metavar="SPEC")
    explain.add_argument("--numel", type=int, default=4, metavar="N", help="elements per gradient (default 4)")
    return parser


def main(argv: Sequence[str] | None = None, *, check: CheckFunction | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it).

    ``check`` replaces :func:`simcluster.check.check_hook` (tests inject a fake).
    """
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.command == "explain":
            from simcluster.explain import explain_command

            return explain_command(args.target, world_size=args.world_size, backend=args.backend,
                                   seed=args.seed, state=args.state, numel=args.numel)
        return _check_command(args, check)
    except SimClusterError as exc:  # usage and load errors: one line, no traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"simcluster: error: {first}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("simcluster: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0


# -- check ------------------------------------------------------------------------------------


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{name} {value}: must be at least 1")
    return value


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The options shared by every row, validated (UsageError → exit 2 before any work)."""
    from simcluster.rank_local import parse_isolate
    from simcluster.targets import parse_world_sizes

    props = None
    if args.properties is not None:
        props = tuple(p.strip() for p in args.properties.split(",") if p.strip())
        unknown = [p for p in props if p not in PROPERTIES]
        if unknown or not props:
            raise UsageError(f"--properties {args.properties!r}: choose from {', '.join(PROPERTIES)}")
    if args.json is not None and not Path(args.json).parent.is_dir():
        raise UsageError(f"--json {args.json}: directory {Path(args.json).parent} does not exist")
    return {
        "backends": ("gloo", "nccl") if args.backend == "all" else (args.backend,),
        "world_sizes": parse_world_sizes(args.world_sizes),
        "steps": _positive("--steps", args.steps),
        "examples": _positive("--examples", args.examples),
        "seed": args.seed,
        "database": None if args.no_database else args.database,
        "properties": props,
        "replay": args.replay,
        "rng": args.rng,
        "isolate": parse_isolate(args.isolate) or None,
    }


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One dict per hook to check: display name, target spec, state, tolerance, api, properties, skipped."""
    from simcluster.targets import parse_tolerance

    if not args.targets:
        from simcluster.defaults import default_entries

        given = [f"--{name}" for name in ("state", "tolerance", "api", "replay") if getattr(args, name) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} need a TARGET: the default run uses each hook's own")

        return [
            {"name": e.name, "target": e.target, "state": e.state, "tolerance": e.tolerance, "api": e.api,
             "properties": e.properties, "backends": e.backends, "skipped": e.skipped}
            for e in default_entries()
        ]
    tolerance = parse_tolerance(args.tolerance or "fp32")
    return [
        {"name": t, "target": t, "state": args.state or "none", "tolerance": tolerance, "api": args.api or "current",
         "properties": None, "backends": None, "skipped": None}
        for t in args.targets
    ]


def _load(rows: list[dict[str, Any]], isolate: tuple[str, ...] | None, per_rank: bool) -> None:
    """Load every hook and state before running anything: a bad TARGET exits 2 at once.

    A TARGET's hook is a :class:`~simcluster.rank_local.RankLocal`: each simulated rank gets
    its own copy of its module (and of the ``--isolate`` modules). The default run's hooks
    (``per_rank=False``: torch's and the reference hooks, which keep no module state) are
    shared, which spares a module copy per rank and example."""
    from simcluster.rank_local import RankLocal
    from simcluster.targets import load_state, load_target

    for row in rows:
        if row["skipped"] is None:
            row["hook"] = RankLocal(row["target"], isolate=isolate) if per_rank else load_target(row["target"])
            load_state(row["state"])  # loaded only to fail early; check_hook gets the spec string


def _check_command(args: argparse.Namespace, check: CheckFunction | None) -> int:
    options = _options(args)
    rows = _rows(args)
    _load(rows, options["isolate"], per_rank=bool(args.targets))
    if check is None:
        from simcluster.check import check_hook as check
    progress = ProgressLine(sys.stderr, enabled=not args.quiet)
    reports: list[CheckReport] = []
    internal = False
    for n, row in enumerate(rows, 1):
        if row["skipped"] is not None:
            reports.append(CheckReport(target=row["name"], passed=True, properties=[], backends=[],
                                       skipped=row["skipped"]))
            continue
        progress.set_prefix(f"[{n}/{len(rows)}] {row['name']}")
        backends = tuple(b for b in options["backends"] if row["backends"] is None or b in row["backends"])
        if not backends:  # a row meant for other backends than the ones asked for
            reports.append(CheckReport(target=row["name"], passed=True, properties=[], backends=[],
                                       skipped=f"checked under {', '.join(row['backends'])} only"))
            continue
        kwargs = dict(options, backends=backends, target=row["target"], state=row["state"],
                      tolerance=row["tolerance"], api=row["api"], progress=progress)
        if row["properties"] is not None:
            kwargs["properties"] = row["properties"]
        for optional in ("replay", "isolate"):
            if kwargs[optional] is None:
                del kwargs[optional]
        started = time.perf_counter()
        try:
            report = check(row["hook"], **kwargs)
        except UsageError:
            raise
        except Exception:  # noqa: BLE001 - a bug of ours: show it, keep checking the others
            progress.clear()
            print(f"simcluster: internal error while checking {row['name']}:", file=sys.stderr)
            traceback.print_exc()
            internal = True
            report = CheckReport(target=row["name"], passed=False, properties=[], backends=list(backends),
                                 notes=["internal error: see stderr"], seconds=time.perf_counter() - started)
        if not args.targets:
            report.target = row["name"]
        progress.finish(f"{report.status} ({report.seconds:.1f}s)")
        reports.append(report)
    progress.clear()
    print(format_table(rows, reports))
    for report in reports:
        if report.status == "FAILED" and report.failures:
            print()
            print(report.format())
    if args.json is not None:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in reports], indent=2) + "\n")
    if internal:
        return EXIT_INTERNAL
    return EXIT_FAILED if any(r.status == "FAILED" for r in reports) else EXIT_OK


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


def format_table(rows: list[dict[str, Any]], reports: list[CheckReport]) -> str:
    """The summary table: hook, state, tolerance, one status column per backend, time.

    Skipped rows follow the checked ones, with their reason.
    """
    head = ("hook", "state", "tolerance", "gloo", "nccl", "time")
    body: list[tuple[str, ...]] = []
    skipped: list[tuple[str, str]] = []
    for row, report in zip(rows, reports):
        if report.skipped is not None:
            skipped.append((row["name"], report.skipped))
            continue
        state = row["state"].rpartition(":")[2] if ":" in row["state"] else row["state"]
        body.append((row["name"], state, row["tolerance"], _backend_status(report, "gloo"),
                     _backend_status(report, "nccl"), f"{report.seconds:.1f}s"))
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{name}  SKIPPED: {reason}" for name, reason in skipped]
    failed = sum(r.status == "FAILED" for r in reports)
    checked = sum(r.skipped is None for r in reports)
    lines.append(f"{checked} checked, {failed} failed, {len(skipped)} skipped")
    return "\n".join(lines)
