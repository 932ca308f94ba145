"""Which hooks real DDP's ``register_comm_hook`` refuses, and how simcluster says so.

The expected outcomes are the measurements of ``benchmarks/measure_registration.py``
(real DDP on a real one-rank gloo group; docs/ddp-facts.md, *Registration (measured)*),
written down here by hand; the gloo test re-measures them and compares.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from simcluster.checking.check import check_hook
from simcluster.checking.properties import registration_problem
from simcluster.cli import main
from simcluster.names import callable_name
from simcluster.usercode.rank_local import RankLocal
from simcluster.usercode.stand_in import stand_in

ROOT = Path(__file__).parent.parent
HOOKS = Path(__file__).parent / "registration_hooks.py"

MEASURED: dict[str, str | None] = {  # name in registration_hooks.py -> what register_comm_hook raised (None: ok)
    "mean": None,
    "lambda_hook": None,
    "bound_method": None,
    "one_param": None,  # registers; fails in backward() (the hook call's TypeError)
    "three_params": None,  # likewise
    "partial_hook": "AttributeError: 'functools.partial' object has no attribute '__name__'",
    "partial_with_scale": "AttributeError: 'functools.partial' object has no attribute '__name__'",
    "partial_named": "AttributeError: 'functools.partial' object has no attribute '__qualname__'",
    "instance_hook": "AttributeError: 'CallableHook' object has no attribute '__name__'",
    "instance_named": "AttributeError: 'CallableHook' object has no attribute '__qualname__'",
    "instance_fully_named": None,
    "instance_named_none": "TypeError: _set_comm_hook_name(): incompatible function arguments",
    "no_bucket": "KeyError: 'bucket'",
}


def spec(name: str) -> str:
    return f"{HOOKS}:{name}"


def said(problem: str | None) -> str | None:
    """``"Type: message"`` of what a :func:`registration_problem` sentence says DDP raises."""
    if problem is None:
        return None
    found = re.search(r"raises (\w+Error):? (.*?)(?: \(|\s—|$)", problem)
    assert found, problem
    return f"{found.group(1)}: {found.group(2)}"


@pytest.mark.parametrize("name", MEASURED)
def test_registration_problem_says_what_real_ddp_raised(name: str) -> None:
    hook = RankLocal(spec(name)).shared
    assert said(registration_problem(hook)) == MEASURED[name]


@pytest.mark.parametrize("name", MEASURED)
def test_a_rank_local_target_is_judged_as_the_users_hook(name: str) -> None:
    """``RankLocal`` set a missing ``__name__``/``__qualname__`` to None: a partial then
    looked like the TypeError case (or, without the name rules, registered)."""
    assert said(registration_problem(RankLocal(spec(name)))) == MEASURED[name]


@pytest.mark.parametrize("name", MEASURED)
def test_the_recorders_registered_with_real_ddp_look_like_the_users_hook(name: str) -> None:
    """What e2e and the real-DDP mode register must be refused as the hook itself would be:
    a ``functools.wraps`` function has a name of its own, so a partial registered through it."""
    from simcluster.ddp.real_ddp import _recording
    from simcluster.real.e2e import recording

    hook = RankLocal(spec(name)).shared
    for wrapped in (recording(hook, {}, lambda: 0), _recording(hook, [], [], [0], [], []),
                    recording(RankLocal(spec(name)), {}, lambda: 0)):
        assert said(registration_problem(wrapped)) == MEASURED[name]


def test_a_stand_in_keeps_the_hooks_names_and_their_absence() -> None:
    import simcluster.usercode.stand_in as module
    import doctest

    assert doctest.testmod(module).failed == 0
    hook = RankLocal(spec("mean")).shared
    wrapped = stand_in(hook, lambda state, bucket: "called")
    assert (wrapped.__name__, wrapped.__qualname__, wrapped.__module__) == (hook.__name__, hook.__qualname__,
                                                                           hook.__module__)
    assert wrapped(None, None) == "called"
    nameless = stand_in(functools.partial(hook), print)
    with pytest.raises(AttributeError, match="'functools.partial' object has no attribute '__name__'"):
        nameless.__name__  # noqa: B018
    with pytest.raises(AttributeError, match="'_Calling' object has no attribute 'other'"):
        nameless.other  # noqa: B018
    assert callable_name(nameless) == callable_name(RankLocal(spec("partial_hook"))) == "partial"
    assert RankLocal(spec("mean")).portable().__name__ == "mean"  # copy.copy keeps working


def test_explain_prints_the_registration_line_check_reports(capsys: pytest.CaptureFixture[str]) -> None:
    """One home for the sentence: explain's line holds check's contract failure, word for word."""
    for name in ("partial_hook", "instance_hook", "no_bucket"):
        report = check_hook(spec(name), world_sizes=(2,), examples=2, backends=("gloo",), database=None)
        failure = next(f for f in report.failures if f.error_type == "registration")
        assert failure.property == "contract" and MEASURED[name] in failure.message
        assert main(["explain", spec(name), "--steps", "1"]) == 0  # explained all the same
        out = capsys.readouterr().out
        line = next(line for line in out.splitlines() if line.startswith("registration: "))
        assert MEASURED[name] in line and failure.message.removeprefix("registration: ") in line
        assert "== step 0" in out and "The hook failed" not in out
    for name in ("mean", "bound_method", "lambda_hook"):
        assert main(["explain", spec(name), "--steps", "1"]) == 0
        assert "registration:" not in capsys.readouterr().out
        assert check_hook(spec(name), world_sizes=(2,), examples=2, backends=("gloo",), database=None).passed


def test_explain_range_opens_with_the_registration_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    """``explain --range`` printed the safe range of a partial as if a real cluster could run it."""
    assert main(["explain", spec("partial_hook"), "--range", "--world-sizes", "2"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("registration: "))
    assert MEASURED["partial_hook"] in line and "world 2:" in out
    assert main(["explain", spec("mean"), "--range", "--world-sizes", "2"]) == 0
    assert "registration:" not in capsys.readouterr().out


def test_a_wrong_arity_hook_registers_and_fails_when_called_as_on_real_ddp() -> None:
    report = check_hook(spec("one_param"), world_sizes=(2,), examples=2, backends=("gloo",), database=None)
    assert [f.property for f in report.failures] == ["liveness"]
    assert "TypeError: one_param() takes 1 positional argument but 2 were given" in report.failures[0].message


@pytest.mark.gloo
def test_registration_problem_agrees_with_real_ddp_on_every_measured_case() -> None:
    """Run the measurement (real DDP, a real one-rank gloo group) and compare each case."""
    script = ROOT / "benchmarks" / "measure_registration.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, check=True).stdout
    loaded = importlib.util.spec_from_file_location("measure_registration", script)
    assert loaded is not None and loaded.loader is not None
    measure = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(measure)
    lines = dict(line.split(": register_comm_hook -> ", 1) for line in out.splitlines() if "register_comm_hook ->" in line)
    assert set(lines) == set(measure.CASES)
    for name, hook in measure.CASES.items():
        real = lines[name].split("; backward -> ")[0]
        ours = said(registration_problem(hook))
        if real == "ok":
            assert ours is None, (name, ours)
        else:
            assert ours is not None and real.startswith(ours), (name, real, ours)
