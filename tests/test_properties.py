"""Every oracle catches a real bug (a hook of hooks/buggy.py run on SimDDP) and passes the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from simcluster.hooks import buggy, reference
from simcluster.checking import properties as P
from simcluster.fake.cluster import SimCluster
from simcluster.ddp.model import DDPConfig, SimDDP, StepResult
from simcluster.errors import CollectiveMismatchError, DeadlockError


def run(hook: Any, steps: Sequence[list[list[torch.Tensor]]], *, state: Any = None, schedule: Any = "in_order",
        cap_bytes: int | None = None, backend: str = "gloo", seed: int = 0) -> list[StepResult]:
    world = len(steps[0])
    shapes = [tuple(g.shape) for g in steps[0][0]]
    cfg = DDPConfig(bucket_cap_mb=None if cap_bytes is None else cap_bytes / 2**20)
    ddp = SimDDP(SimCluster(world, seed=seed, backend=backend, schedule=schedule), hook, shapes, state=state,
                 config=cfg)
    return ddp.run(steps)


def randn(world: int, *shapes: tuple[int, ...], seed: int = 0, scale: float = 1.0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * scale for s in shapes] for _ in range(world)]


# --------------------------------------------------------------------------- averages
def test_averages_catches_forgotten_division_and_passes_the_mean() -> None:
    grads = randn(3, (4,), (2, 3))
    bad = run(buggy.forgot_division, [grads])[0]
    good = run(reference.mean_allreduce_hook, [grads])[0]
    msg = P.averages(bad.grads, grads, "fp32")
    assert msg is not None and "rank 0" in msg and "bound" in msg
    assert P.averages(good.grads, grads, "fp32") is None


def test_averages_fp16_catches_overflow_of_divide_after_sum() -> None:
    grads = [[torch.full((3,), 65504.0)], [torch.full((3,), 40000.0)]]
    bad = run(buggy.fp16_divide_after_allreduce, [grads])[0]
    assert not bool(torch.isfinite(bad.grads[0][0]).all())
    msg = P.averages(bad.grads, grads, "fp16")
    assert msg is not None and "not finite" in msg
    good = run(reference.fp16_compress_hook, [grads])[0]
    assert P.averages(good.grads, grads, "fp16") is None


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_fp32_and_fp16_bounds_hold_for_correct_hooks_with_cancellation(world: int) -> None:
    """Mixed signs and magnitudes: the bound is relative to mean|x|, so correct hooks pass."""
    gen = torch.Generator().manual_seed(world)
    grads = [[(torch.randn(64, generator=gen) * 2.0 ** torch.randint(-12, 12, (64,), generator=gen))] for _ in
             range(world)]
    for hook, tol in ((reference.mean_allreduce_hook, "fp32"), (reference.fp16_compress_hook, "fp16"),
                      (reference.allgather_mean_hook, "fp32")):
        inputs = [[g[0].to(torch.float16).float()] for g in grads] if tol == "fp16" else grads
        out = run(hook, [inputs])[0]
        assert P.averages(out.grads, inputs, tol) is None, (hook.__name__, tol)


def test_bound_is_tight_enough_to_see_a_few_roundings_too_many() -> None:
    """An error of 3 units in the last place on a plain mean is beyond fp32's bound at W=2."""
    x = torch.tensor([1.0, 3.0, -7.0])
    inputs = [[x], [x]]
    off = [[x * (1 + 3 * 2.0**-23)]] * 2
    assert P.averages(off, inputs, "fp32") is not None
    assert P.averages(off, inputs, "fp16") is None  # but fine for fp16 arithmetic
    bound_w2 = P.error_bound("fp32", 2, torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64))
    bound_w8 = P.error_bound("fp32", 8, torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64))
    assert bound_w8 > bound_w2  # more additions, more rounding


def test_exact_and_explicit_tolerances() -> None:
    inputs = [[torch.tensor([3.0, -6.0])], [torch.tensor([9.0, 0.0])], [torch.tensor([0.0, 3.0])]]
    good = run(reference.mean_allreduce_hook, [inputs])[0]
    assert P.averages(good.grads, inputs, "exact") is None
    nudged = [[g[0] + torch.tensor([0.0, 2.0**-20])] for g in good.grads]
    assert P.averages(nudged, inputs, "exact") is not None
    assert P.averages(nudged, inputs, "rtol=0,atol=1e-5") is None
    assert P.averages(nudged, inputs, "rtol=1e-9,atol=0") is not None
    assert P.averages(nudged, inputs, "none") is None


