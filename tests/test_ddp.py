"""The simulated DDP step: layouts per iteration, buckets in flight, hook state across
iterations, every copy-back trap with real DDP's message, torch's hooks over several
iterations, DDP on a subgroup, and a differential test against real DDP on gloo."""

from __future__ import annotations

import doctest
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from hooks import buggy
from simcluster import DeadlockError, HookContractError, SimCluster
from simcluster.ddp import CopyBackError, DDPConfig, SimDDP, StepResult, subgroups

MiB = 2**20


def local_grads(world: int, shapes: list[tuple[int, ...]], steps: int, seed: int = 0) -> list[list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    return [[[torch.randn(s, generator=gen) for s in shapes] for _ in range(world)] for _ in range(steps)]


def mean_over_ranks(grads: list[list[torch.Tensor]], ranks: list[int] | None = None) -> list[torch.Tensor]:
    ranks = list(range(len(grads))) if ranks is None else ranks
    return [torch.stack([grads[r][i] for r in ranks]).double().mean(0) for i in range(len(grads[0]))]


def assert_mean(step: StepResult, local: list[list[torch.Tensor]], rtol: float, atol: float) -> None:
    expected = mean_over_ranks(local)
    for rank, grads in enumerate(step.grads):
        for i, (got, want) in enumerate(zip(grads, expected)):
            assert torch.allclose(got.double(), want, rtol=rtol, atol=atol), (
                f"iteration {step.iteration}, rank {rank}, param {i}: max error {(got.double() - want).abs().max()}"
            )


def test_module_examples_run() -> None:
    import simcluster.ddp as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------ layouts
def recording_hook(calls: list[tuple[int, int, int, bool, tuple[int, ...]]], params: list[list[torch.Tensor]]):
    """allreduce_hook that records (iteration, rank, index, is_last, param indices) of each call."""
    iteration = [0]

    def hook(state: Any, bucket: Any) -> torch.futures.Future:
        rank = dist.get_rank()
        ids = tuple(next(i for i, p in enumerate(params[rank]) if p is q) for q in bucket.parameters())
        calls.append((iteration[0], rank, bucket.index(), bucket.is_last(), ids))
        return default_hooks.allreduce_hook(None, bucket)

    return hook, iteration


def layouts(config: DDPConfig, numels: list[int], iterations: int = 4) -> list[list[tuple[int, bool, tuple[int, ...]]]]:
    """Each iteration's hook calls (index, is_last, params), checked equal on both ranks."""
    calls: list[Any] = []
    ddp_params: list[list[torch.Tensor]] = []
    hook, iteration = recording_hook(calls, ddp_params)
    ddp = SimDDP(SimCluster(2, seed=1), hook, [(n,) for n in numels], config=config)
    ddp_params.extend(ddp.params)
    out = []
    for it, grads in enumerate(local_grads(2, [(n,) for n in numels], iterations)):
        iteration[0] = it
        step = ddp.step(grads)
        per_rank = [[(i, last, ids) for (t, r, i, last, ids) in calls if t == it and r == rank] for rank in range(2)]
        assert per_rank[0] == per_rank[1]
        assert [list(ids) for _, _, ids in per_rank[0]] == step.bucket_params
        out.append(per_rank[0])
    return out


def test_layouts_follow_ddp_facts_per_iteration() -> None:
    # 64 floats = 256 bytes each; a 512-byte cap closes a bucket after two of them.
    rebuilt = [(0, False, (4, 3)), (1, False, (2, 1)), (2, True, (0,))]
    everything = [(0, True, (0, 1, 2, 3, 4))]
    cap = DDPConfig(bucket_cap_mb=512 / MiB)
    assert layouts(cap, [64] * 5) == [everything] + [rebuilt] * 3
    # static_graph: rebuilt from iteration 2
    assert layouts(DDPConfig(bucket_cap_mb=512 / MiB, static_graph=True), [64] * 5) == [everything] * 2 + [rebuilt] * 2
    # find_unused_parameters: caps from iteration 0, walked in parameter order, list reversed; never rebuilt
    unused = layouts(DDPConfig(bucket_cap_mb=512 / MiB, find_unused_parameters=True), [64] * 5)
    assert unused == [[(0, False, (4,)), (1, False, (2, 3)), (2, True, (0, 1))]] * 4
    # a custom ready order drives the rebuild; the default cap keeps one (first, 1 MiB) bucket here
    order = DDPConfig(bucket_cap_mb=512 / MiB, ready_order=(2, 0, 4, 1, 3))
    assert layouts(order, [64] * 5, 2)[1] == [(0, False, (2, 0)), (1, False, (4, 1)), (2, True, (3,))]
    assert layouts(DDPConfig(), [64] * 5, 2) == [everything, [(0, True, (4, 3, 2, 1, 0))]]


def test_a_bucket_overshoots_the_cap_by_one_whole_tensor() -> None:
    # 40 B + 4000 B passes a 100-byte cap: the big tensor joins, unsplit, and closes the bucket
    got = layouts(DDPConfig(bucket_cap_mb=100 / MiB), [10, 1000, 10], 2)
    assert got[1] == [(0, False, (2, 1)), (1, True, (0,))]


# -------------------------------------------------- state and buckets in flight
def frozen_skip_hook(state: dict[int, list[tuple[int, int]]], bucket: Any) -> torch.futures.Future:
    """Skips the all-reduce of frozen parameters' slices (all-zero gradients), remembering
    the slices per bucket.index() the first time it sees a bucket — wrong after the rebuild,
    when index 0 holds other parameters in another order."""
    buffer = bucket.buffer()
    if bucket.index() not in state:
        slices, offset = [], 0
        for g in bucket.gradients():
            if not g.any():
                slices.append((offset, offset + g.numel()))
            offset += g.numel()
        state[bucket.index()] = slices
    live = torch.ones(buffer.numel(), dtype=torch.bool)
    for start, stop in state[bucket.index()]:
        live[start:stop] = False
    sent = buffer[live] / dist.get_world_size()
    out = torch.zeros_like(buffer)

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        out[live] = fut.value()[0]
        return out

    return dist.all_reduce(sent, async_op=True).get_future().then(unpack)


def test_state_keyed_by_bucket_index_breaks_at_the_rebuild() -> None:
    shapes = [(3,), (4,), (5,)]
    steps = local_grads(2, shapes, 3)
    for grads in steps:
        for rank_grads in grads:
            rank_grads[0].zero_()  # parameter 0 is frozen
    factory_calls: list[int] = []

    def state(pg: Any) -> dict[int, list[tuple[int, int]]]:
        factory_calls.append(pg.rank())
        return {}

    ddp = SimDDP(SimCluster(2, seed=0), frozen_skip_hook, shapes, state=state)
    first = ddp.step(steps[0])
    assert_mean(first, steps[0], 1e-6, 1e-6)  # iteration 0: one bucket, the hook is right
    second = ddp.step(steps[1])  # the rebuild: index 0 now holds parameters 2, 1, 0
    assert second.bucket_params == [[2, 1, 0]]
    with pytest.raises(AssertionError, match="param 2"):
        assert_mean(second, steps[1], 1e-6, 1e-6)
    assert factory_calls == [0, 1]  # state made once per rank and kept


def test_hook_confusing_buckets_in_flight_is_caught_after_the_rebuild() -> None:
    shapes = [(6,), (6,), (6,)]  # equal sizes: the confusion is silent, no copy_ error
    steps = local_grads(2, shapes, 3)
    ddp = SimDDP(SimCluster(2, seed=0), buggy.inflight_shared_compressor, shapes, state=buggy.CompressorState,
                 config=DDPConfig(bucket_cap_mb=24 / MiB))
    first = ddp.step(steps[0])
    assert_mean(first, steps[0], 1e-3, 1e-3)  # one bucket: fine
    later = ddp.step(steps[1])
    assert len(later.bucket_params) == 3
    with pytest.raises(AssertionError):
        assert_mean(later, steps[1], 1e-3, 1e-3)
    # the correct fp16 hook passes the same schedule
    ok = SimDDP(SimCluster(2, seed=0), default_hooks.fp16_compress_hook, shapes, state="group",
                config=DDPConfig(bucket_cap_mb=24 / MiB))
    for step, grads in zip(ok.run(steps), steps):
        assert_mean(step, grads, 1e-3, 1e-3)


def test_every_hook_is_called_before_any_collective_completes() -> None:
    shapes = [(4,)] * 4
    ddp = SimDDP(SimCluster(2, seed=3), default_hooks.allreduce_hook, shapes, config=DDPConfig(bucket_cap_mb=16 / MiB))
    steps = local_grads(2, shapes, 2)
    ddp.step(steps[0])
    events = [type(e).__name__ for e in ddp.step(steps[1]).trace.events]
    assert events.count("Posted") == 8 and events.index("Completed") > max(i for i, e in enumerate(events) if e == "Posted")


# ------------------------------------------------------- torch's hooks, K steps
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("hook", "rtol"), [(default_hooks.allreduce_hook, 1e-6), (default_hooks.fp16_compress_hook, 2e-3)]
)
def test_torch_hooks_average_every_iteration_with_several_buckets(hook: Any, rtol: float, seed: int) -> None:
    shapes = [(16, 8), (8,), (32,), (4, 4), (24,)]
    steps = local_grads(3, shapes, 5, seed)
    ddp = SimDDP(SimCluster(3, seed=seed), hook, shapes, state="group", config=DDPConfig(bucket_cap_mb=160 / MiB))
    results = ddp.run(steps)
    assert [len(r.bucket_params) for r in results] == [1, 3, 3, 3, 3]
    for step, grads in zip(results, steps):
        assert_mean(step, grads, rtol, rtol)
        assert all(torch.equal(a, b) for r in step.grads[1:] for a, b in zip(step.grads[0], r))


