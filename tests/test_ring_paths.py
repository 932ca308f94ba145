"""The fast ways of folding gloo's ring give the bits of the plain per-chunk fold.

``collectives._gloo_ring`` picks one of four folds by size (a gathered index, whole-
segment folds per chunk, whole-buffer steps by flat index or strided views, and for
chunks of at most 16 bytes a skewed gather of whole chunks). Each is checked here, forced
on sizes where it would not be picked, against a straightforward reference written from
the measured description: for every chunk, ``acc = x[c-1]; acc = op(acc, x[c-2]); …``,
one element-wise step at a time, with the backend's per-step NaN handling
(``collectives._binop``) — for many world sizes, sizes, dtypes and ops, with NaN
payloads, signed NaNs and infinities in fp16/bf16.

Signaling NaNs are left out on purpose: torch's own fp16 ``add`` on this CPU keeps a
signaling NaN's sign in its scalar tail loop but not in its vectorised body (found while
writing these tests: ``0xFC2E + x`` gave ``0xFE00`` at one position of a slice and ``0x7E00``
at another), so *no* way of laying out the fold — the old one included — is bitwise
stable for them. The same holds for an element where *two* operands are NaNs with
different signs or payloads: torch's vectorised body keeps the second operand's NaN, its
scalar tail the first (``0xFE2E + 0x7E3D`` gave ``0x7E00`` in one position, ``0xFE00`` in
another). Real gloo keeps the first (docs/collectives.md §3), so the model can differ from
gloo in such elements whatever the layout (reported; not changed here). The inputs below
therefore give each element at most one NaN operand (any payload, either sign) or
infinities of both signs.
"""

from __future__ import annotations

import pytest
import torch

from simcluster.fake import collectives as C

AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference_ring(raw: list[torch.Tensor], op: str) -> torch.Tensor:
    f = C._binop(op, "gloo", raw[0].dtype)
    n, numel = len(raw), raw[0].numel()
    out = raw[0].clone()
    for c, (lo, hi) in enumerate(C.ring_chunks(numel, raw[0].element_size(), n)):
        if lo < hi:
            acc = raw[(c - 1) % n][lo:hi].clone()
            for k in range(2, n + 1):
                acc = f(acc, raw[(c - k) % n][lo:hi])
            out.view(AS_INT[out.element_size()])[lo:hi] = acc.view(AS_INT[acc.element_size()])
    return out


def inputs(seed: int, world: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return list(torch.randint(-100, 101, (world, n), generator=g).to(dtype).unbind(0))
    x = (torch.randn(world, n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (world, n), generator=g)).to(dtype)
    if dtype in (torch.float16, torch.bfloat16):
        bits = x.view(torch.int16)
        column = torch.rand(n, generator=g)
        nan_rank = torch.randint(0, world, (n,), generator=g)
        payload = torch.randint(1, 64, (n,), generator=g, dtype=torch.int16)
        sign = torch.where(torch.rand(n, generator=g) < 0.5, 0, -0x8000).to(torch.int16)
        quiet_nan = 0x7E00 if dtype == torch.float16 else 0x7FC0
        for e in torch.nonzero(column < 0.15).flatten().tolist():  # one rank's NaN, any payload and sign
            bits[nan_rank[e], e] = quiet_nan | payload[e] | sign[e]
        infs = (column >= 0.15) & (column < 0.3)  # infinities of both signs (inf - inf makes a NaN)
        pick = torch.rand(world, n, generator=g)
        x[infs & (pick < 0.3)] = float("inf")
        x[infs & (pick > 0.7)] = -float("inf")
    elif dtype.is_floating_point:
        x[torch.rand(world, n, generator=g) < 0.03] = float("nan")
    return list(x.unbind(0))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ia, ib = a.view(AS_INT[a.element_size()]), b.view(AS_INT[b.element_size()])
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(ia, ib))


