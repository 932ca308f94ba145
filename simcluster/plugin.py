"""simcluster's pytest plugin (entry point ``pytest11``): a fixture, markers, profiles, checks.

Installed with simcluster; nothing to enable. What it gives a test suite:

* **``sim_cluster``** — a fresh :class:`~simcluster.SimCluster` per test, 2 ranks, gloo
  model, seed 0, unless the test says otherwise with the marker::

      @pytest.mark.simcluster(world_size=4, backend="nccl", seed=3)
      def test_my_hook(sim_cluster):
          run = sim_cluster.run_hook(my_hook, [torch.ones(8) * r for r in range(4)])
          assert all(torch.equal(run.outputs[0], o) for o in run.outputs)

* **``check_hook`` / ``assert_hook``** — the ``simcluster check`` command as functions,
  with the same options (``state``, ``tolerance``, ``backends``, ``world_sizes``,
  ``steps``, ``examples``, ``seed``, ``api``, ``database``, ``properties``, ``params``,
  ``subgroups``, ``rng``, ``launcher``, ``isolate``); the hook, the state, the tolerance and the shapes may
  be given as the CLI's strings (``"pkg.mod:hook"``, ``"pkg.mod:factory"``, ``"scale=0.1"``,
  ``"4x5,5"``) or as objects (``params=[(4, 5), (5,)]``, ``subgroups=True``) — a hook or
  factory given as a string is loaded once per simulated rank, so its module globals are
  per rank as on a real cluster; a function object shares its module. Options not given
  come from the active profile::

      from simcluster.plugin import assert_hook

      def test_my_hook_averages():
          assert_hook("mypkg.hooks:my_hook", tolerance="fp16", world_sizes=(2, 4))

  The fixtures ``simcluster_check`` / ``simcluster_assert`` are the same functions bound
  to the run's profile and example database (``<rootdir>/.simcluster/examples``).

  ``e2e=True`` (or the marker ``@pytest.mark.simcluster_e2e`` on a test using the
  fixtures) confirms on real DDP and real gloo processes, as ``simcluster check --e2e``:
  the report gains ``e2e:`` notes, and ``assert_hook`` raises
  :class:`~simcluster.errors.SimulatorFidelityError` when the simulation and real
  gloo disagree (docs/e2e.md).

* **Profiles** — Hypothesis settings profiles named ``ci``, ``dev`` and ``thorough``:

  =========  ========  ===========================================  ===========================
  profile    examples  simcluster's example database                the suite's ``@given`` tests
  =========  ========  ===========================================  ===========================
  ci         25        the committed one, **read-only**             derandomized, no database
  dev        50        the committed one, read and write            Hypothesis defaults
  thorough   500       the committed one, read and write (nightly)  Hypothesis defaults
  =========  ========  ===========================================  ===========================

  simcluster's checks are always seeded (``seed=0`` unless given), so they are
  deterministic under every profile and replay the committed examples first. Hypothesis
  refuses ``derandomize=True`` together with a database, hence the split: the read-only
  database is simcluster's option, not part of the Hypothesis profile.

  Chosen by ``--simcluster-profile NAME``, else ``$SIMCLUSTER_PROFILE``, else ``ci`` when
  the ``CI`` environment variable is set, else ``dev``. A chosen profile is also *loaded*
  into Hypothesis (as ``--hypothesis-profile`` would); with ``CI`` set this replaces the
  built-in ``ci`` profile that Hypothesis loads on import. A profile of the same name
  that your ``conftest.py`` registered is left alone (yours wins). ``dev`` is used for
  simcluster's checks without being loaded when nothing was chosen.

Safe under ``pytest -n auto``: every worker configures itself, nothing is shared but the
example database directory, whose writes are atomic per example (and ``ci`` never
writes). Per-run data lives in ``config.stash``; heavy imports (torch, Hypothesis) happen
inside hooks and fixtures, not when pytest loads the plugin.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from simcluster.fake.cluster import SimCluster
    from simcluster.checking.report import CheckReport

__all__ = ["check_hook", "assert_hook", "Profile", "PROFILES", "choose_profile", "hypothesis_profiles"]

PROFILE_OPTION = "--simcluster-profile"
PROFILE_ENV = "SIMCLUSTER_PROFILE"
DATABASE_DIR = ".simcluster/examples"


@dataclass(frozen=True)
class Profile:
    """What a profile sets for simcluster's checks (and for Hypothesis, when loaded)."""

    name: str
    examples: int
    database: str  # "read-only" | "read-write"
    description: str


