"""``launcher="torchrun"``: while rank r's code runs, ``os.environ`` holds torchrun's variables
with rank r's values (``simcluster/fake/launcher.py``); the caller's environment is back after the run.
"""

from __future__ import annotations

import os
import shlex
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from simcluster import SimCluster
from simcluster.errors import SharedSettingError, UsageError
from simcluster.fake.launcher import LauncherEnvironment, rank_environment

TORCHRUN_KEYS = set(rank_environment(3, 0, {})) - {"OMP_NUM_THREADS"}


def _scaled_by_local_rank(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Scales by its LOCAL_RANK, then adds RANK in the then-callback (run where the backend
    model delivers it): rank r's result is sum_s (s + 1) * x + r."""
    scaled = bucket.buffer() * (int(os.environ["LOCAL_RANK"]) + 1)
    fut = dist.all_reduce(scaled, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] + int(os.environ["RANK"]))


def _reads_after_waiting(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Waits on its all-reduce inside the hook (the rank's code goes on on a pooled thread),
    then reads LOCAL_RANK and records the thread."""
    buf = bucket.buffer()
    dist.all_reduce(buf, async_op=True).wait()
    seen.append((int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), threading.get_ident()))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf + int(os.environ["LOCAL_RANK"]))
    return fut


seen: list[tuple[int, int, int]] = []


def test_without_the_launcher_a_hook_reading_local_rank_raises_key_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(KeyError, match="LOCAL_RANK"):
        SimCluster(3).run_hook(_scaled_by_local_rank, [torch.ones(2)] * 3)


def test_each_rank_sees_its_own_rank_in_the_hook_and_in_its_then_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in TORCHRUN_KEYS:
        monkeypatch.delenv(key, raising=False)
    for schedule in ("in_order", "reverse", "random"):
        result = SimCluster(3, schedule=schedule, launcher="torchrun").run_hook(
            _scaled_by_local_rank, [torch.ones(2)] * 3)
        assert [out.tolist() for out in result.outputs] == [[6.0, 6.0], [7.0, 7.0], [8.0, 8.0]], schedule


def test_a_rank_reading_after_a_wait_on_a_pooled_thread_sees_its_own_rank() -> None:
    seen.clear()
    result = SimCluster(3, schedule="reverse", launcher="torchrun").run_hook(_reads_after_waiting, [torch.ones(1)] * 3)
    assert sorted((local, rank) for local, rank, _ in seen) == [(0, 0), (1, 1), (2, 2)]
    assert any(thread != threading.get_ident() for _, _, thread in seen)  # some ran on a pooled thread
    assert [out.tolist() for out in result.outputs] == [[3.0], [4.0], [5.0]]


def test_every_variable_has_rank_rs_value_and_the_measured_constants() -> None:
    def rank_fn(rank: int) -> dict[str, str]:
        return {key: os.environ[key] for key in TORCHRUN_KEYS}

    values = SimCluster(2, launcher="torchrun").run(rank_fn).values
    for rank, env in enumerate(values):
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["ROLE_NAME"], env["MASTER_ADDR"]) == \
            ("0", "1", "default", "localhost")
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # fixed, for determinism (a real run draws them)
        assert (values[0]["MASTER_PORT"], values[0]["TORCHELASTIC_RUN_ID"]) == ("29500", "simcluster")


def test_the_callers_environment_is_restored_exactly_after_a_run_and_after_a_failing_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "caller's")  # one set by the caller, the others absent
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    before = dict(os.environ)
    cluster = SimCluster(2, launcher="torchrun")
    assert cluster.run(lambda rank: os.environ["RANK"]).values == ["0", "1"]
    assert dict(os.environ) == before

    def fails(rank: int) -> None:
        if os.environ["LOCAL_RANK"] == "1":
            raise ValueError("rank 1 fails")

    with pytest.raises(ValueError, match="rank 1 fails"):
        SimCluster(2, launcher="torchrun").run(fails)
    assert dict(os.environ) == before


def test_given_environments_give_each_rank_exactly_its_own_and_the_callers_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's variables as the real ranks had them (two nodes of two: LOCAL_RANK and
    GROUP_RANK follow the layout, not the single-node model; a variable only rank 0 has is
    absent while the others run); the caller's environment is back after the run."""
    monkeypatch.setenv("RANK", "caller's")
    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.delenv("ONLY_ON_0", raising=False)
    ranks = [{"RANK": str(r), "LOCAL_RANK": str(r % 2), "GROUP_RANK": str(r // 2), "WORLD_SIZE": "4",
              "MASTER_ADDR": "node0"} for r in range(4)]
    ranks[0]["ONLY_ON_0"] = "yes"
    before = dict(os.environ)
    keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "ONLY_ON_0")

    def rank_fn(rank: int) -> dict[str, str | None]:
        return {key: os.environ.get(key) for key in keys}

    values = SimCluster(4, launcher=LauncherEnvironment(4, ranks)).run(rank_fn).values
    assert values == [{**{key: None for key in keys}, **env} for env in ranks]
    assert dict(os.environ) == before
    with pytest.raises(UsageError, match="for 4 ranks, but the cluster has 2"):
        SimCluster(2, launcher=LauncherEnvironment(4, ranks))


def test_a_rank_changing_its_own_rank_variable_is_still_reported_and_undone() -> None:
    def rank_fn(rank: int) -> str:
        if rank == 1:
            os.environ["RANK"] = "7"
        return os.environ["RANK"]

    with pytest.raises(SharedSettingError, match="rank 1 changed os.environ: RANK"):
        SimCluster(2, launcher="torchrun").run(rank_fn)
    # the per-rank switching itself is never reported: many switches, no change
    assert SimCluster(3, launcher="torchrun").run(lambda rank: os.environ["RANK"]).values == ["0", "1", "2"]


def test_the_replay_line_names_the_launcher_and_replays() -> None:
    cluster = SimCluster(3, launcher="torchrun")
    first = cluster.run_hook(_scaled_by_local_rank, [torch.ones(2)] * 3)
    line = cluster.replay_line()
    assert "launcher='torchrun'" in line
    replayed = eval(line, {"SimCluster": SimCluster}).run_hook(_scaled_by_local_rank, [torch.ones(2)] * 3)
    assert all(torch.equal(a, b) for a, b in zip(first.outputs, replayed.outputs))
    assert "launcher" not in SimCluster(2).replay_line()


def test_a_bad_launcher_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="launcher='slurm' must be 'none' or 'torchrun'"):
        SimCluster(2, launcher="slurm")


# -- check, explain and the command line ------------------------------------------------------

def _cli_check(capsys: pytest.CaptureFixture[str], target: str, *options: str) -> tuple[int, str]:
    from simcluster.cli import main

    code = main(["check", f"tests/report_hooks.py:{target}", "--no-database", "--quiet", "--backend", "gloo",
                 "--world-sizes", "1,2,3", "--examples", "8", "--jobs", "1", *options])
    out, err = capsys.readouterr()
    return code, out + err


@pytest.fixture()
def _at_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).parent.parent)
    for key in TORCHRUN_KEYS:
        monkeypatch.delenv(key, raising=False)


