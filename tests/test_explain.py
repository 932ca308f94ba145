"""``simcluster explain`` over DDP steps: the story, a failing hook's full diagnostic, the
timeline (SVG/HTML), the Chrome trace, and the safe-range search."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook

from simcluster.cli import main
from simcluster.errors import DeadlockError
from simcluster.teaching.explain import explain, format_failure
from simcluster.teaching.safe_range import safe_range
from simcluster.teaching.story import record
from simcluster.usercode.targets import parse_shapes
from simcluster.teaching.timeline import render_svg
from simcluster.teaching.wire import PRESETS

NET = PRESETS["ethernet25"]
TORCH_FP16 = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks:fp16_compress_hook"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_default_explain_shows_the_rebuild_and_three_buckets_in_flight(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", TORCH_FP16], capsys)
    assert code == 0
    step1 = out[out.index("== step 1 (DDP iteration 1) =="):]
    assert "REBUILT after iteration 0" in step1
    assert "bucket 0: params [2]" in step1 and "bucket 2: params [0]" in step1
    # seed 0 lets all_reduce #0 complete while rank 1's backward() goes on (the gloo model's pick)
    assert ("all_reduce #0 on WORLD completed before rank 1's hook was called for bucket 2: as on a real cluster"
            in step1 and "the hook waits inside" not in step1)
    # the wire: fp16 halves the bytes against plain allreduce on the same buckets (W=2: ring sends n)
    assert "rank 0 sends 20 B this step; plain allreduce_hook on these buckets sends 40 B: compression ratio 2.00" in step1


BLOCKING_HOOK = """
import torch
import torch.distributed as dist


def blocking_hook(state, bucket):
    t = bucket.buffer()
    dist.all_reduce(t)  # synchronous: returns once the all_reduce completed
    fut = torch.futures.Future()
    fut.set_result(t / dist.get_world_size())
    return fut
"""


def test_a_hook_that_waits_inside_is_not_said_to_have_its_buckets_in_flight_together(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hook that waits for its collective before returning (a synchronous all_reduce, a
    ring of isend/irecv + wait(), found in the wild) completes bucket 0's collective before
    DDP can call it for bucket 1: explain said 'in flight together' all the same."""
    path = tmp_path / "blocking.py"
    path.write_text(BLOCKING_HOOK)
    code, out, _ = run(["explain", f"{path}:blocking_hook"], capsys)
    assert code == 0
    step1 = out[out.index("== step 1 (DDP iteration 1) =="):]
    step1 = step1[:step1.index("2. What each rank")]
    assert "they are in flight together" not in step1
    assert "one at a time" in step1 and "bucket 0's collective completed before" in step1
    # its futures are done when it returns them; the line saying they are complete comes later, where DDP's
    # own callback on them runs — the return says so (an audit of explain, 2026-12-06)
    assert "rank 0: hook returns its future, already complete, for bucket 0" in out
    code, out, _ = run(["explain", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook"], capsys)
    assert code == 0 and "rank 0: hook returns its future for bucket 0" in out and "already complete" not in out


def test_params_and_cap_choose_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", TORCH_FP16, "--params", "4x5,5,1000", "--bucket-cap-mb", "0.001",
                        "--steps", "1"], capsys)
    assert code == 0 and "bucket 0: params [0, 1, 2], float32[1025] (4100 B)" in out and "step 1" not in out


def test_the_rebuild_says_the_first_bucket_has_its_own_cap(capsys: pytest.CaptureFixture[str]) -> None:
    """DDP's default caps the first rebuilt bucket at 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES),
    the others at 25 MiB: explain said only 'closes once it reaches the cap' beside 'bucket cap
    DDP's default', while a 1.2 MB first bucket closed early (an audit, 2026-12-06)."""
    code, out, _ = run(["explain", TORCH_FP16, "--params", "4,4", "--steps", "2"], capsys)
    assert code == 0
    assert ("a bucket closes once it reaches the cap: 1048576 B for the first bucket (DDP's "
            "dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB, when bucket_cap_mb is left at its default), 26214400 B for "
            "the others") in out
    code, out, _ = run(["explain", TORCH_FP16, "--params", "4,4", "--steps", "2", "--bucket-cap-mb", "1"], capsys)
    assert code == 0 and "a bucket closes once it reaches the cap, 1048576 B" in out


def test_under_the_nccl_model_the_reading_notes_say_where_real_nccl_differs(capsys: pytest.CaptureFixture[str]) -> None:
    """A learner reading an NCCL-model story was not told that real NCCL completes a future at
    enqueue (callbacks inline, grad mode off) and does not block the host on async_op=False."""
    code, out, _ = run(["explain", TORCH_FP16, "--backend", "nccl", "--steps", "1"], capsys)
    assert code == 0 and "Real NCCL on CUDA differs in timing (not modelled)" in out
    code, out, _ = run(["explain", TORCH_FP16, "--steps", "1"], capsys)
    assert code == 0 and "Real NCCL on CUDA" not in out


def test_parse_shapes() -> None:
    assert parse_shapes("4x5,5,1000") == ((4, 5), (5,), (1000,))
    for bad in ("", "4x", "0", "4x-1", "a", "4,,5"):
        with pytest.raises(ValueError):
            parse_shapes(bad)