def test_averages_uses_each_subgroups_own_mean() -> None:
    grads = [[torch.tensor([float(r)])] for r in range(4)]
    per_group = [[torch.tensor([0.5])], [torch.tensor([0.5])], [torch.tensor([2.5])], [torch.tensor([2.5])]]
    assert P.averages(per_group, grads, "exact", groups=[[0, 1], [2, 3]]) is None
    assert P.averages(per_group, grads, "exact") is not None


# --------------------------------------------------------------------------- replicas_agree
def test_replicas_agree_catches_rank_dependent_rounding() -> None:
    found = False
    for seed in range(5):
        grads = [[g[0] * 2.0 ** (8 * r)] for r, g in enumerate(randn(3, (32,), seed=seed))]
        out = run(buggy.allgather_own_first, [grads])[0]
        found = found or P.replicas_agree(out.grads) is not None
        assert P.replicas_agree(run(reference.allgather_mean_hook, [grads])[0].grads) is None
    assert found


def test_replicas_agree_catches_copy_in_the_wrong_direction() -> None:
    grads = randn(2, (5,))
    out = run(buggy.fp16_copy_wrong_direction, [grads])[0]
    msg = P.replicas_agree(out.grads)
    assert msg is not None and "rank 0 and rank 1" in msg


def test_bits_equal_sees_signed_zero() -> None:
    assert not P.bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert P.bits_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert P.replicas_agree([[torch.tensor([0.0])], [torch.tensor([-0.0])]]) is not None


# --------------------------------------------------------------------------- contract
def test_registration_rules() -> None:
    assert P.registration_problem(reference.mean_allreduce_hook) is None
    msg = P.registration_problem(buggy.misnamed_bucket_param)
    assert msg is not None and "KeyError" in msg
    msg = P.registration_problem(buggy.string_annotations)
    assert msg is not None and "annotat" in msg
    assert P.registration_problem(buggy.string_annotations, api="legacy") is None


def test_result_contract_on_real_hook_outputs() -> None:
    grads = randn(2, (6,))
    offset = run(buggy.returns_offset_view, [grads])[0]
    msg = P.result_problem(offset.outputs[0][0], 6)
    assert msg is not None and "storage offset" in msg
    strided = run(buggy.returns_strided_view, [grads])[0]
    assert P.result_problem(strided.outputs[0][0], 6) is not None
    good = run(reference.mean_allreduce_hook, [grads])[0]
    assert P.result_problem(good.outputs[0][0], 6) is None


def test_result_contract_list_is_legacy_only() -> None:
    t = torch.zeros(4)
    assert "pre-1.10" in (P.result_problem([t], 4) or "")
    assert P.result_problem([t], 4, api="legacy") is None
    assert P.result_problem(t, 4, api="legacy") is not None
    assert P.result_problem(torch.zeros(3), 4) is not None  # too short
    assert P.result_problem(torch.tensor(1.0), 3) is not None  # 0-d for a bucket of 3: setStorage out of bounds
    # measured on real DDP (docs/ddp-facts.md): the storage counts, not the view — a 0-d result
    # for a one-element bucket and a short view of a long storage are applied as they are
    assert P.result_problem(torch.tensor(1.0), 1) is None
    assert P.result_problem(torch.arange(6.0)[:2], 3) is None
    assert P.result_problem(None, 4) is not None
    assert P.result_problem(torch.zeros(5, dtype=torch.float16), 4) is None  # longer, other dtype: accepted


# --------------------------------------------------------------------------- liveness
def test_liveness_catches_a_collective_only_rank_0_issues() -> None:
    with pytest.raises((CollectiveMismatchError, DeadlockError)) as info:
        run(buggy.rank0_logs_global_norm, [randn(2, (4,))])
    assert P.liveness(info.value) is not None
    assert P.liveness(None) is None and P.liveness(ValueError("hook's own")) is None