PROFILES: Mapping[str, Profile] = MappingProxyType({
    "ci": Profile("ci", 25, "read-only", "CI: fast, derandomized, replays the committed examples, never writes"),
    "dev": Profile("dev", 50, "read-write", "local development: finds and keeps new counterexamples"),
    "thorough": Profile("thorough", 500, "read-write", "nightly: ten times the examples"),
})


@dataclass(frozen=True)
class _RunOptions:
    profile: Profile
    database_dir: Path
    explicit: bool  # chosen by option, env or CI (and then loaded into Hypothesis)


_RUN_OPTIONS = pytest.StashKey[_RunOptions]()


def choose_profile(option: str | None, environ: Mapping[str, str]) -> tuple[str, bool]:
    """``(name, explicit)``: the option, else ``$SIMCLUSTER_PROFILE``, else ``ci`` under CI, else ``dev``.

    >>> choose_profile(None, {"CI": "true"})
    ('ci', True)
    >>> choose_profile("thorough", {"CI": "true"})
    ('thorough', True)
    >>> choose_profile(None, {})
    ('dev', False)
    """
    name = option or environ.get(PROFILE_ENV) or None
    if name is not None:
        if name not in PROFILES:
            raise pytest.UsageError(f"simcluster profile {name!r} is unknown; choose from {', '.join(PROFILES)}")
        return name, True
    if environ.get("CI") is not None:
        return "ci", True
    return "dev", False


def hypothesis_profiles() -> dict[str, Any]:
    """The three Hypothesis ``settings`` profiles (for a suite's own ``@given`` tests).

    Hypothesis refuses ``derandomize=True`` together with a database, so the *database*
    half of a profile lives in simcluster's options instead (:func:`_defaults`): simcluster's
    checks are seeded (deterministic) and replay the committed examples; the suite's own
    ``@given`` tests under ``ci`` are derandomized as with Hypothesis's built-in ``ci``.
    """
    from hypothesis import HealthCheck, settings

    base = settings.get_profile("default")  # not the current profile: under CI that is the built-in ci
    out = {}
    for p in PROFILES.values():
        extra: dict[str, Any] = {"derandomize": True, "database": None} if p.database == "read-only" else {}
        out[p.name] = settings(base, max_examples=p.examples, deadline=None, print_blob=True,
                               suppress_health_check=[HealthCheck.too_slow], **extra)
    return out


def _database(profile: Profile, database_dir: Path) -> Any:
    """The example database simcluster's checks use under ``profile``: the committed
    directory, wrapped read-only for ``ci``."""
    from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

    db: Any = DirectoryBasedExampleDatabase(str(database_dir))
    return ReadOnlyDatabase(db) if profile.database == "read-only" else db


def _register() -> None:
    """Register our profiles, leaving any of the same name the user registered (ours fill gaps)."""
    from hypothesis import settings
    from hypothesis import _settings as hypothesis_settings_module
    from hypothesis.errors import InvalidArgument

    builtin_ci = getattr(hypothesis_settings_module, "CI", None)
    for name, value in hypothesis_profiles().items():
        try:
            existing = settings.get_profile(name)
        except InvalidArgument:
            existing = None
        if existing is None or (name == "ci" and existing is builtin_ci):
            settings.register_profile(name, value)


# -- pytest hooks -----------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("simcluster", "simcluster: DDP communication hook checks")
    group.addoption(PROFILE_OPTION, default=None, choices=tuple(PROFILES), metavar="NAME",
                    help=f"profile for simcluster checks and Hypothesis: {', '.join(PROFILES)} "
                         f"(default: ${PROFILE_ENV}, else ci when $CI is set, else dev)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "simcluster(world_size=2, backend='gloo', seed=0, schedule='random', rng='per_rank'): "
        "options of the sim_cluster fixture",
    )
    config.addinivalue_line(
        "markers",
        "simcluster_e2e(e2e_examples=2): the simcluster_check/simcluster_assert fixtures also run real DDP "
        "on real gloo processes and compare (e2e=True)",
    )
    name, explicit = choose_profile(config.getoption(PROFILE_OPTION), os.environ)
    options = _RunOptions(PROFILES[name], config.rootpath / DATABASE_DIR, explicit)
    config.stash[_RUN_OPTIONS] = options
    if explicit:
        from hypothesis import settings

        _register()
        settings.load_profile(name)


