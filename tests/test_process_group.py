"""Every simulated collective against an independent reference, world sizes 1-8, both backends.

The reference is computed here, from the ranks' inputs, without the simulator: exact
integer-valued data (so every summation order gives the same bits) and float64 sums
for random data. What each future holds is checked against the backend facts
(docs/gloo-facts.md), also written out here rather than taken from the code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simcluster import SimCluster
from simcluster.checking.check import check_hook
from simcluster.errors import (CollectiveMismatchError, DeadlockError, InFlightWriteError, SimulatorBug,
                              UnsupportedError)
from simcluster.limits import BACKEND_NAMES
from simcluster.names import without_addresses

WORLD_SIZES = [1, 2, 3, 4, 5, 8]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def ints(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers: exact in every dtype and every summation order."""
    return (torch.arange(n) * (rank + 1) % 7 - 3 + rank).to(dtype)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_ops(backend: str, world: int, dtype: torch.dtype) -> None:
    n = 10
    xs = [ints(r, n, dtype) for r in range(world)]
    stacked = torch.stack([x.double() for x in xs])
    expected = {
        dist.ReduceOp.SUM: stacked.sum(0),
        dist.ReduceOp.MIN: stacked.min(0).values,
        dist.ReduceOp.MAX: stacked.max(0).values,
    }
    cluster = SimCluster(world, seed=1, backend=backend)
    for op, want in expected.items():
        def rank_fn(rank: int, op=op) -> tuple[torch.Tensor, list[torch.Tensor]]:
            t = xs[rank].clone()
            fut = dist.all_reduce(t, op=op, async_op=True).get_future()
            return t, fut.wait()

        result = cluster.run(rank_fn)
        for t, value in result.values:
            assert value[0] is t  # gloo and NCCL: [t], the input tensor itself
            assert torch.equal(t.double(), want), (op, t, want)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_product_and_bitwise(world: int) -> None:
    xs = [torch.tensor([rank + 1, 2, 0b1010 + rank], dtype=torch.int64) for rank in range(world)]
    prod = torch.ones(3, dtype=torch.int64)
    band, bor, bxor = xs[0].clone(), xs[0].clone(), xs[0].clone()
    for x in xs:
        prod = prod * x
    for x in xs[1:]:
        band &= x
        bor |= x
        bxor ^= x
    cluster = SimCluster(world, backend="gloo")
    for op, want in [(dist.ReduceOp.PRODUCT, prod), (dist.ReduceOp.BAND, band), (dist.ReduceOp.BOR, bor),
                     (dist.ReduceOp.BXOR, bxor)]:
        out = cluster.run(lambda r, op=op: _reduced(xs[r], op)).values
        assert all(torch.equal(o, want) for o in out), (op, out, want)


def _reduced(x: torch.Tensor, op: object) -> torch.Tensor:
    t = x.clone()
    dist.all_reduce(t, op=op)
    return t


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_avg_and_premul_sum(backend: str, world: int) -> None:
    xs = [torch.full((4,), float(2 * r + 1)) for r in range(world)]
    mean = sum(x.double() for x in xs) / world
    cluster = SimCluster(world, backend=backend)
    out = cluster.run(lambda r: _reduced(xs[r], dist.ReduceOp.AVG)).values
    assert all(torch.allclose(o.double(), mean) for o in out)
    premul = dist._make_nccl_premul_sum(0.5)

    def rank_fn(rank: int) -> object:
        t = xs[rank].clone()
        work = dist.all_reduce(t, op=premul, async_op=True)
        try:
            work.wait()
        except RuntimeError as exc:
            return str(exc)
        return t

    if backend == "nccl":
        out = cluster.run(rank_fn).values
        assert all(torch.allclose(o.double(), mean * world * 0.5) for o in out)
    else:  # measured: gloo raises at wait(), on every rank, and the group stays usable
        out = cluster.run(rank_fn).values
        assert out == ["Cannot use ReduceOp.PREMUL_SUM with Gloo"] * world
        again = cluster.run(lambda r: _reduced(xs[r], dist.ReduceOp.SUM)).values
        assert torch.allclose(again[0].double(), mean * world)


def overloads_job(rank: int, world_size: int, payload: Any = None) -> dict[str, Any]:
    """torch's other ProcessGroup overloads, called on the default group: a bare tensor, an
    op where the options go, a root as a number (what hooks from the wild call: round 14)."""
    pg = dist.group.WORLD
    out: dict[str, Any] = {}

    def mine() -> torch.Tensor:
        return torch.tensor([float(rank + 1), float(-rank)])

    t = mine()
    pg.allreduce([t], dist.ReduceOp.MAX).wait()
    out["allreduce(list, MAX)"] = t.tolist()
    t = mine()
    work = pg.allreduce(t)
    work.wait()
    out["allreduce(tensor)"] = (t.tolist(), [v.tolist() for v in work.get_future().value()])
    t = mine()
    pg.allreduce(t, op=dist.ReduceOp.MIN).wait()
    out["allreduce(tensor, op=MIN)"] = t.tolist()
    t = torch.tensor([float(rank + 1)])  # one element: was read as a list of one 0-dim row
    pg.allreduce(t).wait()
    out["allreduce(1-element tensor)"] = t.tolist()
    t = mine()
    pg.broadcast(t, world_size - 1).wait()
    out["broadcast(tensor, root)"] = t.tolist()
    t = mine()
    pg.reduce(t, 0, dist.ReduceOp.MAX).wait()
    out["reduce(tensor, 0, MAX) on root"] = t.tolist() if rank == 0 else None
    outs = [torch.zeros(2) for _ in range(world_size)]
    pg.allgather(outs, mine()).wait()
    out["allgather(list, tensor)"] = [o.tolist() for o in outs]
    if world_size == 2:  # batch_isend_irecv with the peer: on gloo one request per op
        received = torch.zeros(2)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine(), 1 - rank), dist.P2POp(dist.irecv, received, 1 - rank)])
        for req in reqs:
            req.wait()
        out["batch_isend_irecv"] = (len(reqs), received.tolist())
    return out


@pytest.mark.gloo
def test_torchs_other_process_group_overloads_do_what_real_gloo_does(gloo_world: Any) -> None:
    """The list-and-options overloads were all the simulated group read: ``pg.allreduce([t],
    ReduceOp.MAX)`` reduced as SUM (the op was taken for options without one: silent wrong
    data), ``pg.allreduce(t)`` of a one-element tensor reduced a 0-dim row of it (a false
    contract failure), and ``pg.allreduce(t)``/``pg.broadcast(t, root)`` with more elements
    were 'not modelled'. Real gloo, world 2, is the oracle."""
    real = gloo_world(2).run(overloads_job, [None, None], timeout=120.0)
    sim = SimCluster(2).run(lambda rank: overloads_job(rank, 2)).values
    assert sim == real
    assert real[0]["allreduce(list, MAX)"] == [2.0, 0.0]


def versions_job(rank: int, world_size: int, payload: Any = None) -> dict[str, list[int]]:
    """How far each call (posted with async_op=True, then waited) moves the version counter
    (``_version``) of each tensor it was given, by the end of its wait: autograd's "modified
    by an inplace operation" check reads it, and simcluster tells a write to a tensor a
    collective still has in flight by it (docs/gloo-facts.md §13)."""
    def moved(tensors: list[torch.Tensor], post: Any) -> list[int]:
        before = [t._version for t in tensors]
        work = post()
        if work is not None:
            work.wait()
        return [t._version - v for t, v in zip(tensors, before)]

    t, base, out = torch.ones(4), torch.ones(8), torch.zeros(4)
    view = base[:4]
    outs, flat, ins, whole = [torch.zeros(4), torch.zeros(4)], torch.zeros(8), [torch.ones(4), torch.ones(4)], torch.ones(8)
    a2a_in, a2a_out, buf = torch.ones(4), torch.zeros(4), torch.ones(4)
    gathered = [torch.zeros(4), torch.zeros(4)] if rank == 0 else None
    pieces = [torch.ones(4), torch.ones(4)] if rank == 0 else None
    peer = 1 - rank
    a2a_outs, pair = [torch.zeros(2), torch.zeros(2)], [torch.ones(3), torch.ones(2)]
    return {
        "all_reduce": moved([t], lambda: dist.all_reduce(t, async_op=True)),
        "all_reduce of a view (view, base)": moved([view, base], lambda: dist.all_reduce(view, async_op=True)),
        "broadcast": moved([t], lambda: dist.broadcast(t, 0, async_op=True)),
        "reduce": moved([t], lambda: dist.reduce(t, 0, async_op=True)),
        "all_gather (input, outputs)": moved([t, *outs], lambda: dist.all_gather(outs, t, async_op=True)),
        "all_gather_into_tensor (input, output)": moved([t, flat], lambda: dist.all_gather_into_tensor(
            flat, t, async_op=True)),
        "reduce_scatter (input 0, output)": moved([ins[0], out], lambda: dist.reduce_scatter(out, ins, async_op=True)),
        "reduce_scatter_tensor (input, output)": moved([whole, out], lambda: dist.reduce_scatter_tensor(
            out, whole, async_op=True)),
        "all_to_all_single (input, output)": moved([a2a_in, a2a_out], lambda: dist.all_to_all_single(
            a2a_out, a2a_in, async_op=True)),
        "gather (input, gather_list)": moved([t, *(gathered or [])], lambda: dist.gather(t, gathered, 0, async_op=True)),
        "scatter (output, scatter_list)": moved([out, *(pieces or [])], lambda: dist.scatter(
            out, pieces, 0, async_op=True)),
        "isend then irecv": moved([buf], lambda: (dist.isend if rank == 0 else dist.irecv)(buf, peer))
        + moved([buf], lambda: (dist.irecv if rank == 0 else dist.isend)(buf, peer)),
        "all_to_all (outputs)": moved(a2a_outs, lambda: dist.all_to_all(a2a_outs, [torch.ones(2), torch.ones(2)],
                                                                         async_op=True)),
        "all_reduce_coalesced": moved(pair, lambda: dist.all_reduce_coalesced(pair, async_op=True)),
        "all_reduce AVG": moved([t], lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)),
        "reduce AVG": moved([t], lambda: dist.reduce(t, 0, op=dist.ReduceOp.AVG, async_op=True)),
        "reduce_scatter AVG (input 0, output)": moved([ins[0], out], lambda: dist.reduce_scatter(
            out, ins, op=dist.ReduceOp.AVG, async_op=True)),
        "reduce_scatter_tensor AVG (input, output)": moved([whole, out], lambda: dist.reduce_scatter_tensor(
            out, whole, op=dist.ReduceOp.AVG, async_op=True)),
        "all_reduce_coalesced AVG": moved(pair, lambda: dist.all_reduce_coalesced(pair, op=dist.ReduceOp.AVG,
                                                                                  async_op=True)),
    }


