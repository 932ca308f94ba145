"""simcluster.fake.collectives: reductions against independent references, and bitwise against real gloo.

Part 1 checks the model without gloo: exact integer/float64 arithmetic, and a scalar
re-derivation of gloo's ring order written from the measured description (per element,
in plain Python/numpy, sharing no code with the vectorised model). Part 2
(``@pytest.mark.gloo``) runs real gloo processes at world sizes 2, 3 and 4 and demands
identical bits, rank by rank, for sizes that straddle segment boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from simcluster.fake import collectives as C
from simcluster.limits import BACKEND_NAMES
from simcluster.errors import BackendError, UnsupportedError, UsageError
from simcluster.real.gloo_runner import GlooCluster

WORLDS = range(1, 9)


# ---------------------------------------------------------------- independent helpers
def make_inputs(seed: int, world: int, n: int, dtype: torch.dtype, nan: bool = False) -> list[torch.Tensor]:
    """Deterministic per-rank inputs with wide magnitudes (so the summation order shows)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return list((torch.rand(world, n, generator=g) < 0.6).unbind(0))
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -120), min(info.max, 120)
        return list(torch.randint(lo, hi + 1, (world, n), generator=g).to(dtype).unbind(0))
    scales = torch.tensor([1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3], dtype=torch.float64)
    x = torch.randn(world, n, generator=g, dtype=torch.float64) * scales[torch.randint(0, 7, (world, n), generator=g)]
    x = x.to(dtype)
    if nan:
        x[torch.rand(world, n, generator=g) < 0.25] = float("nan")
        x[torch.rand(world, n, generator=g) < 0.1] = -float("nan")
    return list(x.unbind(0))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as integers (bool bytes kept as they are)."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    diff = torch.nonzero(bits(got) != bits(want)).flatten()
    assert diff.numel() == 0, f"{what}: {diff.numel()} elements differ, first at {diff[:5].tolist()}"


def scalar_step(dtype: torch.dtype, op: str) -> Callable[[Any, Any], Any]:
    """One gloo reduction step ``acc (op) x`` on scalars, rounding to ``dtype``."""
    if dtype == torch.bfloat16:
        def rnd(v: float) -> float:
            return float(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16).float())
    else:
        np_type = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}[dtype]

        def rnd(v: float) -> float:
            return float(np_type(v))
    if op in ("SUM", "AVG"):
        return lambda acc, x: rnd(acc + x)
    if op == "PRODUCT":
        return lambda acc, x: rnd(acc * x)
    raise ValueError(op)