def pytest_report_header(config: pytest.Config) -> str | None:
    options = config.stash.get(_RUN_OPTIONS, None)
    if options is None:
        return None
    return f"simcluster profile {options.profile.name!r}: {options.profile.description}"


# -- the checks as functions ------------------------------------------------------------------


def _defaults(profile: Profile, database_dir: Path, timeout: float | None = None) -> dict[str, Any]:
    """The options every check of this run starts from; ``timeout``: pytest-timeout's limit for
    the test (else the one :func:`pytest_runtest_call` set for the test now running)."""
    defaults = {"examples": profile.examples, "database": _database(profile, database_dir), "seed": 0}
    timeout = timeout if timeout is not None else _TEST_TIMEOUT.get()
    if timeout:  # our deadline fires first, so a hung hook is a report with its stack, not a killed test
        from simcluster.checking.supervisor import DEFAULT_DEADLINE

        defaults["deadline"] = min(DEFAULT_DEADLINE, max(0.5, timeout / 3))
    return defaults


_TEST_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar("simcluster_test_timeout", default=None)
"""pytest-timeout's limit for the test now running (set around each test call)."""


def _test_timeout(item: pytest.Item) -> float | None:
    """The pytest-timeout limit that applies to ``item`` (marker, option, ini), if any."""
    marker = item.get_closest_marker("timeout")
    value: Any = None
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    if value is None:
        value = item.config.getoption("timeout", None)
    if value is None:
        try:
            value = item.config.getini("timeout")
        except ValueError:
            value = None
    try:
        return float(value) if value not in (None, "") and float(value) > 0 else None
    except (TypeError, ValueError):
        return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Make simcluster's checks in this test use a per-example deadline below pytest-timeout's
    limit: a stuck hook is then reported (stack, rank, step, bucket) before the test is killed."""
    token = _TEST_TIMEOUT.set(_test_timeout(item))
    try:
        return (yield)
    finally:
        _TEST_TIMEOUT.reset(token)


def _resolve(hook: Any, options: dict[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
    """CLI strings → objects: a TARGET string (a :class:`~simcluster.usercode.rank_local.RankLocal`:
    every simulated rank gets its own copy of its module, and of the ``isolate=`` modules),
    a state spec (a :class:`~simcluster.fake.state.StateSpec`), shapes, a tolerance — each
    a one-line UsageError if bad, raised here, before the check starts."""
    from simcluster.checking.tolerances import parse_tolerance
    from simcluster.usercode.rank_local import RankLocal, parse_isolate, rank_local_state
    from simcluster.usercode.targets import parse_shapes

    options = dict(options)
    isolate = parse_isolate(options.get("isolate"))
    if isinstance(hook, str):
        options.setdefault("target", hook)
        hook = RankLocal(hook, isolate=isolate)
    if "state" in options:
        options["state"] = rank_local_state(options["state"], isolate=isolate)
    if isinstance(options.get("params"), str):
        options["params"] = parse_shapes(options["params"], what="params")
    if isinstance(options.get("tolerance"), str):
        options["tolerance"] = parse_tolerance(options["tolerance"]).describe()
    return hook, options


def _check(hook: Any, defaults: dict[str, Any], options: dict[str, Any]) -> CheckReport:
    from simcluster.checking.check import check_hook as run_check

    merged = {**defaults, **options}
    e2e, e2e_examples = merged.pop("e2e", False), merged.pop("e2e_examples", 2)
    spec, state = hook, merged.get("state", "none")
    hook, resolved = _resolve(hook, merged)
    report = run_check(hook, **resolved)
    if e2e:
        from simcluster.real.e2e_check import confirm_report

        confirm_report(report, spec, state, merged, e2e_examples)
    return report


def _default_profile() -> Profile:
    name, _ = choose_profile(None, os.environ)
    return PROFILES[name]


def check_hook(hook: Callable[..., Any] | str, **options: Any) -> CheckReport:
    """:func:`simcluster.checking.check.check_hook` with the CLI's spellings and the profile's defaults.

    Outside the fixtures the profile is ``$SIMCLUSTER_PROFILE`` (else ``ci`` under CI,
    else ``dev``) and the example database is ``.simcluster/examples`` in the current
    directory; any option given explicitly wins.
    """
    return _check(hook, _defaults(_default_profile(), Path(DATABASE_DIR)), options)


def assert_hook(hook: Callable[..., Any] | str, **options: Any) -> None:
    """Like :func:`check_hook`, but raise ``AssertionError`` with the report when a property fails.

    ``e2e=True`` (``e2e_examples=N``, default 2) then also runs real DDP on real gloo processes
    and compares (``simcluster check --e2e``): a disagreement raises
    :class:`~simcluster.errors.SimulatorFidelityError` — simcluster's bug, not the hook's —
    before the hook's own verdict is judged.
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the report
    _assert(check_hook(hook, **options))