@pytest.mark.gloo
def test_collectives_move_version_counters_as_real_gloo_does(gloo_world: Any) -> None:
    """The simulated collectives wrote their results with ``copy_``, which moves the
    tensor's version counter: an all_reduce moved it by 1 where gloo, which writes the
    memory, leaves it (and broadcast, reduce, scatter, all_to_all_single, irecv alike); the
    gathers moved it less than gloo. The version is what autograd checks and what tells a
    hook's write to a tensor in flight. Real gloo, world 2, is the oracle (by the end of
    each wait; within the call it is timing)."""
    real = gloo_world(2).run(versions_job, [None, None], timeout=120.0)
    sim = SimCluster(2).run(lambda rank: versions_job(rank, 2)).values
    assert sim == real
    assert real[0]["all_reduce"] == [0] and real[0]["all_gather_into_tensor (input, output)"] == [0, 2]


def reduce_scatter_shapes_job(rank: int, world_size: int, payload: Any = None) -> list[str]:
    """``reduce_scatter_tensor`` with outputs and inputs of several shapes: ``ok`` or the error
    (type and message, time stamps masked)."""
    from simcluster.names import without_addresses

    outcomes = []
    for out_shape, in_shape in (((1,), (2,)), ((1,), (3,)), ((0,), (2,)), ((2, 2), (4, 2)), ((2, 2), (2, 4))):
        try:
            dist.reduce_scatter_tensor(torch.zeros(out_shape), torch.ones(in_shape))
            outcomes.append("ok")
        except RuntimeError as exc:  # the simulator's BackendError is one
            outcomes.append(f"RuntimeError: {without_addresses(str(exc))}")
    return outcomes


@pytest.mark.gloo
def test_reduce_scatter_tensor_refuses_shapes_as_real_gloo_does(gloo_world: Any) -> None:
    """gloo checks ``output.shape[0] * world == input.shape[0]`` at the call and raises its
    glog line; the simulator checked element counts with words of its own (a ValueError), so
    e2e called a hook confirmed failing on real gloo a FIDELITY BUG, and a check report gave
    the wrong type and text (hooks from the wild, round 19). A (2, 2) output of a (2, 4) input
    has the elements but not the rows: refused by gloo, and now by the simulator."""
    real = gloo_world(2).run(reduce_scatter_shapes_job, [None, None], timeout=120.0)
    sim = SimCluster(2).run(lambda rank: reduce_scatter_shapes_job(rank, 2)).values
    assert sim == real
    assert real[0][-1].startswith("RuntimeError: [rank0]:[F… ProcessGroupGloo.cpp:"), real


def test_batch_isend_irecv_is_one_request_under_the_nccl_model() -> None:
    """torch 2.13's batch_isend_irecv coalesces a batch when the group's backend
    supports_coalescing — ProcessGroupNCCL does (its header) — and returns one work; gloo
    returns one per op (measured: the real-gloo test above). A simulated group is a subclass,
    so torch's exact-type test took the per-op path on every model: the NCCL model let
    ``send_req, recv_req = dist.batch_isend_irecv(ops)`` pass, which raises on a real NCCL
    cluster (hooks from the wild, round 17)."""
    def rank_fn(rank: int) -> tuple[int, list[float]]:
        received = torch.zeros(2)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(rank)), 1 - rank),
                                       dist.P2POp(dist.irecv, received, 1 - rank)])
        for req in reqs:
            req.wait()
        assert reqs[0].is_completed()
        return len(reqs), received.tolist()

    assert SimCluster(2, backend="nccl").run(rank_fn).values == [(1, [1.0, 1.0]), (1, [0.0, 0.0])]
    assert SimCluster(2, backend="gloo").run(rank_fn).values == [(2, [1.0, 1.0]), (2, [0.0, 0.0])]
    assert dist.batch_isend_irecv is not None and dist.batch_isend_irecv.__module__ == "torch.distributed.distributed_c10d"


def test_the_trace_names_each_ranks_premul_sum_factor() -> None:
    """A PREMUL_SUM's factor is what it does; the trace (and explain) said only PREMUL_SUM
    (hooks from the wild, round 13: a ZeRO-style hook choosing between AVG and PREMUL_SUM)."""
    def rank_fn(rank: int) -> None:
        factor = 0.25 if rank == 0 else torch.tensor([0.5])  # a float or a one-element tensor, as torch takes
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(factor), async_op=True).wait()

    text = SimCluster(2, backend="nccl").run(rank_fn).trace.format()
    assert "PREMUL_SUM(factor 0.25)" in text and "PREMUL_SUM(factor 0.5)" in text, text


@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_float_sum_matches_float64_reference(world: int) -> None:
    gen = torch.Generator().manual_seed(world)
    xs = [torch.randn(1000, generator=gen) for _ in range(world)]
    want = sum(x.double() for x in xs)
    out = SimCluster(world).run(lambda r: _reduced(xs[r], dist.ReduceOp.SUM)).values
    for o in out:
        assert torch.equal(o, out[0])  # every rank identical bits
        assert torch.allclose(o.double(), want, rtol=0, atol=world * 2.0**-20 * want.abs().max().item() + 1e-6)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_gather_value_shape_per_backend(backend: str, world: int) -> None:
    xs = [torch.tensor([float(r), float(r) + 0.5]) for r in range(world)]

    def rank_fn(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        outs = [torch.zeros(2) for _ in range(world)]
        value = dist.all_gather(outs, xs[rank], async_op=True).get_future().wait()
        return outs, value

    for outs, value in SimCluster(world, backend=backend).run(rank_fn).values:
        assert all(torch.equal(o, x) for o, x in zip(outs, xs))
        if backend == "gloo":  # measured: the flat list of the output tensors themselves
            assert len(value) == world and all(v is o for v, o in zip(value, outs))
        else:  # NCCL: [flat], one tensor of shape (W, ...)
            assert len(value) == 1 and value[0].shape == (world, 2)
            assert torch.equal(value[0], torch.stack(xs))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_gathers_scatters_broadcast(backend: str, world: int) -> None:
    xs = [torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world)]
    root = world - 1

    def rank_fn(rank: int) -> dict[str, object]:
        got: dict[str, object] = {}
        out = torch.zeros(3 * world)
        dist.all_gather_into_tensor(out, xs[rank])
        got["agit"] = out
        b = xs[rank].clone()
        dist.broadcast(b, src=root)
        got["broadcast"] = b
        g = [torch.zeros(3) for _ in range(world)] if rank == root else None
        dist.gather(xs[rank], gather_list=g, dst=root)
        got["gather"] = g
        s = torch.zeros(3)
        dist.scatter(s, scatter_list=[x * 2 for x in xs] if rank == root else None, src=root)
        got["scatter"] = s
        a2a_out = [torch.zeros(1) for _ in range(world)]
        dist.all_to_all(a2a_out, [torch.tensor([100.0 * rank + j]) for j in range(world)])
        got["all_to_all"] = a2a_out
        single_out = torch.zeros(world)
        dist.all_to_all_single(single_out, torch.tensor([100.0 * rank + j for j in range(world)]))
        got["all_to_all_single"] = single_out
        rs = torch.zeros(3)
        dist.reduce_scatter_tensor(rs, torch.cat([xs[rank] + j for j in range(world)]))
        got["reduce_scatter_tensor"] = rs
        rs_list = torch.zeros(3)
        dist.reduce_scatter(rs_list, [xs[rank] * (j + 1) for j in range(world)])
        got["reduce_scatter"] = rs_list
        red = xs[rank].clone()
        dist.reduce(red, dst=root)
        got["reduce_root"] = red
        dist.barrier()
        return got

    values = SimCluster(world, backend=backend).run(rank_fn).values
    total = sum(xs)
    for rank, got in enumerate(values):
        assert torch.equal(got["agit"], torch.cat(xs))
        assert torch.equal(got["broadcast"], xs[root])
        if rank == root:
            assert all(torch.equal(a, b) for a, b in zip(got["gather"], xs))
            assert torch.equal(got["reduce_root"], total)
        assert torch.equal(got["scatter"], xs[rank] * 2)
        assert [t.item() for t in got["all_to_all"]] == [100.0 * s + rank for s in range(world)]
        assert got["all_to_all_single"].tolist() == [100.0 * s + rank for s in range(world)]
        assert torch.equal(got["reduce_scatter_tensor"], total + world * rank)
        assert torch.equal(got["reduce_scatter"], total * (rank + 1))