def powersgd_state(pg: Any) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(process_group=pg, matrix_approximation_rank=1, start_powerSGD_iter=2)


def test_powersgd_replicas_agree_and_error_feedback_identity_holds() -> None:
    # 64x64 at rank 1: (64 + 64) * 1 * min_compression_rate (2) < 4096, so they are compressed.
    shapes = [(64, 64), (64,), (64, 64), (64,), (64, 64)]
    steps = local_grads(2, shapes, 6)
    # nccl model: callbacks run in the issuing code, so PowerSGD's waits inside callbacks
    # do not hold backend workers (on gloo they deadlock: see the next test)
    ddp = SimDDP(SimCluster(2, seed=4, backend="nccl"), powerSGD_hook.powerSGD_hook, shapes, state=powersgd_state,
                 config=DDPConfig(bucket_cap_mb=16384 / MiB))
    results = ddp.run(steps)
    assert [len(r.bucket_params) for r in results] == [1] + [3] * 5
    for step in results:
        assert all(torch.equal(a, b) for a, b in zip(step.grads[0], step.grads[1]))
    compressed = mean_over_ranks(steps[-1])[0]
    assert not torch.allclose(results[-1].grads[0][0].double(), compressed, atol=1e-3)  # it did compress
    total_out = [sum(step.grads[0][i].double() for step in results) for i in range(len(shapes))]
    total_mean = [sum(mean_over_ranks(g)[i] for g in steps) for i in range(len(shapes))]
    memory = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for state in ddp.states:
        for index, params in enumerate(results[-1].bucket_params):
            flat = state.error_dict[index].double()
            offset = 0
            for i in params:
                memory[i] += flat[offset : offset + memory[i].numel()].view(shapes[i]) / len(ddp.states)
                offset += memory[i].numel()
    for i in range(len(shapes)):
        assert torch.allclose(total_out[i], total_mean[i] - memory[i], atol=1e-4), i


