"""The pytest plugin: sim_cluster fixture and marker, profiles, check_hook/assert_hook, xdist.

Runs that would load a Hypothesis profile (process-wide state) use a subprocess; the
others run in-process with ``CI`` and ``SIMCLUSTER_PROFILE`` removed from the environment.
"""

from __future__ import annotations

from typing import Any

import pytest

import simcluster.checking.check
from simcluster import plugin
from simcluster.checking.report import CheckReport, PropertyFailure

pytest_plugins = ["pytester"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("SIMCLUSTER_PROFILE", raising=False)
    return monkeypatch


FIXTURE_TESTS = '''
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

def test_default(sim_cluster):
    assert (sim_cluster.world_size, sim_cluster.backend.name, sim_cluster.seed) == (2, "gloo", 0)

@pytest.mark.simcluster(world_size=4, backend="nccl", seed=3)
def test_marker(sim_cluster):
    assert (sim_cluster.world_size, sim_cluster.backend.name, sim_cluster.seed) == (4, "nccl", 3)
    run = sim_cluster.run_hook(allreduce_hook, [torch.full((3,), float(r)) for r in range(4)])
    assert all(torch.equal(out, torch.full((3,), 1.5)) for out in run.outputs)

@pytest.mark.simcluster(3)
def test_positional_world_size(sim_cluster):
    assert sim_cluster.world_size == 3

def test_fresh_cluster_per_test(sim_cluster):
    assert sim_cluster.choices == []

def _skips_on_rank_1(state, bucket):
    if torch.distributed.get_rank() == 1:
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    return torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future()

@pytest.mark.simcluster(posting_lines=True)
def test_posting_lines(sim_cluster):
    from simcluster import DeadlockError
    with pytest.raises(DeadlockError, match=r"rank 0 posted it at \\w+\\.py:\\d+ in _skips_on_rank_1"):
        sim_cluster.run_hook(_skips_on_rank_1, [torch.ones(2)] * 2)
'''


def test_fixture_and_marker(pytester: pytest.Pytester, clean_env: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(FIXTURE_TESTS)
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)


def test_marker_with_unknown_option_is_an_error(pytester: pytest.Pytester, clean_env: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.mark.simcluster(world_sise=4)\n"
        "def test_typo(sim_cluster):\n    pass\n"
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    assert "@pytest.mark.simcluster: unknown option(s) ['world_sise']" in result.stdout.str()


def test_a_bad_marker_value_or_e2e_option_is_one_line_not_a_traceback(pytester: pytest.Pytester,
                                                                      clean_env: pytest.MonkeyPatch) -> None:
    """A marker's bad value showed simcluster's traceback; an unknown simcluster_e2e option
    failed as 'check_hook() got an unexpected keyword argument', naming no marker."""
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.mark.simcluster(world_size=0)\n"
        "def test_zero(sim_cluster):\n    pass\n"
        "@pytest.mark.simcluster_e2e(bogus=1)\n"
        "def test_bogus(simcluster_assert):\n    pass\n"
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=2)
    out = result.stdout.str()
    assert "@pytest.mark.simcluster: world_size 0: must be an integer from 1 to 1,024" in out
    assert "@pytest.mark.simcluster_e2e: unknown option(s) ['bogus']; known: [" in out
    assert "Traceback" not in out and "simcluster/fake/cluster.py" not in out


def test_markers_and_option_registered(pytester: pytest.Pytester, clean_env: pytest.MonkeyPatch) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.simcluster(world_size=2, backend='gloo'*"])
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["*--simcluster-profile*"])


def test_unknown_profile_is_a_usage_error(pytester: pytest.Pytester, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SIMCLUSTER_PROFILE", "fastest")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*simcluster profile 'fastest' is unknown*"])


def test_choose_profile() -> None:
    assert plugin.choose_profile(None, {}) == ("dev", False)
    assert plugin.choose_profile(None, {"CI": "1"}) == ("ci", True)
    assert plugin.choose_profile(None, {"CI": "1", "SIMCLUSTER_PROFILE": "thorough"}) == ("thorough", True)
    assert plugin.choose_profile("dev", {"SIMCLUSTER_PROFILE": "thorough"}) == ("dev", True)


PROFILE_PROBE = '''
import os
from hypothesis import settings

def test_profile():
    current = settings.default
    expected = os.environ["EXPECT"].split(",")
    name, examples, readonly = expected[0], int(expected[1]), expected[2] == "ro"
    assert settings.get_current_profile_name() == name
    assert current.max_examples == examples
    if expected[2] == "ro":  # ci: derandomized, so Hypothesis allows no database for @given tests
        assert current.derandomize and current.database is None
    elif expected[2] == "rw":
        assert not current.derandomize
'''


@pytest.mark.parametrize(
    ("env", "args", "expect"),
    [
        ({"SIMCLUSTER_PROFILE": "thorough"}, [], "thorough,500,rw"),
        ({"CI": "true"}, ["--simcluster-profile", "dev"], "dev,50,rw"),
    ],
)
def test_profiles_are_loaded_in_hypothesis(
    pytester: pytest.Pytester, clean_env: pytest.MonkeyPatch, env: dict[str, str], args: list[str], expect: str
) -> None:
    for key, value in {**env, "EXPECT": expect}.items():
        clean_env.setenv(key, value)
    pytester.makepyfile(PROFILE_PROBE)
    result = pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"simcluster profile '{expect.split(',')[0]}'*"])