@pytest.mark.parametrize("argv", [["--params", "4xx"], ["--params", "3", "--numel", "3"], ["--steps", "0"],
                                  ["--network", "fast"], ["--timeline", "x.png"], ["--chrome-trace", "x.txt"],
                                  ["--world-size", "1025"], ["--steps", "101"], ["--seed", "-1"],
                                  ["--numel", "100000000000"]])  # was: a 400 GB allocation's traceback
def test_bad_explain_options_are_one_line_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["explain", TORCH_FP16, *argv], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and out == ""
    if argv[0] in ("--world-size", "--steps", "--seed"):  # the supported ranges of simcluster.limits, as check's
        assert "must be an integer from" in err


def explain_failing(tmp_path: Path, capsys: pytest.CaptureFixture[str], world: int, body: str) -> tuple[str, str]:
    """``simcluster explain`` on a hook ``h`` with ``body`` (a file in ``tmp_path``) that must fail:
    (the whole output, its trace section up to the failure)."""
    (tmp_path / "hook.py").write_text("import torch.distributed as dist\ndef h(state, bucket):\n" + body)
    code, out, _ = run(["explain", f"{tmp_path}/hook.py:h", "--world-size", str(world)], capsys)
    assert code == 1
    return out, out[out.index("(the trace, up to the failure):"):out.index("4. The hook failed at step 0:")]


def test_a_failure_names_the_hooks_own_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Where the error arose, as user code: here the hook's collective call (gloo fails BAND
    on floats at wait(); the error reaches DDP through the hook's future), not torch's
    ``raise_error`` in the future module."""
    out, trace = explain_failing(tmp_path, capsys, 2,
                                 "    return dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.BAND, async_op=True)"
                                 ".get_future()\n")
    assert "all_reduce #0 on WORLD FAILS on every rank: Cannot use ReduceOp.BAND with non-integral dtype" in trace
    where = out[out.index("where (innermost last):"):out.index("again:")].strip().splitlines()
    assert "hook.py:3 in h: return dist.all_reduce(" in where[-1]
    assert "raise_error" not in out


def test_a_future_a_raising_callback_completed_is_told_as_holding_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch marks a then() future complete when its callback raised, holding the error, and
    DDP's wait re-raises it. The trace said 'the future the hook returned … is complete; DDP
    reads it' — as if it held a result (hooks from the wild, round 13)."""
    out, trace = explain_failing(tmp_path, capsys, 2,
                                 "    def boom(fut):\n"
                                 "        raise ValueError('boom')\n"
                                 "    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(boom)\n")
    for rank in (0, 1):
        assert (f"rank {rank}: the future the hook returned for bucket 0 completed WITH AN ERROR (then(h.<locals>.boom) "
                f"of all_reduce#0 on WORLD); DDP's wait at the end of backward() raises it") in trace, trace
    assert "is complete (" not in trace


@pytest.mark.parametrize("extra", [[], ["--range", "--world-sizes", "2"]])
def test_a_hook_using_what_is_not_modelled_gets_one_line_and_exit_3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    """As check says it: not the hook's failure (explain said 'The hook failed at step 0:
    UnsupportedError', exit 1 — hooks from the wild, round 14)."""
    hook = tmp_path / "monitored.py"
    hook.write_text("import torch.distributed as dist\n"
                    "from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook\n"
                    "def hook(state, bucket):\n"
                    "    dist.monitored_barrier()\n"
                    "    return allreduce_hook(state, bucket)\n")
    code = main(["explain", f"{hook}:hook", *extra])
    out, err = capsys.readouterr()
    assert code == 3, (out, err)
    assert err.strip().splitlines() == [
        f"simcluster: cannot explain {hook}:hook: not modelled by the simulator: SimProcessGroup does not support "
        f"monitored_barrier (rank 0, at {hook}:4 in hook: dist.monitored_barrier())"], err
    assert "The hook failed" not in out