def ring_reference(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """gloo's all_reduce, element by element, from the description in docs/collectives.md.

    MIN/MAX pick one rank's element, so the result takes that element's exact bits.
    """
    world, n, esize = len(xs), xs[0].numel(), xs[0].element_size()
    values = [x.double().tolist() for x in xs]
    if world == 1:
        return xs[0].clone()
    total = n * esize
    num_seg = math.ceil(max(math.ceil(total / 2**20), 2 * world) / world) * world
    seg_elems = math.ceil(math.ceil(total / num_seg) / esize)
    chunk_elems = (num_seg // world) * seg_elems
    out = xs[0].clone()
    for i in range(n):
        order = [(i // chunk_elems - k) % world for k in range(1, world + 1)]
        if op in ("MIN", "MAX"):
            keep = order[0]
            for r in order[1:]:
                acc, x = values[keep][i], values[r][i]
                keep = keep if (acc < x if op == "MIN" else x < acc) else r
            out[i] = xs[keep][i]
        else:
            step = scalar_step(xs[0].dtype, op)
            acc = values[order[0]][i]
            for r in order[1:]:
                acc = step(acc, values[r][i])
            out[i] = acc
    return out


def wrap(value: int, dtype: torch.dtype) -> int:
    nbits = torch.iinfo(dtype).bits
    value %= 1 << nbits
    return value - (1 << nbits) if torch.iinfo(dtype).min < 0 and value >= 1 << (nbits - 1) else value


# ---------------------------------------------------------------- reduce_op_name
def test_reduce_op_name_accepts_every_form() -> None:
    for name in C.REDUCE_OPS:
        assert C.reduce_op_name(getattr(dist.ReduceOp.RedOpType, name))[0] == name
        if name != "PREMUL_SUM":  # torch only builds PREMUL_SUM through _make_nccl_premul_sum
            assert C.reduce_op_name(getattr(dist.ReduceOp, name)) == (name, None)
            assert C.reduce_op_name(dist.ReduceOp(getattr(dist.ReduceOp.RedOpType, name))) == (name, None)
    assert C.reduce_op_name(dist._make_nccl_premul_sum(0.25)) == ("PREMUL_SUM", 0.25)
    name, factor = C.reduce_op_name(dist._make_nccl_premul_sum(torch.tensor([3.0])))
    assert name == "PREMUL_SUM" and torch.equal(factor, torch.tensor([3.0]))
    assert C.reduce_op_name("avg") == ("AVG", None)
    with pytest.raises(UsageError, match="MEAN"):
        C.reduce_op_name("MEAN")
    with pytest.raises(UsageError, match="not a reduce op"):
        C.reduce_op_name(3.5)


# ---------------------------------------------------------------- exact references, worlds 1-8
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64])
def test_integer_ops_match_exact_arithmetic(backend: str, dtype: torch.dtype) -> None:
    ops = ["SUM", "PRODUCT", "MIN", "MAX"] + (["BAND", "BOR", "BXOR"] if backend == "gloo" else [])
    for world in WORLDS:
        xs = make_inputs(world, world, 41, dtype)
        cols = list(zip(*[x.tolist() for x in xs]))
        for op in ops:
            want = {
                "SUM": [wrap(sum(c), dtype) for c in cols],
                "PRODUCT": [wrap(math.prod(c), dtype) for c in cols],
                "MIN": [min(c) for c in cols], "MAX": [max(c) for c in cols],
                "BAND": [_fold(c, lambda a, b: a & b) for c in cols],
                "BOR": [_fold(c, lambda a, b: a | b) for c in cols],
                "BXOR": [_fold(c, lambda a, b: a ^ b) for c in cols],
            }[op]
            got = C.reduce(xs, op, backend)
            assert got.dtype == dtype and got.tolist() == want, (backend, dtype, world, op)


def _fold(values: tuple[int, ...], f: Callable[[int, int], int]) -> int:
    acc = values[0]
    for v in values[1:]:
        acc = f(acc, v)
    return acc


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_float_sum_is_exact_on_small_integers_and_bounded_otherwise(backend: str, dtype: torch.dtype) -> None:
    unit = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    for world in WORLDS:
        g = torch.Generator().manual_seed(world)
        ints = [torch.randint(-8, 9, (300,), generator=g).to(dtype) for _ in range(world)]
        exact = [sum(c) for c in zip(*[x.tolist() for x in ints])]
        assert C.reduce(ints, "SUM", backend).tolist() == exact  # no rounding: any order gives these
        xs = make_inputs(100 + world, world, 300, dtype)
        got = C.reduce(xs, "SUM", backend).double().tolist()
        for i, col in enumerate(zip(*[x.double().tolist() for x in xs])):
            bound = (world - 1) * unit * 1.01 * sum(abs(v) for v in col) * (1 + unit) ** world
            assert abs(got[i] - math.fsum(col)) <= bound, (backend, dtype, world, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX"])
def test_gloo_matches_scalar_ring_reference(dtype: torch.dtype, op: str) -> None:
    for world in WORLDS:
        for n in (1, 3, 57, 250):
            xs = make_inputs(7 * world + n, world, n, dtype, nan=op in ("MIN", "MAX"))
            if op == "PRODUCT":
                xs = [(1 + x.double() / 1000).to(dtype) for x in xs]
            want = ring_reference(xs, op)
            got = C.reduce(xs, op, "gloo")
            if op in ("MIN", "MAX"):  # which NaN survives is part of the measured semantics
                assert_same_bits(got, want, f"{op} {dtype} world {world} n {n}")
            else:
                assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_gloo_order_examples_from_design() -> None:
    # world 2: x0 + x1 (ring order x1 + x0, same bits)
    a, b = torch.tensor([0.1, 1e8, 3.0]), torch.tensor([0.2, -1e8 + 8, 1e-8])
    assert_same_bits(C.reduce([a, b], "SUM", "gloo"), a + b, "world 2")
    # world 4, 8 elements: 8 one-element segments, chunk c = elements 2c, 2c+1;
    # chunk 0 = ((x3 + x2) + x1) + x0, chunk 1 = ((x0 + x3) + x2) + x1
    xs = [torch.tensor([v] * 8) for v in (1.0, 1e8, -1e8, 3e-8)]
    got = C.reduce(xs, "SUM", "gloo")
    assert got[0] == ((xs[3][0] + xs[2][0]) + xs[1][0]) + xs[0][0]
    assert got[2] == ((xs[0][0] + xs[3][0]) + xs[2][0]) + xs[1][0]
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]  # the order is visible in the bits


def test_nccl_is_rank_order_fold() -> None:
    xs = make_inputs(5, 5, 999, torch.float32)
    want = xs[0].clone()
    for x in xs[1:]:
        want = want + x
    assert_same_bits(C.reduce(xs, "SUM", "nccl"), want, "nccl SUM")
    gloo = C.reduce(xs, "SUM", "gloo")
    assert not torch.equal(bits(gloo), bits(want))  # the two models really differ here


def test_avg_and_premul_sum() -> None:
    for world in WORLDS:
        xs = make_inputs(world, world, 120, torch.float16)
        s = C.reduce(xs, "SUM", "gloo")
        assert_same_bits(C.reduce(xs, "AVG", "gloo"), s / world, f"gloo AVG world {world}")
        inv = torch.tensor(1.0 / world, dtype=torch.float16)  # NCCL: PreMulSum by half(1/N)
        want = xs[0] * inv
        for x in xs[1:]:
            want = want + x * inv
        assert_same_bits(C.reduce(xs, "AVG", "nccl"), want, f"nccl AVG world {world}")
        f = torch.tensor(0.3, dtype=torch.float16)
        pre = xs[0] * f
        for x in xs[1:]:
            pre = pre + x * f
        assert_same_bits(C.reduce(xs, "PREMUL_SUM", "nccl", premul_factor=0.3), pre, "premul float")
        assert_same_bits(C.reduce(xs, "PREMUL_SUM", "nccl", premul_factor=torch.tensor([0.3])), pre, "premul tensor")
    # NCCL integer AVG: SumPostDiv, C division (toward zero), not floor
    ints = [torch.tensor([-3, 3, -4], dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32)]
    assert C.reduce(ints, "AVG", "nccl").tolist() == [-1, 1, -1]


def test_bool_semantics() -> None:
    xs = [torch.tensor([True, True, False, True])] * 3
    gloo = C.reduce(xs, "SUM", "gloo")  # gloo reduces bool as uint8 bytes: the count stays in the byte
    assert gloo.dtype == torch.bool and bits(gloo).tolist() == [3, 3, 0, 3]
    assert bits(C.reduce(xs, "SUM", "nccl")).tolist() == [1, 1, 0, 1]  # ProcessGroupNCCL: SUM -> MAX
    assert bits(C.reduce(xs, "PRODUCT", "gloo")).tolist() == [1, 1, 0, 1]
    dst = torch.zeros(4, dtype=torch.bool)
    assert bits(C.copy_bits_(dst, gloo)).tolist() == [3, 3, 0, 3]
    assert bits(dst.clone()).tolist() == [1, 1, 0, 1]  # why copy_bits_ exists: torch normalises on copy


def test_complex_empty_and_inputs_untouched() -> None:
    for backend in BACKEND_NAMES:
        xs = [torch.tensor([1 + 2j, 3 - 1j]) * (r + 1) for r in range(3)]
        kept = [x.clone() for x in xs]
        got = C.reduce(xs, "SUM", backend)
        assert got.dtype == torch.complex64 and torch.equal(got, torch.tensor([6 + 12j, 18 - 6j]))
        assert all(torch.equal(a, b) for a, b in zip(xs, kept))
        one = [torch.arange(4.0).reshape(2, 2)]
        res = C.reduce(one, "SUM", backend)
        assert torch.equal(res, one[0]) and res.data_ptr() != one[0].data_ptr() and res.shape == (2, 2)
        empty = C.reduce([torch.empty(0, 3)] * 4, "SUM", backend)
        assert empty.shape == (0, 3)


def test_rejections_are_the_backends_messages() -> None:
    gloo = lambda coll, op, dt: C.unsupported_reason(coll, op, dt, "gloo")  # noqa: E731
    assert gloo("all_reduce", "SUM", torch.float32) is None
    assert gloo("all_reduce", "AVG", torch.bfloat16) is None
    assert gloo("all_reduce", "PREMUL_SUM", torch.float32) == "Cannot use ReduceOp.PREMUL_SUM with Gloo"
    assert gloo("reduce", "BXOR", torch.float16) == "Cannot use ReduceOp.BXOR with non-integral dtype"
    assert gloo("all_reduce", "BAND", torch.int64) is None
    assert gloo("all_reduce", "AVG", torch.int8) == "result type Float can't be cast to the desired output type Char"
    assert gloo("all_reduce", "AVG", torch.bool) == "result type Float can't be cast to the desired output type Bool"
    assert gloo("all_gather", None, torch.int16) == "Invalid scalar type"
    assert gloo("all_reduce", "SUM", torch.uint16) == "Invalid scalar type"
    assert gloo("all_gather", None, torch.complex64) is None
    assert gloo("gather", None, torch.complex64) == "Invalid scalar type"
    assert gloo("all_reduce", "MAX", torch.complex64) == "all_reduce does not support RedOpType.MAX on complex tensors"
    assert gloo("reduce", "PRODUCT", torch.complex64) == "reduce does not support\x02on complex tensors"
    assert gloo("reduce_scatter", "MAX", torch.complex128) == "all_reduce does not support\x04on complex tensors"
    r = C.rejection("all_reduce", "MAX", torch.complex64, "gloo")
    assert r is not None and r.exc_type is ValueError and r.raised_at == "call"
    r = C.rejection("all_reduce", "PREMUL_SUM", torch.float32, "gloo")
    assert r is not None and r.exc_type is RuntimeError and r.raised_at == "wait" and r.evidence == "measured"
    nccl = lambda coll, op, dt: C.unsupported_reason(coll, op, dt, "nccl")  # noqa: E731
    assert nccl("all_reduce", "PREMUL_SUM", torch.float32) is None
    assert nccl("all_reduce", "BOR", torch.int32) == "Cannot use ReduceOp.BOR with NCCL"
    assert nccl("all_reduce", "AVG", torch.bool) == "Cannot use ReduceOp.AVG with boolean inputs"
    assert nccl("all_reduce", "PREMUL_SUM", torch.int64) == "PreMulSum Data type must be half, float, bfloat16 or double"
    assert nccl("broadcast", None, torch.int16) == "Input tensor data type is not supported for NCCL process group: Short"
    assert nccl("all_gather", None, torch.float8_e4m3fn) is None
    assert nccl("all_reduce", "SUM", torch.float8_e4m3fn) == "Float8 dtypes are not currently supported for NCCL reductions"
    with pytest.raises(BackendError, match="Cannot use ReduceOp.PREMUL_SUM with Gloo"):
        C.reduce([torch.ones(2)] * 2, "PREMUL_SUM", "gloo", premul_factor=2.0)
    with pytest.raises(UsageError, match="mpi"):
        C.reduce([torch.ones(2)] * 2, "SUM", "mpi")
    with pytest.raises(UsageError, match="rank 1"):
        C.reduce([torch.ones(2), torch.ones(3)], "SUM", "gloo")


def test_non_contiguous_layouts() -> None:
    bases = make_inputs(12, 3, 20 * 30, torch.float32)
    mats = [b.reshape(20, 30) for b in bases]
    # dense permutation: gloo reduces memory order, so the result is the contiguous result transposed
    got = C.reduce([m.t() for m in mats], "SUM", "gloo")
    assert got.stride() == (1, 30)
    assert_same_bits(got, C.reduce(mats, "SUM", "gloo").t(), "transposed")
    assert not torch.equal(bits(got.contiguous()), bits(C.reduce([m.t().contiguous() for m in mats], "SUM", "gloo")))
    # gaps: refused loudly, with the way to reproduce it
    with pytest.raises(UnsupportedError, match="memory_window"):
        C.reduce([m[:, ::2] for m in mats], "SUM", "gloo")
    window = C.memory_window(mats[0][2:, ::2])
    assert window.shape == (18 * 15,) and window[0] == mats[0][2, 0] and window[1] == mats[0][2, 1]
    with pytest.raises(UnsupportedError, match="past the end"):
        C.memory_window(torch.ones(1).expand(4))  # stride 0: only 1 element of memory
    with pytest.raises(ValueError, match="Tensors must be contiguous"):  # NCCL's class, not a RuntimeError
        C.reduce([m.t() for m in mats], "SUM", "nccl")
    with pytest.raises(UnsupportedError, match="strides"):
        C.reduce([mats[0].t(), mats[1].t().contiguous(), mats[2].t()], "SUM", "gloo")


def test_ring_chunks() -> None:
    assert C.ring_chunks(1000, 4, 3) == [(0, 334), (334, 668), (668, 1000)]  # measured boundaries
    for numel, esize, world in [(1, 4, 3), (57, 2, 4), (262145, 4, 4), (3_000_001, 8, 3)]:
        for kind in ("all_reduce", "reduce"):
            chunks = C.ring_chunks(numel, esize, world, kind=kind)
            assert chunks[0][0] == 0 and chunks[-1][1] == numel and len(chunks) == world
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    # above 2N MiB the two segmentings differ (allreduce shrinks segments, reduce keeps 1 MiB)
    assert C.ring_chunks(2_000_001, 4, 3) != C.ring_chunks(2_000_001, 4, 3, kind="reduce")


def test_reduce_to_root_partials() -> None:
    # x_r = 10**r makes every partial sum name the ranks it contains
    world, n = 3, 6
    xs = [torch.full((n,), 10.0**r) for r in range(world)]
    outs = C.reduce_to_root(xs, "SUM", "gloo", root=1)
    assert outs[1].tolist() == [111.0] * n
    # chunks of 2: chunk c starts at rank c-1 and ends complete on rank c
    assert outs[0].tolist() == [111.0, 111.0, 1.0, 1.0, 11.0, 11.0]
    assert outs[2].tolist() == [100.0, 100.0, 101.0, 101.0, 111.0, 111.0]
    assert all(torch.equal(x, torch.full((n,), 10.0**r)) for r, x in enumerate(xs))
    nccl = C.reduce_to_root(xs, "SUM", "nccl", root=2)
    assert nccl[2].tolist() == [111.0] * n and nccl[0].tolist() == [1.0] * n
    with pytest.raises(UsageError, match="root=3"):
        C.reduce_to_root(xs, "SUM", "gloo", root=3)


def test_reduce_scatter_forms_and_coalesced() -> None:
    world = 3
    slots = [make_inputs(40 + r, world, 57, torch.float32) for r in range(world)]
    got = C.reduce_scatter(slots, "SUM", "gloo")
    for k in range(world):
        assert_same_bits(got[k], C.reduce([slots[r][k] for r in range(world)], "SUM", "gloo"), f"slot {k}")
    whole = make_inputs(9, world, 3 * 57, torch.float32)
    parts = C.reduce_scatter_tensor(whole, "SUM", "gloo")
    full = C.reduce(whole, "SUM", "gloo")
    for k in range(world):
        assert_same_bits(parts[k], full[57 * k: 57 * (k + 1)], f"part {k}")
    bools = C.reduce_scatter_tensor([torch.ones(6, dtype=torch.bool)] * world, "SUM", "gloo")
    assert all(bits(p).tolist() == [1, 1] for p in bools)  # measured: normalised
    cplx = C.reduce_scatter_tensor([torch.tensor([1 + 1j, 2, 3j]) * (r + 1) for r in range(world)], "SUM", "nccl")
    assert [p.tolist() for p in cplx] == [[6 + 6j], [12 + 0j], [18j]]
    assert [p.shape for p in C.reduce_scatter_tensor([torch.empty(0)] * world, "SUM", "gloo")] == [(0,)] * world
    lists = [[x[:10], x[10:13].reshape(3, 1), x[13:]] for x in make_inputs(3, world, 60, torch.float32)]
    res = C.all_reduce_coalesced(lists, "SUM", "gloo")
    joined = C.reduce([torch.cat([t.reshape(-1) for t in ts]) for ts in lists], "SUM", "gloo")
    assert [t.shape for t in res] == [(10,), (3, 1), (47,)]
    assert_same_bits(torch.cat([t.reshape(-1) for t in res]), joined, "coalesced")


def test_large_reduction_is_vectorised() -> None:
    """8 ranks x 1M floats: a per-element Python loop would take minutes; the model takes well under a second."""
    import time

    xs = make_inputs(13, 8, 1 << 20, torch.float32)
    start = time.perf_counter()
    got = C.reduce(xs, "SUM", "gloo")
    elapsed = time.perf_counter() - start
    for i in (0, 123_457, (1 << 20) - 1):  # spot-check against the scalar reference's rule
        lo, hi = i, i + 1
        assert_same_bits(got[lo:hi], ring_reference_at(xs, i), f"element {i}")
    assert elapsed < 15.0, f"8 x 1M float32 SUM took {elapsed:.1f} s"


def ring_reference_at(xs: list[torch.Tensor], i: int) -> torch.Tensor:
    """Element i of gloo's float32 all_reduce, by the scalar rule (chunk from the formula)."""
    world, n = len(xs), xs[0].numel()
    num_seg = math.ceil(max(math.ceil(4 * n / 2**20), 2 * world) / world) * world
    chunk_elems = (num_seg // world) * math.ceil(math.ceil(4 * n / num_seg) / 4)
    order = [(i // chunk_elems - k) % world for k in range(1, world + 1)]
    acc = np.float32(xs[order[0]][i].item())
    for r in order[1:]:
        acc = np.float32(acc + np.float32(xs[r][i].item()))
    return torch.tensor([float(acc)], dtype=torch.float32)


# ---------------------------------------------------------------- bitwise against real gloo
# (collective, n, dtype name, op, seed, extra) — extra is the root for "reduce",
# the split sizes for "coalesced", "nan" for NaN-laden inputs.
GLOO_CASES: list[tuple[Any, ...]] = (
    [("all_reduce", n, "float32", "SUM", n, None) for n in (1, 3, 57, 1000, 262145)]
    + [("all_reduce", 1000, dt, op, 2, None) for dt in ("float64", "float16", "bfloat16") for op in ("SUM", "AVG")]
    + [("all_reduce", 70001, dt, "SUM", 3, None) for dt in ("float16", "float64")]
    + [("all_reduce", 1001, "float32", op, 4, None) for op in ("PRODUCT", "AVG")]
    + [("all_reduce", 777, dt, op, 5, "nan") for dt in ("float32", "bfloat16") for op in ("MIN", "MAX")]
    + [("all_reduce", 301, dt, op, 6, None) for dt in ("int8", "bool") for op in ("SUM", "PRODUCT", "BXOR")]
    + [("reduce", n, "float32", "SUM", 7, 1) for n in (57, 1000)]
    + [("reduce_scatter_tensor", 333, "float32", "SUM", 8, None)]
    + [("coalesced", 1060, "float32", "SUM", 9, (1000, 13, 47))]
    + [("transposed", 30 * 40, "float32", "SUM", 10, (30, 40)), ("gapped", 30 * 40, "float32", "SUM", 11, (30, 40))]
)


def gloo_job(rank: int, world_size: int, cases: list[tuple[Any, ...]]) -> list[torch.Tensor]:
    """Runs in each real gloo process: every case, rank ``rank``'s raw result bytes."""
    out = []
    for coll, n, dt, op, seed, extra in cases:
        dtype = getattr(torch, dt)
        rop = getattr(dist.ReduceOp, op)
        if coll == "reduce_scatter_tensor":
            result = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(result, make_inputs(seed, world_size, n * world_size, dtype)[rank], op=rop)
        elif coll in ("transposed", "gapped"):
            base = make_inputs(seed, world_size, n, dtype)[rank].reshape(extra)
            dist.all_reduce(base.t() if coll == "transposed" else base[:, ::2], op=rop)
            result = base  # the whole memory: gloo may write outside the view
        else:
            result = make_inputs(seed, world_size, n, dtype, nan=extra == "nan")[rank].clone()
            if coll == "all_reduce":
                dist.all_reduce(result, op=rop)
            elif coll == "reduce":
                dist.reduce(result, dst=extra, op=rop)
            else:
                parts = list(result.split(list(extra)))
                dist.all_reduce_coalesced(parts, op=rop)
                result = torch.cat(parts)
        out.append(bits(result).clone())
    return out


def model_bits(case: tuple[Any, ...], world: int) -> list[torch.Tensor]:
    coll, n, dt, op, seed, extra = case
    dtype = getattr(torch, dt)
    if coll == "reduce_scatter_tensor":
        return [bits(p) for p in C.reduce_scatter_tensor(make_inputs(seed, world, n * world, dtype), op, "gloo")]
    xs = make_inputs(seed, world, n, dtype, nan=extra == "nan")
    if coll == "transposed":  # dense: the model takes it as is
        return [bits(C.reduce([x.reshape(extra).t() for x in xs], op, "gloo").t())] * world
    if coll == "gapped":  # gaps: gloo reduces memory windows, the caller writes them back
        views = [x.clone().reshape(extra)[:, ::2] for x in xs]
        result = C.reduce([C.memory_window(v) for v in views], op, "gloo")
        for v in views:
            C.memory_window(v).copy_(result)
        return [bits(v._base if v._base is not None else v) for v in views]
    if coll == "reduce":
        return [bits(t) for t in C.reduce_to_root(xs, op, "gloo", extra)]
    if coll == "coalesced":
        res = C.all_reduce_coalesced([list(x.split(list(extra))) for x in xs], op, "gloo")
        return [bits(torch.cat(res))] * world
    return [bits(C.reduce(xs, op, "gloo"))] * world


REJECTION_PROBES = [("all_reduce", "PREMUL_SUM", "float32"), ("all_reduce", "BAND", "float32"),
                    ("all_reduce", "AVG", "int32"), ("reduce", "SUM", "int16"), ("reduce", "PRODUCT", "complex64")]


def gloo_world_job(rank: int, world_size: int, payload: Any) -> tuple[list[torch.Tensor], list[tuple[str, str, str]]]:
    cases, probes = payload
    return gloo_job(rank, world_size, cases), rejection_job(rank, world_size, probes)


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3, 4])
def test_bitwise_against_real_gloo(world: int, gloo_world: Callable[[int], GlooCluster]) -> None:
    """One real gloo world per size; world 2 also re-measures the rejection messages."""
    probes = REJECTION_PROBES if world == 2 else []
    real = gloo_world(world).run(gloo_world_job, [(GLOO_CASES, probes)] * world, timeout=180.0)
    for i, case in enumerate(GLOO_CASES):
        want = model_bits(case, world)
        for rank in range(world):
            diff = torch.nonzero(real[rank][0][i] != want[rank]).flatten()
            assert diff.numel() == 0, f"world {world} rank {rank} {case[:4]}: {diff.numel()} differ at {diff[:5].tolist()}"
    for rank in range(world):
        for (coll, op, dt), seen in zip(probes, real[rank][1]):
            want_rej = C.rejection(coll, op, getattr(torch, dt), "gloo")
            assert want_rej is not None
            assert seen == (want_rej.raised_at, want_rej.exc_type.__name__, want_rej.message), (coll, op, dt)


def rejection_job(rank: int, world_size: int, probes: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Runs in each real gloo process: where and how each probe call fails."""
    out = []
    for coll, op, dt in probes:
        t = torch.ones(4, dtype=getattr(torch, dt))
        rop = dist._make_nccl_premul_sum(2.0) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)
        try:
            work = (dist.all_reduce(t, op=rop, async_op=True) if coll == "all_reduce"
                    else dist.reduce(t, 0, op=rop, async_op=True))
        except Exception as exc:  # noqa: BLE001 - recording what the real backend raises
            out.append(("call", type(exc).__name__, str(exc).split("\nException raised from")[0]))
            continue
        try:
            work.wait()
            out.append(("ok", "", ""))
        except Exception as exc:  # noqa: BLE001
            out.append(("wait", type(exc).__name__, str(exc).split("\nException raised from")[0]))
    return out


# -- integer SUMs that wrap around ---------------------------------------------------------
@pytest.mark.parametrize("dtype, value, world, held, backend", [
    (torch.uint8, 64, 4, 0, "gloo"),        # 256 mod 256
    (torch.int8, 32, 4, -128, "gloo"),      # 128 is one past int8's largest
    (torch.int32, 2**30, 2, -2**31, "gloo"),
])
def test_integer_wrap_names_the_first_element_whose_sum_left_the_dtype(dtype, value, world, held, backend) -> None:
    inputs = [torch.tensor([1, value, value], dtype=dtype) for _ in range(world)]
    result = C.reduce(inputs, "SUM", backend)
    assert int(result[1]) == held  # torch's (and gloo's) integer add wraps: nothing saturates
    count, words = C.integer_wrap(inputs, result)
    name = str(dtype).removeprefix("torch.")
    assert count == 2
    assert words == f"{' + '.join([str(value)] * world)} = {value * world}, held as {held} in {name} (element 1)"


def test_integer_wrap_says_nothing_when_the_sum_fits_or_the_dtype_is_not_a_narrow_integer() -> None:
    small = [torch.tensor([1, 2], dtype=torch.uint8)] * 4
    assert C.integer_wrap(small, C.reduce(small, "SUM", "gloo")) is None
    floats = [torch.tensor([3e38], dtype=torch.float32)] * 2
    assert C.integer_wrap(floats, C.reduce(floats, "SUM", "gloo")) is None  # an overflow to inf is another story
    wide = [torch.tensor([2**62], dtype=torch.int64)] * 2
    assert C.integer_wrap(wide, C.reduce(wide, "SUM", "gloo")) is None  # no wider type to tell it by


def test_an_all_reduce_whose_integer_sum_wraps_is_in_the_trace_and_explained() -> None:
    from simcluster import SimCluster
    from simcluster.engine.trace import Trace, Wrapped

    def quantized(state, bucket):
        q = torch.full_like(bucket.buffer(), 64, dtype=torch.uint8)
        return dist.all_reduce(q, async_op=True).get_future().then(lambda f: bucket.buffer())

    def fits(state, bucket):
        q = torch.full_like(bucket.buffer(), 63, dtype=torch.uint8)
        return dist.all_reduce(q, async_op=True).get_future().then(lambda f: bucket.buffer())

    run = SimCluster(4, seed=0).run_hook(quantized, [torch.ones(3) for _ in range(4)])
    wrapped = run.trace.of(Wrapped)
    assert wrapped == [Wrapped("all_reduce", "WORLD", 0, "uint8", 3, "64 + 64 + 64 + 64 = 256, held as 0 in uint8 (element 0)")]
    assert "the uint8 SUM WRAPS AROUND in 3 elements" in Trace(wrapped).format()
    assert SimCluster(4, seed=0).run_hook(fits, [torch.ones(3) for _ in range(4)]).trace.of(Wrapped) == []