def test_send_recv_and_future_support_per_backend() -> None:
    def rank_fn(rank: int) -> object:
        t = torch.tensor([float(rank)])
        if rank == 0:
            work = dist.isend(torch.tensor([42.0]), dst=1)
        else:
            work = dist.irecv(t, src=0)
        work.wait()
        try:
            work.get_future()
        except RuntimeError as exc:  # measured on gloo: p2p works have no future
            return t, str(exc)
        return t, None

    out = SimCluster(2).run(rank_fn).values
    assert out[1][0].item() == 42.0
    assert out[0][1] == out[1][1] == "Work::getFuture not implemented."


def test_reduce_scatter_has_no_future_on_gloo_but_has_on_nccl() -> None:
    def rank_fn(rank: int) -> str:
        work = dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(2), async_op=True)
        try:
            work.get_future()
            return "future"
        except RuntimeError as exc:
            return str(exc)
        finally:
            work.wait()

    assert SimCluster(2, backend="gloo").run(rank_fn).values == ["Work::getFuture not implemented."] * 2
    assert SimCluster(2, backend="nccl").run(rank_fn).values == ["future"] * 2


def test_bitwise_op_on_float_fails_at_wait_on_gloo_and_at_call_on_nccl() -> None:
    """gloo: a RuntimeError at wait (measured). NCCL: a ValueError at the call (torch's
    ProcessGroupNCCL maps an op NCCL lacks with ``C10_THROW_ERROR(ValueError, …)``), which a
    hook's ``except RuntimeError`` does not catch; the model raised a RuntimeError (a round of
    hooks written outside the project, 2026-12-07: a hook whose ``except ValueError`` fallback
    works on NCCL failed, one whose ``except RuntimeError`` does not passed)."""
    def rank_fn(rank: int) -> str:
        try:
            work = dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, async_op=True)
        except RuntimeError as exc:
            return "call, RuntimeError: " + str(exc).splitlines()[0]
        except ValueError as exc:
            return "call, ValueError: " + str(exc).splitlines()[0]
        try:
            work.wait()
        except RuntimeError as exc:
            return "wait, RuntimeError: " + str(exc)
        return "ok"

    gloo = SimCluster(2, backend="gloo").run(rank_fn).values
    assert gloo == ["wait, RuntimeError: Cannot use ReduceOp.BAND with non-integral dtype"] * 2
    nccl = SimCluster(2, backend="nccl").run(rank_fn).values
    assert nccl == ["call, ValueError: Cannot use ReduceOp.BAND with NCCL"] * 2

    def bool_average(rank: int) -> str:
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.bool), op=dist.ReduceOp.AVG)
        except RuntimeError:
            return "RuntimeError"
        except TypeError as exc:
            return f"TypeError: {exc}"
        return "ok"
    assert SimCluster(2, backend="nccl").run(bool_average).values == \
        ["TypeError: Cannot use ReduceOp.AVG with boolean inputs"] * 2


def test_an_all_gather_of_uneven_outputs_is_one_broadcast_per_rank_under_the_nccl_model() -> None:
    """ProcessGroupNCCL broadcasts each rank's input into that rank's output when the outputs
    differ in size (torch's sources); the model raised ValueError, a false alarm on a hook that
    gathers uneven shards (a round of hooks written outside the project, 2026-12-07). gloo
    refuses it (measured)."""
    sizes = [2, 1, 1]

    def gather(rank: int) -> list[list[float]]:
        outs = [torch.zeros(s) for s in sizes]
        dist.all_gather(outs, torch.full((sizes[rank],), float(rank + 1)))
        return [o.tolist() for o in outs]

    assert SimCluster(3, backend="nccl").run(gather).values == [[[1.0, 1.0], [2.0], [3.0]]] * 3
    with pytest.raises(RuntimeError, match="invalid tensor size"):
        SimCluster(3, backend="gloo").run(gather)

    def own_input_off(rank: int) -> None:  # rank i's input must have output i's size
        dist.all_gather([torch.zeros(s) for s in sizes], torch.ones(1))
    with pytest.raises(ValueError, match="Tensor input and output of _broadcast_oop must have the same number"):
        SimCluster(3, backend="nccl").run(own_input_off)

    def one_rank_even(rank: int) -> None:  # rank 0 takes NCCL's allgather, the others broadcast
        mine = [1, 1, 1] if rank == 0 else sizes
        dist.all_gather([torch.zeros(s) for s in mine], torch.ones(mine[rank]))
    with pytest.raises(CollectiveMismatchError, match="uneven outputs"):
        SimCluster(3, backend="nccl").run(one_rank_even)


def test_world_and_rank_resolve_per_rank_and_are_restored() -> None:
    seen = SimCluster(3).run(lambda r: (dist.get_rank(), dist.get_world_size(), dist.is_initialized())).values
    assert seen == [(0, 3, True), (1, 3, True), (2, 3, True)]
    assert dist.group.WORLD is None
    assert not dist.is_initialized()


def test_new_group_and_new_subgroups_inside_a_run() -> None:
    def rank_fn(rank: int) -> tuple[int, int, float]:
        pair = dist.new_group([0, 1])
        mine, _ = dist.new_subgroups(group_size=2)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mine)
        if rank in (0, 1):
            return dist.get_rank(pair), dist.get_world_size(pair), t.item()
        assert pair == dist.GroupMember.NON_GROUP_MEMBER
        return dist.get_rank(pair), dist.get_world_size(pair), t.item()

    out = SimCluster(4).run(rank_fn).values
    assert out == [(0, 2, 1.0), (1, 2, 1.0), (-1, -1, 5.0), (-1, -1, 5.0)]


# Measured on real gloo, torch 2.13 (benchmarks/measure_new_group_names.py, docs/gloo-facts.md §7):
# torch names a group str(_world.group_count), counted on every new_group call of the process,
# member or not; members-only calls give two groups one name, whose ranks then cross-connect.


def _reduce_on(group: object) -> list[float]:
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t, group=group)
    return t.tolist()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_groups_made_by_their_members_only_share_a_name_and_end_the_run(backend: str) -> None:
    """wild21: a hook making its subgroup lazily, each rank only the group it is in, passed
    check; on real gloo both groups are named '1' and their ranks connected across them
    (connection resets, timeouts, or right-looking sums)."""
    def members_only(rank: int) -> list[float]:
        try:
            return _reduce_on(dist.new_group([0, 1] if rank < 2 else [2, 3]))
        except Exception:  # noqa: BLE001 - a hook swallowing errors must not hide it
            return []

    with pytest.raises(CollectiveMismatchError, match=r"rank 2 made the group \[2, 3\] as its group '1', but ranks "
                                                      r"\[0, 1\] made \[0, 1\] under that name") as info:
        SimCluster(4, backend=backend).run(members_only)
    made_at = re.findall(r"\n  rank (\d) made (\[.*?\]) at \S*test_process_group.py:\d+ in members_only", str(info.value))
    assert made_at == [("2", "[2, 3]"), ("0", "[0, 1]"), ("1", "[0, 1]")], str(info.value)  # where each was made


def test_one_rank_groups_made_by_their_member_only_both_work() -> None:
    """Both named '1', but a one-rank group connects to no one: measured, both all_reduce
    their own rank's value (a regression sweep: the collision was reported for them)."""
    def own_group(rank: int) -> list[float]:
        return _reduce_on(dist.new_group([rank]))

    assert SimCluster(2).run(own_group).values == [[1.0, 1.0], [2.0, 2.0]]


def test_every_rank_making_every_group_counts_names_as_torch_does() -> None:
    def every_rank(rank: int) -> tuple[list[float], int]:
        pair, other = dist.new_group([0, 1]), dist.new_group([2, 3])
        return _reduce_on(pair if rank < 2 else other), dist.distributed_c10d._world.group_count

    assert SimCluster(4).run(every_rank).values == [([3.0, 3.0], 3)] * 2 + [([7.0, 7.0], 3)] * 2


def test_a_rank_whose_count_is_ahead_makes_another_group_under_the_name() -> None:
    """Rank 0 made new_group([0]) first: its new_group([0, 1]) is its group '2', rank 1's
    is '1' — on gloo rank 0 waited out its timeout and rank 1 connected to rank 0's group [0]."""
    def counts_differ(rank: int) -> list[float]:
        if rank == 0:
            dist.new_group([0])
        return _reduce_on(dist.new_group([0, 1]))

    with pytest.raises(CollectiveMismatchError, match=r"rank 1 made the group \[0, 1\] as its group '1', but rank 0 "
                                                      r"made \[0\] under that name"):
        SimCluster(2).run(counts_differ)


def test_use_local_synchronization_groups_are_made_by_members_only() -> None:
    def local(rank: int) -> tuple[list[float], object]:
        mine = dist.new_group([0, 1] if rank < 2 else [2, 3], use_local_synchronization=True)
        other = dist.new_group([2, 3] if rank < 2 else [0, 1], use_local_synchronization=True)
        return _reduce_on(mine), other  # a non-member's call returns None (measured)

    assert SimCluster(4).run(local).values == [([3.0, 3.0], None)] * 2 + [([7.0, 7.0], None)] * 2