def test_a_failing_hook_gets_the_trace_up_to_the_failure_and_the_whole_diagnostic(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, trace = explain_failing(tmp_path, capsys, 3,
                                 "    t = bucket.buffer()\n"
                                 "    if dist.get_rank() == 1:\n"
                                 "        return dist.broadcast(t, src=0, async_op=True).get_future().then(lambda f: f.value()[0])\n"
                                 "    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])\n")
    assert "rank 0: posts all_reduce #0" in trace and "rank 1: posts broadcast #0" in trace
    failure = out[out.index("4. The hook failed at step 0:"):]
    assert "CollectiveMismatchError" in failure
    # the per-rank calls sit on the diagnostic's later lines: they must not be cut away
    assert "rank 0: all_reduce(float32, (10,), SUM)" in failure and "rank 1: broadcast(float32, (10,), root=0)" in failure
    assert "replay: SimCluster(" in failure
    assert "rank 1, bucket 0: raised from inside the hook" in failure and "rank 0, bucket 0" not in failure


def test_a_failure_quoting_ids_is_told_the_same_every_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hook whose message quotes ``id(bucket)`` and a storage address (new every run: address
    randomisation) is told with them masked, as a report masks them: two runs print the same."""
    body = "    raise RuntimeError(f'bucket {id(bucket)} at {hex(bucket.buffer().data_ptr())} is unknown')\n"
    first, _ = explain_failing(tmp_path, capsys, 2, body)
    assert "RuntimeError: bucket <address> at 0x… is unknown" in first, first
    assert explain_failing(tmp_path, capsys, 2, body)[0] == first


def _waits_alone(state, bucket):  # type: ignore[no-untyped-def]
    t = bucket.buffer()
    if dist.get_rank() == 0:
        dist.all_reduce(t)  # rank 1 never posts: a deadlock
    fut = torch.futures.Future()
    fut.set_result(t)
    return fut


def test_a_where_list_names_the_ranks_code_not_the_script_that_recorded_it() -> None:
    """A script calling ``record`` (the tutorial's generator) saw its own lines in a deadlock's
    "where" list ('make_tutorial.py:103 in part_powersgd: gloo = record(…)'): the stack of the
    parked rank holds the caller's frames too. Frames outside the engine's task are not a rank's."""
    story = record(_waits_alone, world_size=2, steps=1)
    failed = story.failed
    assert failed is not None and isinstance(failed.error, DeadlockError)
    where = format_failure(failed.error)
    where = where[where.index("where (innermost last):") + 1:]
    assert len(where) == 1 and "in _waits_alone: dist.all_reduce(t)" in where[0], where


def _story(seed: int = 0):  # type: ignore[no-untyped-def]
    return record(fp16_compress_hook, world_size=2, seed=seed, steps=2)


def test_timeline_has_a_lane_per_rank_and_worker_and_one_mark_per_event() -> None:
    story = _story()
    svg = render_svg(story, NET)
    root = ET.fromstring(svg)  # well-formed XML
    texts = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    for lane in ("rank 0", "rank 1", "rank 0 · gloo-worker WORLD#0", "rank 1 · gloo-worker WORLD#1"):
        assert lane in texts
    marks = [e for e in root.iter() if (e.get("class") or "").startswith("ev ")]
    expected = {f"{s.step}:{i}" for s in story.steps for i in range(len(s.events))}
    assert sorted(e.get("data-event") for e in marks) == sorted(expected)  # exactly one mark per event
    kinds = {e.get("class") for e in marks}
    assert {"ev hook", "ev post", "ev completed", "ev callback"} <= kinds
    assert "REBUILT" in svg and "<script" not in svg and "href" not in svg


def test_timeline_is_byte_identical_for_identical_seeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [tmp_path / n for n in ("a.html", "b.html", "c.html")]
    for path, seed in zip(paths, ("3", "3", "4")):
        assert run(["explain", TORCH_FP16, "--seed", seed, "--timeline", str(path)], capsys)[0] == 0
    a, b, c = (p.read_bytes() for p in paths)
    assert a == b and a != c and a.startswith(b"<!DOCTYPE html>")


def test_a_blocked_wait_on_a_worker_is_drawn_on_that_workers_lane() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    from simcluster.checking.defaults import powersgd_state

    story = record(powerSGD_hook, world_size=2, state=powersgd_state, shapes=((4, 4), (4, 4)),
                   bucket_cap_mb=64 / 2**20, steps=3)
    assert story.failed is not None and type(story.failed.error).__name__ == "DeadlockError"
    root = ET.fromstring(render_svg(story, NET))
    lane_at = {}  # the lane a y coordinate falls in, from the drawn lane backgrounds and their names
    drawn = list(root)
    for i, e in enumerate(drawn):
        if e.get("class") == "lane":
            lane_at[float(e.get("y"))] = drawn[i + 1].text
    blocked = [e for e in root.iter() if e.get("class") == "ev blocked"]
    assert len(blocked) == 4  # two ranks, each with both gloo workers held by a waiting callback
    for e in blocked:
        top = max(y for y in lane_at if y <= float(e.get("y")))
        assert "gloo-worker" in lane_at[top], lane_at[top]


def test_chrome_trace_has_the_required_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json"
    assert run(["explain", TORCH_FP16, "--chrome-trace", str(path)], capsys)[0] == 0
    events = json.loads(path.read_text())["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid", "tid", "ts"} <= e.keys() and isinstance(e["ts"], int)
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] > 0 and "args" in e
        if e["ph"] in ("s", "f"):
            assert "id" in e
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(0, 0)].startswith("rank's code") and names[(0, 1)] == "gloo-worker WORLD#0"
    starts = sorted(e["id"] for e in events if e["ph"] == "s")
    assert starts and starts == sorted(e["id"] for e in events if e["ph"] == "f")  # every arrow lands
    posts = [e for e in events if e.get("cat") == "post"]
    assert len(posts) == 8 and all("modelled_us" in e["args"] for e in posts)  # 2 ranks x (1 + 3) buckets


def test_safe_range_of_torchs_fp16_hook_at_world_3_is_the_hand_derived_65488() -> None:
    # derivation in simcluster/teaching/safe_range.py and docs/tutorial.md: fp16(M) must round to <= 65472
    result = safe_range(fp16_compress_hook, 3)
    assert result.safe == 65488.0 and result.unsafe is not None and result.unsafe > 65488.0
    assert "not finite" in result.reason


