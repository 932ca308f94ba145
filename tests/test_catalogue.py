"""The harness's mutation score, as tests: every catalogued bug is caught by its oracle,
every correct hook passes.

For each entry of :mod:`simcluster.hooks.catalogue`:

* a **buggy** entry is checked with its ``expected_failure`` property *alone* — so a bug
  that another property reaches first (a callback that raises on a size mismatch is
  charged to *liveness*/*contract* before *averages* sees the wrong values) is still
  asked of the oracle meant for it — and that property must fail on **each** backend the
  entry lists;
* a **correct** entry (reference hooks, and legacy hooks that are correct under their
  era's contract) is checked with every property that applies, and all must hold.

Budget: few examples, small world sizes, fixed seed, no example database; one test per
entry so ``pytest -n auto`` spreads them.  ``benchmarks/mutation_score.py`` runs the same
catalogue at the CLI's defaults (50 examples, world sizes 1-8) and prints the table.
"""

from __future__ import annotations

import pytest
import torch

from simcluster.hooks import buggy, reference
from simcluster.hooks.catalogue import BUGGY, LEGACY, REFERENCE, CatalogueEntry, by_name
from simcluster.checking.check import check_hook, encode_example
from simcluster.checking.report import CheckReport
from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec

EXAMPLES = 12
SEED = 0

def world_sizes(entry: CatalogueEntry) -> tuple[int, ...]:
    """Small world sizes the entry can show its behaviour at (3 keeps fp16's W = 3 overflow case)."""
    if "subgroup" in entry.needs or entry.state == "group":
        return (4,)
    low = max(entry.min_world_size, 1 if not entry.is_buggy else 2)
    return tuple(sorted({low, 3})) if low <= 3 else (low,)


def check(entry: CatalogueEntry, **overrides: object) -> CheckReport:
    options: dict[str, object] = dict(
        target=entry.name, state=entry.state, tolerance=entry.tolerance, backends=entry.backends,
        world_sizes=world_sizes(entry), examples=EXAMPLES, seed=SEED, api=entry.api, database=None,
    )
    if entry.is_buggy:
        options["properties"] = [entry.expected_failure]
    options.update(overrides)
    return check_hook(entry.hook, **options)  # type: ignore[arg-type]


CORRECT = [e for e in REFERENCE + LEGACY if not e.is_buggy]
BUGS = [e for e in BUGGY + LEGACY if e.is_buggy]


@pytest.mark.parametrize("entry", BUGS, ids=lambda e: e.name)
def test_oracle_catches_the_bug_on_a_triggering_example(entry: CatalogueEntry) -> None:
    """Fast and deterministic: the input the bug needs (``entry.needs``) is given, the
    expected property alone must fail on each listed backend."""
    for backend in entry.backends:
        report = check(entry, replay=encode_example(trigger(entry), backend))
        props = {f.property for f in report.failures}
        assert entry.expected_failure in props, f"{entry.name} [{backend}]:\n{report.format()}"


@pytest.mark.slow
@pytest.mark.parametrize("entry", BUGS, ids=lambda e: e.name)
def test_search_finds_the_bug(entry: CatalogueEntry) -> None:
    """The generator's side: Hypothesis, not us, must find an input that shows the bug —
    at the CLI's defaults (50 examples, world sizes 1, 2, 3, 4, 8 from the entry's
    minimum), as ``benchmarks/mutation_score.py`` measures it: every property first, then
    the expected one alone.  (The property set changes what is drawn — a stateful lossy
    hook checked for error feedback gets float16-range values — so the two runs differ:
    ``clip_waits_for_last_bucket`` is found by the first, not by liveness alone.)  With 12 examples at world
    sizes 2-3, ``allgather_own_first``, ``skip_allreduce_if_zero`` and
    ``dp_noise_shared_generator`` were not found at seed 0 (measured)."""
    sizes = tuple(w for w in (1, 2, 3, 4, 8) if w >= entry.min_world_size)
    report = check(entry, examples=50, world_sizes=sizes, properties=None)  # as the benchmark: default first
    caught = {f.backend for f in report.failures if f.property == entry.expected_failure}
    if any(b not in caught and "any" not in caught for b in entry.backends):
        report = check(entry, examples=50, world_sizes=sizes)  # then the expected property alone
    caught = {f.backend for f in report.failures if f.property == entry.expected_failure}
    missed = [b for b in entry.backends if b not in caught and "any" not in caught]
    assert not missed, (f"{entry.name}: {entry.expected_failure} did not fail on {missed} "
                        f"({report.examples} examples):\n{report.format()}")


@pytest.mark.parametrize("entry", CORRECT, ids=lambda e: e.name)
def test_correct_hook_passes_every_property(entry: CatalogueEntry) -> None:
    report = check(entry)
    assert report.passed, report.format()
    assert report.examples >= EXAMPLES * len(entry.backends)


@pytest.mark.parametrize("entry", CORRECT, ids=lambda e: e.name)
def test_correct_hook_passes_on_the_triggering_examples(entry: CatalogueEntry) -> None:
    """The inputs that expose the bugs (large values, a zero rank, 3 buckets, …) do not
    trip a correct hook: the fast tier's examples do not fail correct code."""
    for needs in (("large_values",), ("zero_rank",), ("world>=3",), ("repeated_grads",), ("nonfinite_rank",)):
        probe = CatalogueEntry(entry.name, entry.hook, entry.state, entry.tolerance, entry.api,
                               needs=needs, min_world_size=entry.min_world_size)
        report = check(entry, replay=encode_example(trigger(probe), "gloo"))
        assert report.passed, f"{needs}:\n{report.format()}"