def test_a_gloo_member_waits_in_new_group_until_every_member_made_it() -> None:
    """Real gloo connects a group's members when it is made: rank 0 alone in new_group([0, 1])
    waited there until its timeout (measured). NCCL makes its communicator at the first
    collective: making a group no one uses returns at once."""
    def alone(rank: int) -> None:
        if rank == 0:
            dist.new_group([0, 1])

    with pytest.raises(DeadlockError, match=r"rank 0: blocked in dist.new_group\(\[0, 1\]\) \(torch's group '1'\)"):
        SimCluster(2).run(alone)
    assert SimCluster(2, backend="nccl").run(alone).values == [None, None]

    def both_late(rank: int) -> list[float]:  # rank 0 waits, rank 1 arrives: both go on
        return _reduce_on(dist.new_group([0, 1]))

    run = SimCluster(2).run(both_late)
    assert run.values == [[3.0, 3.0]] * 2
    waits = [(type(e).__name__, e.rank) for e in run.trace.events if "dist.new_group" in getattr(e, "future", "")]
    assert waits == [("Blocked", 0), ("Resumed", 0)]  # the last member to arrive does not wait
    told = run.trace.format()  # as the deadlock report and explain word it: no wait() the code never wrote
    assert "rank 0: blocks in dist.new_group([0, 1]) (torch's group '1')" in told, told
    assert "rank 0: returns from dist.new_group([0, 1])" in told and "wait()" not in told, told


@pytest.mark.parametrize("world, ranks, error, first_line", [
    # measured on real gloo, torch 2.13: benchmarks/measure_new_group_errors.py
    (1, [], TypeError, "__init__(): incompatible constructor arguments. The following argument types are supported:"),
    (2, [], TypeError, "__init__(): incompatible constructor arguments. The following argument types are supported:"),
    (1, [0, 5], ValueError, "the new group's world size should be less or equal to the world size set by "
                            "init_process_group"),
    (2, [0, 5], ValueError, "Rank 5 is out of range. Valid ranks are 0 to 1 (world_size=2)"),
    (2, [0, 0], ValueError, "ranks list must not contain duplicate entries, got [0, 0]"),
])
def test_a_bad_new_group_rank_list_raises_what_torch_raises(world: int, ranks: list[int], error: type,
                                                            first_line: str) -> None:
    """A factory splitting a one-rank world in halves calls ``new_group([])`` (wild5: SimiGrad);
    real torch raises a pybind TypeError, the simulator raised its own ValueError, and e2e
    compared two different errors. The first line is what e2e compares, byte for byte."""
    def body(rank: int) -> None:
        dist.new_group(ranks)

    with pytest.raises(error) as info:
        SimCluster(world).run(body)
    assert str(info.value).splitlines()[0] == first_line


def test_new_subgroups_without_size_fails_on_cpu_as_torch_does() -> None:
    with pytest.raises(ValueError, match="Default group size only takes effect when CUDA is available"):
        SimCluster(2).run(lambda r: dist.new_subgroups())


def test_collective_outside_a_run_is_a_clear_error() -> None:
    pg = SimCluster(2).process_group(0)
    with pytest.raises(Exception, match="outside a simulated run"):
        dist.all_reduce(torch.ones(1), group=pg)


def test_size_and_rank_answer_what_torch_was_given_on_every_group() -> None:
    def body(rank: int) -> list[tuple[int, int, int, int]]:
        sub = dist.new_group([1, 2])
        groups = [dist.group.WORLD] + ([sub] if rank in (1, 2) else [])
        return [(g.size(), g.rank(), dist.ProcessGroup.size(g), dist.ProcessGroup.rank(g)) for g in groups]

    values = SimCluster(3).run(body).values
    assert values == [[(3, 0, 3, 0)], [(3, 1, 3, 1), (2, 0, 2, 0)], [(3, 2, 3, 2), (2, 1, 2, 1)]]


def test_collective_with_root_on_a_group_the_rank_is_not_in_is_skipped_as_in_torch() -> None:
    """Measured on real gloo, torch 2.13, world 3 (docs/gloo-facts.md, *Non-members*): on
    rank 2, after ``g = dist.new_group([0, 1])``, ``dist.reduce(t, dst=0, group=g)`` and
    ``dist.broadcast(t, 0, group=g)`` warn and return None, leaving ``t`` alone — torch
    registers the non-member's ``NON_GROUP_MEMBER`` with the ranks of the group it was not
    let into, so translating ``dst=0`` succeeds before the non-member check. A root outside
    those ranks raises ``ValueError`` (the logger's 'Invalid process group specified')."""
    def rank_fn(rank: int) -> tuple[list[float], object, object]:
        g = dist.new_group([0, 1])
        t = torch.tensor([float(rank + 1)])
        with pytest.warns(UserWarning, match="does not belong to the given group") if rank == 2 else _no_warning():
            r1 = dist.reduce(t, dst=0, group=g)
            r2 = dist.broadcast(t, 0, group=g)
        if rank == 2:
            with pytest.raises(ValueError, match="Invalid process group specified"):
                dist.reduce(t, dst=2, group=g)
        return t.tolist(), r1, r2

    out = SimCluster(3).run(rank_fn).values
    assert out == [([3.0], None, None), ([3.0], None, None), ([3.0], None, None)]


class _no_warning:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_missing_attribute_is_named_on_torchs_type_as_real_gloo_names_it() -> None:
    """Measured (torch 2.13, gloo, world 1): ``work.to_future`` raises AttributeError
    ``'torch._C._distributed_c10d.Work' object has no attribute 'to_future'``, and a group's
    missing attribute names ``torch._C._distributed_c10d.ProcessGroup``. The simulator said
    ``'SimWork' object …``: e2e then called a hook from the wild that calls
    ``all_reduce(…).to_future()`` a fidelity bug (the messages must match byte for byte)."""
    def rank_fn(rank: int) -> list[str]:
        work = dist.all_reduce(torch.ones(2), async_op=True)
        messages = []
        for obj, name in ((work, "to_future"), (dist.group.WORLD, "nope")):
            with pytest.raises(AttributeError) as info:
                getattr(obj, name)
            messages.append(str(info.value))
        work.wait()
        return messages

    assert SimCluster(1).run(rank_fn).values[0] == [
        "'torch._C._distributed_c10d.Work' object has no attribute 'to_future'",
        "'torch._C._distributed_c10d.ProcessGroup' object has no attribute 'nope'",
    ]


def test_a_group_in_torchs_own_error_reads_as_a_real_group_with_its_address_masked() -> None:
    """Real gloo (torch 2.13, a group [1, 2] of world 3): ``dist.get_group_rank(group, 0)``
    raises ``Global rank 0 is not part of group <torch.distributed.distributed_c10d.ProcessGroup
    object at 0x7f…>`` — torch quotes the group's default repr. The simulator's own repr
    (``SimProcessGroup(group2[2], …)``) made e2e call a hierarchical hook from the wild that
    hits this error a fidelity bug. The address is masked: no ``id()`` reaches a report."""
    real_repr = without_addresses(repr(dist.ProcessGroup(0, 1)))  # torch's own wording, measured here

    def rank_fn(rank: int) -> str:
        pair = dist.new_group([1, 2])
        if rank != 1:
            return ""
        with pytest.raises(ValueError) as info:
            dist.get_group_rank(pair, 0)
        assert repr(pair) == real_repr
        return str(info.value)

    assert SimCluster(3).run(rank_fn).values[1] == f"Global rank 0 is not part of group {real_repr}"
    assert "0x…" in real_repr


def test_functional_collectives_are_named_as_not_modelled_not_blamed_on_the_hook() -> None:
    """torch's ``_functional_collectives.all_reduce(t, "sum", group)`` reads ``group.group_name``
    and runs in the group's C++ backend; it works on real gloo (a hook from the wild, round 13:
    torch's own ``_compress_hook`` compiled branch taken always). A simulated group has no C++
    backend: the read raised torch's ``RuntimeError: ProcessGroup name not set``, which the
    check reported as the hook's liveness failure — a false alarm. Now: not modelled (exit 3)."""
    import torch.distributed._functional_collectives as funcol

    def rank_fn(rank: int) -> object:
        return funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)

    with pytest.raises(UnsupportedError, match=r"functional collectives .* are not modelled by the simulator"):
        SimCluster(2).run(rank_fn)


def _backend_aware_gather_mean(state, bucket):
    """Reads all_gather_into_tensor's future by backend, as portable code from the wild does:
    NCCL's [output] (one flat tensor), gloo's one view per rank."""
    world = dist.get_world_size()
    flat = bucket.buffer() / world
    out = torch.empty(world * flat.numel(), dtype=flat.dtype)
    fut = dist.all_gather_into_tensor(out, flat, async_op=True).get_future()

    def mean(f):
        rows = f.value()[0].view(world, -1) if dist.get_backend() == "nccl" else torch.stack(f.value())
        return rows.sum(0)

    return fut.then(mean)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_get_backend_names_the_modelled_backend_as_a_real_cluster_does(backend: str) -> None:
    """``dist.get_backend()`` said ``nccl-sim`` under the NCCL model: a hook branching on it took
    its gloo branch there and was reported broken (a false alarm)."""
    seen = SimCluster(2, backend=backend).run(lambda rank: dist.get_backend()).values
    assert seen == [backend, backend]
    report = check_hook(_backend_aware_gather_mean, backends=(backend,), world_sizes=(2, 3), examples=10,
                        database=None)
    assert report.passed, report.format()


