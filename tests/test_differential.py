"""Differential checks: the simulator against real gloo, bit for bit.

Every hook below runs on the same per-rank gradients in ``SimCluster(backend="gloo",
schedule="in_order")`` and in real gloo processes; the outputs must agree bitwise. The
sizes straddle gloo's ring segmentation at world 3 (docs/collectives.md §1: 1 element, fewer
elements than segments, several segments per chunk, 70000 elements spread over
``2N`` segments), so a wrong reduction order in the model shows up as flipped bits.

Two module-scoped persistent worlds (2 and 3 ranks, forkserver) carry every gloo test,
so the file costs two world start-ups plus ~10-50 ms per comparison. The hooks defined
here are module-level because the gloo children import them by name.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from simcluster.hooks import catalogue
from simcluster.real import differential
from simcluster.real.differential import Raised, compare_outcomes, compare_with_gloo
from simcluster.errors import UsageError
from simcluster.real.gloo_runner import GlooCluster

SIZES = (1, 57, 1000, 70000)
_DEFAULT = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks:"


# ---------------------------------------------------------------- hooks (imported by the gloo children)


def sim_aware_hook(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A mean all-reduce that nudges element 3 up by one ulp — only inside the simulator.

    It tells the two worlds apart by the class of its default group (the simulated one wears
    torch's names, so it asks for simcluster's class), so it is exactly the kind of
    process-dependent hook a differential check must flag.
    """
    from simcluster.fake.process_group import SimProcessGroup

    group = dist.group.WORLD
    simulated = isinstance(group, SimProcessGroup)
    buffer = bucket.buffer()
    buffer.div_(group.size())

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = fut.value()[0]
        if simulated:
            k = min(3, out.numel() - 1)
            out[k] = torch.nextafter(out[k], torch.tensor(math.inf))
        return out

    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(finish)