def test_liveness_catches_skipping_the_allreduce_on_a_zero_rank() -> None:
    grads = [[torch.zeros(3)], [torch.ones(3)]]
    with pytest.raises(Exception) as info:
        run(buggy.skip_allreduce_if_zero, [grads])
    assert P.liveness(info.value) is not None


# --------------------------------------------------------------------------- schedule independence
def test_schedule_independence_catches_noise_drawn_in_completion_order() -> None:
    grads = randn(2, (4,), (4,))
    steps = [grads, grads]  # step 1 has two buckets (cap 16 B) in flight
    in_order = run(buggy.dp_noise_shared_generator, steps, state=buggy.NoiseState, cap_bytes=16)
    # step 0 in order; at step 1 rank 1's backward() goes on to bucket 1 (choice 0: bucket 0's
    # all_reduce was ready when it paused, round 24 of hooks from the wild), then choice 1 with
    # two ready: bucket 1's all_reduce completes first (the choices of step 0 counted, not
    # assumed: each pick of the copy-back's moment is one, since round 22)
    step_0 = [0] * len(in_order[0].schedule)
    swapped = run(buggy.dp_noise_shared_generator, steps, state=buggy.NoiseState, cap_bytes=16,
                  schedule=step_0 + [0, 1, 1, 1, 1])
    msg = P.schedule_independence([r.grads for r in swapped], [r.grads for r in in_order])
    assert msg is not None and "step 1" in msg
    ok_a = run(reference.mean_allreduce_hook, steps, cap_bytes=16)
    ok_b = run(reference.mean_allreduce_hook, steps, cap_bytes=16, schedule=step_0 + [0, 1, 1, 1, 1])
    assert P.schedule_independence([r.grads for r in ok_a], [r.grads for r in ok_b]) is None


# --------------------------------------------------------------------------- error feedback
def _ef(hook: Any, state: Any) -> str | None:
    grads = randn(2, (8,), (3,), seed=3)
    steps = [grads] * 3 + [[[torch.zeros_like(g) for g in rank] for rank in grads]] * 4
    results = run(hook, steps, state=state)
    return P.error_feedback([r.grads[0] for r in results], steps, drain_from=3)


def test_error_feedback_catches_a_residual_that_is_never_added() -> None:
    msg = _ef(buggy.topk_forgets_inplace_add, buggy.IndexedResidualState)
    assert msg is not None and "zero gradients" in msg
    assert _ef(reference.topk_hook, reference.TopKState) is None


def test_error_feedback_tells_a_hook_that_keeps_sending_from_one_that_holds_back() -> None:
    """An EF21-style estimator (hooks from the wild, round 14) sends its estimate of the
    gradient every step: exact while the gradients come, then the stale estimate through the
    zero steps — the lag is 0 when they begin and grows. It was reported as 'what the hook
    held back is never sent', the opposite of what happened."""
    ones = [torch.ones(4)]
    zero = [torch.zeros(4)]
    inputs = [[ones, ones]] * 3 + [[zero, zero]] * 4
    resends = [ones] * 3 + [[torch.full((4,), 0.5)]] * 4  # the estimate, halving only once
    msg = P.error_feedback(resends, inputs, drain_from=3)
    assert msg is not None and msg.startswith(P.NOT_DRAINED)
    assert "2 away from the accumulated mean, 0 when they began" in msg and "kept sending after" in msg
    assert "held back is never sent" not in msg
    holds = [[torch.full((4,), 0.5)]] * 3 + [zero] * 4  # sends half, then nothing: held back, never sent
    msg = P.error_feedback(holds, inputs, drain_from=3)
    assert msg is not None and "held back is never sent" in msg and "kept sending" not in msg


def test_error_feedback_catches_a_growing_lag() -> None:
    ones = [torch.ones(4)]
    means = [[ones, ones]] * 5
    growing = [[torch.full((4,), 1.0 + 10.0 * t)] for t in range(5)]  # lag grows by 10 per step
    msg = P.error_feedback(growing, means, drain_from=5, lag=4.0)
    assert msg is not None and "grows" in msg
    assert P.error_feedback([ones] * 5, means, drain_from=5, lag=4.0) is None