def test_score_counts_cover_the_catalogue() -> None:
    """Every entry is in exactly one of the two test lists, and both kinds exist."""
    names = [e.name for e in CORRECT] + [e.name for e in BUGS]
    assert sorted(names) == sorted(e.name for e in REFERENCE + BUGGY + LEGACY)
    assert len(CORRECT) >= 5 and len(BUGS) >= 20


def trigger(entry: CatalogueEntry) -> Example:
    """An example with what ``entry.needs``: 3 parameters of 8 elements and a 16-byte cap
    (3 buckets in flight after the rebuild, at steps 1 and 2), ranks with different
    values, a non-trivial completion schedule (the third option, wrapped: a paused rank goes
    on to its next bucket, then the newest of three ready collectives completes first), new
    values each step (``nonfinite_rank``: the last rank's element 3 is inf)."""
    values = {"fp16": "float16", "bf16": "bfloat16"}.get(entry.tolerance, "float32")
    if entry.tolerance == "none":
        values = "float16"  # the error-feedback domain
    world = max(entry.min_world_size, 3 if "world>=3" in entry.needs else 2)
    subgroups = 1
    if "subgroup" in entry.needs:
        world, subgroups = 4, 2
    top = torch.finfo(getattr(torch, values)).max
    ranks = tuple(RankSpec("const", value=top) if "large_values" in entry.needs
                  else RankSpec("uniform", exp=0, seed=r + 1, zero=("zero_rank" in entry.needs and r == 0),
                                nonfinite=((3, "inf"),) if "nonfinite_rank" in entry.needs and r == world - 1 else ())
                  for r in range(world))
    shifts = (0, 0) if "repeated_grads" in entry.needs else (7, 11)
    layout = Layout(((8,), (8,), (8,)), 16 / 2**20, (2, 1, 0))
    return Example(world, layout, StepSpec(ranks), shifts, (2,) * 16, "float32", values, False, subgroups)


def _explicit(world: int, shapes: tuple[tuple[int, ...], ...], value: float, values: str = "float32") -> Example:
    """A 3-step example: one rank spec for all ranks, cap 16 bytes (one bucket per parameter after the rebuild)."""
    base = StepSpec((RankSpec("const", value=value),) * world)
    layout = Layout(shapes, 16 / 2**20, tuple(range(len(shapes))))
    return Example(world, layout, base, (0, 0), (), "float32", values)


@pytest.mark.parametrize("name", ["buggy.scaled_fp16_blocking", "buggy.clip_waits_for_last_bucket"])
def test_blocking_bugs_deadlock_on_three_buckets(name: str) -> None:
    """Given three buckets in flight, the gloo model deadlocks both hooks: *liveness* fails
    with simcluster's DeadlockError at step 1 (the first step after the rebuild)."""
    entry = by_name(name)
    token = encode_example(_explicit(2, ((8,), (8,), (8,)), 1.0), "gloo")
    report = check(entry, replay=token)
    assert [(f.property, f.error_type) for f in report.failures] == [("liveness", "DeadlockError")]
    assert report.failures[0].details["step"] == 1


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("hook,dtype", [(reference.fp16_compress_hook, torch.float16),
                                        (reference.bf16_compress_hook, torch.bfloat16)])
def test_compressed_mean_of_the_largest_value_is_finite(hook: object, dtype: torch.dtype, world: int) -> None:
    """Every rank at ±max(dtype): the reference hooks' mean stays finite at every world size
    (65504 / 3 rounded to nearest is 21840, and 3 × 21840 rounds to inf in float16)."""
    top = torch.finfo(dtype).max
    tolerance = "fp16" if dtype == torch.float16 else "bf16"
    for value in (top, -top):
        token = encode_example(_explicit(world, ((4,),), value, str(dtype).split(".")[1]), "gloo")
        report = check_hook(hook, tolerance=tolerance, replay=token, properties=["averages", "replicas_agree"])
        assert report.passed, report.format()


def test_summand_bound_keeps_every_sum_finite() -> None:
    """B_W is the largest float16 share for which W of them, summed left to right, stay
    finite: B_W itself passes and the next float16 value up overflows at some W in 2..8."""
    overflowing_next = 0
    for world in range(1, 9):
        bound = torch.tensor(reference.summand_bound(torch.float16, world), dtype=torch.float16)
        up = torch.nextafter(bound, torch.tensor(float("inf"), dtype=torch.float16))
        for share, must_be_finite in ((bound, True), (up, None)):
            total = share.clone()
            for _ in range(world - 1):
                total = total + share
            if must_be_finite:
                assert torch.isfinite(total), (world, float(bound))
            elif not torch.isfinite(total):
                overflowing_next += 1
    assert overflowing_next >= 1  # the bound is not loose everywhere


def test_legacy_findings_are_the_eras_divide_after_sum() -> None:
    """The two legacy hooks kept as findings both fail *averages* only near the dtype's max:
    ordinary values pass (a check limited to moderate inputs has nothing to say)."""
    for name, value, values in (("legacy.allreduce_hook", 3.0e38, "float32"),
                                ("legacy.fp16_compress_hook", 40000.0, "float16")):
        entry = by_name(name)
        assert entry.expected_failure == "averages" and entry.bug_class == "legacy finding"
        bad = check(entry, replay=encode_example(_explicit(2, ((4,),), value, values), "gloo"))
        good = check(entry, replay=encode_example(_explicit(2, ((4,),), 1.5, values), "gloo"))
        assert [f.property for f in bad.failures] == ["averages"], bad.format()
        assert good.passed, good.format()


def test_buggy_module_is_not_the_reference() -> None:
    """Sanity: the catalogue points at the real functions (no accidental aliasing)."""
    assert by_name("buggy.forgot_division").hook is buggy.forgot_division
    assert by_name("reference.fp16_compress_hook").hook is reference.fp16_compress_hook