def test_a_profile_registered_by_the_user_wins(pytester: pytest.Pytester, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("CI", "true")
    clean_env.setenv("EXPECT", "ci,7,-")
    pytester.makeconftest("from hypothesis import settings\nsettings.register_profile('ci', max_examples=7)\n")
    pytester.makepyfile(PROFILE_PROBE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


class _Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        self.fail = fail

    def __call__(self, hook: Any, **options: Any) -> CheckReport:
        self.calls.append((hook, options))
        failures = [PropertyFailure("averages", "gloo", "sum, not mean", 2, "-", "-", [], "simcluster check x")] \
            if self.fail else []
        return CheckReport(target=options.get("target", "?"), passed=not failures, properties=["averages"],
                           backends=["gloo"], failures=failures)


def test_check_hook_takes_cli_spellings_and_profile_defaults(
    clean_env: pytest.MonkeyPatch,
) -> None:
    from hypothesis.database import ReadOnlyDatabase

    from simcluster.hooks.reference import TopKState, mean_allreduce_hook

    recorder = _Recorder()
    clean_env.setattr(simcluster.checking.check, "check_hook", recorder)
    plugin.check_hook("simcluster.hooks.reference:mean_allreduce_hook", tolerance="FP16", state="simcluster.hooks.reference:TopKState")
    hook, options = recorder.calls[-1]
    # strings become RankLocal: every simulated rank gets its own copy of the module
    assert hook.shared is mean_allreduce_hook and options["target"] == "simcluster.hooks.reference:mean_allreduce_hook"
    state = options["state"]  # parsed once, the factory a RankLocal (each rank builds it from its own copy)
    assert options["tolerance"] == "fp16" and state.kind == "factory" and state.name.endswith("reference:TopKState")
    assert state.factory.shared is TopKState
    assert options["examples"] == plugin.PROFILES["dev"].examples
    assert not isinstance(options["database"], ReadOnlyDatabase)
    clean_env.setenv("CI", "1")
    plugin.check_hook(mean_allreduce_hook, examples=3)
    options = recorder.calls[-1][1]
    assert options["examples"] == 3 and isinstance(options["database"], ReadOnlyDatabase)


def test_assert_hook_raises_with_the_report(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(simcluster.checking.check, "check_hook", _Recorder(fail=True))
    with pytest.raises(AssertionError, match="FAILED averages"):
        plugin.assert_hook("simcluster.hooks.buggy:forgot_division")
    clean_env.setattr(simcluster.checking.check, "check_hook", _Recorder(fail=False))
    plugin.assert_hook("simcluster.hooks.reference:mean_allreduce_hook")


def test_bad_target_in_check_hook_is_a_usage_error(clean_env: pytest.MonkeyPatch) -> None:
    from simcluster.errors import TargetLoadError

    clean_env.setattr(simcluster.checking.check, "check_hook", _Recorder())
    with pytest.raises(TargetLoadError, match="no attribute 'nope'"):
        plugin.check_hook("simcluster.hooks.reference:nope")


REAL_CHECK = '''
def test_reference_hook_holds(simcluster_assert):
    simcluster_assert("simcluster.hooks.reference:mean_allreduce_hook", examples=2, world_sizes=(2,), steps=1,
                      backends=("gloo",), database=None)

def test_buggy_hook_fails(simcluster_check):
    report = simcluster_check("simcluster.hooks.buggy:returns_tensor_not_future", examples=2, world_sizes=(2,), steps=1,
                              backends=("gloo",), database=None, properties=("contract",))
    assert not report.passed and report.failures[0].property == "contract"
'''


def test_fixtures_run_the_real_checker(pytester: pytest.Pytester, clean_env: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(REAL_CHECK)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_under_xdist_with_CI_set_workers_use_our_ci_profile(
    pytester: pytest.Pytester, clean_env: pytest.MonkeyPatch
) -> None:
    """Each xdist worker configures itself: fixtures work, and CI=true loads *our* ci profile
    (25 examples), not Hypothesis' built-in one that its import loads (docs/cli.md, *Profiles*)."""
    clean_env.setenv("CI", "true")
    clean_env.setenv("EXPECT", "ci,25,ro")
    pytester.makepyfile(test_fixtures=FIXTURE_TESTS, test_probe=PROFILE_PROBE)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist", "--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)


def test_a_failing_assert_hook_shows_the_tests_line_and_the_report_only(pytester: pytest.Pytester,
                                                                       clean_env: pytest.MonkeyPatch) -> None:
    """pytest prints the failing test's own line and the report; simcluster's frames (and
    the report object's fields, as pytest would show a frame's locals) are hidden."""
    pytester.makepyfile(
        "from simcluster.plugin import assert_hook\n"
        "def test_it():\n"
        "    assert_hook('simcluster.hooks.buggy:forgot_division', backends=['gloo'], world_sizes=[2], examples=20)\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "> " in text and "assert_hook('simcluster.hooks.buggy:forgot_division'" in text
    assert "FAILED averages [gloo, world size 2]" in text
    assert "self = CheckReport(" not in text and "def assert_passed" not in text and "def _assert" not in text