def test_safe_range_of_plain_allreduce_is_the_whole_float32_range_at_world_2() -> None:
    # allreduce_hook divides first: M/2 + M/2 never overflows, up to the largest float32
    result = safe_range(allreduce_hook, 2, tolerance="fp32")
    assert result.unsafe is None and result.safe == 3.4028234663852886e38


def test_module_examples_run() -> None:
    import doctest

    import simcluster.teaching.explain
    import simcluster.teaching.story
    import simcluster.teaching.wire

    for module in (simcluster.teaching.explain, simcluster.teaching.story, simcluster.teaching.wire):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0


def test_range_on_the_command_line_for_the_legacy_hook(capsys: pytest.CaptureFixture[str]) -> None:
    # hooks/legacy.py's 1.8-era hook sums in fp16 before dividing. At W=8 any M that rounds to
    # fp16 8192 (fp16's spacing is 4 below 8192; 8190 is the tie and goes to the even 8192) sums to
    # 8·8192 = 65536 → inf, while fp16(M) = 8188 sums to at most 65504. So the largest safe float32
    # is the one just below 8190.
    code, out, _ = run(["explain", "simcluster.hooks.legacy:fp16_compress_hook", "--api", "legacy", "--range",
                        "--world-sizes", "8"], capsys)
    below_8190 = 8189.99951171875
    assert code == 0 and f"world 8: safe up to M = {below_8190:.9g}; at 8190 (the next float32): " in out
    assert "got inf" in out


