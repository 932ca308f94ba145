"""torch's own DDP comm hooks, unmodified, on the engine (one bucket), with their numeric results.

Expected values are computed here independently (float64 means, exact inputs, or the
structure a compressor reconstructs exactly). Where a hook fails on the gloo model,
the failure is the finding, asserted as such (and reported in README.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

from simcluster import SimCluster
from simcluster.limits import BACKEND_NAMES

STATES = [None, "group"]


def exact_grads(world: int, n: int = 12) -> list[torch.Tensor]:
    """Multiples of 1/4 of modest size: exact in fp16/bf16, after /W for W a power of two, and in any order."""
    return [(torch.arange(n, dtype=torch.float32) - 5) * (r + 1) / 4 for r in range(world)]


def mean64(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.double() for g in grads]).mean(0)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    "hook",
    [
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
        default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook),
    ],
    ids=["allreduce", "fp16_compress", "bf16_compress", "fp16_wrapper(allreduce)", "bf16_wrapper(allreduce)"],
)
def test_averaging_hooks_give_the_exact_mean_on_exact_inputs(hook, world: int, state, backend: str) -> None:
    grads = exact_grads(world)
    result = SimCluster(world, seed=2, backend=backend).run_hook(hook, grads, state=state)
    wrapper = "wrapper" in getattr(hook, "__name__", "")
    for out in result.outputs:
        # the wrappers decompress into the half-precision buffer they installed with
        # set_buffer(): their future holds fp16/bf16, which DDP casts back on copy-back
        assert out.dtype == (torch.float16 if "fp16" in hook.__name__ else torch.bfloat16) if wrapper else torch.float32
        assert torch.equal(out.double(), mean64(grads))


@pytest.mark.parametrize("world", [2, 3, 5])
def test_allreduce_hook_on_random_data_is_the_mean_within_fp32_rounding(world: int) -> None:
    gen = torch.Generator().manual_seed(world)
    grads = [torch.randn(4000, generator=gen) for _ in range(world)]
    outs = SimCluster(world, seed=1).run_hook(default_hooks.allreduce_hook, grads).outputs
    want = mean64(grads)
    bound = world * 2.0**-23 * torch.stack([g.double().abs() for g in grads]).sum(0) / world + 1e-30
    for out in outs:
        assert torch.equal(out, outs[0])
        assert ((out.double() - want).abs() <= bound * 2).all()


def test_fp16_compress_hook_rounds_to_half_precision() -> None:
    grads = [torch.tensor([1.0 + 2.0**-12, 3.0]), torch.tensor([1.0 + 2.0**-12, 5.0])]
    out = SimCluster(2).run_hook(default_hooks.fp16_compress_hook, grads).outputs[0]
    assert out.tolist() == [1.0, 4.0]  # 1 + 2^-12 is not an fp16 value: it rounds to 1


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_noop_hook_returns_each_ranks_own_gradient(backend: str) -> None:
    grads = exact_grads(3)
    result = SimCluster(3, backend=backend).run_hook(noop_hook, grads)
    assert all(torch.equal(o, g) for o, g in zip(result.outputs, grads))
    assert result.trace.collectives() == []  # no communication at all


def powersgd_state(start_iter: int):
    feedback = start_iter > 1  # PowerSGDState refuses error feedback / warm start before iteration 2

    def factory(pg):
        return powerSGD_hook.PowerSGDState(
            process_group=pg, matrix_approximation_rank=1, start_powerSGD_iter=start_iter,
            min_compression_rate=0.5, use_error_feedback=feedback, warm_start=feedback,
        )

    return factory


def rank_one_grads(world: int, rows: int, cols: int, tail: int) -> list[torch.Tensor]:
    """Rank r's matrix gradient is (r+1) * u v^T: the mean is rank one, so PowerSGD's
    rank-1 approximation reconstructs it (up to float32 rounding)."""
    u = torch.linspace(-1, 1, rows)
    v = torch.linspace(0.5, 2, cols)
    return [torch.cat([((r + 1) * torch.outer(u, v)).reshape(-1), torch.full((tail,), float(r))]) for r in range(world)]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("hook", [powerSGD_hook.powerSGD_hook, powerSGD_hook.batched_powerSGD_hook])
def test_powersgd_before_start_iter_is_a_plain_mean(hook, backend: str) -> None:
    world = 2
    grads = rank_one_grads(world, 16, 16, 4)
    params = [torch.nn.Parameter(torch.zeros(16, 16)), torch.nn.Parameter(torch.zeros(4))]
    result = SimCluster(world, backend=backend).run_hook(hook, grads, state=powersgd_state(10), parameters=params)
    for out in result.outputs:
        assert torch.allclose(out.double(), mean64(grads), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_compresses_a_rank_one_mean_exactly_and_keeps_replicas_identical(world: int, backend: str) -> None:
    grads = rank_one_grads(world, 16, 16, 4)
    params = [torch.nn.Parameter(torch.zeros(16, 16)), torch.nn.Parameter(torch.zeros(4))]
    result = SimCluster(world, backend=backend).run_hook(
        powerSGD_hook.powerSGD_hook, grads, state=powersgd_state(0), parameters=params
    )
    for out in result.outputs:
        assert torch.equal(out, result.outputs[0])  # replicas agree bitwise
        assert torch.allclose(out.double(), mean64(grads), rtol=1e-4, atol=1e-5)
    assert [e.op for e in result.trace.collectives()] == ["all_reduce"] * 3  # uncompressed, P, Q


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_batched_powersgd_fails_once_compression_starts(backend: str) -> None:
    """A finding in torch 2.13 itself: batched_powerSGD_hook passes its 2-D low-rank
    matrix to ``_orthogonalize``, which asserts a 3-D batch — so the hook raises a bare
    AssertionError on every rank the first time it compresses (any backend: the
    failing code runs before any collective)."""
    world, side = 2, 8
    u, v = torch.linspace(-1, 1, side), torch.linspace(1, 2, side)
    grads = [((r + 1) * torch.outer(u, v)).reshape(-1) for r in range(world)]
    with pytest.raises(AssertionError) as info:
        SimCluster(world, backend=backend).run_hook(powerSGD_hook.batched_powerSGD_hook, grads, state=powersgd_state(0))
    assert info.traceback[-1].name == "_orthogonalize"
    assert "rank 1 also raised" in "\n".join(info.value.__notes__)


@pytest.mark.parametrize("hook", [quantization_hooks.quantization_pertensor_hook,
                                  quantization_hooks.quantization_perchannel_hook])
def test_quantization_hooks_fail_on_gloo(hook) -> None:
    """A finding: the hooks index ``fut.wait()[0]`` as NCCL's ``[flat]`` all_gather value;
    gloo's value is the flat list of per-rank tensors, so indexing breaks on gloo."""
    with pytest.raises(RuntimeError, match="IndexError"):
        SimCluster(2, backend="gloo").run_hook(hook, exact_grads(2), state="group")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("hook", [quantization_hooks.quantization_pertensor_hook,
                                  quantization_hooks.quantization_perchannel_hook])