def test_an_error_raised_in_a_collective_under_the_nccl_model_is_the_hooks_own() -> None:
    """torch's collective error logger asks torch.cuda.nccl.version() for an "nccl" group, which a
    CPU build lacks: the run stands in for it, so the hook sees the collective's own error."""
    def rank_fn(rank: int) -> str:
        try:
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
        except Exception as exc:  # noqa: BLE001 - the error is the subject
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    messages = SimCluster(2, backend="nccl").run(rank_fn).values
    assert all("BAND" in m and "AttributeError" not in m for m in messages), messages
    with pytest.raises(AttributeError):  # and after the run, torch is as it was
        torch.cuda.nccl.version()


def _barrier_after_async_all_reduce(rank: int) -> tuple[bool, bool]:
    """An async all_reduce with a then-callback, then a synchronous barrier (as a
    compression hook from the wild does): what the rank sees right after the barrier."""
    ran = {"callback": False}
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()

    def callback(f: torch.futures.Future) -> list[torch.Tensor]:
        ran["callback"] = True
        return f.value()

    fut.then(callback)
    dist.barrier()
    return fut.done(), ran["callback"]


@pytest.mark.parametrize("schedule", [[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], "reverse", "random"])
def test_gloo_barrier_completes_after_the_groups_earlier_work_and_its_callbacks(schedule: object) -> None:
    """Measured (torch 2.13, gloo, 2 ranks, docs/gloo-facts.md §8): after ``dist.barrier()``
    returns, an all_reduce posted before it is done and its ``then`` callback has run — even
    when the all_reduce cannot finish before the barrier is called (a peer posts late) and
    the callback sleeps. The gloo model let the scheduler complete the barrier first
    (schedule [1, 0, …]: neither was done), so a hook from the wild that zeroes its bucket
    after the barrier failed replicas_agree on a schedule real gloo never runs."""
    for seed in range(3):
        result = SimCluster(3, seed=seed, backend="gloo", schedule=schedule).run(_barrier_after_async_all_reduce)
        assert result.values == [(True, True)] * 3


def _barrier_behind_a_refused_all_reduce(rank: int, waits: bool) -> str:
    """An all_reduce gloo refuses at wait() (BAND on floats), waited on (error caught) or not,
    then a barrier: what the barrier did on this rank."""
    work = dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND, async_op=True)
    if waits:
        with pytest.raises(RuntimeError, match="BAND"):
            work.wait()
    try:
        dist.barrier()
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"  # the real backend's type (simcluster's BackendError is one)
    return "passed"


def test_a_gloo_barrier_behind_a_failed_collective_re_raises_its_error_on_every_rank_some_or_none() -> None:
    """Measured (torch 2.13, 2 real gloo ranks, ``benchmarks/measure_barrier_reraise.py
    --no-wait``: an unwaited all_reduce gloo refuses at ``wait()``, then a barrier): per rank
    a race — the barrier re-raised that error without taking part, or went into the exchange.
    One rank re-raised while its peer's barrier broke in 4 of the 5 runs where one did, both
    in 1, neither for 50 trials in another. The model re-raised on every rank alike, so a hook
    catching the error passed where real runs hung (3 of 4, a round of hooks written outside
    the project, 2026-12-07). Now each such rank's outcome is a pick of the schedule."""
    band = "RuntimeError: Cannot use ReduceOp.BAND with non-integral dtype"

    def run(schedule: str, seed: int = 0) -> Any:
        return SimCluster(2, seed=seed, backend="gloo", schedule=schedule).run(
            lambda rank: _barrier_behind_a_refused_all_reduce(rank, waits=False))

    assert run("in_order").values == ["passed"] * 2  # pick 0: the workers had let go
    every = run("reverse")
    assert every.values == [band] * 2
    assert ("barrier #1 on WORLD FAILS on ranks 0, 1: Cannot use ReduceOp.BAND with non-integral dtype "
            "(the error of all_reduce#0 on WORLD, which the barrier waited for)") in every.trace.format()
    with pytest.raises(DeadlockError) as info:
        run("random", seed=0)
    message = str(info.value)
    assert "barrier #1 on WORLD: rank 0 re-raised the error of all_reduce#0 on WORLD (Cannot use ReduceOp.BAND" in message
    assert "without taking part in the barrier" in message and "Ranks [1] went into the barrier's exchange" in message


def test_a_gloo_barrier_right_after_a_caught_failure_may_still_re_raise_it() -> None:
    """Real gloo re-raises there too for a moment (1 trial in 3-75, measured: a worker lets go
    of a failed work only after its wait() raised); a hook that caught the error and called a
    barrier failed 2 of 4 six-step real runs and passed the model (a round of hooks written
    outside the project, 2026-12-07). Now the barrier right after a failed collective is
    behind it as behind an unfinished one: a pick per rank, 0 (in order) the exchange."""
    def run(schedule: str, seed: int = 0) -> Any:
        return SimCluster(2, seed=seed, backend="gloo", schedule=schedule).run(
            lambda rank: _barrier_behind_a_refused_all_reduce(rank, waits=True))

    assert run("in_order").values == ["passed", "passed"]
    assert run("reverse").values == ["RuntimeError: Cannot use ReduceOp.BAND with non-integral dtype"] * 2
    with pytest.raises(DeadlockError, match="unfinished then, or failed shortly before"):
        run("random", seed=0)


def _collectives_between(between: int) -> Callable[[int], str]:
    def rank_fn(rank: int) -> str:
        work = dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND, async_op=True)
        with pytest.raises(RuntimeError, match="BAND"):
            work.wait()
        for _ in range(between):
            dist.all_reduce(torch.ones(1))
        try:
            dist.barrier()
        except RuntimeError as exc:
            return f"RuntimeError: {exc}"
        return "passed"
    return rank_fn


@pytest.mark.parametrize("between", [1, 2])
def test_a_gloo_barrier_a_few_collectives_after_a_caught_failure_may_still_re_raise_it(between: int) -> None:
    """Measured on real gloo (benchmarks/measure_barrier_reraise.py --between K): with one or two
    successful all_reduces between the caught failure and the barrier, the barrier still
    re-raised the failure in 3 of 4 runs (gloo's second worker thread runs them while the first
    is still letting go of the failed work); with three, never in 1,200 trials. The model held
    only the collective just before the barrier, and passed such a hook under every schedule."""
    outcomes = {tuple(SimCluster(2, backend="gloo", schedule=schedule).run(_collectives_between(between)).values)
                for schedule in ("in_order", "reverse")}
    assert outcomes == {("passed", "passed"), ("RuntimeError: Cannot use ReduceOp.BAND with non-integral dtype",) * 2}


def test_a_gloo_barrier_three_collectives_after_a_caught_failure_passes_under_every_schedule() -> None:
    for seed in range(4):
        assert SimCluster(2, seed=seed, backend="gloo", schedule="random").run(_collectives_between(3)).values == \
            ["passed", "passed"]
    assert SimCluster(2, backend="gloo", schedule="reverse").run(_collectives_between(3)).values == ["passed"] * 2


def test_a_gloo_barrier_called_inside_an_earlier_collectives_callback_deadlocks() -> None:
    """Measured: real gloo hangs (both ranks, past the group's 8 s timeout) when a then-callback
    running on the worker that ran an all_reduce calls ``dist.barrier()`` — the barrier waits
    for that all_reduce, which finishes only when its callback returns. The simulator says
    so, and why."""
    def rank_fn(rank: int) -> Any:
        fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()

        def callback(f: torch.futures.Future) -> list[torch.Tensor]:
            dist.barrier()
            return f.value()

        return fut.then(callback).wait()

    with pytest.raises(DeadlockError) as info:
        SimCluster(2, backend="gloo", schedule="in_order").run(rank_fn)
    message = str(info.value)
    assert "barrier() (call #1 on WORLD): on ranks [0, 1] it waits, as gloo's barrier does" in message
    assert "behind 2 busy backend worker threads" not in message


def _a2a_outcome(world: int, backend: str, make: Any) -> list[tuple[str, object]]:
    """Each rank's ``all_to_all_single`` with ``make(rank) -> (out, inp, out_splits,
    in_splits)``: ``("ok", out)``, or where it raised (``"call"``/``"wait"``) and the error."""

    def rank_fn(rank: int) -> tuple[str, object]:
        out, inp, out_splits, in_splits = make(rank)
        try:
            work = dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=True)
        except RuntimeError as exc:
            return "call", f"RuntimeError: {exc}"  # the real backend's type (simcluster's BackendError is one)
        try:
            work.wait()
        except RuntimeError as exc:
            return "wait", f"RuntimeError: {exc}"
        return "ok", out

    return SimCluster(world, backend=backend).run(rank_fn).values


