"""The explicit non-finite examples and the *keeps_nonfinite* property.

No drawn gradient is non-finite, so until 2026-12-04 a hook that decides on a local overflow
check (skip the all_reduce when its own bucket holds an inf, as mixed-precision code does) or
that hides an overflow from ``torch.amp.GradScaler`` (``nan_to_num``, a clamp) passed every
check. The explicit non-finite examples put an ``inf`` (then a ``NaN``) at one element of one
rank's gradient; *liveness* and *keeps_nonfinite* judge them, *averages*, *replicas_agree* and
*error_feedback* raise no false alarm on them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from simcluster.checking import explicit
from simcluster.checking.check import check_hook
from simcluster.checking.explicit import NONFINITE, nonfinite_examples
from simcluster.checking.options import make_options
from simcluster.checking.properties import averages, keeps_nonfinite, replicas_agree
from simcluster.checking.replay import decode_example, encode_example
from simcluster.checking.report import CheckReport
from simcluster.usercode.rank_local import RankLocal

HOOKS = str(Path(__file__).with_name("nonfinite_hooks.py"))
WORLDS = (1, 2, 3, 4, 8)


def options(target: str, *, tolerance: str = "fp32", state: str = "none", properties: list[str] | None = None,
            seed: int = 0, params: object = None) -> object:
    return make_options(RankLocal(target), target=target, replay_target=target, state=state, isolate=(),
                        tolerance=tolerance, backends=("gloo", "nccl"), world_sizes=WORLDS, steps=3, examples=50,
                        seed=seed, api="current", properties=properties, params=params, subgroups=None,
                        deadline=60.0, rng="per_rank")


def replay_nonfinite(target: str, value: str, backend: str = "gloo", **kw: object) -> CheckReport:
    """The non-finite example holding ``value`` alone, as its replay token runs it."""
    tolerance = str(kw.get("tolerance", "fp32"))
    example = next(ex for ex in nonfinite_examples(options(target, tolerance=tolerance), WORLDS, 3)
                   if ex.base.ranks[-1].nonfinite[0][1] == value)
    return check_hook(target, replay=encode_example(example, backend), **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the examples
def test_the_examples_put_one_nonfinite_value_on_one_rank() -> None:
    """World 2 (the smallest of 2 or more), the last rank holds inf (then NaN) at one element
    of the 6 x 6 matrix, every other element finite, in every step; the same for every seed."""
    examples = nonfinite_examples(options(f"{HOOKS}:marks_overflow_hook"), WORLDS, 3)
    assert [ex.base.ranks[-1].nonfinite[0][1] for ex in examples] == list(NONFINITE) == ["inf", "nan"]
    assert examples == nonfinite_examples(options(f"{HOOKS}:marks_overflow_hook", seed=7), WORLDS, 3)
    for ex in examples:
        assert ex.world_size == 2 and ex.layout.shapes == ((6, 6), (4,))
        for step in ex.grads():
            flat = [torch.cat([p.reshape(-1) for p in rank]) for rank in step]
            assert bool(torch.isfinite(flat[0]).all())
            bad = (~torch.isfinite(flat[1])).nonzero().reshape(-1).tolist()
            assert bad == [1]
    assert nonfinite_examples(options(f"{HOOKS}:marks_overflow_hook"), (1,), 3)[0].world_size == 1
    assert nonfinite_examples(options(f"{HOOKS}:marks_overflow_hook", properties=["averages"]), WORLDS, 3) == []


def test_a_nonfinite_example_replays_from_its_token() -> None:
    """The token carries the non-finite values (as strings: a decoded NaN equals the original);
    tokens of examples without any stay as they were (no new key)."""
    for ex in nonfinite_examples(options(f"{HOOKS}:marks_overflow_hook"), WORLDS, 3):
        decoded, backend = decode_example(encode_example(ex, "nccl"))
        assert (decoded, backend) == (ex, "nccl")
        assert [torch.equal(a.isnan(), b.isnan()) for a, b in zip(decoded.grads()[0][1], ex.grads()[0][1])] == [True] * 2
    plain = explicit.race_example(options(f"{HOOKS}:marks_overflow_hook"), WORLDS, 3)
    assert plain is not None and b"nonfinite" not in __import__("zlib").decompress(
        __import__("base64").urlsafe_b64decode(encode_example(plain, "gloo")[4:] + "==="))


# --------------------------------------------------------------------------- liveness
def test_default_check_catches_a_hook_that_skips_on_a_local_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """hooks/buggy.py's skips_on_local_overflow: the rank holding the inf skips the all_reduce its
    peer posts — a deadlock, reported with rank, step, bucket and collective. Without the
    explicit non-finite examples the default check passes it."""
    target = "simcluster.hooks.buggy:skips_on_local_overflow"
    report = check_hook(target, backends=("gloo",), database=None)
    failed = [f for f in report.failures if f.property == "liveness"]
    assert len(failed) == 1, report.format()
    f = failed[0]
    assert f.world_size == 2 and f.error_type == "DeadlockError" and f.details["step"] == 0
    assert "rank 0: DDP's reducer (iteration 0, bucket 0)" in f.message
    assert "all_reduce(float32, (40,), SUM)" in f.message and "never posted by ranks [1]" in f.message
    assert "inf" in f.gradients
    again = check_hook(target, backends=("gloo",), replay=f.details["token"], database=None)
    assert [x.message for x in again.failures] == [f.message]
    monkeypatch.setattr(explicit, "nonfinite_examples", lambda *a: [])
    assert check_hook(target, backends=("gloo",), database=None, supervise=False).passed


def test_agreeing_on_the_overflow_first_is_live_and_marking_it_keeps_it() -> None:
    """The correct way to skip on overflow (every rank posts a MAX of its flag, then all skip
    and return inf) passes every property, both examples, both backends; agreeing and then
    zeroing the bucket is live, but hides the overflow on every rank."""
    assert check_hook(f"{HOOKS}:marks_overflow_hook", database=None).passed
    for value in NONFINITE:
        report = replay_nonfinite(f"{HOOKS}:zero_on_agreed_overflow_hook", value)
        assert [f.property for f in report.failures] == ["keeps_nonfinite"], report.format()
        assert "hidden from GradScaler on every rank" in report.failures[0].message


# --------------------------------------------------------------------------- keeps_nonfinite
def test_default_check_catches_a_hook_that_hides_the_overflow() -> None:
    """hooks/buggy.py's hides_overflow (nan_to_num_ before the all_reduce) on both backends: the
    report names the step, bucket, the rank and element holding the inf, what every rank got
    there, and GradScaler."""
    report = check_hook("simcluster.hooks.buggy:hides_overflow", database=None)
    failed = [f for f in report.failures if f.property == "keeps_nonfinite"]
    assert sorted(f.backend for f in failed) == ["gloo", "nccl"], report.format()
    message = failed[0].message
    assert message.startswith("step 0, bucket 0 (params [0, 1]): rank 1's gradient holds inf at param 0, element 1")
    assert "all finite on ranks 0, 1" in message and "1.7014117" in message  # float32's max, halved
    assert "hidden from GradScaler on every rank" in message
    # the advice covers a hook with no nan_to_num too, whose inf never reached the result (an audit of reports:
    # allgather_assumes_gloo_list on NCCL keeps rank 0's gradient only)
    assert "or, if the hook has none, rank 1's gradient may never reach the result at all" in message
    assert [f.property for f in report.failures] == ["keeps_nonfinite"] * 2  # no averages/replicas alarm


def test_a_hook_that_hides_it_on_one_rank_is_named() -> None:
    """rank 0 alone sanitises its result: replicas differ (replicas_agree) and, judged alone,
    keeps_nonfinite names rank 0 as hiding it and rank 1 as the one that skips the step."""
    report = replay_nonfinite(f"{HOOKS}:rank0_sanitises_hook", "inf")
    assert [f.property for f in report.failures] == ["replicas_agree"], report.format()
    alone = replay_nonfinite(f"{HOOKS}:rank0_sanitises_hook", "inf", properties=["keeps_nonfinite"])
    message = alone.failures[0].message
    assert "all finite on rank 0 " in message and "hidden from GradScaler on rank 0" in message
    assert "rank 1 (whose result keeps it) skips the step: the replicas diverge" in message


@pytest.mark.parametrize("hook,hidden", [("clamp_after_allreduce_hook", "inf"), ("zero_nans_hook", "nan")])
def test_each_value_has_its_example(hook: str, hidden: str) -> None:
    """A clamp after the all_reduce hides an inf but a NaN passes through it; zeroing NaNs hides a
    NaN but not an inf: each is caught by one example only — and by the default check."""
    for value in NONFINITE:
        report = replay_nonfinite(f"{HOOKS}:{hook}", value)
        assert [f.property for f in report.failures] == (["keeps_nonfinite"] if value == hidden else []), \
            report.format()
    assert "keeps_nonfinite" in {f.property for f in check_hook(f"{HOOKS}:{hook}", database=None).failures}


# --------------------------------------------------------------------------- no false alarms
@pytest.mark.parametrize("target,state,tolerance,backend", [
    ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook", "none", "fp32", "gloo"),
    ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks:fp16_compress_hook", "none", "fp16", "gloo"),
    ("torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks:quantization_pertensor_hook", "group",
     "scale=0.003923,atol=5.961e-08", "nccl"),
    ("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook:powerSGD_hook",
     "simcluster.checking.defaults:powersgd_state", "none", "gloo"),
    ("simcluster.hooks.reference:topk_hook", "simcluster.hooks.reference:TopKState", "none", "gloo"),
])
def test_hooks_that_let_it_through_pass_both_examples(target: str, state: str, tolerance: str, backend: str) -> None:
    """torch's hooks keep the overflow visible — the quantizer and PowerSGD (which compresses the
    6 x 6 matrix from step 2) as NaNs over the bucket — and averages, replicas_agree and
    error_feedback (checked for PowerSGD and top-k) raise no alarm on a step without a finite mean."""
    for value in NONFINITE:
        report = replay_nonfinite(target, value, backend, state=state, tolerance=tolerance)
        assert report.passed, report.format()


def test_averages_skips_a_group_whose_inputs_are_not_finite() -> None:
    """The oracle alone: a group holding an inf is not judged (its mean is not finite); the other
    group of the same step is, and still fails when it is wrong."""
    inputs = [[torch.tensor([1.0, math.inf])], [torch.tensor([3.0, 2.0])],
              [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 4.0])]]
    nan_results = [[torch.tensor([math.nan, math.nan])]] * 2
    good = nan_results + [[torch.tensor([2.0, 3.0])]] * 2
    assert averages(good, inputs, "fp32", groups=[[0, 1], [2, 3]]) is None
    assert averages(good, inputs, "scale=0.01", groups=[[0, 1], [2, 3]]) is None
    bad = nan_results + [[torch.tensor([4.0, 6.0])]] * 2
    assert "rank 2, param 0" in str(averages(bad, inputs, "fp32", groups=[[0, 1], [2, 3]]))
    assert averages(nan_results, inputs[2:], "fp32") is not None  # finite inputs: a NaN result fails


def test_replicas_agree_compares_nan_payloads_only_where_the_inputs_are_finite() -> None:
    """NaNs with different payloads differ bit for bit; at a step whose inputs hold an overflow
    they count as equal (GradScaler skips on every rank that sees one), finite values do not."""
    a = torch.tensor([1.0, math.nan])
    b = a.clone()
    b.view(torch.int32)[1] += 1  # another NaN payload
    inputs = [[torch.tensor([0.0, math.inf])], [torch.tensor([0.0, 1.0])]]
    assert bool(b[1].isnan())
    assert replicas_agree([[a], [b]]) is not None
    assert replicas_agree([[a], [b]], inputs=inputs) is None
    assert replicas_agree([[a], [torch.tensor([2.0, math.nan])]], inputs=inputs) is not None
    assert replicas_agree([[a], [b]], inputs=[[torch.ones(2)], [torch.ones(2)]]) is not None


def test_keeps_nonfinite_oracle() -> None:
    """Kept anywhere in the bucket, as inf or NaN: holds; hidden in the bucket that held it: fails,
    naming the bucket; another bucket's finite result is not asked to carry it."""
    inputs = [[torch.tensor([1.0, 2.0]), torch.tensor([5.0])], [torch.tensor([3.0, math.inf]), torch.tensor([6.0])]]
    spread = [[torch.tensor([math.nan, math.nan]), torch.tensor([5.5])]] * 2
    assert keeps_nonfinite(spread, inputs) is None
    assert keeps_nonfinite(spread, inputs, buckets=[[0], [1]]) is None
    moved = [[torch.tensor([2.0, 3.0]), torch.tensor([math.inf])]] * 2
    assert keeps_nonfinite(moved, inputs) is None  # one bucket of both params: still visible
    message = keeps_nonfinite(moved, inputs, buckets=[[1], [0]])
    assert message is not None and message.startswith("bucket 1 (params [0]): rank 1's gradient holds inf")
    assert keeps_nonfinite(moved, [[torch.ones(2), torch.ones(1)]] * 2) is None  # nothing to keep


def test_averages_still_judges_finite_float64_inputs_whose_magnitudes_overflow_their_mean() -> None:
    """The skip looks at the mean of |x| first (cheap): float64 inputs near float64's max make it
    inf without any input being so; such a group is still judged (a wrong result fails)."""
    top = torch.finfo(torch.float64).max
    inputs = [[torch.tensor([top, 1.0], dtype=torch.float64)]] * 2
    wrong = [[torch.tensor([top, 2.0], dtype=torch.float64)]] * 2
    assert "element 1" in str(averages(wrong, inputs, "fp32"))