def test_quantization_hooks_on_nccl_are_the_mean_within_the_quantization_step(hook, world: int) -> None:
    gen = torch.Generator().manual_seed(world)
    grads = [torch.randn(600, generator=gen) for _ in range(world)]
    outs = SimCluster(world, backend="nccl").run_hook(hook, grads, state="group").outputs
    # uint8 quantization: each rank's error is at most half its step (max - min) / 255
    step = max((g.max() - g.min()).item() for g in grads) / 255
    for out in outs:
        assert torch.equal(out, outs[0])
        assert ((out.double() - mean64(grads)).abs() <= step / 2 + 1e-6).all()


def test_post_local_sgd_switches_from_global_to_subgroup_mean() -> None:
    world = 4
    grads = exact_grads(world)
    cluster = SimCluster(world, seed=0)

    def factory(pg):
        subgroup, _ = dist.new_subgroups(group_size=2)
        return PostLocalSGDState(process_group=pg, subgroup=subgroup, start_localSGD_iter=1)

    states: dict[int, PostLocalSGDState] = {}  # by rank: under gloo a rank waits in new_group for the others

    def hook(state, bucket):
        return post_localSGD_hook(state, bucket)

    def step(rank: int, it: int) -> torch.Tensor:
        from simcluster.fake.bucket import make_bucket

        if it == 0:
            states[rank] = factory(cluster.process_group(rank))
        p = torch.nn.Parameter(torch.zeros(12))
        bucket = make_bucket(0, [p], [grads[rank].clone()], is_last=True)
        return hook(states[rank], bucket).wait()

    first = cluster.run(lambda r: step(r, 0)).values
    assert all(torch.equal(o.double(), mean64(grads)) for o in first)
    second = cluster.run(lambda r: step(r, 1)).values
    for rank, out in enumerate(second):
        pair = [grads[r] for r in range(world) if r // 2 == rank // 2]
        assert torch.equal(out.double(), mean64(pair))


def test_post_local_sgd_without_subgroup_fails_on_cpu() -> None:
    """A finding: with subgroup=None it calls dist.new_subgroups(), whose default group
    size is the CUDA device count; on a CPU machine that raises (as on real gloo)."""
    state = lambda pg: PostLocalSGDState(process_group=pg, subgroup=None, start_localSGD_iter=0)  # noqa: E731
    with pytest.raises(ValueError, match="Default group size only takes effect when CUDA is available"):
        SimCluster(2).run_hook(post_localSGD_hook, exact_grads(2), state=state)