@pytest.mark.parametrize("world", [1, 2])
def test_all_to_all_single_split_sizes_not_fitting_fail_at_wait_on_gloo_with_torchs_words(world: int) -> None:
    # Measured (benchmarks/measure_alltoall.py, docs/gloo-facts.md §8): real gloo posts the
    # call and its work fails at wait() with c10d's checkSplitSizes message, input first —
    # also at world 1 (two sizes for a one-rank group). The fake raised its own ValueError
    # at the call.
    count = _a2a_outcome(world, "gloo", lambda r: (torch.empty(2 * world), torch.arange(2.0 * world),
                                                     [1] * (world + 1), [1] * (world + 1)))
    assert count == [("wait", "RuntimeError: Number of tensor splits not equal to group size")] * world
    total = _a2a_outcome(world, "gloo", lambda r: (torch.empty(world), torch.arange(float(world)),
                                                     [1] * world, [2] * world))
    assert total == [("wait", "RuntimeError: Split sizes doesn't match total dim 0 size")] * world


def test_all_to_all_single_split_count_raises_at_the_call_on_nccl() -> None:
    # NCCL's alltoall_base runs checkSplitSizes before enqueueing (read, not run).
    got = _a2a_outcome(1, "nccl", lambda r: (torch.empty(2), torch.arange(2.0), [1, 1], [1, 1]))
    assert got == [("call", "RuntimeError: Number of tensor splits not equal to group size")]


def test_all_to_all_single_without_splits_cuts_bytes_on_gloo() -> None:
    # Measured on real gloo, 2 ranks, inputs arange(5) + 10 * rank (float32): each rank
    # gets 10 bytes — two and a half floats — from each; these are real gloo's outputs.
    got = _a2a_outcome(2, "gloo", lambda r: (torch.full((5,), 99.0), torch.arange(5.0) + 10 * r, [], []))
    assert [kind for kind, _ in got] == ["ok", "ok"]
    assert got[0][1].tolist() == [0.0, 1.0, 0.0, 2.336244799722335e-41, 2.3384868772652547e-41]
    assert got[1][1].tolist() == [2.2958874039497803e-41, 2.304855714121459e-41, 12.0157470703125, 13.0, 14.0]
    rows = _a2a_outcome(2, "gloo", lambda r: (torch.full((3, 2), 99.0), torch.arange(6.0).reshape(3, 2) + 10 * r,
                                              [], []))
    assert rows[0][1].flatten().tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
    assert rows[1][1].flatten().tolist() == [3.0, 4.0, 5.0, 13.0, 14.0, 15.0]
    uneven = _a2a_outcome(2, "gloo", lambda r: (torch.empty(5, dtype=torch.uint8),
                                                torch.arange(5, dtype=torch.uint8), [], []))
    assert uneven == [("wait", "RuntimeError: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/"
                                "alltoall.cc:29] in->size % context->size == 0. ")] * 2
    sizes = _a2a_outcome(2, "gloo", lambda r: (torch.empty(6), torch.arange(4.0), [], []))
    assert sizes == [("wait", "RuntimeError: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/"
                               "alltoall.cc:30] in->size == out->size. ")] * 2


@pytest.mark.parametrize("make, message", [
    # measured on real gloo, 2 ranks (docs/gloo-facts.md §8): raised at the call, as a RuntimeError
    (lambda: dist.all_gather_into_tensor(torch.empty(12), torch.ones(2, 3), async_op=True),
     "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (2, 3), got (6))"),
    (lambda: dist.all_gather_into_tensor(torch.empty(2, 6), torch.ones(2, 3), async_op=True),
     "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (2, 3), got (1, 6))"),
    (lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(3), async_op=True),
     "ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (3), got (2))"),
    (lambda: dist.all_gather_into_tensor(torch.empty(1), torch.ones(1), async_op=True),
     "ProcessGroupGloo::allgather: invalid output tensor list at index 0 (expected length 2, got 1)"),
    (lambda: dist.all_gather([torch.empty(1)] * 3, torch.ones(1), async_op=True),
     "ProcessGroupGloo::allgather: invalid output tensor list at index 0 (expected length 2, got 3)"),
    (lambda: dist.all_gather([torch.empty(1, 1), torch.empty(1, 1)], torch.ones(1), async_op=True),
     "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (1), got (1, 1))"),
])
def test_gloo_all_gathers_refuse_outputs_that_do_not_fit_with_gloos_words(make: Any, message: str) -> None:
    # The fake raised its own ValueError ('output has 2 elements, expected input.numel() *
    # world_size = 1'), and accepted a (2, 6) output for a (2, 3) input, which gloo refuses.
    def rank_fn(rank: int) -> str:
        try:
            make()
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    assert SimCluster(2, backend="gloo").run(rank_fn).values == [message, message]


def test_gloo_all_gather_into_tensor_takes_a_stacked_output() -> None:
    def rank_fn(rank: int) -> torch.Tensor:
        out = torch.empty(4, 3)
        dist.all_gather_into_tensor(out, torch.full((2, 3), float(rank)))
        return out

    for out in SimCluster(2, backend="gloo").run(rank_fn).values:
        assert out.tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2


def _posted_then(write: Any) -> Any:
    """A rank function: posts the call ``write`` names, writes (or not) while it is in flight, waits."""
    def rank_fn(rank: int) -> None:
        t, other = torch.arange(4.0) + rank, torch.arange(4.0)
        outs = [torch.zeros(4), torch.zeros(4)]
        with torch.inference_mode():
            frozen = torch.ones(4)
        if write in ("coalesced: the second tensor", "coalesced: nothing"):
            work = dist.all_reduce_coalesced([t, other], async_op=True)
        elif write == "all_gather: an output":
            work = dist.all_gather(outs, t, async_op=True)
        elif write == "an inference tensor: a value":
            work = dist.all_reduce(frozen, async_op=True)
        elif write.startswith("a 1-element strided view"):
            work = dist.all_reduce(t[0:3:2][:1], async_op=True)
        else:
            work = dist.all_reduce(t, async_op=True)
        {"copy_ of itself": lambda: t.copy_(t), "zero_ of an empty slice": lambda: t[4:].zero_(),
         "squeeze_": lambda: t.squeeze_(), "coalesced: nothing": lambda: None,
         "a 1-element strided view, the other element": lambda: t[2:3].zero_(),
         "a value": lambda: t.mul_(2), "coalesced: the second tensor": lambda: other.mul_(2),
         "all_gather: an output": lambda: outs[1].fill_(7), "an inference tensor: a value": lambda: frozen.mul_(2),
         }[write]()
        work.wait()
    return rank_fn


@pytest.mark.parametrize("write", ["copy_ of itself", "zero_ of an empty slice", "squeeze_", "coalesced: nothing",
                                   "a 1-element strided view, the other element"])
def test_what_moves_a_version_counter_but_no_value_is_no_write_in_flight(write: str) -> None:
    """Calls that move the counter of a tensor in flight without changing a value are no race
    (real gloo: 0 wrong of 300 each, a round of hooks from the wild): the values are compared
    with a copy taken at the post. A 1-element view with a stride of 2 crashed that comparison
    on the engine's pool thread, and the run waited out its deadline, charged to the hook."""
    SimCluster(2).run(_posted_then(write))


@pytest.mark.parametrize("write", ["a value", "coalesced: the second tensor", "all_gather: an output",
                                   "an inference tensor: a value"])
def test_a_write_to_any_tensor_a_call_has_in_flight_is_reported(write: str) -> None:
    """Every tensor a call reads or writes in flight is watched: a coalesced call's every tensor
    (only the first was: real gloo wrong 174 of 300), an all_gather's outputs (wrong 21-26 of
    300 at 200k elements), an inference tensor (no version counter: reading it raised
    "Inference tensors do not track version counter", charged to the hook)."""
    with pytest.raises(InFlightWriteError, match=r"wrote to a tensor that \w+#0 on WORLD"):
        SimCluster(2).run(_posted_then(write))


def test_an_engine_step_that_breaks_on_a_pool_thread_is_a_simulator_bug_not_a_hang() -> None:
    """An exception in the engine's own step (here: the scheduler's pick) on a pool thread —
    which drives once a rank waits — ended that thread and left the run to its deadline, then
    charged to the hook as a hang (a comparison crashing on a strided view did so, round 20 of
    hooks from the wild). The run now aborts and raises it as simcluster's bug."""
    class Broken:
        choose = {}.__getitem__  # raises KeyError from C: no frame of this file in its traceback

        def describe(self) -> str:
            return "broken"

    def rank_fn(rank: int) -> None:
        dist.all_reduce(torch.ones(1), async_op=True).wait()

    with pytest.raises(SimulatorBug) as info:
        SimCluster(2, schedule=Broken(), stuck_timeout=5).run(rank_fn)
    assert isinstance(info.value.__cause__, KeyError)

    class RaisingSchedule(Broken):  # a schedule of the user's own that raises is the user's exception
        def choose(self, n_ready: int) -> int:
            raise ZeroDivisionError("a schedule of the user's")

    with pytest.raises(ZeroDivisionError) as raised:
        SimCluster(2, schedule=RaisingSchedule(), stuck_timeout=5).run(rank_fn)
    assert "raised by the code under test while simcluster's engine ran" in "\n".join(raised.value.__notes__)


def test_a_write_in_flight_names_the_tensor_written_and_how_it_was_seen() -> None:
    """A coalesced call's second tensor written: the report named the call's first tensor's
    dtype and shape (an empty one: a round of hooks from the wild). It names the one written,
    and, for a tensor too large to keep a copy of, that a counter moved by a call that changes
    no value would read the same."""
    def rank_fn(rank: int) -> None:
        empty, written = torch.zeros(0), torch.ones(3)
        work = dist.all_reduce_coalesced([empty, written], async_op=True)
        written.mul_(2)
        work.wait()

    with pytest.raises(InFlightWriteError) as info:
        SimCluster(2).run(rank_fn)
    assert "had in flight (its tensor 2 of 2, float32[3]): after posting it" in str(info.value), info.value

    def large_only(rank: int) -> None:
        large = torch.ones(5000)
        work = dist.all_reduce(large, async_op=True)
        large.copy_(large)
        work.wait()

    with pytest.raises(InFlightWriteError, match=r"in flight \(float32\[5000\]\).*seen by its version counter, which "
                                                 r"in-place calls that change no value .* move too"):
        SimCluster(2).run(large_only)


