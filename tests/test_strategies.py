"""The strategies draw what they promise: value domains, edge cases, layouts, schedules."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings, strategies as st

from simcluster.checking.strategies import (
    Example,
    Layout,
    RankSpec,
    ScheduleChoices,
    StepSpec,
    examples,
    gradients,
    layouts,
    materialize_step,
    schedules,
    special_values,
    world_sizes,
)

FAST = settings(max_examples=40, derandomize=True, deadline=None, database=None)


@FAST
@given(st.data())
def test_fp16_domain_holds_only_finite_float16_values(data: st.DataObject) -> None:
    grads = data.draw(gradients([(5,), (3, 3)], 3, torch.float32, values=torch.float16))
    for rank in grads:
        for g in rank:
            assert g.dtype == torch.float32
            assert bool(torch.isfinite(g).all())
            assert torch.equal(g, g.to(torch.float16).to(torch.float32))  # representable in fp16
            assert float(g.abs().max()) <= 65504.0


@FAST
@given(st.data())
def test_bf16_and_native_dtypes_stay_finite_and_representable(data: st.DataObject) -> None:
    for dtype, values in ((torch.float32, torch.bfloat16), (torch.bfloat16, None), (torch.float16, None),
                          (torch.float64, None)):
        grads = data.draw(gradients([(4,)], 2, dtype, values=values))
        g = grads[0][0]
        assert g.dtype == dtype and bool(torch.isfinite(g).all())
        if values is not None:
            assert torch.equal(g, g.to(values).to(dtype))


@FAST
@given(st.data())
def test_exact_values_average_exactly_in_float32(data: st.DataObject) -> None:
    world = data.draw(world_sizes())
    grads = data.draw(gradients([(6,), (2, 2)], world, exact=True))
    for k in range(2):
        stack = torch.stack([grads[r][k].to(torch.float64) for r in range(world)])
        mean64 = stack.sum(0) / world
        assert torch.equal(mean64.to(torch.float32).to(torch.float64), mean64)  # mean representable
        # dividing first, then folding in float32 in any order, is exact too
        folded = sum((grads[r][k] / world for r in reversed(range(world))), torch.zeros_like(grads[0][k]))
        assert torch.equal(folded.to(torch.float64), mean64)


def test_edge_cases_are_reachable() -> None:
    """Each edge case the module docstring promises shows up in a modest number of draws."""
    seen: set[str] = set()
    fi = torch.finfo(torch.float16)

    @settings(max_examples=120, derandomize=True, deadline=None, database=None)
    @given(gradients([(8,)], 3, values=torch.float16))
    def probe(grads: list[list[torch.Tensor]]) -> None:
        flat = [g[0] for g in grads]
        if any(bool((t == 0).all()) for t in flat) and not all(bool((t == 0).all()) for t in flat):
            seen.add("zero rank")
        if all(bool((t.abs() == fi.max).any()) for t in flat):
            seen.add("max on every rank")
        if any(bool(((t != 0) & (t.abs() < fi.smallest_normal)).any()) for t in flat):
            seen.add("subnormal")
        if any(bool((t < 0).any()) for t in flat):
            seen.add("negative")
        mags = [float(t.abs().max()) for t in flat if bool((t != 0).any())]
        if len(mags) >= 2 and max(mags) / min(mags) > 2**20:
            seen.add("mixed magnitudes across ranks")

    probe()
    assert seen == {"zero rank", "max on every rank", "subnormal", "negative", "mixed magnitudes across ranks"}


def test_materialize_is_deterministic_and_shift_zero_repeats() -> None:
    spec = StepSpec((RankSpec("uniform", 3, 7), RankSpec("mixed", -2, 9, specials=((1, 65504.0),))))
    a = materialize_step(spec, [(3,), (2, 2)])
    b = materialize_step(spec, [(3,), (2, 2)])
    assert all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert float(a[1][0].reshape(-1)[1]) == 65504.0
    ex = Example(2, Layout(((3,), (2, 2)), None, (0, 1)), spec, shifts=(0, 5))
    steps = ex.grads()
    assert torch.equal(steps[1][0][0], steps[0][0][0])  # shift 0: the same gradients again
    assert not torch.equal(steps[2][0][0], steps[0][0][0])  # shift 5: new values, same kind


@FAST
@given(layouts())
def test_layouts_are_valid_for_ddp(layout: Layout) -> None:
    n = len(layout.shapes)
    assert sorted(layout.ready_order) == list(range(n))
    assert layout.cap_bytes is None or 16 <= layout.cap_bytes <= 512
    assert all(all(side >= 1 for side in s) and len(s) in (1, 2) for s in layout.shapes)


def test_layouts_reach_matrices_powersgd_compresses() -> None:
    found = []

    @settings(max_examples=60, derandomize=True, deadline=None, database=None)
    @given(layouts())
    def probe(layout: Layout) -> None:
        found.extend(s for s in layout.shapes if len(s) == 2 and (s[0] + s[1]) * 2 < s[0] * s[1])

    probe()
    assert found, "no 2-D shape large enough for rank-1 PowerSGD to compress"


def test_schedule_choices_spend_entries_only_on_real_choices() -> None:
    sched = ScheduleChoices((3, 1))
    picks = [sched.choose(n) for n in (1, 2, 1, 3, 4, 1)]
    assert picks == [0, 3 % 2, 0, 1, 0, 0]
    assert sched.taken == [(2, 1), (3, 1), (4, 0)]
    assert ScheduleChoices(()).choose(5) == 0  # empty = in order


def test_failing_schedule_shrinks_to_in_order() -> None:
    """A property that fails for every schedule shrinks to the empty (in-order) schedule."""
    from hypothesis import find

    assert find(schedules(), lambda s: True, settings=settings(database=None, derandomize=True)) == ()
    smallest = find(schedules(), lambda s: any(c % 2 for c in s), settings=settings(database=None, derandomize=True))
    assert smallest == (1,)


@FAST
@given(examples(world_size_choices=(2, 3), steps=2, subgroups=True))
def test_examples_are_consistent(ex: Example) -> None:
    assert ex.world_size in (2, 3) and ex.world_size % ex.subgroups == 0
    grads = ex.grads()
    assert len(grads) == 2 and len(grads[0]) == ex.world_size
    assert [tuple(g.shape) for g in grads[0][0]] == [tuple(s) for s in ex.layout.shapes]


def test_special_values_cover_the_extremes() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        fi = torch.finfo(dtype)
        vals = special_values(dtype)
        assert fi.max in vals and -fi.max in vals and 0.0 in vals
        sub = min(v for v in vals if v > 0)
        assert sub < fi.smallest_normal and torch.tensor(sub, dtype=dtype).item() == sub and math.isfinite(sub)