def raising_hook(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Raises in the hook body, naming the rank (both worlds must agree on it)."""
    raise ValueError(f"refusing bucket {bucket.index()} on rank {dist.get_rank()}\nsecond line differs: {id(bucket)}")


def callback_raising_hook(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """The all-reduce completes, then its ``.then`` callback raises: the error surfaces at wait()."""

    def fail(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        raise KeyError(f"callback failed with {fut.value()[0].numel()} elements")

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(fail)


def powersgd_state(process_group: Any) -> powerSGD_hook.PowerSGDState:
    """Rank-1 PowerSGD with error feedback and warm start, compressing from iteration 2."""
    return powerSGD_hook.PowerSGDState(
        process_group=process_group, matrix_approximation_rank=1, start_powerSGD_iter=2,
        use_error_feedback=True, warm_start=True, random_seed=7,
    )


# ---------------------------------------------------------------- fixtures and data


@pytest.fixture(scope="module")
def world2() -> Iterator[GlooCluster]:
    with GlooCluster(2, timeout=60.0, start_method="forkserver") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def world3() -> Iterator[GlooCluster]:
    with GlooCluster(3, timeout=60.0, start_method="forkserver") as cluster:
        yield cluster


@pytest.fixture
def worlds(world2: GlooCluster, world3: GlooCluster) -> dict[int, GlooCluster]:
    return {2: world2, 3: world3}


def random_steps(world: int, n: int, steps: int = 3, seed: int = 0) -> list[list[torch.Tensor]]:
    """``steps`` x ``world`` float32 gradients of ``n`` elements with varied magnitudes."""
    g = torch.Generator().manual_seed(seed * 1000 + world * 100 + n)
    return [[torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)
             for _ in range(world)] for _ in range(steps)]


def assert_equal(report: Any) -> None:
    assert report.equal, report.summary()
    assert report.differences == []
    assert len(report.sim_outputs) == len(report.gloo_outputs) == report.steps


# ---------------------------------------------------------------- torch's hooks


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("hook", [_DEFAULT + "allreduce_hook", _DEFAULT + "fp16_compress_hook",
                                  "simcluster.checking.defaults:fp16_wrapped_allreduce_hook"])
def test_torch_default_hooks_agree_bitwise(hook: str, world: int, worlds: dict[int, GlooCluster]) -> None:
    for n in SIZES:
        grads = random_steps(world, n)
        report = compare_with_gloo(hook, grads, world_size=world, cluster=worlds[world])
        assert_equal(report)
        # An oracle independent of both engines: each output is close to the mean.
        for s, step in enumerate(grads):
            mean = torch.stack(step).double().mean(0)
            out = report.gloo_outputs[s][0][0].double()
            assert torch.allclose(out, mean, rtol=2e-3, atol=1e-3 * float(mean.abs().max()))


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_agrees_bitwise_through_compressed_steps(world: int, worlds: dict[int, GlooCluster]) -> None:
    shapes = [(16, 8), (8,), (4, 4)]  # matrices are compressed, the vector is all-reduced
    grads = random_steps(world, 16 * 8 + 8 + 16, steps=4)
    report = compare_with_gloo(powerSGD_hook.powerSGD_hook, grads, state=powersgd_state, world_size=world,
                               cluster=worlds[world], parameters_shapes=shapes)
    assert_equal(report)
    # Steps 0-1 are plain means; steps 2-3 are compressed (not the mean any more).
    for s, step in enumerate(grads):
        mean = torch.stack(step).mean(0)
        close = torch.allclose(report.gloo_outputs[s][0][0], mean, rtol=1e-5, atol=1e-5)
        assert close == (s < 2), f"step {s}"


# ---------------------------------------------------------------- reference hooks


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("entry", catalogue.REFERENCE, ids=lambda e: e.name)
def test_reference_hooks_agree_bitwise(entry: catalogue.CatalogueEntry, world: int,
                                       worlds: dict[int, GlooCluster]) -> None:
    for n in SIZES:
        report = compare_with_gloo(entry.hook, random_steps(world, n), state=entry.state, world_size=world,
                                   cluster=worlds[world])
        assert_equal(report)
        assert not any(isinstance(o, Raised) for step in report.gloo_outputs for rank in step for o in rank)


# ---------------------------------------------------------------- state factories

_STATES = Path(__file__).parent / "differential_states.py"


@pytest.mark.gloo
@pytest.mark.parametrize("hook,state", [
    (_DEFAULT + "allreduce_hook", f"{_STATES.parent}/../{_STATES.parent.name}/{_STATES.name}:group_state"),
    (default_hooks.allreduce_hook, "differential_states:group_state"),
], ids=["fresh-file-spec", "shared-module-spec"])
def test_a_state_factory_spec_is_loaded_once(hook: Any, state: str, world2: GlooCluster,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []
    loader = differential._state_loader

    def counting(fresh: bool) -> Any:
        load = loader(fresh)
        return lambda spec: (loads.append(spec), load(spec))[1]

    monkeypatch.setattr(differential, "_state_loader", counting)
    report = compare_with_gloo(hook, random_steps(2, 57, steps=2), state=state, world_size=2, cluster=world2)
    assert_equal(report)
    assert loads == [state]  # the simulation uses the load that named the factory for the gloo side


# ---------------------------------------------------------------- exceptions


@pytest.mark.gloo
@pytest.mark.parametrize("hook,kind", [(raising_hook, "ValueError"), (callback_raising_hook, "RuntimeError")])
def test_raising_hooks_agree_on_type_and_first_line(hook: Any, kind: str, world2: GlooCluster) -> None:
    report = compare_with_gloo(hook, random_steps(2, 5, steps=2), world_size=2, cluster=world2)
    assert_equal(report)
    outcomes = [o for step in report.gloo_outputs for rank in step for o in rank]
    assert all(isinstance(o, Raised) and o.type == kind for o in outcomes), outcomes
    assert "rank 1" in str(report.gloo_outputs[0][1][0]) or kind == "RuntimeError"
    assert "\n" not in outcomes[0].message  # only the first line is compared


# ---------------------------------------------------------------- the comparison can fail


@pytest.mark.gloo
def test_a_process_dependent_hook_is_reported_with_the_first_differing_element(world2: GlooCluster) -> None:
    grads = random_steps(2, 57, steps=2)
    report = compare_with_gloo(sim_aware_hook, grads, world_size=2, cluster=world2)
    assert not report.equal
    assert [(d.rank, d.step, d.bucket) for d in report.differences] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    real = report.gloo_outputs[0][0][0]
    nudged = torch.nextafter(real[3], torch.tensor(math.inf))
    bits = lambda x: f"0x{int(x.view(torch.int32)) & 0xFFFFFFFF:08x}"  # noqa: E731
    detail = report.differences[0].detail
    assert detail.startswith("element 3 of 57 (float32)"), detail
    assert f"sim {nudged.item()!r} ({bits(nudged)})" in detail
    assert f"gloo {real[3].item()!r} ({bits(real[3])})" in detail
    assert "difference" in report.summary()


def test_compare_outcomes_is_bitwise() -> None:
    assert compare_outcomes(torch.tensor([0.0]), torch.tensor([-0.0])) is not None
    nan = torch.tensor([float("nan")])
    assert compare_outcomes(nan, nan.clone()) is None
    assert compare_outcomes(torch.ones(2), torch.ones(2, dtype=torch.float64)) == "sim torch.float32[2] vs gloo torch.float64[2]"
    assert compare_outcomes([torch.ones(1)], [torch.zeros(1)]).startswith("item 0: element 0 of 1")
    assert compare_outcomes(Raised("ValueError", "a"), Raised("ValueError", "a")) is None
    assert "raised ValueError: b" in compare_outcomes(Raised("ValueError", "a"), Raised("ValueError", "b"))
    assert compare_outcomes(torch.ones(1), Raised("X", "y")) == "sim a tensor torch.float32[1] vs gloo raised X: y"


def test_hooks_must_be_importable_and_worlds_must_match() -> None:
    grads = [[torch.ones(2), torch.ones(2)]]
    with pytest.raises(UsageError, match="cannot be sent to gloo processes"):
        compare_with_gloo(lambda s, b: default_hooks.allreduce_hook(s, b), grads, world_size=2)
    with pytest.raises(UsageError, match="2 tensors"):
        compare_with_gloo(default_hooks.allreduce_hook, [[torch.ones(2)]], world_size=2)
    with pytest.raises(UsageError, match="world_size=2"):
        compare_with_gloo(default_hooks.allreduce_hook, grads, world_size=2, cluster=GlooCluster(3))


# ---------------------------------------------------------------- buggy and legacy hooks


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("entry", catalogue.BUGGY + catalogue.LEGACY, ids=lambda e: e.name)
def test_buggy_and_legacy_hooks_behave_alike(entry: catalogue.CatalogueEntry, world: int,
                                             worlds: dict[int, GlooCluster]) -> None:
    """Bugs included: offset and strided views keep their layout, [tensor] results, 0-d
    results, non-Futures, per-rank RNG noise — the simulator must reproduce each bit."""
    if entry.min_world_size > world:
        pytest.skip(f"needs world >= {entry.min_world_size}")
    if entry.name == "buggy.fire_and_forget_allreduce":  # its outcome on gloo is timing
        pytest.skip("races on real gloo (its future is read while the all_reduce may still write: 193-200 times in "
                    "200 before, docs/ddp-facts.md), so one real run is one draw; the DDP model reports the race")
    # rank0_logs_global_norm: at 57 elements gloo aborts rank 0 at once (size mismatch) and the
    # simulator names the mismatch; at 1 element gloo pairs the two 1-element all_reduces and
    # then hangs (timeout: too slow for this file).
    sizes = (57,) if entry.expected_failure == "liveness" else (1, 57, 1000)
    for n in sizes:
        report = compare_with_gloo(entry.hook, random_steps(world, n), state=entry.state, world_size=world,
                                   cluster=worlds[world], timeout=20.0)
        assert report.equal, report.summary()
        if entry.name == "buggy.rank0_logs_global_norm":
            assert report.gloo_outputs == [] and "CollectiveMismatchError" in report.notes[-1]


# ---------------------------------------------------------------- a measured divergence


def nan_payload_steps() -> list[list[torch.Tensor]]:
    """Rank 0 holds a float16 NaN with payload 5 (0x7e05) at element 0, rank 1 ones."""
    nan = torch.tensor([0x7E05], dtype=torch.int16).view(torch.float16)
    return [[torch.cat([nan, torch.ones(56, dtype=torch.float16)]), torch.ones(57, dtype=torch.float16)]]


@pytest.mark.gloo
@pytest.mark.parametrize("sign", [1, -1])
def test_float16_nan_payloads_are_canonicalised_as_gloo_does(world2: GlooCluster, sign: int) -> None:
    """Measured: gloo's float16 SUM returns every NaN as 0x7e00 / 0xfe00 (sign kept, payload
    dropped, sNaN quieted), at world 2, 3 and 4 and 57 or 5000 elements. This comparison first
    found the simulator keeping the payload (as torch's own float16 arithmetic does); the
    gloo model now drops it, and the two agree bit for bit."""
    steps = nan_payload_steps()
    if sign < 0:
        steps[0][0][0] = -steps[0][0][0]
    report = compare_with_gloo(default_hooks.allreduce_hook, steps, world_size=2, cluster=world2)
    assert report.equal, report.summary()
    out = report.sim_outputs[0][0][0]
    assert out.view(torch.int16)[0].item() & 0xFFFF == (0x7E00 if sign > 0 else 0xFE00)


def product_hook(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """The bucket's element-wise product over the ranks (gloo's ring, one reduction step a rank)."""
    fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.PRODUCT, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


@pytest.mark.gloo
@pytest.mark.parametrize("sign", [1, -1])
def test_float16_product_drops_nan_payloads_as_gloo_does(world2: GlooCluster, sign: int) -> None:
    """Measured 2026-12-06 (benchmarks/measure_nan_payloads.py --ops PRODUCT, worlds 2–17, and
    measure_many_ranks.py at 130–256 ranks): gloo's float16 PRODUCT writes every NaN as
    0x7e00 / 0xfe00, as its SUM does; the model kept the payload (``0x7e05 × 1.0`` gave
    0x7e05 where gloo gives 0x7e00) — 44–12,297 differing elements a case, now 0."""
    steps = nan_payload_steps()
    if sign < 0:
        steps[0][0][0] = -steps[0][0][0]
    report = compare_with_gloo(product_hook, steps, world_size=2, cluster=world2)
    assert report.equal, report.summary()
    out = report.sim_outputs[0][0][0]
    assert out.view(torch.int16)[0].item() & 0xFFFF == (0x7E00 if sign > 0 else 0xFE00)
