"""The Hypothesis driver: search for counterexamples to a hook's properties, and the public entry points.

    >>> from simcluster.hooks.reference import mean_allreduce_hook
    >>> report = check_hook(mean_allreduce_hook, examples=5, world_sizes=(2, 3))
    >>> report.passed, report.properties
    (True, ['contract', 'liveness', 'replicas_agree', 'averages', 'keeps_nonfinite', 'schedule_independence'])

For each backend model, one Hypothesis test draws an :class:`~simcluster.checking.strategies.Example`
(world size, layout, ``steps`` steps of per-rank gradients, a completion schedule) and
judges it (:func:`~simcluster.checking.judge.run_example`: a simulated DDP run, then the
oracles in a fixed order, raising on the first violation). Each *distinct bug* —
property, exception type, the user-code line it arose at — raises its own exception
class, so Hypothesis keeps searching after the first failure, shrinks each separately,
and the report lists every one (at most :data:`MAX_BUGS` per backend), each with its
**shrunk** counterexample.

The concerns around the search each have their module: :mod:`~simcluster.checking.options`
(validating ``check_hook``'s arguments, choosing the properties),
:mod:`~simcluster.checking.explicit` (the examples every search tries after its drawn ones),
:mod:`~simcluster.checking.judge` (one example, the oracles' order, what a hook's
exception counts as), :mod:`~simcluster.checking.replay` (the ``sc1.`` replay token),
:mod:`~simcluster.checking.render` (a failure as a report entry and a replay command),
:mod:`~simcluster.checking.supervisor` (the child process the search runs in).

**Replay.** Every failure carries a replay token (:mod:`simcluster.checking.replay`);
``check_hook(..., replay=token)`` (CLI: ``--replay TOKEN``) runs exactly that example
once, bit for bit. With ``database=DIR`` Hypothesis also keeps failing examples there
and tries them first on later runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from simcluster.checking import properties as P
from simcluster.checking.explicit import explicit_examples
from simcluster.checking.judge import (
    ORDER, exit_head, keeps_residual, order_hint, read_hint, repeat_hint, rng_hint, rounding_hint, run_example,
    sources_hint, unreached_hint, with_posting_lines,
)
from simcluster.checking.options import Options, make_options
from simcluster.checking.render import death_failure, failure
from simcluster.checking.replay import decode_example, encode_example
from simcluster.checking.report import CheckReport, PropertyFailure
from simcluster.checking.tolerances import parse_tolerance
from simcluster.checking.strategies import Example, examples as example_strategy
from simcluster.checking.supervisor import DEFAULT_DEADLINE, Monitor, run_supervised
from simcluster.errors import HookExited, UnsupportedError, UsageError, Violation
from simcluster.limits import BACKEND_NAMES, check_database_dir
from simcluster.names import loadable_spec, target_spec
from simcluster.usercode.output import captured_output, marking_ranks, rank_lines
from simcluster.usercode.rank_local import RankLocal, parse_isolate

__all__ = ["check_hook", "assert_hook", "encode_example", "decode_example", "run_example", "keeps_residual", "Violation"]

MAX_BUGS = 5  # distinct failures reported per backend
SHRINK_BUDGET = 3  # × examples: simulated examples allowed for shrinking after the first failure


# --------------------------------------------------------------------------- the API
def check_hook(hook: Callable[..., Any] | str, *, target: str | None = None, state: Any = "none",
               tolerance: str = "fp32", backends: Sequence[str] = BACKEND_NAMES,
               world_sizes: Sequence[int] = (1, 2, 3, 4, 8), steps: int = 3, examples: int = 50,
               seed: int | None = 0, api: str = "current",
               database: str | os.PathLike[str] | ExampleDatabase | None = None,
               properties: Sequence[str] | None = None, progress: Callable[[str], None] | None = None,
               replay: str | None = None, params: Sequence[Sequence[int]] | str | None = None,
               subgroups: bool | None = None, deadline: float = DEFAULT_DEADLINE,
               supervise: bool = True, rng: str = "per_rank",
               isolate: str | Sequence[str] | None = None, gradient_as_bucket_view: bool = False,
               launcher: str = "none") -> CheckReport:
    """Check ``hook`` and return a :class:`~simcluster.checking.report.CheckReport` (never raises for findings).

    ``hook``: a ``module:name`` / ``file.py:name`` string — every simulated rank then gets its
    own copy of its module, as every process imports it (:class:`~simcluster.usercode.rank_local.RankLocal`;
    ``isolate``: more modules to copy per rank, e.g. ``"mypkg.helpers"``) — or a callable
    (its module is then shared by every rank: module globals are not per rank). ``target``: the
    name used in the report and the replay line (default: the string, or
    ``module:qualname``). ``state``: ``"none"`` (hook state ``None``, i.e.
    ``dist.group.WORLD``), ``"group"`` (each rank's process group; also draws DDP on
    equal subgroups of the world), ``"module:factory"`` or a callable
    ``factory(process_group)``. ``tolerance``: ``exact`` | ``fp32`` | ``fp16`` | ``bf16`` |
    ``rtol=R,atol=A`` | ``none`` (skip *averages*); it also picks the inputs (fp16:
    float16 values up to ±65504; exact: exactly averageable values). ``steps`` >= 1
    (default 3: iteration 0, the rebuild, one more). ``examples`` per backend; ``seed``
    fixes generation (``None``: random); every example draws the seed of the ranks' torch,
    ``random`` and numpy generators (carried by its replay token), which ``rng``
    (``"per_rank"``: seed + rank, ``"same"``: seed) turns into each rank's. ``api``: ``"current"`` or
    ``"legacy"``. ``database``: a directory (or an ExampleDatabase) keeping failing
    examples, replayed first next time. ``params``: fixed parameter shapes, e.g.
    ``[(4, 5), (5,)]`` or ``"4x5,5"`` (values, world sizes, caps, ready orders and
    schedules are still drawn). ``subgroups``: draw DDP on equal subgroups of the world
    whatever the state (default: only with ``state="group"``); a factory then receives
    the rank's subgroup. ``gradient_as_bucket_view``: every drawn DDP runs with
    ``gradient_as_bucket_view=True`` (a hook whose owner requires it). ``launcher``: ``"none"``
    or ``"torchrun"`` — every simulated rank's ``os.environ`` then holds torchrun's variables
    with its own values (``RANK``, ``LOCAL_RANK``, …: :mod:`simcluster.fake.launcher`), for a hook
    that reads them. ``properties``: a subset of
    :data:`~simcluster.checking.report.PROPERTIES` (default: all that apply). ``progress``: called
    with a line per backend. ``replay``: a token from a failure: run just that example.
    Usage errors raise :class:`~simcluster.errors.UsageError`.

    **Supervision.** Each backend's search runs in a forked child process
    (:mod:`simcluster.checking.supervisor`): an example that runs longer than ``deadline``
    seconds (spinning, blocked in C, sleeping) or that kills or ends its process is a
    *liveness* failure of the hook, reported with the rank, step and bucket of the last
    hook call, the stuck code's stack and the example's replay command; the other
    backend is still checked. ``KeyboardInterrupt`` and pytest's outcome exceptions
    (``pytest.fail``, pytest-timeout's) end the whole check at once and propagate.
    ``supervise=False`` runs in this process (no deadline: a hook that never returns
    hangs the caller).
    """
    start = time.monotonic()
    isolated = parse_isolate(isolate)
    if rng not in ("per_rank", "same"):
        raise UsageError(f"rng={rng!r}: use 'per_rank' or 'same'")
    if isinstance(database, (str, os.PathLike)):
        check_database_dir("database", os.fspath(database))
    if isinstance(hook, str):
        target = target or hook
        hook = RankLocal(hook, isolate=isolated)
    replay_target = target or (hook if isinstance(hook, str) else "")
    from simcluster.checking.train_check import check_training  # hooks that train rather than reduce: real DDP
    from simcluster.checking.training import TRAININGS, training_for

    if (training := training_for(hook)) is not None:
        return check_training(training, target=target or target_spec(hook) or training.name, backends=backends,
                              world_sizes=world_sizes, steps=steps, examples=examples, seed=seed, replay=replay)
    if properties is not None and "trains_like_reference" in properties and not isinstance(properties, str):
        raise UsageError("properties: trains_like_reference applies to hooks that step an optimizer "
                         f"({', '.join(sorted(TRAININGS))}), checked by training on real DDP")
    if not callable(hook):
        raise UsageError(f"hook={hook!r} is not callable")
    opts = make_options(hook, target=target or target_spec(hook) or repr(hook),
                        replay_target=replay_target or loadable_spec(hook) or "", state=state, isolate=isolated,
                        tolerance=tolerance, backends=backends, world_sizes=world_sizes, steps=steps,
                        examples=examples, seed=seed, api=api, properties=properties, params=params,
                        subgroups=subgroups, deadline=deadline, rng=rng, bucket_view=gradient_as_bucket_view,
                        launcher=launcher)
    if replay is not None:
        replayed = decode_example(replay)[1]
        if replayed not in backends:
            raise UsageError(f"replay: the token's example runs on {replayed}, but backends {list(backends)} were "
                             "asked for: drop the backend option or ask for that one")
        backends = (replayed,)  # what runs, and what the report (the table's columns) says ran
    report = _new_report(opts, backends)
    if replay is not None:
        _replay(opts, replay, report, supervise)
    else:
        for backend in backends:
            if progress is not None:
                progress(f"{opts.target}: {backend}, {examples} examples, world sizes {list(world_sizes)}")
            _search(opts, backend, report, world_sizes, steps, examples, seed, database, supervise)
    report.passed = not report.failures
    report.seconds = time.monotonic() - start
    return report


def assert_hook(hook: Callable[..., Any] | str, **options: Any) -> None:
    """:func:`check_hook`, raising ``AssertionError(report.format())`` unless every property held."""
    check_hook(hook, **options).assert_passed()


def _new_report(opts: Options, backends: Sequence[str]) -> CheckReport:
    """The report before any example: its notes, and a registration failure found without running."""
    report = CheckReport(target=opts.target, passed=True, properties=list(opts.props), backends=list(backends))
    refusal = P.build_refusal(opts.hook)
    if refusal is not None:
        report.notes.append(f"{refusal}; the hook itself is checked")
    if "contract" in opts.props and (problem := P.registration_problem(opts.hook, opts.api)):
        state = f" --state {opts.state_name}" if opts.state_name != "none" else ""
        replay = (f"simcluster check {opts.replay_target or opts.target}{state} --api {opts.api} "
                  "--properties contract --examples 1")  # found before any example: one is enough
        report.failures.append(PropertyFailure("contract", "any", f"registration: {problem}", 0, "-", "-", [],
                                               replay, "registration"))
    return report


def _replay(opts: Options, token: str, report: CheckReport, supervise: bool) -> None:
    """Run the one example a replay token holds (supervised unless told not to)."""
    example, backend = decode_example(token)

    def replay_job(monitor: Monitor) -> CheckReport:
        part = _partial(opts, monitor)
        _run_one(part.opts, example, backend, part.report, steps=example.steps, whole_output=True)
        return part.report

    _supervised(replay_job, opts, backend, report, example.steps, opts.deadline, supervise)


def _search(opts: Options, backend: str, report: CheckReport, world_sizes: Sequence[int], steps: int,
            examples: int, seed: int | None, database: Any, supervise: bool) -> None:
    """One backend's search: Hypothesis' drawn examples, then the explicit ones — whose
    failure is reported when it is a bug the drawn examples did not find (another distinct
    key: a flex-quantisation hook from the wild failed *contract* at world 1 in the draw,
    and its callbacks' deadlock at world 2, which real gloo met, went unreported)."""
    def backend_job(monitor: Monitor) -> CheckReport:
        part = _partial(opts, monitor)
        with _warnings_once_per_place(part.report):
            seen = _run_hypothesis(part.opts, backend, part.report, world_sizes, steps, examples, seed, database)
            for explicit in explicit_examples(opts, world_sizes, steps):
                _run_one(part.opts, explicit, backend, part.report, steps, seen=seen)
        return part.report

    _supervised(backend_job, opts, backend, report, steps, opts.deadline, supervise, search=True)


# --------------------------------------------------------------------------- supervision
@dataclasses.dataclass
class _Partial:
    opts: Options
    report: CheckReport


def _partial(opts: Options, monitor: Monitor) -> _Partial:
    """What one supervised job fills in: options bound to its monitor, an empty report."""
    return _Partial(dataclasses.replace(opts, monitor=monitor),
                    CheckReport(target=opts.target, passed=True, properties=[], backends=[]))


def _supervised(job: Callable[[Monitor], CheckReport], opts: Options, backend: str,
                report: CheckReport, steps: int, deadline: float, supervise: bool, search: bool = False) -> None:
    """Run one backend's search (or one replay) as ``job``, supervised unless told not to,
    and add what its partial report found to ``report``. A child that died or overran its
    deadline is a liveness failure of the hook — for a death in a search, said to depend on
    more than the example when the example alone, in a fresh process, does not die
    (:func:`_death_repeats`); stop requests and usage errors propagate."""
    if not supervise:
        _add(report, job(Monitor()))
        return
    prepare_to_fork()
    outcome = run_supervised(job, deadline=deadline)
    if outcome.value is not None:
        _add(report, outcome.value)
    elif outcome.death is not None:
        report.examples += 1
        found = death_failure(opts, backend, outcome.death, steps)
        token = (outcome.death.payload or outcome.death.previous or {}).get("token")
        if search and token is not None and outcome.death.kind != "deadline" and not _death_repeats(opts, token):
            found.message += ("\n(run once more, alone in a fresh process, the same example did not end its "
                              "process: this death depends on something outside the example — a timer or signal the "
                              "code armed (signal.alarm), a thread it started, state an earlier example left in the "
                              "process — so the replay command may not repeat it)")
        report.failures.append(found)
    elif outcome.error is not None:
        error = outcome.error
        if isinstance(error, (SystemExit, HookExited)):  # user code ended the child outside any example
            report.failures.append(PropertyFailure(
                "liveness", backend, f"{exit_head(error, 0) or error!r}", 0, "-", "-", [],
                f"simcluster check {opts.replay_target or opts.target}", error_type=type(error).__name__))
            return
        raise error


def _death_repeats(opts: Options, token: str) -> bool:
    """Whether the example ``token`` holds ends its process again when it runs alone, in a
    fresh supervised child (its replay): a hook that armed ``signal.alarm(1)`` in one example
    was killed by SIGALRM in a later one, and its replay passed (an audit of hostile hooks,
    2026-12-07). One more example, once per death reported by a search."""
    example, backend = decode_example(token)

    def alone(monitor: Monitor) -> None:
        with captured_output():  # what it prints is not the reported run's
            try:
                run_example(dataclasses.replace(opts, monitor=monitor), example, backend)
            except Violation:  # whether it fails is not asked here (nor its report's hints worked out)
                pass

    again = run_supervised(alone, deadline=opts.deadline)
    return again.death is not None


def _add(report: CheckReport, part: CheckReport) -> None:
    """One backend's (or replay's) findings into the whole report; a warning seen by two
    searches is listed once."""
    report.failures += part.failures
    report.examples += part.examples
    report.warnings += [w for w in part.warnings if w not in report.warnings]


_prepared = False


def prepare_to_fork() -> None:
    """Do, once in this process, the one-time set-up every forked search would repeat.

    Hypothesis's first test in a process registers its global ``Random`` and, to check
    the registration, runs a full ``gc.collect()``: with torch loaded (~180,000 objects)
    that takes 0.10-0.13 s, measured, in a parent and in a forked child alike. Each
    supervised search is a fresh child — two per row (one per backend) — so each paid
    it again. Done here once, before the fork, every child inherits the registration
    (one-example check of ``allreduce_hook``, both backends: 0.50 s -> 0.15-0.20 s).
    Called before each supervised search and before ``check --jobs`` forks its
    workers; later calls return at once.
    """
    global _prepared
    if _prepared:
        return
    _prepared = True

    @settings(max_examples=1, database=None, phases=(Phase.generate,), deadline=None)
    @given(st.just(None))
    def nothing(_: None) -> None:
        return None

    nothing()


# --------------------------------------------------------------------------- the search
def _failure(opts: Options, v: Violation, steps: int) -> PropertyFailure:
    with captured_output():  # the hints re-run the example: its prints are not the reported run's
        # a failure that does not repeat makes every re-running experiment moot; asked of the
        # violation as found (the posting lines' re-run adds lines its own re-run would not)
        hint = repeat_hint(opts, v)
        v = with_posting_lines(opts, v)
        if not hint:
            unreached = unreached_hint(opts, v)  # nothing communicated reached the result: no rounding of a sum either
            hint = (read_hint(opts, v) + order_hint(opts, v) + unreached + ("" if unreached else rounding_hint(opts, v))
                    + rng_hint(opts, v) + sources_hint(opts, v))
    return failure(opts, v.prop, str(v) + hint, v.info, steps)


def _run_one(opts: Options, example: Example, backend: str, report: CheckReport, steps: int, *,
             whole_output: bool = False, seen: set[tuple[str, str, str, str]] | None = None) -> None:
    """Run one example; a violation becomes a report entry, with what the hook printed, line
    by line with its rank — all of it with ``whole_output`` (a replay: its report is the one
    the search printed, the output unclipped; the search's said "the replay command prints
    them all"), else clipped. With ``seen`` (the distinct bugs reported so far), only a new
    one, within :data:`MAX_BUGS`."""
    report.examples += 1
    try:
        with captured_output(opts.monitor.output_fd) as printed, marking_ranks(printed):
            run_example(opts, example, backend)
    except Violation as v:
        if seen is not None:
            key = _bug_key(v)[1:]
            if key in seen or len(seen) >= MAX_BUGS:
                return
            seen.add(key)
        v.info["output"] = "\n".join(rank_lines(printed.parts()))
        v.info["whole_output"] = whole_output
        report.failures.append(_failure(opts, v, steps))


def _domain(tolerance: str, props: Sequence[str]) -> dict[str, Any]:
    """The inputs a tolerance promises to handle (see docs/properties.md, "Inputs").

    With error feedback checked and no accuracy promised, values stay within float16's
    range (stored as float32): a residual accumulates up to a few steps' gradients, and
    overflow near float32's maximum is the *averages* property's business, not this one's.
    So do they under ``scale=``/``norm=``: a lossy compressor's accuracy is judged
    relative to the bucket's scale, not its arithmetic at float32's edge.
    """
    if tolerance == "exact":
        return {"exact": True}
    if (tolerance == "none" and "error_feedback" in props) or parse_tolerance(tolerance).lossy:
        return {"values": torch.float16}
    return {"values": {"fp16": torch.float16, "bf16": torch.bfloat16}.get(tolerance)}


_PHASES = tuple(p for p in Phase if p is not Phase.explain)
"""Hypothesis's explain phase only annotates its own failure printout (unused here) and
re-runs the shrunk example's neighbours: a third of a failing PowerSGD row (docs/speed.md)."""


def _digest(opts: Options, backend: str, steps: int) -> bytes:
    """What tells this search apart in Hypothesis' example database (its key for saved failures)."""
    return (
        f"simcluster check|{opts.target}|{backend}|{opts.tolerance}|{opts.state_name}|{opts.api}|{steps}"
        + ("" if opts.params is None else f"|params={opts.params}")
        + ("|subgroups" if opts.subgroups and opts.state.kind != "group" else "")
        + ("|gradient_as_bucket_view" if opts.bucket_view else "")
        + ("" if opts.rng == "per_rank" else f"|rng={opts.rng}")
        + ("" if opts.launcher == "none" else f"|launcher={opts.launcher}")
        + (f"|isolate={','.join(opts.hook.isolate)}" if isinstance(opts.hook, RankLocal) and opts.hook.isolate else "")
    ).encode()


def _hypothesis_test(opts: Options, backend: str, examples: int, count: list[int]) -> Callable[[Example], None]:
    """The body Hypothesis calls per drawn example, counting into ``count[0]``.

    Shrink budget: once a failure is found, at most max(30, 3 × examples) more examples are
    simulated; after that only examples that already failed are run again (the shrinker's
    other candidates are declared passing, so it stops improving and keeps its best).
    Count-based, so as deterministic as the rest.

    What the hook prints is captured per example (:mod:`simcluster.usercode.output`); the
    output of the run Hypothesis reports a bug on (its final run of the shrunk example) is
    kept in the violation's ``info["output"]`` for the report."""
    failing: set[Example] = set()
    spent = [0]

    def test(example: Example) -> None:
        if failing:
            spent[0] += 1
            if spent[0] > max(30, SHRINK_BUDGET * examples) and example not in failing:
                return
        count[0] += 1
        final = _is_final_run()  # the run Hypothesis reports: its output is told line by line with each rank
        try:
            with captured_output(opts.monitor.output_fd) as printed, \
                    marking_ranks(printed) if final else contextlib.nullcontext():
                run_example(opts, example, backend)
        except Violation as violation:
            failing.add(example)
            if final:
                violation.info["output"] = "\n".join(rank_lines(printed.parts()))
            raise

    return test


def _is_final_run() -> bool:
    """Whether Hypothesis is running the example it will report (its last run of a shrunk bug)."""
    try:
        from hypothesis.control import current_build_context

        return bool(current_build_context().is_final)
    except Exception:  # noqa: BLE001 - another Hypothesis: no output is kept rather than a wrong one
        return False


def _run_hypothesis(opts: Options, backend: str, report: CheckReport, world_sizes: Sequence[int], steps: int,
                    examples: int, seed: int | None, database: Any) -> set[tuple[str, str, str, str]]:
    """Hypothesis' search; the distinct bugs it reported (keys of :func:`_bug_key`)."""
    count = [0]
    strategy = example_strategy(world_size_choices=tuple(world_sizes), steps=steps, subgroups=opts.subgroups,
                                params=opts.params, bucket_view=opts.bucket_view,
                                **_domain(opts.tolerance, opts.props))
    test = _hypothesis_test(opts, backend, examples, count)
    test._hypothesis_internal_add_digest = _digest(opts, backend, steps)  # type: ignore[attr-defined]
    wrapped = given(strategy)(test)
    if seed is not None:
        wrapped = hypothesis_seed(seed)(wrapped)
    db = DirectoryBasedExampleDatabase(os.fspath(database)) if isinstance(database, (str, os.PathLike)) else database
    wrapped = settings(max_examples=examples, deadline=None, database=db, verbosity=Verbosity.quiet,
                       derandomize=False, print_blob=False, report_multiple_bugs=True,
                       phases=_PHASES, suppress_health_check=list(HealthCheck))(wrapped)
    try:
        with _count_budgeted_search(), _constants_of_code_under_test(opts.hook):
            wrapped()
    except Exception as exc:  # noqa: BLE001 - sorted below
        found = _violations(exc)
        if not found:
            raise _unsupported_inside(exc) or exc
        return _report_bugs(opts, backend, report, found, steps)
    finally:
        report.examples += count[0]
    return set()


def _report_bugs(opts: Options, backend: str, report: CheckReport, found: list[Violation],
                 steps: int) -> set[tuple[str, str, str, str]]:
    """The first :data:`MAX_BUGS` distinct bugs, in checking order, with a note if there were
    more; their keys."""
    seen: set[tuple[str, str, str, str]] = set()
    for v in sorted(found, key=_bug_key):
        key = _bug_key(v)[1:]
        if key not in seen and len(seen) < MAX_BUGS:
            seen.add(key)
            report.failures.append(_failure(opts, v, steps))
    if len({_bug_key(v)[1:] for v in found}) > MAX_BUGS:
        report.notes.append(f"{backend}: more than {MAX_BUGS} distinct failures; the first {MAX_BUGS} are shown")
    return seen


class _FrozenClock:
    """``time`` as Hypothesis's engine sees it during a check: the clock never moves.

    Hypothesis stops generating 10 s after the first bug and stops shrinking after
    300 s of wall time, so on a slower machine it would report a different (less
    shrunk) counterexample. With the clock frozen those limits never fire; the search is
    bounded by counts alone (``max_examples``, Hypothesis' shrink-call limits and
    :data:`SHRINK_BUDGET`), so the same seed gives the same report on any machine."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._now = real.monotonic()

    def monotonic(self) -> float:
        return self._now

    perf_counter = monotonic

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def _warnings_once_per_place(report: CheckReport) -> Iterator[None]:
    """Keep each warning (text, category, file, line) once in ``report.warnings`` during a
    search, as Python's default filter shows it once per place in one process — listed with
    the report, not printed among the examples (whose output is captured). The search
    defeats that filter: every simulated rank of every example imports its own copy of the
    hook's module (a fresh ``__warningregistry__``), and Hypothesis's per-example
    ``catch_warnings`` resets every registry — a hook calling a deprecated torch API printed
    the same warning hundreds of times above its report. Filters still decide what is
    shown; this only drops repeats."""
    import warnings

    original = warnings.showwarning

    def once(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        text = f"{filename}:{lineno}: {category.__name__}: {message}"
        if text not in report.warnings:
            report.warnings.append(text)

    warnings.showwarning = once
    try:
        yield
    finally:
        warnings.showwarning = original


@contextlib.contextmanager
def _count_budgeted_search() -> Iterator[None]:
    from hypothesis.internal.conjecture import engine as conjecture_engine

    real = getattr(conjecture_engine, "time", None)
    if real is None:  # a Hypothesis that reads time differently: its limits apply (documented)
        yield
        return
    conjecture_engine.time = _FrozenClock(real)  # type: ignore[assignment]
    try:
        yield
    finally:
        conjecture_engine.time = real  # type: ignore[assignment]


def _code_under_test_module(hook: Any) -> ModuleType | None:
    """The module that defines ``hook`` (through ``functools.partial``, ``__wrapped__`` and
    :class:`~simcluster.usercode.rank_local.RankLocal`), or None for a test file's hook.

    Test files are left out as Hypothesis leaves them out: their literals are expected
    values, not the thresholds and sizes of the code under test."""
    fn = inspect.unwrap(hook)
    while isinstance(fn, functools.partial):
        fn = inspect.unwrap(fn.func)
    module = inspect.getmodule(fn if inspect.isroutine(fn) or inspect.isclass(fn) else type(fn))
    path = getattr(module, "__file__", None)
    if path is None:
        return None
    p = Path(path)
    if "test" in p.parts or "tests" in p.parts or p.stem.startswith("test_") or p.stem.endswith("_test"):
        return None
    return module


@contextlib.contextmanager
def _constants_of_code_under_test(hook: Any) -> Iterator[None]:
    """Hypothesis's pool of "local constants" during a check: the literals of the hook's module only.

    Now and then (about one draw in twenty) Hypothesis draws a literal found in the source
    of *local* code — every module in ``sys.modules`` outside the standard library and
    site-packages — so that a threshold such as ``if numel > 1024`` is tried. Left alone,
    that pool would depend on which other modules happen to be imported (a pytest-xdist
    worker's earlier tests, the user's conftest) and on how simcluster itself is installed
    (an editable install counts as local): the same seed would draw different examples,
    and a printed result would not follow from the command. Here the pool is the hook's
    own module's literals (wherever it is installed, torch's hooks included), so the
    search is a function of the seed, the options and the code under test. A Hypothesis
    without this internal keeps its own pool (its results may then vary as above)."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants, constants_from_module
    except ImportError:
        yield
        return
    real = getattr(providers, "_get_local_constants", None)
    cache = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)
    if real is None or not hasattr(cache, "clear"):
        yield
        return
    module = _code_under_test_module(hook)
    pool = Constants() if module is None else constants_from_module(module)
    providers._get_local_constants = lambda: pool  # type: ignore[attr-defined]
    cache.clear()  # the permitted-values cache holds a filtered copy of the pool
    try:
        yield
    finally:
        providers._get_local_constants = real  # type: ignore[attr-defined]
        cache.clear()