# --------------------------------------------------------------------------- who wrote in flight
def _scales(t: torch.Tensor) -> None:
    t.copy_(t)  # moves the counter, changes no value: not the writer
    t.mul_(2)  # the writer


def test_a_reported_run_names_the_user_line_that_wrote_to_a_tensor_in_flight() -> None:
    """The report named only the line that posted the call. A run that records posting lines
    (what ``check`` re-runs a reported failure with) traces user lines and names the one after
    which the values changed — in a helper, with the hook line that called it — not the
    same-value write before it."""
    def rank_fn(rank: int) -> None:
        t = torch.arange(4.0) + 1
        work = dist.all_reduce(t, async_op=True)
        _scales(t)
        work.wait()

    with pytest.raises(InFlightWriteError) as info:
        SimCluster(2, posting_lines=True).run(rank_fn)
    message = str(info.value)
    assert re.search(r"ranks \[0, 1\] wrote to it at \S*test_process_group.py:\d+ in _scales: t.mul_\(2\)  # the writer "
                     r"\(called from \S*test_process_group.py:\d+ in rank_fn: _scales\(t\)\)", message), message
    with pytest.raises(InFlightWriteError) as info:  # the search's runs do not trace
        SimCluster(2).run(rank_fn)
    assert "wrote to it at" not in str(info.value)


def test_a_write_no_user_line_made_is_blamed_on_none() -> None:
    """An all_gather completing first writes its result (its counter moved, as gloo moves it)
    into the memory an all_reduce posted earlier still has in flight: a race, reported; but no
    user line wrote it, so none is named — not the line that ran last before the engine wrote
    (the schedule completes the all_gather first and lets each rank run on before the all_reduce)."""
    def rank_fn(rank: int) -> None:
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)
        gather = dist.all_gather_into_tensor(t, torch.full((2,), float(rank)), async_op=True)
        t.numel()  # a user line runs before the engine completes anything
        gather.wait()
        work.wait()

    with pytest.raises(InFlightWriteError) as info:
        SimCluster(2, posting_lines=True, schedule=[1, 0, 0]).run(rank_fn)
    message = str(info.value)
    assert "wrote to a tensor that all_reduce#0 on WORLD had in flight" in message, message
    assert "posted it at" in message and "wrote to it" not in message, message


def test_a_write_in_flight_on_a_one_rank_group_is_no_race() -> None:
    """A collective of one rank moves no data: the write meets no transfer. The shrinker took
    write-in-flight failures to world 1, where the report's "differently on each rank" was not
    true (round 23 of hooks from the wild); they now show at world 2 and more."""
    SimCluster(1).run(_posted_then("a value"))
    with pytest.raises(InFlightWriteError):
        SimCluster(2).run(_posted_then("a value"))


def test_a_reported_rerun_records_the_first_user_read_of_memory_in_flight_and_nothing_else() -> None:
    """The read watch (simcluster.fake.read_watch) of a run that records posting lines: a
    user line that reads a tensor an all_reduce has in flight, once per call; not metadata or
    views, not other tensors, not a read after wait(), not the simulator's own reads."""
    from simcluster.engine.trace import ReadInFlight

    def rank_fn(rank: int) -> float:
        scale, other = torch.tensor([float(rank + 1), 0.0]), torch.ones(2)
        work = dist.all_reduce(scale, op=dist.ReduceOp.MAX, async_op=True)
        _ = (scale.shape, scale.numel(), scale.dtype, scale[:1], scale.view(2, 1), other.sum())  # no element read
        seen = scale[:1].sum().item()  # read through a view
        scale.max()  # a second read of the same call: not recorded again
        work.wait()
        return seen + scale.sum().item()  # after wait(): no race

    run = SimCluster(2, posting_lines=True).run(rank_fn)
    reads = run.trace.of(ReadInFlight)
    assert [(e.rank, e.op, e.seq, e.how) for e in reads] == [(0, "all_reduce", 0, "Tensor.sum"),
                                                             (1, "all_reduce", 0, "Tensor.sum")], reads
    assert "seen = scale[:1].sum().item()" in reads[0].site
    assert "rank 0: reads memory all_reduce #0 on WORLD still has in flight (Tensor.sum at" in run.trace.format()
    assert not SimCluster(2).run(rank_fn).trace.of(ReadInFlight)  # the search never watches


def names_a_hook_may_read(rank: int, world_size: int = 1, payload: Any = None) -> list[Any]:
    """What a hook reads of its objects' names, run on real gloo (a job of ``gloo_world``) and
    in a simulated run: type names and class reprs, and the groups' descriptions."""
    work = dist.all_reduce(torch.ones(1), async_op=True)
    future = work.get_future()
    objects = [work, future, future.then(lambda f: f.value()), torch.futures.Future(), dist.group.WORLD]
    names = [(type(x).__name__, type(x).__qualname__, repr(type(x))) for x in objects]
    descs = [dist.group.WORLD.group_desc, dist.new_group([0]).group_desc, dist.new_group([0], group_desc="mine").group_desc]
    future.wait()
    return [names, descs]


def test_the_names_a_hook_reads_are_real_gloos(gloo_world: Any) -> None:
    """``type(fut).__name__`` said ``torch._C.Future`` (real: ``Future``), a work's and a group's
    the dotted C path too, and a group's ``group_desc`` was empty (real: ``default_pg`` for
    WORLD, ``undefined`` for a new group): a hook naming a type in its message, or branching on
    the description, did another thing than on real gloo (e2e: FIDELITY BUG; an audit of
    hostile hooks, 2026-12-07). Python's own errors still name the C path (tests above)."""
    real = gloo_world(1).run(names_a_hook_may_read, [None], timeout=120.0)[0]
    assert real[1] == ["default_pg", "undefined", "mine"] and real[0][0][0] == "Work"  # the measured facts, stated
    assert SimCluster(1).run(names_a_hook_may_read).values[0] == real


def recv_sources(rank: int, world_size: int = 2, payload: Any = None) -> list[Any]:
    """What ``source_rank()`` answers on point-to-point works, on real gloo (a job of
    ``gloo_world``) and in a simulated run: a batched irecv's, a plain irecv's, a send's."""
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), peer), dist.P2POp(dist.irecv, torch.zeros(2), peer)]
    send, recv = dist.batch_isend_irecv(ops)
    answers: list[Any] = []
    try:
        send.source_rank()
    except RuntimeError as exc:
        answers.append(str(exc))
    for work in (send, recv):
        work.wait()
    answers.append(recv.source_rank())
    if rank == 0:
        work = dist.isend(torch.ones(1), 1)
        work.wait()
    else:
        work = dist.irecv(torch.zeros(1), 0)
        answers.append(work.source_rank())  # not waited for yet
        work.wait()
        answers.append(work.source_rank())
    return answers


def test_a_recv_works_source_rank_is_real_gloos(gloo_world: Any) -> None:
    """gloo's recv work answers ``source_rank()`` with the rank it received from once its
    ``wait()`` returned (-1 before, even completed); every
    simulated work raised, and a hook asking a batched irecv where its data came from took
    another path than on real gloo (e2e: FIDELITY BUG; an audit of hostile hooks, 2026-12-07)."""
    real = gloo_world(2).run(recv_sources, [None, None], timeout=120.0)
    assert real[0][1] == 1 and real[1][1:] == [0, -1, 0]  # the measured facts, stated: -1 until wait() returned
    assert SimCluster(2).run(recv_sources).values == real


def _polls_its_recv_until_completed(rank: int) -> float:
    if rank == 0:
        dist.isend(torch.ones(1), 1).wait()
        return 1.0
    got = torch.zeros(1)
    work = dist.irecv(got, 0)
    while not work.is_completed():  # on real gloo: for ever (measured: False until wait() returned)
        pass
    work.wait()
    return float(got)


def test_a_hook_polling_a_point_to_point_work_before_waiting_deadlocks_on_the_gloo_model() -> None:
    """gloo's point-to-point works say ``is_completed()`` False until their ``wait()`` returned
    (measured: a recv polled for 2 s after its peer's send, and the send, both False): a rank
    polling its recv until it completes spins for ever on real gloo. The simulated work said
    True once the pair had matched, and such a hook passed. Under the NCCL model the work
    completes when the operation does."""
    with pytest.raises(DeadlockError, match=r"which gloo says is completed only once its wait\(\) returned"):
        SimCluster(2, backend="gloo").run(_polls_its_recv_until_completed)
    assert SimCluster(2, backend="nccl").run(_polls_its_recv_until_completed).values == [1.0, 1.0]