def test_averages_says_when_a_failure_is_within_a_half_precision_tolerance() -> None:
    """A hook compressing to float16 checked at fp32: the report names the tolerance its
    format needs; a result off by more than float16 rounding gets no such hint."""
    inputs = [[torch.tensor([0.9401059746742249, 3.0])], [torch.tensor([0.5, -1.25])]]
    mean = (inputs[0][0].double() + inputs[1][0].double()) / 2
    as_fp16 = [[mean.half().float()], [mean.half().float()]]
    summed = [[mean.float() * 2], [mean.float() * 2]]
    assert "within --tolerance fp16" in (P.averages(as_fp16, inputs, "fp32") or "")
    # a mean of 1 + 2^-8: bfloat16 rounds it to 1.0, further off than float16's bound allows
    coarse = [[torch.tensor([1.0])], [torch.tensor([1.0078125])]]
    as_bf16 = [[torch.tensor([1.00390625]).bfloat16().float()]] * 2
    assert "within --tolerance bf16" in (P.averages(as_bf16, coarse, "fp32") or "")
    failure = P.averages(summed, inputs, "fp32")
    assert failure is not None and "within --tolerance" not in failure
    assert P.averages(as_fp16, inputs, "fp16") is None


def test_averages_says_when_a_non_finite_result_is_a_sum_that_overflowed() -> None:
    """Found with a hook from the wild using ``ReduceOp.AVG`` on gloo (which sums, then
    divides — measured, docs/collectives.md): at float32's largest value on both ranks the
    report said only 'got inf … is not finite'. It now says the ranks' sum there exceeds
    float32's range, the cause; an inf whose sum does not overflow gets no such hint."""
    big = torch.finfo(torch.float32).max
    inputs = [[torch.tensor([big, 1.0])], [torch.tensor([big, 1.0])]]
    inf = [[torch.tensor([float("inf"), 1.0])], [torch.tensor([float("inf"), 1.0])]]
    failure = P.averages(inf, inputs, "fp32")
    assert failure is not None and "is not finite" in failure
    assert "sum there" in failure and "exceeds float32's largest value" in failure and "divide first" in failure
    small = [[torch.tensor([1.0, 1.0])], [torch.tensor([1.0, 1.0])]]
    wrong = [[torch.tensor([float("inf"), 1.0])], [torch.tensor([float("inf"), 1.0])]]
    other = P.averages(wrong, small, "fp32")
    assert other is not None and "exceeds" not in other


# --------------------------------------------------------------------------- overflow: the cause named from the dtypes
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_overflow_threshold_is_where_torch_s_cast_starts_giving_inf(dtype: torch.dtype) -> None:
    """Measured with torch's own casts: the threshold casts to inf, the float32 (for
    float32: float64) just below it to the dtype's largest value."""
    limit = P.overflow_threshold(dtype)
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    at = torch.tensor(limit, dtype=wide)
    assert float(at) == limit  # representable in the wider type
    below = torch.nextafter(at, torch.zeros_like(at))
    assert torch.isinf(at.to(dtype)) and float(below.to(dtype)) == torch.finfo(dtype).max


def test_the_bfloat16_and_float16_thresholds_are_the_documented_values() -> None:
    assert f"{P.overflow_threshold(torch.bfloat16):.9g}" == "3.39617753e+38"
    assert P.overflow_threshold(torch.float16) == 65520.0
    # and the W = 3 share: 65504 / 3 rounds up to 21840 in float16, three of them to inf
    share = torch.tensor(65504.0 / 3).half()
    assert float(share) == 21840.0 and torch.isinf(share + share + share)
    fifth = torch.tensor(65504.0 / 5).half()  # and at W = 5 (the error_bound docstring says so)
    assert float(fifth) == 13104.0 and torch.isinf(fifth + fifth + fifth + fifth + fifth)
    assert "dividing first is not enough" in P.overflow_cause([65504.0] * 5, torch.float16)