def test_check_without_the_launcher_fails_with_a_hint_naming_the_option(
        capsys: pytest.CaptureFixture[str], _at_root: None) -> None:
    code, out = _cli_check(capsys, "keeps_its_local_rank")
    assert code == 1 and "KeyError: 'LOCAL_RANK'" in out
    assert "--launcher torchrun (Python: launcher='torchrun') gives every simulated rank" in out


def test_check_with_the_launcher_passes_a_hook_reading_local_rank(
        capsys: pytest.CaptureFixture[str], _at_root: None) -> None:
    code, out = _cli_check(capsys, "keeps_its_local_rank", "--launcher", "torchrun")
    assert code == 0, out


def test_a_failure_under_the_launcher_prints_a_replay_that_carries_it_and_reproduces(
        capsys: pytest.CaptureFixture[str], _at_root: None) -> None:
    code, out = _cli_check(capsys, "drops_local_rank_one", "--launcher", "torchrun", "--properties", "averages")
    assert code == 1 and "failed" in out
    replay = next(line.split("replay:", 1)[1].strip() for line in out.splitlines()
                  if line.strip().startswith("replay:") and "simcluster check" in line)
    assert "--launcher torchrun" in replay
    from simcluster.cli import main

    argv = shlex.split(replay)[2:]
    assert main(["check", *argv, "--no-database", "--quiet"]) == 1
    assert "averages" in capsys.readouterr().out


def test_check_hook_takes_the_launcher(_at_root: None) -> None:
    from simcluster.checking.check import check_hook

    report = check_hook("tests/report_hooks.py:keeps_its_local_rank", backends=("gloo",), world_sizes=(3,),
                        examples=4, launcher="torchrun", supervise=False)
    assert report.passed and report.examples >= 4, report.failures
    without = check_hook("tests/report_hooks.py:keeps_its_local_rank", backends=("gloo",), world_sizes=(3,),
                         examples=4, supervise=False)
    assert not without.passed and "KeyError: 'LOCAL_RANK'" in without.failures[0].message
    with pytest.raises(UsageError, match="launcher='slurm' must be 'none' or 'torchrun'"):
        check_hook("tests/report_hooks.py:keeps_its_local_rank", launcher="slurm")


def test_explain_takes_the_launcher_and_says_it_again(capsys: pytest.CaptureFixture[str], _at_root: None) -> None:
    from simcluster.cli import main

    assert main(["explain", "tests/report_hooks.py:keeps_its_local_rank", "--world-size", "3"]) == 1
    capsys.readouterr()
    assert main(["explain", "tests/report_hooks.py:keeps_its_local_rank", "--world-size", "3",
                 "--launcher", "torchrun"]) == 0
    out = capsys.readouterr().out
    assert "launcher='torchrun'" in out and out.rstrip().endswith("--launcher torchrun")


@pytest.mark.parametrize("command", ["check", "explain"])
def test_a_bad_launcher_on_the_command_line_exits_2_with_one_line(
        capsys: pytest.CaptureFixture[str], command: str) -> None:
    from simcluster.cli import main

    assert main([command, "tests/report_hooks.py:keeps_its_local_rank", "--launcher", "slurm"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().count("\n") == 0 and "--launcher: invalid choice: 'slurm'" in err, err


def test_the_plugins_fixture_and_check_take_the_launcher(_at_root: None) -> None:
    from simcluster.plugin import check_hook as plugin_check

    report = plugin_check("tests/report_hooks.py:keeps_its_local_rank", backends=["gloo"], world_sizes=[2],
                          examples=3, launcher="torchrun")
    assert report.passed, report.failures