def test_powersgd_with_several_buckets_in_flight_deadlocks_on_gloo() -> None:
    # Measured on real gloo (2 ranks, 3 buckets): DDP hangs in backward() of iteration 2,
    # each bucket's callback holding one of the group's 2 worker threads while it waits.
    shapes = [(64, 64), (64,), (64, 64), (64,), (64, 64)]
    ddp = SimDDP(SimCluster(2, seed=0), powerSGD_hook.powerSGD_hook, shapes, state=powersgd_state,
                 config=DDPConfig(bucket_cap_mb=16384 / MiB))
    steps = local_grads(2, shapes, 3)
    ddp.step(steps[0])
    ddp.step(steps[1])
    with pytest.raises(DeadlockError, match="never completes"):
        ddp.step(steps[2])


# ------------------------------------------------------------ subgroups
def test_ddp_on_subgroups_averages_within_each_group() -> None:
    shapes = [(5,), (3,)]
    grads = local_grads(4, shapes, 1)[0]
    ddp = SimDDP(SimCluster(4, seed=0), default_hooks.allreduce_hook, shapes, state="group",
                 process_group_factory=subgroups([0, 1], [2, 3]))
    step = ddp.step(grads)
    for rank in range(4):
        members = [0, 1] if rank < 2 else [2, 3]
        for got, want in zip(step.grads[rank], mean_over_ranks(grads, members)):
            assert torch.allclose(got.double(), want, atol=1e-6)
    assert [g.size() for g in ddp.groups] == [2, 2, 2, 2]
    # state=None: torch's hook falls back to WORLD (a real-cluster trap): the mean over all 4
    world = SimDDP(SimCluster(4, seed=0), default_hooks.allreduce_hook, shapes,
                   process_group_factory=subgroups([0, 1], [2, 3])).step(grads)
    for got, want in zip(world.grads[3], mean_over_ranks(grads)):
        assert torch.allclose(got.double(), want, atol=1e-6)


def test_same_seed_same_bits_and_schedule() -> None:
    shapes = [(7,), (9,), (5,)]
    steps = local_grads(3, shapes, 3)
    runs = [SimDDP(SimCluster(3, seed=5), default_hooks.allreduce_hook, shapes,
                   config=DDPConfig(bucket_cap_mb=30 / MiB)).run(steps) for _ in range(2)]
    for a, b in zip(*runs):
        assert a.schedule == b.schedule
        assert all(torch.equal(x, y) for ra, rb in zip(a.grads, b.grads) for x, y in zip(ra, rb))