def test_overflow_hint_is_derived_from_the_dtypes_the_collectives_carried() -> None:
    """Found reviewing the hint: it assumed the result's dtype was the one summed. float32
    gradients sent as bfloat16 overflow at the cast (3.397e38 on one rank, 0 on the other:
    the float32 sum, 3.397e38, is finite) — said so only when the trace says bfloat16 travelled."""
    x = 3.397e38
    inputs = [[torch.tensor([x])], [torch.tensor([0.0])]]
    inf = [[torch.tensor([float("inf")])]] * 2
    cast = P.averages(inf, inputs, "bf16", dtypes=("bfloat16",))
    assert cast is not None and "the cast to bfloat16 overflowed, not the sum" in cast
    assert "rank 0's gradient there" in cast and "sums before it divides" not in cast
    assert "divide by 2 first, then cast" in cast  # x / 2 fits bfloat16
    lazy = P.averages(inf, inputs, "bf16", dtypes=lambda: ["float32", "bfloat16"])  # the narrowest explains it
    assert lazy is not None and "the cast to bfloat16 overflowed" in lazy
    for carried in (("float32",), (), ("int32",)):  # nothing that travelled overflows here: no hint
        other = P.averages(inf, inputs, "bf16", dtypes=carried)
        assert other is not None and "is not finite" in other and "overflow" not in other and "\n(" not in other


def test_overflow_hint_says_when_dividing_first_is_not_enough() -> None:
    """float16 at W = 3: 65504 / 3 rounds to 21840 and 3 × 21840 = 65520 rounds to inf, so a
    hook that divides first overflows; the hint must not tell it to divide first. At W = 2
    the shares (32752) sum to 65504, finite: there only the sum-first order overflows."""
    three = [[torch.tensor([65504.0])]] * 3
    inf3 = [[torch.tensor([float("inf")])]] * 3
    hint = P.averages(inf3, three, "fp16", dtypes=["float16"])
    assert hint is not None and "dividing first is not enough" in hint
    assert "65504.0/3 rounds to 21840 in float16, and 3 × 21840 = 65520 rounds to inf" in hint
    assert "divide first, as torch's allreduce_hook does" not in hint
    two = [[torch.tensor([65504.0])]] * 2
    summed = P.averages([[torch.tensor([float("inf")])]] * 2, two, "fp16", dtypes=["float16"])
    assert summed is not None and "the ranks' sum there, 131008, exceeds float16's largest value 65504" in summed
    assert "a hook that sums before it divides gets inf" in summed and "dividing first is not enough" not in summed
    mixed = P.overflow_cause([65504.0, 65504.0, 65500.0], torch.float16)  # 65500/3 = 21833.3 rounds up too
    assert "the shares x/3 round in float16 to [21840, 21840, 21840], and their sum 65520 rounds to inf" in mixed
    assert P.overflow_cause([65504.0, 65504.0, 65472.0], torch.float16).startswith("the ranks' sum")  # shares: 65504
    # torch's fp16_compress_hook casts, then divides: 65488.0039 casts up to 65504 first, whose third rounds up
    # (explain --range named only the sum, and told a hook that divides first to divide first: an audit, 2026-12-06)
    edge = float(torch.tensor(65488.0039, dtype=torch.float32))
    cast_first = P.overflow_cause([edge] * 3, torch.float16)
    assert ("dividing first is not enough here — 65488.00390625 cast to float16 rounds to 65504, 65504/3 rounds to "
            "21840, and 3 × 21840 = 65520 rounds to inf") in cast_first, cast_first


def test_module_examples_run() -> None:
    import doctest

    result = doctest.testmod(P)
    assert result.attempted > 0 and result.failed == 0