PATHS = {
    "gathered": lambda raw, f, chunks: C._fold_gathered(raw, f),
    "per_chunk": C._fold_per_chunk,
    "by_step": C._fold_by_step,
}
CASES = [
    (world, n)
    for world in (2, 3, 5, 8, 16)
    for n in (1, 3, 57, 1000, 4099)
]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.uint8])
def test_every_fold_path_matches_the_per_chunk_reference(path: str, dtype: torch.dtype) -> None:
    ops = ("SUM", "PRODUCT", "MIN", "MAX") if dtype.is_floating_point else ("SUM", "PRODUCT", "MAX", "BXOR")
    for op in ops:
        for seed, (world, n) in enumerate(CASES):
            raw = inputs(seed, world, n, dtype)
            chunks = C.ring_chunks(n, raw[0].element_size(), world)
            got = PATHS[path](raw, C._binop(op, "gloo", dtype), chunks)
            want = reference_ring(raw, op)
            assert same_bits(got, want), (path, op, dtype, world, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 64, 200])
def test_reduce_picks_a_path_with_the_reference_bits(dtype: torch.dtype, world: int) -> None:
    """Through the public ``reduce``: sizes that land in each path at large worlds."""
    for n in (5, 4096, 70_001 if world <= 3 else 9_000):
        raw = inputs(world * 7 + n, world, n, dtype)
        got = C.reduce(raw, "SUM", "gloo")
        want = reference_ring(raw, "SUM")
        assert same_bits(got, want), (dtype, world, n)


TINY_CHUNKS = [(64, 57), (64, 100), (64, 256), (100, 150), (200, 800), (300, 1200), (1024, 4096), (130, 1000), (32, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.uint8, torch.int64])
def test_the_skewed_fold_of_tiny_chunks_matches_the_reference(dtype: torch.dtype) -> None:
    """Many ranks, chunks of 1–16 bytes: each chunk moved as one wide element, then folded by rows."""
    tried = 0
    for seed, (world, n) in enumerate(TINY_CHUNKS):
        if world > 300 and dtype != torch.float32:  # world 1024 once: its reference's W² folds take ~7 s
            continue
        raw = inputs(seed, world, n, dtype)
        chunks = C.ring_chunks(n, raw[0].element_size(), world)
        chunk = chunks[0][1] - chunks[0][0]
        if chunk * raw[0].element_size() not in C._WIDE:
            continue
        tried += 1
        want = reference_ring(raw, "SUM")  # once per case
        assert same_bits(C._fold_skewed(raw, torch.Tensor.add_, chunk), want), (dtype, world, n)
        assert same_bits(C.reduce(raw, "SUM", "gloo"), want), (dtype, world, n)
    assert tried >= 3, "the cases no longer reach the skewed fold"


def test_the_skew_index_names_ring_order() -> None:
    """Operand k of chunk c is rank (c-1-k) mod N: at N=4, chunk 0's fold starts at rank 3."""
    assert C._skew_index(4).tolist() == [[3, 0, 1, 2], [2, 3, 0, 1], [1, 2, 3, 0], [0, 1, 2, 3]]


def test_the_paths_are_really_different_folds() -> None:
    """Guard for the test above: the reference is order-sensitive, so a wrong order fails."""
    raw = inputs(0, 5, 1000, torch.float32)
    left_fold = raw[0].clone()
    for x in raw[1:]:
        left_fold = left_fold + x
    assert not same_bits(left_fold, reference_ring(raw, "SUM"))


def test_inputs_are_left_untouched() -> None:
    raw = inputs(1, 9, 5000, torch.float16)
    before = [x.clone() for x in raw]
    chunks = C.ring_chunks(5000, 2, 9)
    for path in PATHS.values():
        path(raw, C._binop("SUM", "gloo", torch.float16), chunks)
    assert all(same_bits(a, b) for a, b in zip(raw, before))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_many_ranks_keep_each_ops_nan_and_infinity_handling(dtype: torch.dtype) -> None:
    """At 130 and more ranks ``reduce`` folds a half-precision PRODUCT or MAX by whole-buffer
    steps (``_fold_by_step``: the skewed fold of tiny chunks is for plain adds only); PRODUCT
    (gloo's fp16 takes the later operand's NaN sign and drops its payload) and MAX (a NaN-blind compare) must come out
    as the per-chunk reference folds them, NaN payloads, signs and infinities included (only
    SUM was checked at these sizes before; real gloo at 130–256 ranks: benchmarks/measure_many_ranks.py, docs/collectives.md §8)."""
    for op in ("PRODUCT", "MAX"):
        for world, n in ((130, 1000), (200, 9000)):
            raw = inputs(world + n, world, n, dtype)
            assert same_bits(C.reduce(raw, op, "gloo"), reference_ring(raw, op)), (op, world, n)
