"""Failure reports tell the whole story: the CLI on small buggy hooks (tests/report_hooks.py),
asserting on the printed report and the JSON — per-rank detail, every distinct bug, the
state factory named, the DDP buckets with the rebuild hint, and replay lines that run."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from simcluster.checking.check import check_hook, encode_example
from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec
from simcluster.cli import main

pytest_plugins = ["pytester"]

HOOKS = "tests/report_hooks.py"
ROOT = Path(__file__).resolve().parent.parent


def _check(capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str, *options: str) -> tuple[int, str, Any]:
    """Run ``simcluster check`` from the repository root; (exit code, stdout, the JSON report)."""
    out_json = tmp_path / "report.json"
    argv = ["check", f"{HOOKS}:{target}", "--no-database", "--quiet", "--json", str(out_json), *options]
    code = main(argv)
    out, _ = capsys.readouterr()
    return code, out, json.loads(out_json.read_text())[0]


def _line(text: str) -> int:
    """The line of tests/report_hooks.py that contains ``text``."""
    return next(i for i, line in enumerate((ROOT / HOOKS).read_text().splitlines(), 1) if text in line)


@pytest.fixture(autouse=True)
def _at_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def test_mismatch_report_shows_every_rank_call(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "uneven_allreduce_hook", "--backend", "gloo", "--world-sizes", "2",
                             "--examples", "5", "--properties", "liveness")
    assert code == 1
    # both ranks' calls, with their shapes: what the first line alone never said
    assert "rank 0: all_reduce(float32, (" in out and "rank 1: all_reduce(float32, (1,)" in out
    line = _line("fut = dist.all_reduce(part")
    assert f"at tests/report_hooks.py:{line} in uneven_allreduce_hook" in out  # the line of the second rank's call
    (failure,) = data["failures"]
    assert "rank 1: all_reduce(float32, (1,)" in failure["message"]
    assert failure["error_type"] == "CollectiveMismatchError" and failure["details"]["line"] == f"{HOOKS}:{line}"


def test_a_recursion_is_one_line_below_the_hooks_own_call_of_it(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    """A RecursionError's report listed the last three user frames: three copies of the
    recursing line, and not the hook's line that began the recursion. A frame that follows
    itself is now one line, said to be a recursion, and the report and its replay say the same
    (how deep a recursion gets before Python's limit is not: it depends on where it began)."""
    code, out, data = _check(capsys, tmp_path, "recursing_hook", "--backend", "gloo", "--world-sizes", "2",
                             "--examples", "3", "--properties", "liveness")
    assert code == 1
    began, recursing = _line("    _nested_count(0)"), _line("return _nested_count(depth + 1) + 1")
    assert (f"  at tests/report_hooks.py:{began} in recursing_hook: _nested_count(0)\n"
            f"  at tests/report_hooks.py:{recursing} in _nested_count: return _nested_count(depth + 1) + 1  "
            "[the same line again and again: a recursion]\n") in out, out
    (failure,) = data["failures"]
    assert [(f["line"], f["repeated"]) for f in failure["details"]["frames"]] == [(began, False), (recursing, True)]
    replay = main(shlex.split(failure["replay"])[1:] + ["--quiet", "--no-database"])
    again = capsys.readouterr().out
    assert replay == 1 and "[the same line again and again: a recursion]" in again
    assert out[out.index("FAILED liveness"):out.index("  layout:")] == again[again.index("FAILED liveness"):
                                                                             again.index("  layout:")]


def test_a_mutual_recursion_is_shown_once_below_the_hooks_own_call_of_it(capsys: pytest.CaptureFixture[str],
                                                                        tmp_path: Path) -> None:
    """Two functions calling each other until RecursionError: the report's three lines were the
    pair and one more copy, and the hook's line that began it was cut (Python's traceback
    collapses only a line that repeats itself). The pair is now shown once, said to recur."""
    code, out, data = _check(capsys, tmp_path, "mutually_recursing_hook", "--backend", "gloo", "--world-sizes", "2",
                             "--examples", "3", "--properties", "liveness")
    assert code == 1
    began, ping, pong = _line("    _ping(0)"), _line("return _pong(depth + 1)"), _line("return _ping(depth + 1)")
    assert (f"  at tests/report_hooks.py:{began} in mutually_recursing_hook: _ping(0)\n"
            f"  at tests/report_hooks.py:{ping} in _ping: return _pong(depth + 1)\n"
            f"  at tests/report_hooks.py:{pong} in _pong: return _ping(depth + 1)  "
            "[the last 2 lines again and again: a recursion]\n") in out, out
    (failure,) = data["failures"]
    assert [(f["line"], f["repeated"], f["cycle"]) for f in failure["details"]["frames"]] == [
        (began, False, 0), (ping, False, 0), (pong, True, 2)]


def test_frames_module_examples_run() -> None:
    import doctest

    import simcluster.engine.frames as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_p2p_deadlock_names_the_missing_recv(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "send_before_recv_hook", "--backend", "gloo", "--world-sizes", "2",
                             "--examples", "5", "--properties", "liveness")
    assert code == 1
    assert "rank 0: send(" in out and "rank 1 never posted the matching recv from rank 0" in out
    assert "rank 1 never posted the matching send" not in out
    assert "blocked in the synchronous send#0" in out
    assert f"report_hooks.py:{_line('dist.send(buf.clone()')} in send_before_recv_hook" in out
    assert "never posted the matching recv from rank 1" in data["failures"][0]["message"]


def test_world_size_1_crash_does_not_hide_the_self_send(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "gossip_hook", "--state", f"{HOOKS}:GossipState", "--backend", "all",
                             "--world-sizes", "1,2,3", "--examples", "20", "--properties", "contract,liveness")
    assert code == 1
    failures = data["failures"]
    kinds = {(f["backend"], f["property"], f["error_type"]) for f in failures}
    # gloo raises at a send to self (as real gloo does); the NCCL model deadlocks on it
    assert {("gloo", "liveness", "ZeroDivisionError"), ("gloo", "contract", "BackendError"),
            ("nccl", "liveness", "ZeroDivisionError"), ("nccl", "liveness", "DeadlockError")} <= kinds
    deadlock = next(f for f in failures if f["error_type"] == "DeadlockError")
    assert "never posted the matching recv from itself" in deadlock["message"] and deadlock["world_size"] >= 2
    crash = next(f for f in failures if f["error_type"] == "ZeroDivisionError")
    assert crash["world_size"] == 1
    # the factory is named as the culprit, with its line; not "the hook raised"
    assert f"the state factory {HOOKS}:GossipState raised" in crash["message"]
    assert "the hook raised" not in crash["message"]
    assert crash["details"]["frames"][-1]["function"] == "__init__"
    assert f"report_hooks.py:{_line('self.peer =')}" in crash["frames"][-1]
    send = next(f for f in failures if f["error_type"] == "BackendError")
    assert send["world_size"] >= 2 and "state_ >= CONNECTED" in send["message"] and "send to itself" in send["message"]
    # every failure has its own replay command, and each reproduces its own bug
    assert out.count("replay:    simcluster check") == len(failures) >= 2
    for failure in failures:
        argv = shlex.split(failure["replay"])[1:] + ["--quiet", "--no-database"]
        assert main(argv) == 1
        replayed, _ = capsys.readouterr()
        assert failure["message"].splitlines()[0] in replayed


def test_result_contract_names_the_rank_and_bucket(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "none_on_rank1_hook", "--backend", "gloo", "--world-sizes", "2",
                             "--examples", "5", "--properties", "contract")
    assert code == 1
    assert "Expected a proper Tensor but got None" in out
    assert "rank 1, DDP iteration 0, bucket 0: the hook's future resolved to None" in out


def test_legacy_failures_are_worded_in_the_legacy_contract(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    code, out, _ = _check(capsys, tmp_path, "legacy_none_on_rank1_hook", "--backend", "gloo", "--world-sizes", "2",
                          "--examples", "5", "--properties", "contract", "--api", "legacy")
    assert code == 1
    assert "under the PyTorch 1.7-1.9 contract (api='legacy') it must resolve to a one-element list [tensor]" in out
    assert "rank 1, DDP iteration 0, bucket 0" in out and "Expected a proper Tensor" not in out


def test_rebuild_hint_for_a_residual_keyed_by_bucket_index(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "residual_by_index_hook", "--state", f"{HOOKS}:ResidualByIndex",
                             "--backend", "gloo", "--world-sizes", "1", "--steps", "2", "--examples", "30",
                             "--properties", "liveness")
    assert code == 1
    failure = data["failures"][0]
    assert failure["details"]["step"] == 1
    steps = failure["details"]["ddp_steps"]
    assert [s["rebuilt"] for s in steps] == [False, True]
    assert steps[0]["buckets"][0]["params"] != steps[1]["buckets"][0]["params"]
    expected = (f"bucket 0 held params {steps[0]['buckets'][0]['params']} at step 0 and "
                f"{steps[1]['buckets'][0]['params']} from step 1")
    assert expected in failure["hint"] and f"hint:      DDP rebuilt its buckets after step 0: {expected}" in out
    assert "step 1 (rebuilt): bucket 0 = params" in out


def test_long_diagnostics_are_summarised_not_cut() -> None:
    from simcluster.checking.properties import averages
    from simcluster.checking.render import MAX_LINES, error_text

    inputs = [[torch.ones(1000)], [torch.ones(1000)]]
    message = averages([[torch.full((1000,), 2.0)]] * 2, inputs, "fp32")
    assert message is not None and "999 more" in message and len(message) < 400
    long = RuntimeError("\n".join(f"line {i}" for i in range(500)))
    text = error_text(long)
    assert len(text.splitlines()) == MAX_LINES and text.endswith("… and 461 more lines")


def test_a_very_long_line_is_summarised_with_its_length() -> None:
    """A hook's message holding a 12,000-character line (a tensor's repr, say): the report
    keeps the start of it and says how much more there was."""
    from simcluster.checking.render import MAX_LINE_CHARS, error_text

    text = error_text(ValueError("bad value: " + "x" * 12_000))
    first = text.splitlines()[0]
    assert first.startswith("ValueError: bad value: xxx")
    assert first.endswith(f"… and {12_011 - MAX_LINE_CHARS} more characters")
    assert len(first) < MAX_LINE_CHARS + 100


def test_deadlock_of_many_ranks_is_summarised() -> None:
    import torch.distributed as dist

    from simcluster import SimCluster
    from simcluster.errors import DeadlockError

    def hook(state: object, bucket: Any) -> Any:
        if dist.get_rank() != 0:
            dist.all_reduce(bucket.buffer(), async_op=True).wait()
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    with pytest.raises(DeadlockError) as info:
        SimCluster(12, backend="gloo").run_hook(hook, [torch.ones(2)] * 12)
    text = str(info.value)
    assert "… and 3 more pending results" in text and "never posted by ranks [0]" in text
    assert "rank 9:" not in text  # listed up to 8, then counted
    assert "posted by ranks [1..11] (11 ranks)" in text


def test_plugin_replay_line_runs_as_printed(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CI", "SIMCLUSTER_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_buggy_hook.py").write_text(
        "import torch.distributed as dist\n"
        "from simcluster.plugin import assert_hook\n\n"
        "def forgot_division(state, bucket):\n"
        "    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()\n"
        "    return fut.then(lambda f: f.value()[0])\n\n"
        "def test_it():\n"
        "    assert_hook(forgot_division, backends=('gloo',), world_sizes=(2,), examples=5, steps=1,\n"
        "                properties=('averages',), database=None)\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "tests/test_buggy_hook.py")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "the float64 mean" in text and "FAILED averages" in text
    line = next(l for l in text.splitlines() if "replay:    simcluster check" in l)
    command = line.split("replay:", 1)[1].strip().lstrip("E").strip()
    assert command.startswith("simcluster check tests/test_buggy_hook.py:forgot_division ")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "simcluster", *shlex.split(command)[1:], "--quiet", "--no-database"]
    proc = subprocess.run(argv, cwd=pytester.path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr  # the property fails again: not 2 ("no module named …")
    assert "FAILED averages" in proc.stdout


def test_differential_files_a_crash_under_the_rank_that_crashed_and_reproduces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import report_hooks  # noqa: F401 - importable by name: the gloo children import it the same way

    from simcluster.real.differential import compare_with_gloo

    monkeypatch.chdir(tmp_path)
    grads = [[torch.ones(4), torch.full((4,), 3.0)]]
    report = compare_with_gloo("report_hooks:dies_on_real_gloo_rank1", grads, world_size=2, timeout=60)
    (difference,) = report.differences
    assert difference.rank == 1 and "failed as a whole" in difference.detail  # rank 0 only saw rank 1 go
    command = next(n for n in report.notes if n.startswith("reproduce: ")).removeprefix("reproduce: ")
    assert "pass the same payloads" not in command
    proc = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr  # the comparison ran again and differs again
    assert "1 difference(s)" in proc.stdout and "rank 1, step -1" in proc.stdout


def _self_send_hook(state: object, bucket: Any) -> Any:
    import torch.distributed as dist

    t = bucket.buffer()
    work = dist.isend(t.clone(), dst=dist.get_rank())  # to itself
    work.wait()
    return dist.all_reduce(t, async_op=True).get_future()


def test_self_send_raises_at_the_call_on_gloo_and_deadlocks_on_nccl() -> None:
    from simcluster import SimCluster
    from simcluster.errors import BackendError, DeadlockError

    with pytest.raises(BackendError) as gloo:
        SimCluster(2, backend="gloo").run_hook(_self_send_hook, [torch.ones(2)] * 2)
    assert isinstance(gloo.value, RuntimeError)  # as real gloo's, so a hook's `except RuntimeError` sees it
    assert str(gloo.value).startswith("[enforce fail at third_party/gloo/gloo/transport/tcp/pair.cc:801] "
                                      "state_ >= CONNECTED. 1 vs 4. Pair is not connected")
    with pytest.raises(DeadlockError) as nccl:
        SimCluster(2, backend="nccl").run_hook(_self_send_hook, [torch.ones(2)] * 2)
    assert "rank 0: send(float32, (2,), 0->0, tag=0) to itself" in str(nccl.value)
    assert "rank 0 never posted the matching recv from itself" in str(nccl.value)


def test_callback_error_names_its_line_and_merges_identical_ranks(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "callback_indexes_gloo_list", "--backend", "gloo", "--world-sizes", "2",
                             "--examples", "5", "--properties", "contract")
    assert code == 1
    line = _line("f.value()[world]")
    assert f"at {HOOKS}:{line} in <lambda>" in out  # from the At: stack torch writes into the message
    assert data["failures"][0]["details"]["line"] == f"{HOOKS}:{line}"
    assert "rank 1 also failed the same way" in out and out.count("Got the following error") == 1


def test_not_callable_message_reads_right(tmp_path: Path) -> None:
    from simcluster.errors import TargetLoadError
    from simcluster.usercode.targets import load_target

    (tmp_path / "values.py").write_text("COUNT = 3\nNAME = 'x'\n")
    with pytest.raises(TargetLoadError, match="COUNT is an int, not callable"):
        load_target(f"{tmp_path}/values.py:COUNT")
    with pytest.raises(TargetLoadError, match="NAME is a str, not callable"):
        load_target(f"{tmp_path}/values.py:NAME")


def test_a_backend_rejecting_the_op_at_wait_is_a_contract_failure_at_the_call(capsys: pytest.CaptureFixture[str],
                                                                              tmp_path: Path) -> None:
    """The rejection reaches DDP through the hook's (errored) future: the report says the
    collective's own error, as real DDP raises it, judges it *contract* as a rejection at
    the call is, and points at the user line that made the call."""
    code, out, data = _check(capsys, tmp_path, "returns_band_future", "--backend", "gloo", "--world-sizes", "2",
                             "--examples", "5")
    assert code == 1
    failure = data["failures"][0]
    assert failure["property"] == "contract"
    assert "Cannot use ReduceOp.BAND with non-integral dtype" in out and "Unable to cast" not in out
    line = _line("op=dist.ReduceOp.BAND")
    assert f"at {HOOKS}:{line} in returns_band_future" in out
    assert failure["details"]["line"] == f"{HOOKS}:{line}"


def test_an_order_dependent_failure_says_the_in_order_schedule_passes(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "draws_noise_in_completion_order", "--backend", "gloo",
                             "--world-sizes", "2", "--properties", "replicas_agree", "--params", "5,5", "--examples", "400")
    assert code == 1
    failure = data["failures"][0]
    assert failure["property"] == "replicas_agree" and failure["schedule"]
    assert "with every collective completing in order this step passes" in failure["message"]


def test_a_hook_that_gives_up_after_a_few_polls_is_caught_in_order(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    """Round 24 of hooks from the wild: three polls, then the local gradient. Every poll after
    the first let the other ranks run, so the second always saw the all_reduce complete and
    the give-up path (which real gloo took in most steps) was never run; the check passed."""
    code, out, data = _check(capsys, tmp_path, "gives_up_after_three_polls", "--backend", "gloo",
                             "--world-sizes", "2")
    assert code == 1, out
    failure = data["failures"][0]
    assert failure["property"] == "contract" and "InFlightReadError" in failure["message"], out
    assert "schedule:  in order" in out  # the path a quiet cluster mostly takes


def test_a_failure_on_the_rare_answer_of_a_poll_names_the_poll(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    """``if work.is_completed():`` right after posting: every poll once let the others run
    first, so it always answered complete and the branch real runs take 86-100 % of the time
    was never run. Now the first poll is a schedule choice: the in-order schedule sees
    pending, a drawn one may see complete, and the report says which poll it was, where."""
    code, out, data = _check(capsys, tmp_path, "skips_the_copy_back_when_already_done", "--backend", "gloo",
                             "--world-sizes", "2", "--properties", "replicas_agree", "--tolerance", "fp16")
    assert code == 1, out
    failure = data["failures"][0]
    assert failure["property"] == "replicas_agree" and failure["schedule"], out
    line = _line("if work.is_completed():  # the fast path")
    assert re.search(r"here a first poll looked only after the other ranks ran, and may have seen its work complete: "
                     rf"rank \d's of work of all_reduce#0 on WORLD \(its callbacks\) at {HOOKS}:{line} — on real gloo",
                     failure["message"]), failure["message"]
    replay = shlex.split(failure["replay"])
    assert replay[:2] == ["simcluster", "check"]
    for _ in range(2):  # the printed replay reproduces it, as printed
        assert main(replay[1:] + ["--quiet", "--no-database"]) == 1
        assert "here a first poll looked only after the other ranks ran" in capsys.readouterr().out
    code, out, data = _check(capsys, tmp_path, "skips_the_copy_back_when_already_done", "--backend", "gloo",
                             "--world-sizes", "2", "--properties", "schedule_independence", "--tolerance", "fp16")
    assert code == 1 and data["failures"][0]["property"] == "schedule_independence", out
    assert f"at {HOOKS}:{line} — on real gloo" in data["failures"][0]["message"], out


def test_a_write_to_a_tensor_in_flight_is_a_contract_failure_naming_the_posting_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Posting an all_reduce, then dividing its tensor in place: a race on a real cluster
    (measured on gloo: wrong results, ranks disagreeing, docs/gloo-facts.md §14) that the
    simulator folded in as if the division came first — every property passed (hooks from the
    wild, round 19). The write is now seen by the tensor's version counter and reported,
    with the line that posted the collective."""
    code, out, data = _check(capsys, tmp_path, "divides_after_posting", "--backend", "gloo", "--world-sizes", "2")
    assert code == 1, out
    failure = data["failures"][0]
    assert failure["property"] == "contract" and failure["error_type"] == "InFlightWriteError", out
    assert re.search(r"ranks? .*wrote to a tensor that all_reduce#0 on WORLD had in flight \(float32\[\d+\]\): "
                     "after posting it", failure["message"]), failure["message"]
    line = _line("# posts buf")
    assert f"posted it at {HOOKS}:{line} in divides_after_posting" in failure["message"], failure["message"]


def test_a_write_in_flight_by_another_buckets_hook_call_is_named_with_its_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One staging buffer for every bucket: the next bucket's hook call copies into the memory
    the previous bucket's all_reduce has in flight. The report named only the line that posted
    the all_reduce, in bucket 0's hook call — the write was the next call's. The reporting
    re-run now traces user lines and names the one that wrote, and in which hook call."""
    code, out, data = _check(capsys, tmp_path, "shares_one_staging_buffer", "--backend", "gloo", "--world-sizes", "1,2")
    assert code == 1, out
    failure = next(f for f in data["failures"] if f["error_type"] == "InFlightWriteError")  # at world 2: a race
    # (at world 1 no data moves: the shared buffer's damage shows as averages there)
    message = failure["message"]
    posted = re.search(r"in DDP iteration (\d+), bucket (\d+)'s hook call, posted it at " + re.escape(HOOKS)
                       + rf":{_line('fut = dist.all_reduce(view')} ", message)
    wrote = re.search(r"in DDP iteration (\d+), bucket (\d+)'s hook call, wrote to it at " + re.escape(HOOKS)
                      + rf":{_line('# stages this bucket')} in shares_one_staging_buffer: view.copy_", message)
    assert posted and wrote, message
    assert posted.group(1) == wrote.group(1) and int(wrote.group(2)) > int(posted.group(2)), message
    replay = shlex.split(failure["replay"])
    for _ in range(2):  # the printed replay reproduces it, with the writer's line
        assert main(replay[1:] + ["--quiet", "--no-database"]) == 1
        assert f"wrote to it at {HOOKS}:{_line('# stages this bucket')}" in capsys.readouterr().out


def test_a_write_to_another_part_of_a_tensor_in_flight_is_no_failure(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """A view's version counter is its base's: dividing the second half of a bucket moves
    the counter of the first half, in flight. The values of the half in flight are what
    decide: unchanged, so no race and no failure."""
    code, out, _ = _check(capsys, tmp_path, "divides_chunk_after_posting_another", "--backend", "gloo",
                          "--world-sizes", "2,3")
    assert code == 0, out


def test_a_failure_whatever_the_order_gets_no_order_hint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "adds_its_rank", "--backend", "gloo", "--world-sizes", "2",
                             "--properties", "replicas_agree", "--params", "5,5")
    assert code == 1
    assert data["failures"][0]["property"] == "replicas_agree"
    assert "completing in order" not in out


# --------------------------------------------------------------------------- the hook's own output
def test_what_the_hook_prints_is_kept_out_of_the_run_and_shown_with_its_failure(capfd, tmp_path: Path) -> None:
    """A search runs the hook hundreds of times: its prints are captured per example, and the
    failing example's are shown under ``output:`` (the report's own lines stay readable),
    each line with the rank whose code printed it (since 2026-12-06: they had none)."""
    out_json = tmp_path / "report.json"
    code = main(["check", f"{HOOKS}:prints_and_forgets_division", f"{HOOKS}:prints_and_averages", "--no-database",
                 "--quiet", "--backend", "gloo", "--world-sizes", "2", "--examples", "20", "--json", str(out_json)])
    out, err = capfd.readouterr()
    assert code == 1
    failing, passing = json.loads(out_json.read_text())
    assert passing["passed"] and failing["failures"]
    printed = failing["failures"][0]["output"].splitlines()
    gradients = failing["failures"][0]["gradients"]  # e.g. "step 0: r0: [0.0] | r1: [-1.0]"
    assert printed[:2] == [f"rank {r}: printing hook: rank {r} bucket 0 holds [{v}]"
                           for r, v in enumerate(_first_values(gradients))]
    report_lines = out.splitlines()
    start = report_lines.index(next(l for l in report_lines if l.startswith("  output:    rank 0: printing hook: rank 0")))
    assert report_lines[start + 1].startswith("             rank 1: printing hook: rank 1")
    assert "replay:" in report_lines[start + len(printed)]
    # everything else the hooks printed (hundreds of examples) was kept out of the output
    assert sum("printing hook:" in line for line in (out + err).splitlines()) == len(printed)
    # the printed replay prints the same report, output: included (it ran uncaptured: the
    # section was missing and the prints came unlabelled — round 22 of hooks from the wild)
    replay = shlex.split(failing["failures"][0]["replay"])
    for _ in range(2):
        assert main(replay[1:] + ["--quiet", "--no-database"]) == 1
        again, again_err = capfd.readouterr()
        assert [line for line in again.splitlines() if "printing hook:" in line] == \
            report_lines[start:start + len(printed)], again
        assert "printing hook:" not in again_err


def _first_values(gradients: str) -> list[str]:
    """``["0.0", "-1.0"]`` from ``"step 0: r0: [0.0] | r1: [-1.0]"`` (one one-element param per rank)."""
    return [part.split("[")[1].split("]")[0] for part in gradients.split("|")]


def test_printed_output_is_clipped_with_a_count() -> None:
    from simcluster.checking.render import MAX_OUTPUT_LINES, printed_output

    text = "\n".join(f"line {i}" for i in range(100)) + "\n\n"
    shown = printed_output(text).splitlines()
    assert len(shown) == MAX_OUTPUT_LINES
    assert shown[0] == "line 0" and shown[-2] == f"line {MAX_OUTPUT_LINES - 2}"
    assert shown[-1] == f"… and {100 - MAX_OUTPUT_LINES + 1} more lines (the replay command prints them all)"
    assert printed_output(text, whole=True).splitlines() == [f"line {i}" for i in range(100)]  # the replay's
    assert printed_output("") == ""


def test_captured_output_keeps_every_way_of_writing_in_order() -> None:
    """print, the streams' buffer and fileno (what logging, tqdm and C code use), os.write."""
    import os
    import sys

    from simcluster.usercode.output import captured_output

    with captured_output() as box:
        print("one")
        sys.stderr.buffer.write(b"two\n")
        sys.stderr.flush()
        os.write(sys.stdout.fileno(), b"three\n")
        os.write(2, "vier ü\n".encode())
        assert sys.stdout.encoding == "utf-8"
        print("no newline at the end", end="")
    assert box.text == "one\ntwo\nthree\nvier ü\nno newline at the end"


def test_a_logging_handler_made_in_one_captured_block_writes_into_the_next() -> None:
    """A state factory's ``logging.StreamHandler(sys.stdout)`` (made at step 0, as a training
    script's basicConfig after init_process_group) logs in every later step, as a process's
    handler writes to its one stdout: the capture of step 1 holds its line, and logging
    reports no error. The stream of each block used to be closed at its end: from step 1,
    '--- Logging error --- ValueError: I/O operation on closed file' (hooks from the wild)."""
    import logging
    import sys

    from simcluster.usercode.output import captured_output

    log = logging.getLogger("simcluster-test-handler-across-blocks")
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        with captured_output() as first:
            log.addHandler(logging.StreamHandler(sys.stdout))
            log.info("step 0")
        with captured_output() as second:
            log.info("step 1")
    finally:
        log.handlers.clear()
    assert first.text == "step 0\n"
    assert second.text == "step 1\n", second.text


# --------------------------------------------------------------------------- overflow: the cause, from the dtypes carried
def _token(values: list[float], backend: str = "gloo") -> str:
    """The replay token of one step where rank r holds ``values[r]`` in both elements of one parameter."""
    from simcluster.checking.replay import encode_example
    from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec

    ranks = tuple(RankSpec("const", value=v) for v in values)
    return encode_example(Example(len(values), Layout(((2,),), None, (0,)), StepSpec(ranks)), backend)


def _replayed(capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str, values: list[float],
              *options: str) -> tuple[int, str, Any]:
    return _check(capsys, tmp_path, target, "--steps", "1", "--replay", _token(values), *options)


def test_a_bfloat16_cast_that_overflows_is_named_not_the_sum(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    """float32 gradients cast to bfloat16 before dividing: 3.397e38 on rank 0 is inf at the
    cast while the float32 sum (3.397e38, rank 1 holds 0) is finite — the report said
    nothing about why. The float32 just below 3.39617753e38 casts to bfloat16's largest
    value: the same hook passes there."""
    code, out, data = _replayed(capsys, tmp_path, "bf16_cast_then_divide", [3.397e38, 0.0], "--tolerance", "bf16")
    assert code == 1
    message = data["failures"][0]["message"]
    assert data["failures"][0]["property"] == "averages" and "got inf" in message
    assert "(the cast to bfloat16 overflowed, not the sum: rank 0's gradient there" in message
    assert "every magnitude from 3.39617753e+38 up rounds to inf" in message and "sums before it divides" not in message
    below = float(torch.nextafter(torch.tensor(3.39617753e38), torch.tensor(0.0)))
    code, out, _ = _replayed(capsys, tmp_path, "bf16_cast_then_divide", [below, 0.0], "--tolerance", "bf16")
    assert code == 0, out


def test_a_float16_hook_that_divides_first_is_not_told_to_divide_first(capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path) -> None:
    """World size 3, every rank at 65504: 65504/3 rounds to 21840 in float16 and three
    shares sum to 65520, inf. The hint names the rounded shares (found by the search's
    edge example)."""
    code, out, data = _check(capsys, tmp_path, "fp16_divide_then_cast", "--tolerance", "fp16", "--backend", "gloo",
                             "--world-sizes", "3", "--properties", "averages")
    assert code == 1
    message = data["failures"][0]["message"]
    assert "dividing first is not enough here — 65504.0/3 rounds to 21840 in float16, and 3 × 21840 = 65520" in message
    assert "divide first, as torch's allreduce_hook does" not in message


def test_a_float16_sum_that_overflows_says_the_hook_sums_first(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    """World size 2 at 65504: the float16 sum (131008) overflows, the shares (32752) do not —
    the hook that divides first passes the same example."""
    code, out, data = _replayed(capsys, tmp_path, "fp16_sum_then_divide", [65504.0, 65504.0], "--tolerance", "fp16")
    assert code == 1
    message = data["failures"][0]["message"]
    assert "(the ranks' sum there, 131008, exceeds float16's largest value 65504: a hook that sums before it divides gets inf" in message
    assert "cast" not in message and "not enough" not in message
    code, out, _ = _replayed(capsys, tmp_path, "fp16_divide_then_cast", [65504.0, 65504.0], "--tolerance", "fp16")
    assert code == 0, out


def test_a_non_finite_result_that_no_overflow_explains_gets_no_overflow_hint(capsys: pytest.CaptureFixture[str],
                                                                            tmp_path: Path) -> None:
    code, out, data = _replayed(capsys, tmp_path, "mean_over_nonzero_ranks", [0.0, 0.0])
    assert code == 1
    message = data["failures"][0]["message"]
    assert "got nan" in message and "is not finite" in message
    assert len(message.splitlines()) == 1  # no hint line


def test_a_hook_that_forgets_to_divide_is_told_its_result_is_the_sum(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    """The report said only '|error| … > bound'. Under fp32 the match is decisive: no re-run
    is suggested. Where the only element off the mean is an overflowed sum (inf), nothing
    tells a sum from a sum divided after it overflowed: no such line."""
    code, out, data = _replayed(capsys, tmp_path, "forgot_division", [3.0, -1.0, 0.5])
    assert code == 1
    assert "got 2.5, the float64 mean of the ranks' gradients is 0.8333" in out
    assert "\n    (the result is the sum over ranks: the hook did not divide by the world size)\n" in out
    big = torch.finfo(torch.float32).max
    code, out, data = _replayed(capsys, tmp_path, "forgot_division", [big, big])
    assert code == 1 and "got inf" in out and "sum over ranks" not in out


# --------------------------------------------------------------------------- replicas apart: did communication reach the result?
def test_replicas_apart_because_nothing_communicated_reached_the_result(capsys: pytest.CaptureFixture[str],
                                                                        tmp_path: Path) -> None:
    """The hook all-reduces a copy and returns its own bucket: the report said only that the
    ranks differ. Now it says the collective's output never reached the result (found by
    running the step again with the other ranks' gradients changed)."""
    code, out, data = _check(capsys, tmp_path, "reduces_a_copy_returns_its_own", "--backend", "gloo",
                             "--world-sizes", "2,3", "--properties", "replicas_agree")
    assert code == 1
    failure = data["failures"][0]
    assert failure["property"] == "replicas_agree"
    step = failure["details"]["step"]
    assert (f"(nothing this hook communicated reached its result: each rank's result at step {step} stays bit for "
            "bit the same when the other ranks' gradients change") in failure["message"]


def test_a_hook_that_communicates_nothing_is_told_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "noop", "--backend", "gloo", "--world-sizes", "2",
                             "--properties", "replicas_agree")
    assert code == 1
    assert "(the hook communicated nothing at step 0: each rank's result is computed from its own gradients alone)" in out


def test_an_average_only_one_ranks_gradients_reach_names_that_rank(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A broadcast from rank 0 where an all_reduce was meant: the *averages* report showed
    `got 0.0` beside the mean and the inputs, and nothing said that only rank 0's data got
    through — which the numbers cannot show after shrinking (rank 0's gradient is 0.0, as a
    zeroed bucket would be). Now an experiment names the rank."""
    code, out, data = _check(capsys, tmp_path, "broadcasts_rank_0s", "--backend", "gloo", "--world-sizes", "2,3",
                             "--properties", "averages")
    assert code == 1
    failure = data["failures"][0]
    step = failure["details"]["step"]
    assert (f"(only rank 0's gradients reach the results at step {step}: every rank's result stays bit for bit the "
            "same when any other rank's gradients change — a broadcast from rank 0") in failure["message"]


def test_a_deadlock_names_the_hook_line_that_called_the_posting_helper() -> None:
    """buggy.skip_allreduce_if_zero posts through a helper (_mean_unless): the report named the
    helper's line only, never the hook's line where a rank decided to skip (an audit of
    reports). The direct caller is named beside it when it is user code too."""
    from simcluster.checking.check import check_hook

    report = check_hook("simcluster.hooks.buggy:skip_allreduce_if_zero", backends=("gloo",), world_sizes=(2,),
                        database=None)
    deadlocks = [f for f in report.failures if "posted it at" in f.message]
    assert deadlocks, report.format()
    assert re.search(r"posted it at \S*buggy\.py:\d+ in _mean_unless: .* \(called from \S*buggy\.py:\d+ in "
                     r"skip_allreduce_if_zero: return _mean_unless\(", deadlocks[0].message), deadlocks[0].message


def test_replicas_apart_by_rounding_alone_are_told_so() -> None:
    """buggy.allgather_own_first: each rank adds its own gathered part first, so ranks sum the
    same values in different orders: every result is a good average, yet the replicas differ
    in the last bits. The report said only that they differ (an audit of reports). Now it
    says the averages hold there and the replicas differ by rounding alone; ranks adding
    different noise (dp_noise_per_rank_rng) are apart beyond rounding and get no such line."""
    rounding = "the replicas differ by rounding alone"
    assert all(rounding in m for m in _replicas_apart("simcluster.hooks.buggy:allgather_own_first"))
    assert not any(rounding in m for m in _replicas_apart("simcluster.hooks.buggy:dp_noise_per_rank_rng"))


def _replicas_apart(hook: str) -> list[str]:
    """The messages of ``hook``'s *replicas_agree* failures under a gloo check (at least one)."""
    from simcluster.checking.check import check_hook

    report = check_hook(hook, backends=("gloo",), database=None)
    messages = [f.message for f in report.failures if f.property == "replicas_agree"]
    assert messages, report.format()
    return messages


def test_an_overflow_under_a_lossy_tolerance_is_explained_too() -> None:
    """Under a lossy tolerance (scale=, norm=: judged per bucket) the report named the
    element that went inf but never why — the float16 share overflow that an element-wise
    tolerance's report explains (round 18 of hooks from the wild, a stochastic-rounding fp16
    hook; torch's fp16_compress_hook here)."""
    from simcluster.checking.check import check_hook

    report = check_hook("torch.distributed.algorithms.ddp_comm_hooks.default_hooks:fp16_compress_hook",
                        backends=("gloo",), tolerance="scale=0.01,atol=6e-8", database=None)
    overflow = [f for f in report.failures if f.property == "averages" and "got inf" in f.message]
    assert overflow, report.format()
    assert all("the float16 sum overflows" in f.message for f in overflow), overflow[0].message


def test_a_failure_that_does_not_repeat_says_so_and_no_experiment_is_believed(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A hook whose behaviour hangs on process-wide state (round 18 of hooks from the wild: a
    clock) fails an example that passes when run again. The report then claimed 'with every
    collective completing in order this step passes: the result depends on the order …' — an
    experiment that had only re-run it. Each reported failure is now run once more as it was:
    when it does not fail the same way, the report says so and runs no other experiment."""
    code, out, data = _check(capsys, tmp_path, "divides_but_not_every_seventh_time", "--backend", "gloo")
    assert code == 1
    messages = [f["message"] for f in data["failures"]]
    # run once more with every property, the example passes or fails another one first: either way not as it was
    assert any(re.search(r"\(run once more, the same example (passed|failed \w+ at step \d+ instead): what the hook does "
                         r"depends on something outside the example", m) for m in messages), messages
    assert not any("with every collective completing in order" in m for m in messages), messages


def test_replicas_apart_by_each_ranks_own_random_draws_are_told_so() -> None:
    """buggy.dp_noise_per_rank_rng adds noise drawn from each rank's global generator after
    the all_reduce: the report said only that the replicas differ (an audit of reports).
    Run again with every rank's generators seeded alike, they agree: the report says each
    rank's result depends on its own draws. Replicas apart by rounding (allgather_own_first)
    draw nothing and get no such line."""
    own_draws = "each rank's result depends on its own random draws"
    assert all(own_draws in m for m in _replicas_apart("simcluster.hooks.buggy:dp_noise_per_rank_rng"))
    assert not any(own_draws in m for m in _replicas_apart("simcluster.hooks.buggy:allgather_own_first"))


def test_a_shape_error_between_two_buckets_in_flight_is_told_so() -> None:
    """buggy.inflight_shared_compressor keeps "the" bucket's buffer in its state; after the
    rebuild, bucket 0's callback copies its 4 elements into bucket 1's 1-element buffer and
    raises. The report's only hint was the rebuild (an audit of reports); now the error's
    two sizes are named as the two buckets' of that step. A shape error whose sizes are not
    two buckets' of the step, or a step with one bucket, gets no such line."""
    from simcluster.checking.check import check_hook
    from simcluster.checking.render import bucket_mixup_hint

    report = check_hook("simcluster.hooks.buggy:inflight_shared_compressor", backends=("gloo",),
                        state="simcluster.hooks.buggy:CompressorState", tolerance="fp16", database=None)
    (raised,) = [f for f in report.failures if f.property == "liveness"]
    assert re.search(r"\(the error names the sizes of bucket \d's \(\d+ elements?\) and bucket \d's \(\d+ elements?\) "
                     r"at step \d+, where \d+ buckets are in flight at once", raised.message), raised.format()
    steps = [{"step": 0, "buckets": [{"index": 0, "numel": 4}]},
             {"step": 1, "buckets": [{"index": 0, "numel": 4}, {"index": 1, "numel": 1}]}]
    error = RuntimeError("output with shape [1] doesn't match the broadcast shape [4]")
    assert "bucket 0's (4 elements) and bucket 1's (1 element) at step 1" in bucket_mixup_hint(error, steps, 1)
    assert bucket_mixup_hint(error, steps, 0) == ""  # one bucket at step 0
    assert bucket_mixup_hint(RuntimeError("output with shape [3] doesn't match the broadcast shape [4]"), steps, 1) == ""


def test_a_deadlock_names_the_earlier_collective_where_two_lines_met() -> None:
    """buggy.rank0_logs_global_norm: only rank 0 all-reduces a one-element norm before the
    bucket. With one-element buckets that call meets rank 1's bucket all_reduce — same
    signature, another line — and rank 0's own bucket call is left unmatched. The report
    named call #1 never posted by rank 1 and nothing else: rank 1 had posted its all_reduce,
    and where it went was untold (an audit of reports). Now the earlier collective that met
    two different lines is named, with both lines; a hook whose ranks all post from one line
    (skips_on_local_overflow's deadlock) gets no such entry."""
    from simcluster.checking.check import check_hook

    report = check_hook("simcluster.hooks.buggy:rank0_logs_global_norm", backends=("gloo",), world_sizes=(2,),
                        database=None)
    (deadlock,) = [f for f in report.failures if f.error_type == "DeadlockError"]
    message = deadlock.message
    assert re.search(r"earlier, all_reduce\(float32, \(1,\), SUM\) \(call #0 on WORLD\) met calls posted at "
                     r"different lines.*\n +rank 0, in DDP iteration 0, bucket 0's hook call, posted it at \S*buggy\.py:\d+ in rank0_logs_global_norm: "
                     r"dist\.all_reduce\(norm_sq.*\n +rank 1, in DDP iteration 0, bucket 0's hook call, posted it at \S*buggy\.py:\d+ in rank0_logs_global_norm: "
                     r"return dist\.all_reduce\(buffer", message), message
    same_line = check_hook("simcluster.hooks.buggy:skips_on_local_overflow", backends=("gloo",), world_sizes=(2,),
                           database=None)
    (other,) = [f for f in same_line.failures if f.error_type == "DeadlockError"]
    assert "never posted by ranks [1]" in other.message and "earlier," not in other.message


def test_the_gradients_line_keeps_the_ranks_the_report_names_and_those_holding_inf() -> None:
    """At world 8 the gradients line showed ranks 0-3 and '(+4 ranks)': rank 7's inf, the
    cause, was cut away (an audit of reports). Named and non-finite ranks are always shown."""
    from simcluster.checking.render import render_gradients
    from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec

    ranks = tuple(RankSpec("const", value=float(r)) for r in range(7)) + (
        RankSpec("const", value=7.0, nonfinite=((1, "inf"),)),)
    example = Example(8, Layout(((2,),), None, (0,)), StepSpec(ranks))
    line = render_gradients(example, 0)
    assert "r3: " in line and "r4: " not in line and "| … | r7: [7.0, inf] (+3 ranks)" in line, line
    named = render_gradients(example, 0, named=[5])
    assert "r3: [3.0 ×2] | … | r5: [5.0 ×2] | … | r7: [7.0, inf] (+2 ranks)" in named, named


def test_a_mismatch_names_the_line_of_both_calls(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """An extra call on rank 0: the mismatch is found at rank 1's innocent call, and the
    report gave only that one's line; the culprit's is now there too (check and explain:
    an audit of explain, 2026-12-06)."""
    code, out, data = _check(capsys, tmp_path, "extra_call_on_rank0", "--backend", "gloo", "--world-sizes", "2",
                             "--properties", "liveness")
    assert code == 1
    message = data["failures"][0]["message"]
    assert "CollectiveMismatchError" in message
    assert re.search(r"rank 0, in DDP iteration 0, bucket 0's hook call, posted it at tests/report_hooks\.py:\d+ in "
                     r"extra_call_on_rank0: dist\.all_reduce\(torch\.ones\(1\), async_op=True\)", message), message
    assert "\n    rank 1 posted it in DDP iteration 0, bucket 0's hook call\n" in message, message


def test_a_mismatch_names_the_hook_call_or_callback_each_call_was_posted_in() -> None:
    """tests/race_hooks.py:callback_broadcast_hook: rank 0's callback for bucket 0 broadcasts
    while rank 1's hook call for bucket 1 all-reduces. The report named both lines and the
    step, never which bucket each call belonged to, nor that the broadcast ran in a callback
    of the bucket-0 all_reduce (an audit of reports): both are said now."""
    from simcluster.checking.check import check_hook

    report = check_hook("tests/race_hooks.py:callback_broadcast_hook", backends=("gloo",), world_sizes=(2,),
                        database=None)
    (race,) = [f for f in report.failures if "CollectiveMismatchError" in f.message]
    assert re.search(r"rank \d, in DDP iteration 1, bucket 1's hook call, posted it at \S*race_hooks\.py:\d+ in "
                     r"_skip_nonfinite_mean: ", race.message), race.message
    assert re.search(r"rank (\d): broadcast\(float32, \(3,\), root=0\) at \S*race_hooks\.py:\d+ in done: .*\n +rank \1 "
                     r"posted it in a callback of all_reduce#\d+ on WORLD \(posted in DDP iteration 1, bucket 0's hook "
                     r"call\)", race.message), race.message


def test_a_rank_whose_constant_changes_vanish_in_the_hook_is_not_said_unreached(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Rank 0 holds zeros, ranks 1 and 2 two different values each; the hook sends each
    rank's gradients minus their mean. Rank 0's data does reach the result, but a constant
    (the experiment's two changes: all 1s or 2s, all -3s or -5s) is centred to zeros: the
    report said 'only ranks 1, 2's gradients reach the results' (TernGrad from the wild,
    round 16, clips at 2.5 standard deviations). A third, non-constant change settles it."""
    from simcluster.checking.replay import encode_example
    from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec

    ranks = (RankSpec("const", value=0.0), RankSpec("const", value=1.0, specials=((1, 3.0),)),
             RankSpec("const", value=2.0, specials=((1, 5.0),)))
    token = encode_example(Example(3, Layout(((2,),), None, (0,)), StepSpec(ranks)), "gloo")
    code, out, data = _check(capsys, tmp_path, "sums_centred", "--steps", "1", "--replay", token,
                             "--properties", "averages")
    assert code == 1 and data["failures"][0]["property"] == "averages"
    assert "reach the results" not in data["failures"][0]["message"], data["failures"][0]["message"]


def test_an_average_some_ranks_gradients_never_reach_names_the_ranks_that_do(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, data = _check(capsys, tmp_path, "leaves_out_ranks_past_1", "--backend", "nccl", "--world-sizes", "3",
                             "--properties", "averages")
    assert code == 1
    failure = data["failures"][0]
    assert (f"(only ranks 0, 1's gradients reach the results at step {failure['details']['step']}: "
            "every rank's result stays bit for bit the same") in failure["message"]


def test_an_nccl_all_gather_read_as_gloos_list_is_told_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """hooks/buggy.py's allgather_assumes_gloo_list stacks and averages fut.value(): on NCCL it
    holds one (W, n) tensor, and every replica trains on rank 0's gradient alone. The line
    names rank 0 and the cause, not a broadcast the hook never made."""
    out_json = tmp_path / "report.json"
    code = main(["check", "hooks/buggy.py:allgather_assumes_gloo_list", "--no-database", "--quiet", "--json",
                 str(out_json), "--backend", "nccl", "--world-sizes", "2,3", "--properties", "averages"])
    capsys.readouterr()
    assert code == 1
    message = json.loads(out_json.read_text())[0]["failures"][0]["message"]
    assert "(only rank 0's gradients reach the results at step" in message
    assert "an all_gather's future on NCCL holds one stacked tensor, [flat] of shape (world, …)" in message
    assert "broadcast" not in message


def test_a_gloo_all_gather_read_as_nccls_flat_is_told_so_in_every_contract_failure(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """hooks/buggy.py's allgather_assumes_nccl_flat means over fut.value()[0], NCCL's (W, n)
    tensor, which on gloo is rank 0's 1-D part: the result is 0-d, and DDP's copy-back
    raises (setStorage out of bounds) for a bucket of more than one element. Every contract
    failure says where the future came from. (A 0-d result for a one-element bucket is no
    contract failure: real DDP applies it — measured 2026-12-06, docs/ddp-facts.md.)"""
    out_json = tmp_path / "report.json"
    code = main(["check", "hooks/buggy.py:allgather_assumes_nccl_flat", "--no-database", "--quiet", "--json",
                 str(out_json), "--backend", "gloo", "--world-sizes", "2", "--properties", "contract"])
    capsys.readouterr()
    assert code == 1
    messages = [f["message"] for f in json.loads(out_json.read_text())[0]["failures"]]
    assert messages and all("setStorage" in m for m in messages), messages
    assert all("the hook's future comes from all_gather#0 on WORLD; on gloo that future holds the W output tensors "
               "themselves, [outs[0], …, outs[W-1]], not [flat output] as on NCCL" in m for m in messages)


def test_an_average_every_ranks_gradients_reach_gets_no_such_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A sum not divided: every rank's data reaches every result."""
    code, out, data = _check(capsys, tmp_path, "prints_and_forgets_division", "--backend", "gloo",
                             "--world-sizes", "2,3", "--properties", "averages")
    assert code == 1 and data["failures"][0]["property"] == "averages"
    assert "gradients reach the results" not in out


def test_replicas_apart_because_every_collective_ran_on_a_one_rank_group_say_so(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """An MoE hook (hooks from the wild, round 12) all-reduces on ``dist.new_group`` groups of
    one rank: the report said nothing communicated reached the result, 'e.g. a collective on a
    copy whose output is never used …, or a future completed with the local buffer' — neither
    is what happened. Now it names the one-rank group the collective ran on."""
    code, out, data = _check(capsys, tmp_path, "reduces_on_its_own_group", "--state",
                             f"{HOOKS}:own_rank_group", "--backend", "gloo", "--world-sizes", "2",
                             "--properties", "replicas_agree")
    assert code == 1
    message = data["failures"][0]["message"]
    step = data["failures"][0]["details"]["step"]
    assert (f"(every collective of step {step} ran on a group of one rank — e.g. all_reduce#0 on group") in message
    assert "ranks [0] alone: a reduction over one rank is that rank's own data" in message
    assert "e.g. a collective on a copy" not in message


def test_replicas_apart_after_communication_reached_the_result_get_no_such_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """adds_its_rank's result is the mean plus the rank: the other ranks' gradients reach it."""
    code, out, data = _check(capsys, tmp_path, "adds_its_rank", "--backend", "gloo", "--world-sizes", "2,3",
                             "--properties", "replicas_agree")
    assert code == 1 and data["failures"][0]["property"] == "replicas_agree"
    assert "reached its result" not in out and "communicated nothing" not in out


# --------------------------------------------------------------------------- 0-dim parameters
def test_a_scalar_parameter_given_by_params_reaches_the_hook_as_a_0_dim_gradient(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Real DDP buckets a 0-dim parameter (``nn.Parameter(torch.tensor(2.0))``) and hands the hook
    a 0-dim view in ``bucket.gradients()`` (measured, torch 2.13 gloo, docs/hooks.md round 12).
    simcluster never drew one and ``--params`` could not give one, so a hook reading
    ``g.shape[0]`` passed; ``--params 2x3,scalar`` now finds the IndexError, and the replay
    line gives the shapes back as they were written."""
    code, out, data = _check(capsys, tmp_path, "rows_of_each_gradient", "--backend", "gloo", "--world-sizes", "1",
                             "--params", "2x3,scalar")
    assert code == 1, out
    failure = data["failures"][0]
    assert failure["property"] == "liveness" and "IndexError: tuple index out of range" in failure["message"]
    assert "params [(2, 3), ()]" in out
    assert "--params 2x3,scalar " in out
    code, out, _ = _check(capsys, tmp_path, "rows_of_each_gradient", "--backend", "gloo", "--world-sizes", "1",
                          "--params", "2x3,3")
    assert code == 0, out


def test_the_scalar_example_finds_a_hook_that_cannot_take_a_0_dim_gradient_without_params(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The draw makes no 0-dim parameter, so without --params the same hook passed at the
    defaults; the scalar example (a 2 x 3 matrix and a 0-dim parameter, the smallest world of 2
    or more) runs after every search and finds it on every seed."""
    for seed in ("0", "1"):
        code, out, data = _check(capsys, tmp_path, "rows_of_each_gradient", "--backend", "gloo", "--seed", seed)
        assert code == 1, out
        failure = data["failures"][0]
        assert "IndexError: tuple index out of range" in failure["message"]
        assert "params [(2, 3), ()], default cap" in out and "world size 2" in out
    from types import SimpleNamespace

    from simcluster.checking.explicit import SCALAR_SHAPES, scalar_example

    assert SCALAR_SHAPES == ((2, 3), ())
    opts = SimpleNamespace(params=None, tolerance="fp32", bucket_view=False, props=())
    example = scalar_example(opts, (1, 3, 8), 3)  # type: ignore[arg-type]
    assert example is not None and example.world_size == 3 and example.layout.shapes == SCALAR_SHAPES
    assert scalar_example(SimpleNamespace(**{**vars(opts), "params": ((4,),)}), (2,), 3) is None  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the hook's own futures, by name
def test_a_future_the_hook_made_is_named_by_its_rank_s_count_and_line(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """The report said 'a torch.futures.Future() made by rank 1': which one, of the several
    the hook makes? Each is numbered per rank in the order the rank made it (rank 0 made
    three by then, rank 1 two: a count over all ranks would not say #1), with its line —
    the same in a second run."""
    runs = [_check(capsys, tmp_path, "forgets_one_of_its_futures", "--backend", "gloo", "--world-sizes", "2",
                   "--properties", "liveness") for _ in range(2)]
    (code, out, data), (_, _, again) = runs
    assert code == 1 and data["failures"][0]["error_type"] == "DeadlockError"
    line = _line("lost = torch.futures.Future()")
    assert (f"rank 1: DDP's reducer (iteration 0, bucket 0) waits on torch.futures.Future() #1 made by rank 1 at "
            f"{HOOKS}:{line}, which never completes") in out
    assert data["failures"][0]["message"] == again["failures"][0]["message"]


def test_a_future_holding_a_future_is_worded_as_torch_without_an_address(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    # hooks from the wild 2026-12-04: the report said 'Unable to cast <simcluster.fake.futures.SimFuture
    # object at 0x7f4a633e54f0> to Tensor' (a class the user never wrote, and an address: a
    # different report every run) and 'resolved to a SimFuture', not which callback made it
    code, out, data = _check(capsys, tmp_path, "callback_returns_its_future", "--backend", "gloo",
                             "--world-sizes", "1", "--examples", "3", "--properties", "contract")
    assert code == 1
    assert "Unable to cast <torch.Future object at 0x…> to Tensor" in out
    assert "SimFuture" not in out and "0x7" not in out
    assert ("the hook's future resolved to a Future: a then-callback (then(callback_returns_its_future.<locals>.timed)"
            " of all_reduce#0 on WORLD) returned a future") in out
    assert "SimFuture" not in json.dumps(data)


def test_a_torchrun_variable_missing_from_os_environ_is_told_as_the_launchers(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # hivemind's hook (hooks from the wild, round 9) logs os.environ['LOCAL_RANK']: the report said
    # only "KeyError: 'LOCAL_RANK'", as if the hook were broken; under torchrun it is set
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    code, out, _ = _check(capsys, tmp_path, "reads_local_rank", "--backend", "gloo", "--world-sizes", "1",
                          "--examples", "3")
    assert code == 1 and "KeyError: 'LOCAL_RANK'" in out
    assert "simcluster: hint: os.environ['LOCAL_RANK'] is set by torchrun in each rank's process" in out
    code, out, _ = _check(capsys, tmp_path, "reads_its_own_rank_key", "--backend", "gloo", "--world-sizes", "1",
                          "--examples", "3")
    assert code == 1 and "KeyError: 'RANK'" in out and "torchrun" not in out


def test_the_at_lines_skip_torchs_deprecation_wrapper(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # ColossalAI's fp8 hook (hooks from the wild 2026-12-04): the report's last 'at' line was
    # '.../site-packages/typing_extensions.py:3140 in wrapper: return arg(*args, **kwargs)',
    # the wrapper torch 2.13 puts around dist.all_gather_into_tensor — not the user's code
    code, out, data = _check(capsys, tmp_path, "gathers_into_a_flat_output", "--backend", "gloo",
                             "--world-sizes", "2", "--examples", "3", "--properties", "contract,liveness")
    assert code == 1
    assert "ProcessGroupGloo::allgather: invalid tensor size at index 0" in out
    at_lines = [line for line in out.splitlines() if line.startswith("  at ")]
    assert at_lines and all("typing_extensions" not in line for line in at_lines), at_lines
    assert at_lines[-1].endswith(f"report_hooks.py:{_line('dist.all_gather_into_tensor(out, buf.view(1, -1))')} "
                                 "in gathers_into_a_flat_output: dist.all_gather_into_tensor(out, buf.view(1, -1))")


def test_replicas_apart_because_the_hook_reduced_p_grad_say_p_grad_is_not_the_buffer(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Modulus SFNO's reduction_comm_hook (hooks from the wild, round 7) all-reduces p.grad and
    returns the buffer: the report said a collective on 'a copy' never reached the result, and
    left the user to guess that p.grad is one. With --gradient-as-bucket-view (p.grad a view of
    the buffer, as in real DDP) the same hook keeps replicas together."""
    code, out, data = _check(capsys, tmp_path, "reduces_p_grad_returns_the_buffer", "--backend", "gloo",
                             "--world-sizes", "2", "--properties", "replicas_agree")
    assert code == 1
    message = data["failures"][0]["message"]
    assert "nothing this hook communicated reached its result" in message
    assert ("(p.grad is one: with DDP's default gradient_as_bucket_view=False it is a tensor of its own, not a view "
            "of the bucket's buffer)") in message
    code, out, data = _check(capsys, tmp_path, "reduces_p_grad_returns_the_buffer", "--backend", "gloo",
                             "--world-sizes", "2", "--properties", "replicas_agree", "--gradient-as-bucket-view")
    assert code == 0, out


def test_an_integer_sum_that_wrapped_around_is_named_in_the_averages_report(capsys: pytest.CaptureFixture[str],
                                                                            tmp_path: Path) -> None:
    """int8 codes 101 and 102 sum to 203, which int8 holds as -53 (203 - 256): the result is
    far off and the report said only '|error| … > bound'. Where the codes' sum fits (40 + 40)
    the hook's own rounding is the only error: a failure, with no such line."""
    code, out, data = _replayed(capsys, tmp_path, "int8_codes_offset", [1.0, 2.0])
    assert code == 1
    message = data["failures"][0]["message"]
    assert data["failures"][0]["property"] == "averages" and "got -126.5" in message
    assert ("(an integer sum wrapped around: all_reduce#0 on WORLD summed int8 past its range in 2 elements, "
            "e.g. 101 + 102 = 203, held as -53 in int8 (element 0) — integer adds wrap silently") in message
    code, out, data = _replayed(capsys, tmp_path, "int8_codes_offset", [-60.4, -60.0])
    assert code == 1 and "got -60.0" in data["failures"][0]["message"]
    assert "wrapped around" not in out


# --------------------------------------------------------------------------- deadlocks: the user's lines
def test_a_deadlock_report_names_the_line_that_posted_the_unmatched_call_and_what_the_silent_rank_returned(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """hooks/buggy.py:skips_on_local_overflow: rank 1 (holding the inf) returns a future it
    completed itself; rank 0 posts the all_reduce. The report said which call was unmatched,
    never where: now the line that posted it, and what rank 1's hook returned — the future,
    with the line that made it. Byte-identical in a second run, and the printed replay
    command (run twice) reproduces it."""
    import inspect

    from simcluster.hooks import buggy

    # the hook's body is buggy._mean_unless (shared with skip_allreduce_if_zero): the lines are there
    source, start = inspect.getsourcelines(buggy._mean_unless)
    posted = start + next(i for i, line in enumerate(source) if "dist.all_reduce(" in line)
    made = start + next(i for i, line in enumerate(source) if "torch.futures.Future()" in line)
    path = os.path.relpath(inspect.getsourcefile(buggy) or "", ROOT)

    def check(*argv: str) -> tuple[int, str, Any]:
        out_json = tmp_path / "report.json"
        code = main([*argv, "--no-database", "--quiet", "--json", str(out_json)])
        return code, capsys.readouterr()[0], json.loads(out_json.read_text())[0]

    runs = [check("check", "simcluster.hooks.buggy:skips_on_local_overflow", "--backend", "gloo") for _ in range(2)]
    (code, out, data), (_, _, again) = runs
    assert code == 1
    (failure,) = [f for f in data["failures"] if f["error_type"] == "DeadlockError"]
    message = failure["message"]
    assert ("all_reduce(float32, (40,), SUM) (call #0 on WORLD): posted by ranks [0], never posted by ranks [1]\n"
            f"    rank 0, in DDP iteration 0, bucket 0's hook call, posted it at {path}:{posted} in _mean_unless: "
            "return dist.all_reduce(") in message
    assert ("rank 1: DDP's reducer (iteration 0, bucket 0) waits on nothing: the hook returned torch.futures.Future() "
            f"#0 made by rank 1 at {path}:{made}, which has completed") in message
    assert f"{path}:{posted} in _mean_unless" in out
    assert [f["message"] for f in again["failures"]] == [f["message"] for f in data["failures"]]
    for _ in range(2):
        code, replayed, data = check(*shlex.split(failure["replay"])[1:])
        assert code == 1 and [f["message"] for f in data["failures"]] == [message]
        assert message.splitlines()[-1] in replayed


def test_a_deadlock_the_reporting_rerun_does_not_reproduce_keeps_its_first_report() -> None:
    """The posting lines come from a re-run of the example (the search walks no stack at a
    post). A hook whose state outlives a run can behave otherwise the second time: then the
    first report stands as it was, without lines, rather than a story of another run."""
    import torch.distributed as dist

    from simcluster.checking.judge import run_example, with_posting_lines
    from simcluster.checking.options import make_options
    from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec
    from simcluster.errors import Violation

    skip = [True]

    def hook(state: object, bucket: Any) -> Any:
        if skip[0] and dist.get_rank() == 1:
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    opts = make_options(hook, target="hook", replay_target="hook", state="none", isolate=(), tolerance="none",
                        backends=("gloo",), world_sizes=(2,), steps=1, examples=1, seed=0, api="current",
                        properties=["liveness"], params=None, subgroups=None, deadline=60.0, rng="per_rank")
    example = Example(2, Layout(((4,),), ready_order=(0,)), StepSpec((RankSpec("const", value=1.0),) * 2))
    with pytest.raises(Violation) as caught:
        run_example(opts, example, "gloo")
    first = caught.value
    assert first.info["error_type"] == "DeadlockError" and "posted it at" not in str(first)
    found = with_posting_lines(opts, first)
    assert found is not first and "rank 0, in DDP iteration 0, bucket 0's hook call, posted it at tests/test_reports.py:" in str(found)
    assert str(found).startswith(str(first).splitlines()[0])
    skip[0] = False  # the re-run no longer deadlocks
    assert with_posting_lines(opts, first) is first


def test_the_abridger_never_folds_values_that_differ_in_their_bits() -> None:
    """Reports and explain print tensors through one abridger: a run of equal values is one
    value and a count, but -0.0 is not 0.0 (a hook that flips a sign is what the report is
    about) and NaN never equals itself; a long tensor keeps its head, its tail and its size."""
    from simcluster.checking.render import abridged
    from simcluster.teaching.explain import values

    assert abridged(torch.tensor([2.0, 2.0, 2.0])) == "[2.0 ×3]"
    assert abridged(torch.tensor([0.0, -0.0, 0.0])) == "[0.0, -0.0, 0.0]"
    assert abridged(torch.tensor([float("nan")] * 2)) == "[nan, nan]"
    assert abridged(torch.arange(8.0)) == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, …] (8 values)"
    assert values(torch.arange(400_000.0)) == (
        "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, …, 399996.0, 399997.0, 399998.0, 399999.0] (400,000 values)")


def test_another_parameters_average_from_the_same_bucket_is_not_blamed_on_another_bucket(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """wild21: a hook concatenating per-parameter results in reverse order got "another
    bucket's data reached it — hook state holding the bucket …?" with one bucket in the run:
    the mix-up is the hook's own order within the bucket, and the hint now says that."""
    code, out, data = _check(capsys, tmp_path, "concatenates_parameters_reversed", "--backend", "gloo",
                             "--world-sizes", "2", "--params", "2,2", "--properties", "averages")
    assert code == 1
    message = data["failures"][0]["message"]
    assert re.search(r"param (\d)'s result is param (\d)'s average, on every rank; both are in bucket 0", message), message
    assert "another bucket" not in message


def test_a_failure_that_repeats_with_other_results_says_so_and_no_experiment_is_believed(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """wild21: a random-k hook drawing from a generator seeded by OS entropy failed
    replicas_agree on every run, so the report ran its experiments — and the one re-running
    with every rank's generators seeded alike saw the replicas agree by chance, in 3 of 6
    replays ("each rank's result depends on its own random draws": not this hook's story).
    A failure that repeats is now also run twice more and its results compared bit for bit."""
    code, out, data = _check(capsys, tmp_path, "adds_a_process_wide_draw", "--backend", "gloo", "--world-sizes", "2",
                             "--properties", "replicas_agree", "--params", "2")
    assert code == 1
    (message,) = [f["message"] for f in data["failures"]]
    assert "(run once more, the same example failed the same way, but two more runs of it gave other results at " \
           "step 0: what the hook does depends on something outside the example" in message, message
    assert "seeded alike" not in message and "completing in order" not in message, message


def test_a_callback_raising_on_one_rank_is_liveness_and_says_who_went_on(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """wild21: a callback's exception was charged to contract (as a result DDP cannot take);
    it is the hook's own exception — the raising rank's backward() fails while the others
    complete the step and wait at their next collective on a real cluster."""
    code, out, data = _check(capsys, tmp_path, "raises_in_rank_1s_callback", "--backend", "gloo",
                             "--world-sizes", "3")
    assert code == 1
    assert [f["property"] for f in data["failures"]] == ["liveness"], data["failures"]
    message = data["failures"][0]["message"]
    assert "CallbackError: Got the following error when running the callback: FloatingPointError: rank 1 found" \
        in message, message
    assert "ranks [0, 2] completed this step: on a real cluster rank 1's backward() raises this" in message, message


def test_a_failure_told_otherwise_when_run_again_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """wild21: a hook iterating a set of tensors (id() order) failed liveness on every replay,
    at step 0 or 1, with other shapes in its message; the liveness report had no caveat. A
    failure whose message differs when run again is one whose replay may not repeat."""
    code, out, data = _check(capsys, tmp_path, "raises_a_process_wide_count", "--backend", "gloo",
                             "--world-sizes", "2")
    assert code == 1
    (message,) = [f["message"] for f in data["failures"]]
    assert "ValueError: draw" in message and "(run once more, the same example failed the same way, but with another " \
           "message: what the hook does depends on something outside the example" in message, message


def test_library_files_are_named_by_their_import_path_wherever_the_environment_lives() -> None:
    """With the virtual environment inside the project (the README's set-up), report lines
    named torch's files '.venv/lib/python3.11/site-packages/torch/…' (regenerating
    docs/tutorial.md showed it): a library file is named as imported, a project file relative
    to the current directory (this test runs from the repository root)."""
    import os

    from simcluster.engine.frames import short_path

    assert short_path(torch.__file__) == os.path.join("torch", "__init__.py")
    assert short_path(os.__file__) == "os.py"
    assert short_path(str(ROOT / HOOKS)) == HOOKS
    # a traceback torch writes into a message (a then-callback's error: 'At:\n  /…/torch/…(92): f')
    from simcluster.checking.render import error_text

    quoted = RuntimeError(f"Got the following error when running the callback\nAt:\n  {torch.__file__}(92): f")
    assert error_text(quoted).splitlines()[-1].strip() == f"{os.path.join('torch', '__init__.py')}(92): f"


@pytest.mark.parametrize("target, options, shown", [
    # a deadlock's report names the line that posted each call, from a re-run with posting
    # lines; the repeat check compared that message with its own re-run's, without them
    ("send_before_recv_hook", ("--world-sizes", "2"), "posted it at tests/report_hooks.py:"),
    # a default repr in the hook's own message: its address changes every run
    ("asserts_with_its_states_repr", ("--state", f"{HOOKS}:make_config"), "_Config object at 0x…> has no scale"),
    # ids and a storage address in decimal and hex: new every run (round 24's audit left this open)
    ("asserts_with_ids", ("--state", f"{HOOKS}:make_config"),
     "bucket <address> (state <address>, storage 0x…, <address>) not registered"),
])
def test_a_deterministic_failure_gets_no_may_not_repeat_caveat(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                target: str, options: tuple[str, ...],
                                                                shown: str) -> None:
    """A regression sweep of this stop's repeat check: 13 deterministic deadlock, mismatch and
    in-flight-write reports of earlier rounds' hooks said 'may not repeat', and so did a hook
    quoting a default repr. The replay prints the same report, address masked."""
    code, out, data = _check(capsys, tmp_path, target, "--backend", "gloo", *options)
    assert code == 1
    messages = [f["message"] for f in data["failures"]]
    assert any(shown in m for m in messages), messages
    assert not any("may not repeat" in m for m in messages), messages


def test_a_collective_left_in_flight_when_ddp_reads_the_bucket_is_a_contract_failure(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A hook that posts its all_reduce and returns a future it completed itself passed every
    property (round 22 of hooks from the wild), where real DDP copies the bucket back before
    the all_reduce writes. Now: contract, InFlightReadError, with the line that posted the
    collective; the printed replay reproduces it."""
    code, out, data = _check(capsys, tmp_path, "forgets_its_all_reduce", "--backend", "gloo", "--world-sizes", "1,2")
    assert code == 1, out
    failure = data["failures"][0]
    assert failure["property"] == "contract" and failure["error_type"] == "InFlightReadError", out
    line = _line("dist.all_reduce(buf, async_op=True)  # never waited on")
    assert f"posted it at {HOOKS}:{line} in forgets_its_all_reduce" in failure["message"], failure["message"]
    replay = shlex.split(failure["replay"])
    for _ in range(2):
        assert main(replay[1:] + ["--quiet", "--no-database"]) == 1
        out = capsys.readouterr().out
        assert "InFlightReadError: " in out and "copy-back" in out and "read bucket 0" in out, out


# --------------------------------------------------------------------------- hints that must not mislead
def _example(world: int, shapes: tuple[tuple[int, ...], ...], *values: float, steps: int = 1) -> Example:
    """``values[r]`` everywhere on rank ``r``, the same every step, one bucket per parameter after the rebuild."""
    base = StepSpec(tuple(RankSpec("const", value=v) for v in values))
    return Example(world, Layout(shapes, 16 / 2**20, tuple(range(len(shapes)))), base, (0, 0)[:steps - 1])


def _report(hook: str, example: Example, **options: Any) -> str:
    report = check_hook(f"{HOOKS}:{hook}", replay=encode_example(example, "gloo"), backends=("gloo",), **options)
    assert report.failures, report.format()
    return report.format()


def test_a_sign_of_zero_is_named_by_its_element_and_never_called_rounding_when_nothing_was_communicated() -> None:
    """A hook that communicates nothing, shrunk to ranks holding 0.0 and -0.0: the report said
    "a bit pattern differs (e.g. -0.0 vs 0.0) at byte 3" (no element), and under "the hook
    communicated nothing" that "the replicas differ by rounding alone: the ranks combined the
    same values in different orders" (round 22 of hooks from the wild)."""
    text = _report("returns_its_own_bucket", _example(2, ((3,),), 0.0, -0.0), properties=["replicas_agree"])
    assert "element 0: 0.0 vs -0.0 (zeros of opposite signs)" in text, text
    assert "communicated nothing" in text or "nothing this hook communicated" in text, text
    assert "rounding alone" not in text, text


def test_a_loose_tolerance_passing_is_no_evidence_of_rounding() -> None:
    """Replicas a quarter apart passed --tolerance norm=1.0, and the report said they "differ
    by rounding alone" (round 22 of hooks from the wild): rounding is judged at float32's."""
    text = _report("averages_then_adds_its_rank", _example(2, ((4,),), 1.0, 1.0), tolerance="norm=1.0",
                   properties=["replicas_agree", "averages"])
    assert "differ by 0.25" in text and "rounding alone" not in text, text


def test_a_sum_with_a_rank_holding_zeros_does_not_claim_that_rank_did_not_divide() -> None:
    """Rank 0 divides, rank 1 does not; shrunk to rank 0 holding zeros, the result is the sum,
    and the report said flatly "the hook did not divide by the world size" (round 22)."""
    text = _report("divides_on_rank_0_only", _example(2, ((1,),), 0.0, -1.0), properties=["averages"])
    assert "the hook did not divide by the world size" in text, text
    assert "rank 0's gradients are all zero in this example, so whether its code divided does not show" in text, text


def test_a_lag_the_rebuild_does_not_cause_is_not_blamed_on_it() -> None:
    """A residual keyed by shape, shared by two parameters of one shape, never drains; the
    report blamed DDP's bucket rebuild, which the example also had (round 22). A run whose
    buckets never change (find_unused_parameters=True) keeps the lag: not the rebuild."""
    example = Example(1, Layout(((8,), (8,)), 16 / 2**20, (0, 1)),
                      StepSpec((RankSpec("const", value=0.0, specials=((0, 1000.0),)),)), (0, 0))
    text = _report("sign_with_residual_by_shape", example, state=f"{HOOKS}:ResidualByShape", tolerance="none",
                   properties=["error_feedback"])
    assert "error feedback lost" in text and "not DDP's bucket rebuild" in text, text
    assert "likely cause: DDP rebuilt" not in text, text


def test_an_overflow_in_the_cast_after_a_wider_sum_is_explained() -> None:
    """A float64 sum cast to float32 before the division gives inf at float32's maximum; the
    report named no cause, since the collective carried float64, where the sum fits (round 22)."""
    top = float(torch.finfo(torch.float32).max)
    text = _report("sums_in_float64_then_narrows", _example(2, ((1,),), top, top), properties=["averages"])
    assert "got inf" in text, text
    assert "the collectives carried float64, where this sum fits, but the result is float32, which does not hold it" \
        in text, text


def test_a_mismatch_with_the_ranks_roles_swapped_is_one_bug_not_two() -> None:
    """A hook choosing its dtype from local data mismatches with rank 0 posting bf16 in one
    example and rank 1 in another: keyed by the line of the call that completed the mismatch,
    they were two bugs, reported twice as mirror images (a round of hooks written outside the
    project, 2026-12-07). One bug: the calls that disagree."""
    report = check_hook(f"{HOOKS}:dtype_from_local_data_hook", world_sizes=(2,), examples=60, seed=0, database=None,
                        tolerance="bf16", backends=("gloo",))
    mismatches = [f for f in report.failures if "CollectiveMismatchError" in f.message]
    assert len(mismatches) == 1, report.format()


def test_a_wrong_value_from_a_read_of_memory_in_flight_names_the_read() -> None:
    """A hook that reads the scale its MAX-reduce still had in flight: the report of the ranks'
    disagreement gave no cause, word for word the report of a hook that never reduces the
    scale (a round of hooks written outside the project, 2026-12-07). The reporting re-run
    watches reads: it names the line, the call and the ranks. The same hook reading after
    wait() passes, so the read is the bug."""
    agree = ("contract", "liveness", "replicas_agree")  # the scale's rounding is not the question here
    report = check_hook(f"{HOOKS}:scale_read_in_flight_hook", world_sizes=(3,), examples=20, seed=0, database=None,
                        tolerance="none", properties=agree, backends=("gloo",))
    assert not report.passed
    message = report.failures[0].message
    line = _line("step = scale.item() / 100")
    assert "likely cause: a read of memory in flight — ranks [0, 1, 2] read memory all_reduce#0 on WORLD still had " \
           "in flight" in message, message
    assert f"with Tensor.item at tests/report_hooks.py:{line} in _scaled_mean" in message, message
    fixed = check_hook(f"{HOOKS}:scale_read_after_wait_hook", world_sizes=(3,), examples=20, seed=0, database=None,
                       tolerance="none", properties=agree, backends=("gloo",))
    assert fixed.passed, fixed.format()


def test_replicas_apart_by_the_group_size_are_no_rounding() -> None:
    """A rank whose fast path forgot the division returned the sum of two denormals where its
    peer returned the mean: within the fp32 tolerance by its absolute term only, and the
    report said "the replicas differ by rounding alone" (a round of hooks written outside
    the project, 2026-12-07). A ratio of exactly the group size at every differing element
    is named as such; a rounding difference is not."""
    from simcluster.checking.judge import _apart_by_the_group_size

    tiny = torch.tensor([1.4e-45, 0.0, 3.0])
    assert _apart_by_the_group_size([[tiny], [tiny * 2]], [[0, 1]]) == 2
    assert _apart_by_the_group_size([[tiny * 3], [tiny], [tiny]], [[0, 1, 2]]) == 3
    rounded = torch.tensor([1.0, 0.1 + 0.2, 3.0])
    assert _apart_by_the_group_size([[rounded], [torch.tensor([1.0, 0.3, 3.0])]], [[0, 1]]) is None
    assert _apart_by_the_group_size([[tiny], [tiny]], [[0, 1]]) is None  # no difference: nothing to name
    assert _apart_by_the_group_size([[tiny], [tiny * 2], [tiny * 5]], [[0, 1, 2]]) is None


def test_a_failure_in_a_drain_step_repeats_when_run_once_more(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """stop 44: powerSGD_hook's liveness failure in its fourth step (the first of the zero
    steps *error_feedback* appends to drain a residual) was reported as "run once more, the
    same example passed: what the hook does depends on something outside the example" — the
    re-run checked the failing property alone, so it fed the example without its drain steps
    and never reached the failing step. A deterministic hook failing in a drain step is
    re-run as it was and carries no such caveat."""
    code, out, data = _check(capsys, tmp_path, "hangs_in_its_fourth_step", "--backend", "gloo",
                             "--world-sizes", "2", "--steps", "3", "--properties", "liveness,error_feedback")
    assert code == 1
    (failure,) = data["failures"]
    assert failure["property"] == "liveness" and "DeadlockError" in failure["message"], failure
    assert "step 3" in failure["message"], failure["message"]
    assert "run once more" not in failure["message"], failure["message"]