def argument_checks_job(rank: int, world_size: int, payload: Any = None) -> dict[str, str]:
    """Runs in each real gloo process (and in each simulated rank): arguments a hook can get
    wrong — dtypes gloo does not move, roots outside the group, a negative tag, layouts — each
    call made alike on every rank, then waited. Per case: where it failed (``call``/``wait``),
    the builtin class of the error and its first line, and the tensors' values after."""
    def t(dtype: torch.dtype = torch.float32, n: int = 4) -> torch.Tensor:
        return torch.full((n,), rank + 1.0).to(dtype)

    def each(name: str, post: Callable[[], Any], *kept: torch.Tensor) -> None:
        try:
            work = post()
        except Exception as exc:  # noqa: BLE001 - the answer
            outcome = f"call: {_builtin_name(exc)}: {first_line_of(exc)}"
        else:
            try:
                if work is not None:
                    work.wait()
                outcome = "ok"
            except Exception as exc:  # noqa: BLE001 - the answer
                outcome = f"wait: {_builtin_name(exc)}: {first_line_of(exc)}"
        out[name] = f"{outcome} | {[k.float().tolist() for k in kept]}"
        dist.all_reduce(torch.zeros(1))  # in step (not a barrier: gloo's re-raises an earlier failure)

    out: dict[str, str] = {}
    for dtype in (torch.int16, torch.float8_e4m3fn):
        x, outs, whole = t(dtype), [t(dtype) for _ in range(world_size)], t(dtype, 4 * world_size)
        each(f"broadcast {dtype}", lambda: dist.broadcast(x, 0, async_op=True), x)
        each(f"all_gather {dtype}", lambda: dist.all_gather(outs, t(dtype), async_op=True), *outs)
        each(f"all_gather_into_tensor {dtype}", lambda: dist.all_gather_into_tensor(whole, t(dtype), async_op=True),
             whole)
        each(f"scatter {dtype}", lambda: dist.scatter(x, outs if rank == 0 else None, 0, async_op=True), x)
        each(f"all_to_all_single {dtype}", lambda: dist.all_to_all_single(whole, t(dtype, 4 * world_size),
                                                                          async_op=True), whole)
        each(f"send/recv {dtype}", lambda: dist.isend(x, 1) if rank == 0 else dist.irecv(x, 0), x)
    gathered = [t(torch.complex64) for _ in range(world_size)]
    each("gather complex64", lambda: dist.gather(t(torch.complex64), gathered if rank == 0 else None, 0,
                                                 async_op=True), *[g.real for g in gathered])
    for root in (world_size, -1):
        each(f"broadcast src={root}", lambda: dist.broadcast(t(), root, async_op=True))
        each(f"reduce dst={root}", lambda: dist.reduce(t(), root, async_op=True))
        each(f"gather dst={root}", lambda: dist.gather(t(), None, root, async_op=True))
        each(f"scatter src={root}", lambda: dist.scatter(t(), None, root, async_op=True))
    shaped = torch.zeros(2, 3)
    each("send (6,) into recv (2, 3)", lambda: dist.isend(torch.arange(6.0), 1) if rank == 0 else dist.irecv(shaped, 0),
         shaped)
    each("send/recv tag=-3", lambda: dist.isend(t(), 1, tag=-3) if rank == 0 else dist.irecv(t(), 0, tag=-3))
    each("send/recv non-contiguous", lambda: (dist.isend(torch.zeros(3, 3).t(), 1) if rank == 0
                                              else dist.irecv(torch.zeros(3, 3).t(), 0)))
    each("all_to_all_single non-contiguous input", lambda: dist.all_to_all_single(
        torch.zeros(2 * world_size, 2), torch.zeros(2, 2 * world_size).t(), async_op=True))
    each("all_to_all_single non-contiguous output", lambda: dist.all_to_all_single(
        torch.zeros(2, 2 * world_size).t(), torch.ones(2 * world_size, 2), async_op=True))
    each("all_to_all outputs of 2, inputs of 1", lambda: dist.all_to_all(
        [torch.zeros(2) for _ in range(world_size)], [torch.ones(1) for _ in range(world_size)], async_op=True))
    each("all_to_all 3 inputs", lambda: dist.all_to_all(
        [torch.zeros(1) for _ in range(world_size)], [torch.ones(1) for _ in range(world_size + 1)], async_op=True))
    each("reduce_scatter list too long", lambda: dist.reduce_scatter(t(), [t() for _ in range(world_size + 1)],
                                                                    async_op=True))
    received = torch.zeros(2)
    work = dist.isend(torch.ones(2), 1) if rank == 0 else dist.irecv(received, 0)
    work.wait()
    out["irecv _source_rank after wait"] = str(work._source_rank()) if rank == 1 else "sender"
    for given, into in ((torch.float32, torch.float64), (torch.int32, torch.int64)):
        each(f"all_gather_into_tensor {given} into {into}", lambda: dist.all_gather_into_tensor(
            torch.zeros(4 * world_size, dtype=into), t(given), async_op=True))
    return out


def _builtin_name(exc: BaseException) -> str:
    """The builtin class an error is (simcluster's backend errors are subclasses of it)."""
    return next(k.__name__ for k in type(exc).__mro__ if k.__module__ == "builtins")


def first_line_of(exc: BaseException) -> str:
    return str(exc).partition("\n")[0]


@pytest.mark.gloo
def test_arguments_gloo_refuses_are_refused_where_and_as_real_gloo_does(gloo_world: Any) -> None:
    """Found by probing through e2e (stop 42): an int16 or float8 broadcast, all_gather,
    scatter or all_to_all passed here (only the reductions checked the dtype) where real gloo
    raises ``Invalid scalar type`` at wait() and moves nothing; a root past the group raised
    ``IndexError`` from inside simcluster, and root -1 was taken as the last rank; a negative tag,
    a non-contiguous send or all_to_all_single input, an all_gather_into_tensor output of
    another dtype, all_to_all tensors of different sizes all passed; list lengths were refused
    in simcluster's words; a recv's ``_source_rank()`` raised; a (6,) send received into a (2, 3)
    tensor was a mismatch. Real gloo, world 2, is the oracle."""
    real = gloo_world(2).run(argument_checks_job, [None, None], timeout=120.0)
    sim = SimCluster(2).run(lambda rank: argument_checks_job(rank, 2)).values
    for rank in range(2):
        assert {k: v for k, v in sim[rank].items() if v != real[rank][k]} == {}, f"rank {rank}: real {real[rank]}"
    assert real[1]["broadcast torch.int16"] == "wait: RuntimeError: Invalid scalar type | [[2.0, 2.0, 2.0, 2.0]]"
    assert real[0]["broadcast src=2"] == "call: RuntimeError: ProcessGroupGloo::broadcast: invalid root rank: 2 | []"


def test_a_broadcast_into_a_view_with_gaps_is_not_modelled() -> None:
    """Real gloo broadcasts the memory from each rank's data pointer, not a gapped view's
    elements (measured by probing through e2e, stop 42: ``broadcast(x[:, ::2], 1)`` wrote rank
    1's first six elements of memory into x[0, :] and x[1, :2]); the simulator wrote the view's
    elements only, a silent difference. Now the run has no verdict."""
    def rank_fn(rank: int) -> None:
        x = (torch.arange(12.0) + 100 * rank).reshape(3, 4)
        dist.broadcast(x[:, ::2], 1)

    with pytest.raises(UnsupportedError, match=r"a broadcast into a \[3, 2\] view with gaps"):
        SimCluster(2).run(rank_fn)
    SimCluster(2).run(lambda rank: dist.broadcast(torch.ones(3, 4).t(), 0))  # a dense permutation is modelled


def completed_after_wait_job(rank: int, world_size: int, payload: Any = None) -> dict[str, bool]:
    """``work.is_completed()`` right after each call's ``wait()`` returned."""
    def after_wait(post: Callable[[], Any]) -> bool:
        work = post()
        work.wait()
        return work.is_completed()

    return {
        "all_reduce": after_wait(lambda: dist.all_reduce(torch.ones(4), async_op=True)),
        "reduce_scatter": after_wait(lambda: dist.reduce_scatter(torch.zeros(2), [torch.ones(2)] * world_size,
                                                                 async_op=True)),
        "reduce_scatter_tensor": after_wait(lambda: dist.reduce_scatter_tensor(
            torch.zeros(2), torch.ones(2 * world_size), async_op=True)),
        "all_gather": after_wait(lambda: dist.all_gather([torch.zeros(2) for _ in range(world_size)], torch.ones(2),
                                                         async_op=True)),
        "broadcast": after_wait(lambda: dist.broadcast(torch.ones(2), 0, async_op=True)),
        "send/recv": after_wait(lambda: dist.isend(torch.ones(2), 1) if rank == 0 else dist.irecv(torch.zeros(2), 0)),
    }


@pytest.mark.gloo
def test_a_reduce_scatter_never_says_it_completed_as_on_real_gloo(gloo_world: Any) -> None:
    """gloo's reduce_scatter works say ``is_completed()`` False even after their ``wait()``
    returned (every other collective's says True); the simulated one said True, so a hook
    polling one passed here and spins for ever on gloo (found probing through e2e, stop 42).
    Real gloo, world 2, is the oracle; a polling hook is a deadlock that says why."""
    real = gloo_world(2).run(completed_after_wait_job, [None, None], timeout=120.0)
    sim = SimCluster(2).run(lambda rank: completed_after_wait_job(rank, 2)).values
    assert sim == real
    assert real[0]["reduce_scatter"] is False and real[0]["all_reduce"] is True

    def polls(rank: int) -> None:
        work = dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(4), async_op=True)
        work.wait()
        while not work.is_completed():
            pass

    with pytest.raises(DeadlockError, match="gloo never says is completed"):
        SimCluster(2).run(polls)