def test_what_the_hook_prints_is_shown_with_its_step(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Prints land in their step's section, in order, not scattered above the explanation,
    each line with the rank whose code printed it — the hook's and its callback's, which
    runs after the other rank's hook (the lines had no rank: an audit of explain)."""
    (tmp_path / "hook.py").write_text(
        "import sys\n"
        "import torch.distributed as dist\n"
        "def h(state, bucket):\n"
        "    print(f'hello from {dist.get_rank()}')\n"
        "    t = bucket.buffer().div_(dist.get_world_size())\n"
        "    def done(f):\n"
        "        sys.stderr.write(f'done on {dist.get_rank()}\\n')\n"
        "        return f.value()[0]\n"
        "    return dist.all_reduce(t, async_op=True).get_future().then(done)\n")
    code = main(["explain", f"{tmp_path}/hook.py:h", "--steps", "2", "--params", "3"])
    out, err = capfd.readouterr()
    assert code == 0 and err == ""
    assert out.startswith("simcluster explain:")
    for step in (0, 1):
        section = out[out.index(f"What the hook printed during step {step}"):]
        lines = section.splitlines()[1:5]
        assert lines[:2] == ["   rank 0: hello from 0", "   rank 1: hello from 1"], section
        assert sorted(lines[2:]) == ["   rank 0: done on 0", "   rank 1: done on 1"], section


def test_explain_runs_a_legacy_hook(capsys: pytest.CaptureFixture[str]) -> None:
    """`explain --api legacy` on any 1.7-1.9 hook (found with a DGC hook from the wild) said
    the hook failed at step 0 with `GradBucket.index() exists only in torch >= 1.10`: the
    recorder itself asked the legacy bucket for index(). The hook never calls it."""
    code, out, _ = run(["explain", "simcluster.hooks.legacy:allreduce_hook", "--api", "legacy", "--steps", "2"],
                       capsys)
    assert "index() exists only" not in out
    assert code == 0, out
    assert "rank 1: calls the hook on bucket 0" in out and "The hook failed" not in out


def test_the_trace_says_what_a_hook_returned_when_it_is_not_a_future(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # an optimizer-in-the-hook that returns nothing (hooks from the wild): the trace used to say
    # "hook returns its future", then the failure said it returned None
    out, trace = explain_failing(tmp_path, capsys, 2, "    return None\n")
    assert "rank 0: hook returns None, not a future, for bucket 0" in trace
    assert "returns its future" not in trace
    assert "returned None" in out[out.index("4. The hook failed at step 0:"):]


def test_the_trace_says_a_hook_returned_its_future(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook"]) == 0
    assert "rank 0: hook returns its future for bucket 0" in capsys.readouterr().out


def test_the_trace_says_a_rank_read_memory_a_collective_still_had_in_flight(capsys: pytest.CaptureFixture[str]) -> None:
    """A learner sees the read that races gloo's worker, where it is; waiting first, none."""
    main(["explain", "tests/report_hooks.py:scale_read_in_flight_hook", "--world-size", "2"])
    out = capsys.readouterr().out
    assert re.search(r"rank 0: READS memory all_reduce #0 on WORLD still has in flight \(Tensor.item at "
                     r"tests/report_hooks.py:\d+ in _scaled_mean: step = scale.item\(\) / 100", out), out
    assert "a race on a real cluster" in out
    main(["explain", "tests/report_hooks.py:scale_read_after_wait_hook", "--world-size", "2"])
    assert "READS memory" not in capsys.readouterr().out


# -- what the explanation says about real DDP, checked against what the hook itself observes --------

OBSERVING_HOOK = """
import torch
import torch.distributed as dist

_kept = {}


def observing_hook(state, bucket):
    rank, index = dist.get_rank(), bucket.index()
    buf = bucket.buffer()
    before = _kept.get((rank, index))
    same = before is not None and before.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    _kept[(rank, index)] = buf
    grads_match = all(p.grad is not None and torch.equal(p.grad.reshape(-1), g.reshape(-1))
                      for p, g in zip(bucket.parameters(), bucket.gradients()))
    if rank == 0 and index == 0:
        print(f"HOOK grad_enabled={torch.is_grad_enabled()} same_buffer_as_last_step={same} p.grad_is_local={grads_match}")

    def done(fut):
        if rank == 0 and index == 0:
            print(f"CALLBACK grad_enabled={torch.is_grad_enabled()}")
        return fut.value()[0] / dist.get_world_size()

    return dist.all_reduce(buf, async_op=True).get_future().then(done)
"""


def _observed(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    path = tmp_path / "observing.py"
    path.write_text(OBSERVING_HOOK)
    code, out, _ = run(["explain", f"{path}:observing_hook", *extra], capsys)
    assert code == 0, out
    return out


def _step(out: str, k: int) -> str:
    start = out.index(f"== step {k} (DDP iteration {k}) ==")
    end = out.find("== step", start + 1)
    return out[start:end if end >= 0 else len(out)]


def test_the_explanation_says_where_callbacks_run_and_in_which_grad_mode_as_the_hook_observes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The trace said 'callback … runs gloo-worker WORLD#0' and nothing of grad mode; a
    learner could not tell the callback from the hook. What it says now must match what the
    hook and its callback print about their own grad mode (hook off, gloo callback on)."""
    out = _observed(tmp_path, capsys, "--steps", "1")
    assert "HOOK grad_enabled=False" in out and "CALLBACK grad_enabled=True" in out
    callbacks = [line for line in out.splitlines() if ": callback observing_hook.<locals>.done of" in line]
    assert callbacks and all("gloo worker thread" in line and "grad mode on" in line for line in callbacks)
    assert "grad mode is OFF" in out and "inside loss.backward()" in out


def test_the_reducer_is_not_said_to_read_results_on_a_gloo_worker(capsys: pytest.CaptureFixture[str]) -> None:
    """Real DDP's reducer waits for every bucket's future at the end of backward(), on the
    rank's thread; the trace said 'DDP's reducer takes the result of … (gloo-worker WORLD#0)'.
    Each future the hook returned is now named by its bucket."""
    code, out, _ = run(["explain", TORCH_FP16], capsys)
    assert code == 0
    trace = [line.strip() for line in _step(out, 1).splitlines()]
    assert not [line for line in trace if "DDP" in line and "gloo" in line]
    assert "collect.<locals>.store" not in out
    for rank in (0, 1):
        for bucket in (0, 1, 2):
            assert any(line.startswith(f"rank {rank}: the future the hook returned for bucket {bucket} is complete")
                       and "end of backward()" in line for line in trace), (rank, bucket)


def test_the_reading_notes_state_the_measured_facts_a_learner_needs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", TORCH_FP16, "--steps", "1"], capsys)
    assert code == 0
    notes = out[:out.index("== step 0")]
    assert "in flight: a collective posted" in notes
    assert "is None" in notes and "not ready yet" in notes                   # p.grad before its gradient is ready
    assert "same p.grad tensors the hook saw" in notes                       # the copy-back writes into p.grad
    assert "2 gloo worker threads" in notes and "not on the rank's own thread" in notes
    assert "runs inline in the hook" in notes and "not modelled" in notes    # the race the model leaves out
    assert "rank 0's" in notes and "broadcasts" in notes
    code, out, _ = run(["explain", TORCH_FP16, "--steps", "1", "--backend", "nccl"], capsys)
    notes = out[:out.index("== step 0")]
    assert "gloo worker" not in notes and "NCCL model" in notes


def test_the_rebuild_is_explained_and_later_steps_say_the_buffers_are_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One parameter: the rebuild keeps the layout but replaces the buffer (measured); explain
    said nothing at step 1 then, and never said that later steps reuse the buffers. What it
    says must match what the hook sees of its own bucket.buffer()."""
    out = _observed(tmp_path, capsys, "--numel", "5", "--steps", "3")
    step1, step2 = _step(out, 1), _step(out, 2)
    assert "same_buffer_as_last_step=False" in step1 and "same_buffer_as_last_step=True" in step2
    assert "REBUILT after iteration 0" in step1 and "new buffer" in step1 and "why:" in step1
    assert "same buffers" in step2 and "REBUILT" not in step2
    assert "p.grad_is_local=True" in step1 and "p.grad of each of them holds the same local gradient" in out


def test_the_timeline_marks_the_rebuild_and_names_no_simcluster_internals(tmp_path: Path) -> None:
    story = record(allreduce_hook, world_size=2, steps=2, shapes=((5,),), bucket_cap_mb=None)
    svg = render_svg(story, NET)
    assert "REBUILT" in svg and "collect.&lt;locals&gt;.store" not in svg and "future is complete" in svg


def test_a_wait_on_a_worker_says_it_holds_the_worker_and_a_pick_says_who_picked(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The clipping hook's callbacks wait on a later bucket and starve gloo's 2 workers of the
    group (the deadlock report: 'behind 2 busy backend worker threads'). The trace said
    'blocks in wait() on … (gloo-worker WORLD#1)' and '(picked 1 of 2 ready)' without saying
    that the wait holds the worker, or who picks."""
    code, out, _ = run(["explain", "simcluster.hooks.buggy:clip_waits_for_last_bucket",
                        "--state", "simcluster.hooks.buggy:ClipState"], capsys)
    assert code == 1 and "busy backend worker threads" in out
    trace = _step(out, 1)
    waits = [line for line in trace.splitlines() if "blocks in wait()" in line]
    assert waits and all("gloo worker thread" in w and "holds" in w for w in waits)
    picks = [line for line in trace.splitlines() if "completes on ranks" in line]
    assert picks and all("seeded scheduler picked it among" in p and "a rank's backward() going on" in p
                         for p in picks)


def test_replicas_that_differ_by_design_are_not_only_called_drift(capsys: pytest.CaptureFixture[str]) -> None:
    """post_localSGD_hook averages inside subgroups from its start iteration on: replicas
    differ by design, and local SGD re-syncs them with a model averager. Explain said only
    'the model copies would drift apart', which reads as a bug to a learner."""
    code, out, _ = run(["explain", "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook:post_localSGD_hook",
                        "--state", "simcluster.checking.defaults:post_localsgd_state", "--world-size", "4",
                        "--steps", "3"], capsys)
    assert code == 0
    step2 = _step(out, 2)
    assert "on group" in step2 and "replicas agree bitwise: NO" in step2      # subgroup averaging from iteration 2
    assert "model averager" in step2 and "broadcasts parameters only in its constructor" in step2
    assert "replicas agree bitwise: NO" not in _step(out, 1)
    # fewer bytes on the wire because each all_reduce spans 2 ranks of 4, not because of compression
    wire = step2[step2.index("4. The collectives"):step2.index("5. What each future")]
    assert "float32[" in wire and "float16" not in wire and "not compression" in wire
    assert "not compression" not in _step(out, 1)


def test_a_legacy_explanation_names_the_legacy_buckets_tensor(capsys: pytest.CaptureFixture[str]) -> None:
    """With --api legacy the bucket has no buffer() (the simulated legacy bucket raises on it,
    as 1.7-1.9's had none); explain's section title said 'bucket.buffer()' all the same."""
    code, out, _ = run(["explain", "simcluster.hooks.legacy:allreduce_hook", "--api", "legacy", "--steps", "1"], capsys)
    assert code == 0
    title = next(line for line in out.splitlines() if line.startswith("2. What each rank's hook receives"))
    assert "buffer()" not in title and "get_tensors()" in title
    assert "--api legacy: the bucket is torch 1.7-1.9's" in out
    code, out, _ = run(["explain", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook",
                        "--api", "legacy", "--steps", "1"], capsys)
    assert code == 1 and "GradBucket.buffer() exists only in torch >= 1.10" in out   # what the title would claim


# -- each simulated rank its own copy of the hook's module, as check gives it -------------------

RANK_STATE_HOOKS = Path(__file__).parent / "rank_state_hooks"
RESIDUAL = f"{RANK_STATE_HOOKS}/residual_dict.py:hook"  # counts calls per bucket in a module dict
CHECK = dict(world_sizes=(2,), examples=3, backends=("gloo",), database=None)


def test_explain_gives_each_rank_its_own_module_as_check_does(capsys: pytest.CaptureFixture[str]) -> None:
    """``residual_dict`` counts, in a module-level dict, how often its process reduced each
    bucket: correct when every process has its own dict, a collective mismatch when the ranks
    share one (rank 1 sees rank 0's call and switches to float64). check passes it; explain
    said it failed (one module for every rank) until each rank got its copy."""
    from simcluster.checking.check import check_hook
    from simcluster.usercode.rank_local import RankLocal

    assert check_hook(RESIDUAL, **CHECK).passed
    code, out, _ = run(["explain", RESIDUAL], capsys)
    assert code == 0 and "The hook failed" not in out
    step1 = out[out.index("== step 1"):]
    # the second call on bucket 0 in each process: float64 on both ranks, as on real processes
    assert "rank 0: posts all_reduce #0 on WORLD (float64[3]" in step1
    assert "rank 1: posts all_reduce #0 on WORLD (float64[3]" in step1
    # a function object shares its module under both (a private copy: the counts stay in this test)
    shared = check_hook(RankLocal(RESIDUAL).fresh(), **CHECK)
    assert [f.property for f in shared.failures] == ["liveness"]
    assert "CollectiveMismatchError" in shared.failures[0].message
    text, ran = explain(RankLocal(RESIDUAL).fresh(), world_size=2)
    assert not ran and "CollectiveMismatchError" in text[text.index("4. The hook failed at step 0:"):]
    text, ran = explain(RESIDUAL, world_size=2)  # a spec: per rank, as the command line
    assert ran and text.count("(float64[3]") == out.count("(float64[3]")


def test_explain_isolate_copies_the_named_modules_as_check_isolate_does(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``rspkg.hooks`` keeps its call counter in ``rspkg.helpers``: shared by the ranks unless
    ``--isolate rspkg.helpers`` — check and explain agree both ways."""
    from simcluster.checking.check import check_hook

    monkeypatch.syspath_prepend(str(RANK_STATE_HOOKS))
    options = dict(CHECK, world_sizes=(4,))
    shared = check_hook("rspkg.hooks:hook", **options)
    assert [f.property for f in shared.failures] == ["liveness"] and "CollectiveMismatchError" in shared.failures[0].message
    code, out, _ = run(["explain", "rspkg.hooks:hook", "--world-size", "4"], capsys)
    assert code == 1 and "CollectiveMismatchError" in out[out.index("4. The hook failed at step 0:"):]

    assert check_hook("rspkg.hooks:hook", isolate="rspkg.helpers", **options).passed
    code, out, _ = run(["explain", "rspkg.hooks:hook", "--world-size", "4", "--isolate", "rspkg.helpers"], capsys)
    assert code == 0 and "The hook failed" not in out
    assert out.splitlines()[-1].endswith("--isolate rspkg.helpers")  # the again: line repeats it


@pytest.mark.parametrize("value", ["torch.nn", "not a module", "mypkg..x"])
def test_explain_isolate_refuses_what_check_isolate_refuses_in_the_same_words(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    check_code, _, check_err = run(["check", TORCH_FP16, "--isolate", value, "--quiet"], capsys)
    code, out, err = run(["explain", TORCH_FP16, "--isolate", value], capsys)
    assert code == check_code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err == check_err and f"--isolate {value!r}" in err


COLLECT_ALL_HOOK = """
import torch
import torch.distributed as dist


def collecting_hook(state, bucket):
    buf = bucket.buffer()
    a = dist.all_reduce(buf, async_op=True).get_future()
    b = dist.all_reduce(torch.ones(1), async_op=True).get_future()

    def average(fut):
        total, count = fut.value()[0].value()[0], fut.value()[1].value()[0]
        return total / count

    return torch.futures.collect_all([a, b]).then(average)
"""


def test_the_trace_names_only_the_hooks_own_callbacks_around_collect_all(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # ColossalAI's fp8 hook (hooks from the wild, 2026-12-04) chains then() on collect_all:
    # the trace listed 'callback collect_all.<locals>.one_done of all_to_all_single#0 …', a
    # function of simcluster's (torch's collect_all counts its inputs in C++).
    path = tmp_path / "collecting.py"
    path.write_text(COLLECT_ALL_HOOK)
    code, out, _ = run(["explain", f"{path}:collecting_hook", "--steps", "1"], capsys)
    assert code == 0, out
    trace = out[out.index("3. What happened"):out.index("4. The collectives")]
    assert "one_done" not in trace and "collect_all.<locals>" not in trace
    assert "rank 0: callback collecting_hook.<locals>.average of collect_all of 2 futures runs" in trace


_SYNC_AND_WAITED = '''
import torch
import torch.distributed as dist


def hook(process_group, bucket):
    scale = bucket.buffer().abs().max()
    dist.all_reduce(scale, op=dist.ReduceOp.MAX)  # synchronous: no wait() written here
    work = dist.all_reduce(bucket.buffer().div_(2), async_op=True)
    work.wait()  # the hook's own wait()
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
'''


def test_a_synchronous_collective_is_told_as_the_call_not_as_a_wait_the_hook_never_wrote(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GQSGD's dithering hook (hooks from the wild, round 7) calls
    ``dist.all_reduce(maximum, op=MAX)`` without ``async_op``; explain said 'blocks in wait()
    on work of all_reduce#0 on WORLD (its callbacks)' — a wait() and callbacks the hook never
    wrote. A wait() the hook does write is still told as one."""
    path = tmp_path / "sync_hook.py"
    path.write_text(_SYNC_AND_WAITED)
    code, out, _ = run(["explain", f"{path}:hook", "--world-size", "2", "--steps", "1", "--params", "3"], capsys)
    assert code == 0
    blocks = [line for line in _step(out, 0).splitlines() if "blocks in" in line]
    synchronous = [line for line in blocks if "all_reduce#0" in line]
    waited = [line for line in blocks if "all_reduce#1" in line]
    assert len(synchronous) == 2 and len(waited) == 2
    assert all("blocks in the synchronous all_reduce#0 on WORLD (async_op=False" in line and "wait()" not in line
               and "its callbacks" not in line for line in synchronous)
    assert all("blocks in wait() on work of all_reduce#1 on WORLD" in line for line in waited)


_REDUCES_P_GRAD = '''
import torch
import torch.distributed as dist


def hook(state, bucket):
    for p in bucket.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
'''


def test_explain_says_p_grad_is_not_a_view_of_the_buffer_when_a_hook_reduces_p_grad(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Modulus SFNO's reduction_comm_hook (hooks from the wild, round 7) all_reduces the p.grad of
    bucket.parameters() and returns bucket.buffer(): without gradient_as_bucket_view every rank
    keeps its own gradient (real DDP too, e2e bitwise). Explain said only that p.grad 'holds the
    same local gradient' — not that it is a tensor of its own, which is why the reduction is lost."""
    path = tmp_path / "p_grad_hook.py"
    path.write_text(_REDUCES_P_GRAD)
    code, out, _ = run(["explain", f"{path}:hook", "--world-size", "2", "--steps", "1", "--params", "3"], capsys)
    assert code == 0 and "replicas agree bitwise: NO" in out
    assert "p.grad of each of them holds the same local gradient, in a tensor of its own" in out
    assert "not a view of the buffer, so a collective on p.grad leaves the buffer local" in out


def _skips_on_rank_1(state: object, bucket: object) -> object:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        done = torch.futures.Future()
        done.set_result(bucket.buffer())  # type: ignore[attr-defined]
        return done
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()  # type: ignore[attr-defined]


def test_explain_names_the_line_that_posted_an_unmatched_call() -> None:
    """A story is told once, so explain records where each collective was posted: its
    deadlock names the line of the all_reduce rank 1 never matched, and what rank 1 returned."""
    import inspect
    import os

    here = os.path.relpath(__file__) if not os.path.relpath(__file__).startswith("..") else __file__
    source, start = inspect.getsourcelines(_skips_on_rank_1)
    posted = start + next(i for i, line in enumerate(source) if "return dist.all_reduce(" in line)
    made = start + next(i for i, line in enumerate(source) if "torch.futures.Future()" in line)
    text, ran = explain(_skips_on_rank_1, world_size=2, shapes=((4,),), bucket_cap_mb=None, steps=1)
    assert not ran
    assert f"rank 0, in DDP iteration 0, bucket 0's hook call, posted it at {here}:{posted} in _skips_on_rank_1" in text
    assert (f"rank 1: DDP's reducer (iteration 0, bucket 0) waits on nothing: the hook returned torch.futures.Future() "
            f"#0 made by rank 1 at {here}:{made}, which has completed") in text


def test_a_large_bucket_is_shown_by_its_ends_and_count(capsys: pytest.CaptureFixture[str]) -> None:
    """One 400,000-element parameter: explain printed every value of every rank's bucket and
    of the mean — ~11 MB for one step (an audit of explain). A bucket of more than 64
    elements is shown by its first 8 and last 4 values and its count; a small one whole."""
    code, out, _ = run(["explain", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook",
                        "--params", "1000x400", "--steps", "1"], capsys)
    assert code == 0 and len(out) < 20_000, len(out)
    line = next(l for l in out.splitlines() if l.startswith("   rank 0, bucket 0: "))
    values = line.removeprefix("   rank 0, bucket 0: ")
    assert values.endswith("] (400,000 values)") and values.count(", ") == 12 and ", …, " in values  # 8, …, 4
    code, out, _ = run(["explain", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook",
                        "--params", "8x8", "--steps", "1"], capsys)
    values = next(l for l in out.splitlines() if l.startswith("   rank 0, bucket 0: ")).split(": ", 1)[1]
    assert code == 0 and "…" not in values and values.count(", ") == 63


def test_powersgd_explained_before_it_compresses_says_how_to_see_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The project's PowerSGD state compresses from iteration 2; `explain` runs 2 steps by
    default, so a learner saw two plain all_reduce steps and no compression, without a word
    (an audit of explain). Now a note names start_powerSGD_iter and the --steps that reach it;
    with those steps, the compressed iteration is there and the note is not."""
    target = ["explain", "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook:powerSGD_hook",
              "--state", "simcluster.checking.defaults:powersgd_state"]
    code, out, _ = run(target, capsys)
    assert code == 0
    assert ("note: the state's start_powerSGD_iter is 2: PowerSGD all-reduces the bucket uncompressed before DDP "
            "iteration 2, and these steps ended at iteration 1 — run with --steps 3 to see it compress") in out
    # with 3 steps iteration 2 compresses — and on the gloo model, with 3 buckets in flight, its callbacks'
    # waits hold both worker threads: the deadlock real gloo has too (docs/gloo-facts.md); NCCL's model runs it
    code, out, _ = run([*target, "--steps", "3"], capsys)
    assert code == 1 and "start_powerSGD_iter" not in out and "4. The hook failed at step 2:" in out
    code, out, _ = run([*target, "--steps", "3", "--backend", "nccl"], capsys)
    assert code == 0 and "start_powerSGD_iter" not in out and "== step 2 (DDP iteration 2) ==" in out


def test_the_trace_shows_ddp_reading_a_bucket_before_the_collective_it_did_not_wait_for(
        capsys: pytest.CaptureFixture[str]) -> None:
    """explain said every rank's future held the mean and the replicas agreed, for a hook that
    returns a future of its bucket without waiting for its all_reduce (round 22 of hooks from
    the wild). The trace now shows DDP reading the bucket before the all_reduce completes,
    and the step fails as the race it is."""
    code, out, _ = run(["explain", "tests/report_hooks.py:forgets_its_all_reduce"], capsys)
    assert code == 1, out
    trace = _step(out, 0).splitlines()
    read = next(i for i, line in enumerate(trace) if "rank 0: the future the hook returned for bucket 0 is complete" in line)
    completes = next(i for i, line in enumerate(trace) if "all_reduce #0 on WORLD completes" in line)
    assert read < completes, "\n".join(trace)
    assert "InFlightReadError" in out