def _unsupported_inside(exc: BaseException) -> UnsupportedError | None:
    """What the code under test did that the simulator does not model, when Hypothesis wrapped
    it in a group: a thread the hook started that posts a collective 0.3 s later is rejected
    in one run of an example and not in its re-run — Hypothesis' ``FlakyFailure`` — which was
    reported as simcluster's internal error with 170 lines of traceback (an audit of hostile
    hooks), not as the one line it is."""
    if isinstance(exc, BaseExceptionGroup):
        return next((found for sub in exc.exceptions if (found := _unsupported_inside(sub)) is not None), None)
    return exc if isinstance(exc, UnsupportedError) else None


def _violations(exc: BaseException) -> list[Violation]:
    if isinstance(exc, Violation):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        return [v for sub in exc.exceptions for v in _violations(sub)]
    return []


def _bug_key(v: Violation) -> tuple[int, str, str, str, str]:
    """Sort key and identity of a distinct bug: property (in checking order), exception type,
    user line (a collective mismatch: its calls, whichever rank's line raised), and for
    *averages* what the result is (:func:`~simcluster.checking.judge.averages_outcome`:
    another bucket's data, or not)."""
    return (ORDER.index(v.prop), v.prop, v.info.get("error_type", ""), v.info.get("identity", v.info.get("line", "")),
            v.info.get("outcome", ""))