def test_averages_says_when_every_result_is_the_sum_and_only_then() -> None:
    x = [[torch.tensor([0.1, -2.0])], [torch.tensor([0.2, 5.0])], [torch.tensor([0.4, 1.0])], [torch.tensor([0.3, 0.5])]]
    total = sum(r[0].double() for r in x)
    summed = [[total.float()]] * 4
    line = "(the result is the sum over ranks: the hook did not divide by the world size)"
    assert (P.averages(summed, x, "fp32") or "").endswith("\n" + line)
    # DDP on two groups: each group's sum
    pairs = [[x[0][0] + x[1][0]]] * 2 + [[x[2][0] + x[3][0]]] * 2
    grouped = P.averages(pairs, x, "fp32", groups=[[0, 1], [2, 3]])
    assert grouped is not None and "the sum over each group's ranks: the hook did not divide by the group's size (2)" in grouped
    assert "sum" not in (P.averages(pairs, x, "fp32") or "")  # judged as one group, the pairs are no sum
    halved = [[(total / 8).float()]] * 4  # divided twice: no sum
    assert "sum" not in (P.averages(halved, x, "fp32") or "x")
    one_rank_off = [[total.float()]] * 3 + [[(total / 4).float()]]
    assert "sum" not in (P.averages(one_rank_off, x, "fp32") or "x")
    # a sum through float16 matches only within a loose tolerance: confirm it exactly
    via_fp16 = [[sum(r[0].half() for r in x).float()]] * 4
    loose = P.averages(via_fp16, x, "rtol=0.01,atol=0")
    assert loose is not None and "the result is the sum over ranks" in loose
    assert "not exactly: re-run with --tolerance exact to confirm it" in loose
    ints = [[torch.tensor([3.0])], [torch.tensor([-1.0])]]
    exact = P.averages([[torch.tensor([2.0])]] * 2, ints, "rtol=0.01,atol=0")
    assert exact is not None and "sum over ranks" in exact and "re-run" not in exact  # the sum, bit for bit


def test_a_sum_that_overflowed_is_still_recognised_as_the_sum() -> None:
    big = torch.finfo(torch.float32).max
    inputs = [[torch.tensor([big, 1.0])], [torch.tensor([big, 2.0])]]
    inf_sum = [[torch.tensor([float("inf"), 3.0])]] * 2
    hint = P.averages(inf_sum, inputs, "fp32", dtypes=["float32"])
    assert hint is not None and hint.splitlines()[1] == (
        "(the result is the sum over ranks: the hook did not divide by the world size; where the sum is beyond "
        "float32's range, inf)")
    # summed in float16 (the trace says so): 65504 + 65504 is inf there, not in the float32 result
    fp16 = [[torch.tensor([65504.0, 1.0])], [torch.tensor([65504.0, 2.0])]]
    assert "beyond float16's range, inf" in (P.averages(inf_sum, fp16, "fp16", dtypes=["float16"]) or "")
    # -inf where the sum is +big is no sum
    assert "sum over ranks" not in (P.averages([[torch.tensor([-float("inf"), 3.0])]] * 2, inputs, "fp32") or "")


def test_averages_says_when_a_subgroup_got_the_worlds_mean_or_was_divided_by_its_size() -> None:
    """Round 11 (docs/hooks.md): a trainer's `rank_ordered_average` all-gathers on
    `group=None` — with DDP on subgroups its *averages* report showed `got -0.5` beside a
    group mean of 0.0 and said nothing of why: -0.5 is the mean over the whole world."""
    x = [[torch.tensor([0.0, 4.0])], [torch.tensor([-1.0, 2.0])], [torch.tensor([3.0, 1.0])], [torch.tensor([5.0, 1.0])]]
    world = sum(r[0].double() for r in x) / 4
    on_world = P.averages([[world.float()]] * 4, x, "fp32", groups=[[0, 1], [2, 3]])
    assert on_world is not None and "every rank's result is the mean over the whole world's 4 ranks, not over its " \
        "DDP group's 2" in on_world
    # the numbers, not the code: a gossip hook that never touched WORLD can give them too (round 17)
    assert "what a hook gives that reduces on the default group" in on_world and "the hook reduced" not in on_world
    # each group's sum divided by the world's size
    quarter = [[((x[0][0] + x[1][0]) / 4)]] * 2 + [[((x[2][0] + x[3][0]) / 4)]] * 2
    divided = P.averages(quarter, x, "fp32", groups=[[0, 1], [2, 3]])
    assert divided is not None and "its DDP group's sum divided by the world's size 4, not by the group's 2" in divided
    # not said when DDP ran on the whole world, nor for a result that is neither
    assert "whole world" not in (P.averages([[world.float() * 2]] * 4, x, "fp32") or "x")
    assert "whole world" not in (P.averages([[x[0][0] * 0]] * 4, x, "fp32", groups=[[0, 1], [2, 3]]) or "x")
    assert "world's size" not in (P.averages([[x[0][0] * 0]] * 4, x, "fp32", groups=[[0, 1], [2, 3]]) or "x")