def _assert(report: CheckReport) -> None:
    __tracebackhide__ = True
    from simcluster.real.e2e_check import raise_fidelity

    raise_fidelity(report)
    report.assert_passed()


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def sim_cluster(request: pytest.FixtureRequest) -> Iterator[SimCluster]:
    """A fresh SimCluster: 2 ranks, gloo, seed 0 — or what ``@pytest.mark.simcluster(...)`` says."""
    from simcluster.fake.cluster import SimCluster

    kwargs: dict[str, Any] = {"world_size": 2, "seed": 0, "backend": "gloo"}
    marker = request.node.get_closest_marker("simcluster")
    if marker is not None:
        if len(marker.args) > 1:
            pytest.fail("@pytest.mark.simcluster takes at most one positional argument (world_size)", pytrace=False)
        if marker.args:
            kwargs["world_size"] = marker.args[0]
        allowed = {"world_size", "seed", "backend", "schedule", "rng", "stuck_timeout", "posting_lines", "launcher"}
        unknown = sorted(set(marker.kwargs) - allowed)
        if unknown:
            pytest.fail(f"@pytest.mark.simcluster: unknown option(s) {unknown}; known: {sorted(allowed)}", pytrace=False)
        kwargs.update(marker.kwargs)
    from simcluster.errors import UsageError

    try:
        cluster = SimCluster(**kwargs)
    except UsageError as exc:  # a bad value in the marker: its one line, not simcluster's traceback
        pytest.fail(f"@pytest.mark.simcluster: {exc}", pytrace=False)
    yield cluster


@pytest.fixture
def simcluster_check(request: pytest.FixtureRequest) -> Callable[..., CheckReport]:
    """``check(hook, **options) -> CheckReport`` bound to this run's profile and database."""
    options = request.config.stash[_RUN_OPTIONS]
    # the test's pytest-timeout limit read here: a fixture is set up before pytest_runtest_call runs
    defaults = _defaults(options.profile, options.database_dir, _test_timeout(request.node))
    marker = request.node.get_closest_marker("simcluster_e2e")
    if marker is not None:
        import inspect

        from simcluster.checking.check import check_hook

        allowed = {"e2e_examples", *inspect.signature(check_hook).parameters} - {"hook"}
        unknown = sorted(set(marker.kwargs) - allowed)
        if unknown:
            pytest.fail(f"@pytest.mark.simcluster_e2e: unknown option(s) {unknown}; known: {sorted(allowed)}",
                        pytrace=False)
        defaults |= {"e2e": True, **marker.kwargs}
    return lambda hook, **kw: _check(hook, defaults, kw)


@pytest.fixture
def simcluster_assert(simcluster_check: Callable[..., CheckReport]) -> Callable[..., None]:
    """``assert_(hook, **options)``: raise ``AssertionError(report.format())`` if a property fails."""

    def assert_(hook: Any, **options: Any) -> None:
        _assert(simcluster_check(hook, **options))

    return assert_
