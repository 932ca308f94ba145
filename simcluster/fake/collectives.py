"""The pure semantics of reductions: what each backend computes, bit for bit.

Nothing here knows about ranks running, futures or scheduling: the engine matches
the N calls of a collective and hands this module the N input tensors. Every function
returns **new** tensors and leaves its inputs untouched.

gloo (MEASURED on torch 2.13.0 CPU against real gloo processes; ``docs/collectives.md``)
--------------------------------------------------------------------------------------
``all_reduce`` is gloo's ring algorithm. The flat buffer of ``B`` bytes (element size
``e``) is cut into ``numSeg = roundUp(max(ceil(B / 1 MiB), 2N), N)`` segments of
``segBytes = roundUp(ceil(B / numSeg), e)`` bytes; chunk ``c`` is segments
``[c*spr, (c+1)*spr)`` with ``spr = numSeg / N``. Chunk ``c`` travels the ring
``c-1 -> c-2 -> ... -> c``: it starts as ``x[c-1]`` and each rank ``r`` on the way
computes ``acc = op(acc, x[r])`` *in the tensor's dtype* (fp16/bf16 round after every
step; there is no fp32 accumulator). Every rank ends with identical bits. Operand order
matters only for NaN payloads and MIN/MAX with NaN, and was fitted too: SUM/PRODUCT are
``acc + x`` / ``acc * x`` (x86 keeps the first NaN operand), MIN is
``acc if acc < x else x`` and MAX ``x if x < acc else acc`` -- a comparison with a NaN
is false, so which NaN (if any) survives depends on the ring position. Example, world 4::

    chunk 0 = ((x3 + x2) + x1) + x0        chunk 1 = ((x0 + x3) + x2) + x1

World 2 is the same ring (``x1 + x0`` and ``x0 + x1``: equal bits for numbers).
World 1 returns the input. ``AVG`` is that SUM divided by ``N`` (``sum / N`` in the
dtype); integer/bool AVG fails *after* the sum was written in place. bool is reduced as
uint8 bytes: ``all_reduce(SUM)`` of three ``True`` leaves the byte ``3`` in a bool tensor
(what :func:`reduce` returns; ``clone()``/``copy_()`` of a bool tensor normalise it to 1,
use :func:`copy_bits_` to keep it). ``reduce`` (to a root) uses gloo's reduce ring, whose
segments are ``roundUp(min(ceil(B / 2N), 1 MiB), e)`` bytes; non-root ranks keep partial
sums in their buffers (:func:`reduce_to_root`). ``reduce_scatter`` (list form) gives rank
``k`` the all_reduce of slot ``k``; ``reduce_scatter_tensor`` gives it part ``k`` of an
all_reduce of the whole flat input (:func:`reduce_scatter`, :func:`reduce_scatter_tensor`).
``all_reduce_coalesced`` all-reduces the concatenation (:func:`all_reduce_coalesced`).
gloo ignores strides: it reduces the ``numel`` elements of memory from the data pointer
(:func:`memory_window`), so a transposed tensor is reduced in memory order and a view with
gaps is reduced wrongly, with writes outside the view.

NCCL (INFERRED from ProcessGroupNCCL/NCCL sources; NCCL cannot run here)
--------------------------------------------------------------------------
Real NCCL's order depends on algorithm (ring/tree/NVLS), channels and topology. The
model is one fixed, documented choice: a left fold in rank order ``((x0 + x1) + x2)...``
in the dtype. ``AVG`` on floats is NCCL's PreMulSum by ``dtype(1/N)``:
``sum(x_r * dtype(1/N))``; on integers it is SumPostDiv: the wrapped sum divided by
``N``, truncating toward zero. ``PREMUL_SUM(f)`` is ``sum(x_r * dtype(f))``. MIN/MAX use
``fmin``/``fmax`` (NaN-ignoring). bool SUM is mapped to MAX (logical or), as
ProcessGroupNCCL does.

>>> import torch
>>> xs = [torch.tensor([1e8, 1.0]), torch.tensor([1.0, 1e8]), torch.tensor([-1e8, -1e8])]
>>> reduce(xs, "SUM", "gloo")   # both elements fall in chunk 0: (x2 + x1) + x0
tensor([0., 1.])
>>> reduce(xs, "SUM", "nccl")   # (x0 + x1) + x2 for every element
tensor([0., 0.])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed

from simcluster.errors import UnsupportedError, UsageError, backend_error
from simcluster.limits import BACKEND_NAMES

__all__ = [
    "REDUCE_OPS",
    "GLOO_MAX_SEGMENT_BYTES",
    "Rejection",
    "reduce_op_name",
    "rejection",
    "unsupported_reason",
    "reduce",
    "integer_wrap",
    "reduce_to_root",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_reduce_coalesced",
    "ring_chunks",
    "memory_window",
    "copy_bits_",
    "bits_equal",
]

REDUCE_OPS: tuple[str, ...] = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo's default maxSegmentSize (measured: fits every size tried)

Factor = float | torch.Tensor | None
_BinOp = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def reduce_op_name(op: object) -> tuple[str, Factor]:
    """``(name, premul factor or None)`` for a ``ReduceOp``, a ``ReduceOp.RedOpType`` or a name.

    >>> import torch.distributed as dist
    >>> reduce_op_name(dist.ReduceOp.AVG)
    ('AVG', None)
    >>> reduce_op_name(dist._make_nccl_premul_sum(0.5))
    ('PREMUL_SUM', 0.5)
    """
    if type(op) is _ReduceOp:  # what the front end passes: cached by kind (PREMUL_SUM never is)
        name = _OP_NAMES.get(op.op)
        if name is not None:
            return name, None
    if isinstance(op, str):
        name, factor = op.upper(), None
    elif hasattr(op, "op") and hasattr(op.op, "name"):  # a ReduceOp object
        name = op.op.name
        factor = op.factor if name == "PREMUL_SUM" else None
    elif hasattr(op, "name"):  # a ReduceOp.RedOpType
        name, factor = op.name, None
    else:
        raise UsageError(f"not a reduce op: op={op!r} (type={type(op).__name__})")
    if name not in REDUCE_OPS:
        raise UsageError(f"unknown reduce op: op={op!r}; expected one of {', '.join(REDUCE_OPS)}")
    if type(op) is _ReduceOp and name != "PREMUL_SUM":
        _OP_NAMES[op.op] = name
    return name, factor


_ReduceOp = torch.distributed.ReduceOp
_OP_NAMES: dict[Any, str] = {}
"""``ReduceOp.RedOpType`` -> name, filled by :func:`reduce_op_name` (hot: every reduction call)."""


# --------------------------------------------------------------------------- acceptance
@dataclass(frozen=True)
class Rejection:
    """How a backend refuses a call.

    ``raised_at`` is ``"call"`` (the ``dist.*`` call itself raises, before the process
    group sees anything) or ``"wait"`` (the call returns a Work whose ``wait()`` and future
    raise). ``evidence`` is ``"measured"`` (gloo, verbatim), ``"source"`` (NCCL, read
    from ProcessGroupNCCL/NCCL sources) or ``"assumed"`` (NCCL's complex-op check: gloo's
    wording reused, NCCL's not verified).
    """

    exc_type: type[Exception]
    message: str
    raised_at: str
    evidence: str


_GLOO_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16,
                torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool}
_TORCH_NAMES = {torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short", torch.int32: "Int",
                torch.int64: "Long", torch.bool: "Bool", torch.float16: "Half", torch.bfloat16: "BFloat16",
                torch.float32: "Float", torch.float64: "Double", torch.complex64: "ComplexFloat",
                torch.complex128: "ComplexDouble", torch.complex32: "ComplexHalf"}
_NCCL_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                torch.int32, torch.int64, torch.bool, torch.float8_e5m2, torch.float8_e4m3fn,
                torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
_FLOAT8 = {torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
_REDUCING = {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
_COMPLEX_OK = {"SUM", "AVG", "PREMUL_SUM"}  # torch.distributed's supports_complex deny-list, inverted
_OP_VALUE = {name: i for i, name in enumerate(REDUCE_OPS)}  # RedOpType's integer values


def _dtype_name(dtype: torch.dtype) -> str:
    return _TORCH_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@functools.lru_cache(maxsize=512)
def rejection(collective: str, op: str | None, dtype: torch.dtype, backend: str) -> Rejection | None:
    """The error the real backend raises for this call, or None when it accepts it.

    The complex check comes first (it is done before the backend's dtype switch); for
    ``all_reduce``/``all_reduce_coalesced`` it is torch.distributed's Python check and
    raises at the call. Every gloo error was measured to surface at ``wait()``.
    """
    _check_backend(backend)
    if op is not None and op not in REDUCE_OPS:
        raise UsageError(f"unknown reduce op: op={op!r}; expected one of {', '.join(REDUCE_OPS)}")
    reducing = collective in _REDUCING and op is not None
    if dtype.is_complex and reducing and op not in _COMPLEX_OK:
        if collective in ("all_reduce", "all_reduce_coalesced"):
            return Rejection(ValueError, f"all_reduce does not support RedOpType.{op} on complex tensors", "call",
                             "measured")
        # torch's C++ check prints the op's enum value as a raw char (a torch quirk, kept verbatim)
        verb = "reduce" if collective == "reduce" else "all_reduce"
        if backend == "gloo":
            return Rejection(RuntimeError, f"{verb} does not support{chr(_OP_VALUE[op])}on complex tensors", "wait",
                             "measured")
        return Rejection(RuntimeError, f"{verb} does not support{chr(_OP_VALUE[op])}on complex tensors", "call",
                         "assumed")  # ProcessGroupNCCL has the same check; its exact wording is not verified
    if dtype.is_complex and (reducing or collective != "gather"):
        dtype = torch.float32 if dtype == torch.complex64 else torch.float64  # torch passes view_as_real
    return _gloo_rejection(op if reducing else None, dtype) if backend == "gloo" else _nccl_rejection(
        op if reducing else None, dtype)


def _gloo_rejection(op: str | None, dtype: torch.dtype) -> Rejection | None:
    def err(msg: str) -> Rejection:
        return Rejection(RuntimeError, msg, "wait", "measured")

    if dtype not in _GLOO_DTYPES:
        return err("Invalid scalar type")
    if op == "PREMUL_SUM":
        return err("Cannot use ReduceOp.PREMUL_SUM with Gloo")
    if op in ("BAND", "BOR", "BXOR") and dtype.is_floating_point:
        return err(f"Cannot use ReduceOp.{op} with non-integral dtype")
    if op == "AVG" and not dtype.is_floating_point:  # raised by the division, after the sum was written
        return err(f"result type Float can't be cast to the desired output type {_dtype_name(dtype)}")
    return None


def _nccl_rejection(op: str | None, dtype: torch.dtype) -> Rejection | None:
    if dtype not in _NCCL_DTYPES:
        return Rejection(TypeError, f"Input tensor data type is not supported for NCCL process group: "
                         f"{_dtype_name(dtype)}", "call", "source")
    if op is None:
        return None
    if dtype in _FLOAT8:
        return Rejection(RuntimeError, "Float8 dtypes are not currently supported for NCCL reductions", "call",
                         "source")
    if dtype == torch.bool and op == "AVG":
        return Rejection(TypeError, "Cannot use ReduceOp.AVG with boolean inputs", "call", "source")
    if op in ("BAND", "BOR", "BXOR"):
        return Rejection(ValueError, f"Cannot use ReduceOp.{op} with NCCL", "call", "source")
    if op == "PREMUL_SUM" and dtype not in (torch.float16, torch.float32, torch.bfloat16, torch.float64):
        return Rejection(TypeError, "PreMulSum Data type must be half, float, bfloat16 or double", "call", "source")
    return None


def unsupported_reason(collective: str, op: str | None, dtype: torch.dtype, backend: str) -> str | None:
    """None when ``backend`` accepts the call; otherwise the real backend's error message.

    >>> unsupported_reason("all_reduce", "PREMUL_SUM", torch.float32, "gloo")
    'Cannot use ReduceOp.PREMUL_SUM with Gloo'
    >>> unsupported_reason("all_reduce", "AVG", torch.float32, "gloo") is None
    True
    """
    found = rejection(collective, op, dtype, backend)
    return None if found is None else found.message


# --------------------------------------------------------------------------- element ops
def _binop(op: str, backend: str, dtype: torch.dtype | None = None) -> _BinOp:
    """``f(acc, x)``: one reduction step with the operand order the backend uses.

    gloo's fp16 PRODUCT keeps ``x``'s NaN sign when both are NaN (``x * acc``); its fp16 SUM
    and PRODUCT drop NaN payloads (``0x7E00``/``0xFE00``); its bf16 arithmetic goes through
    c10::BFloat16, which writes every NaN as ``0x7FC0``.
    """
    if backend == "gloo" and dtype == torch.bfloat16 and op in ("SUM", "AVG", "PRODUCT"):
        step = torch.add if op != "PRODUCT" else torch.mul
        return lambda acc, x: _canonical_bf16_nan(step(acc, x))
    if backend == "gloo" and dtype == torch.float16 and op in ("SUM", "AVG"):
        return lambda acc, x: _canonical_fp16_nan(torch.add(acc, x))
    if backend == "gloo" and dtype == torch.float16 and op == "PRODUCT":
        return lambda acc, x: _canonical_fp16_nan(torch.mul(x, acc))
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        return torch.add
    if op == "PRODUCT":
        return (lambda acc, x: torch.mul(x, acc)) if backend == "gloo" and dtype == torch.float16 else torch.mul
    if op == "MIN":
        return torch.fmin if backend == "nccl" else (lambda acc, x: torch.where(acc < x, acc, x))
    if op == "MAX":
        return torch.fmax if backend == "nccl" else (lambda acc, x: torch.where(x < acc, acc, x))
    return {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]


def _canonical_fp16_nan(t: torch.Tensor) -> torch.Tensor:
    """gloo's float16 sum and product (measured, simcluster.real.differential): every NaN comes out as
    ``0x7E00``, or ``0xFE00`` when its sign bit is set — the payload is dropped."""
    nans = t.isnan()
    if not bool(nans.any()):
        return t
    negative = t.view(torch.int16) < 0
    canonical = torch.where(negative, torch.tensor(-512, dtype=torch.int16), torch.tensor(0x7E00, dtype=torch.int16))
    return torch.where(nans, canonical.view(torch.float16), t)


def _canonical_bf16_nan(t: torch.Tensor) -> torch.Tensor:
    nan = torch.tensor(0x7FC0, dtype=torch.int16).view(torch.bfloat16)
    return torch.where(t.isnan(), nan, t)


def memory_window(t: torch.Tensor) -> torch.Tensor:
    """The ``numel`` elements that gloo reduces for ``t``: contiguous memory from its data pointer.

    MEASURED: gloo ignores strides. For a contiguous tensor this is ``t`` itself; for a
    dense permutation (``x.t()``) it is the same elements in memory order; for a view with
    gaps (``x[:, ::2]``) it is a *different* set of elements -- gloo reduces the first
    ``numel`` elements of memory from the view's start, writing outside the view. Write
    the result into every rank's window to reproduce that.

    >>> x = torch.arange(12.0).reshape(3, 4)
    >>> memory_window(x[:, ::2]).tolist()   # the view holds 0, 2, 4, 6, 8, 10
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    end = (t.storage_offset() + t.numel()) * t.element_size()
    if end > t.untyped_storage().nbytes():  # only overlapping (e.g. expanded) views
        raise UnsupportedError(f"a {list(t.shape)} view with strides {t.stride()} at offset {t.storage_offset()}: "
                               "gloo would read past the end of its storage (undefined behaviour, not modelled)")
    return t.detach().as_strided((t.numel(),), (1,), t.storage_offset())


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill its memory window exactly (contiguous up to a dim permutation)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _as_raw(t: torch.Tensor, backend: str = "gloo") -> torch.Tensor:
    """The flat buffer the backend reduces: memory order, complex as real pairs, bool as bytes."""
    if type(t) is torch.Tensor and t.dtype in _PLAIN_DTYPES and t.dim() == 1 and not t.requires_grad \
            and t.is_contiguous():
        return t  # already that buffer (a bucket, the common case): no detach/reshape views (hot, per rank)
    if t.is_contiguous() or t.numel() <= 1:
        flat = t.detach().reshape(-1)
    elif backend == "gloo" and is_dense(t):
        flat = memory_window(t)
    elif backend == "gloo":
        raise UnsupportedError(
            f"a non-dense {list(t.shape)} view (strides {t.stride()}): real gloo reduces the {t.numel()} "
            "elements of memory from its data pointer, not the view's elements, so the ranks' views "
            "end up different; compute on collectives.memory_window(t) of each rank to reproduce it")
    else:
        raise backend_error(ValueError, "nccl rejects a non-contiguous tensor: ValueError: Tensors must be contiguous")
    if flat.is_complex():
        return torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8) if flat.dtype == torch.bool else flat


_PLAIN_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                           torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
"""Dtypes whose raw buffer is the tensor's own elements (not complex, not bool)."""


def _from_raw(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and strided like ``like`` whose memory window holds ``raw``."""
    if raw.dtype is like.dtype and like.dim() == 1 and like.dtype in _PLAIN_DTYPES and like.is_contiguous():
        return raw  # 1-D already (a bucket, the common case): reshape(like.shape) would be a view of it (~2 us)
    if like.is_contiguous() or like.numel() <= 1:
        if like.is_complex():
            return torch.view_as_complex(raw.reshape(-1, 2)).reshape(like.shape)
        return (raw.view(torch.bool) if like.dtype == torch.bool else raw).reshape(like.shape)
    out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype)
    _as_raw(out.as_strided((out.numel(),), (1,), 0)).copy_(raw)
    return out


def _require_contiguous(tensors: Sequence[torch.Tensor], collective: str) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise UnsupportedError(f"{collective} of a non-contiguous {list(t.shape)} tensor (strides {t.stride()}) "
                                   "is not modelled: what the backend does with it was not measured")


def _check_backend(backend: str) -> None:
    if backend not in BACKEND_NAMES:
        raise UsageError(f"unknown backend: backend={backend!r}; expected one of {', '.join(BACKEND_NAMES)}")


def _prepare(inputs: Sequence[torch.Tensor], op: str, backend: str, collective: str) -> list[torch.Tensor]:
    _check_backend(backend)
    if not inputs:
        raise UsageError(f"{collective}: no inputs (one tensor per rank expected)")
    first = inputs[0]
    shape, dtype, stride = first.shape, first.dtype, first.stride()
    for r, t in enumerate(inputs):
        if t.shape != shape or t.dtype != dtype:
            raise UsageError(f"{collective}: rank {r} passed {t.dtype}{list(t.shape)}, "
                             f"rank 0 passed {first.dtype}{list(first.shape)}")
        if t.stride() != stride and not (t.is_contiguous() and first.is_contiguous()):
            raise UnsupportedError(f"{collective}: rank {r} passed strides {t.stride()}, rank 0 {first.stride()}; "
                                   "gloo reduces each rank's memory order, so the ranks' results would differ")
    found = rejection(collective, op, first.dtype, backend)
    if found is not None:
        raise backend_error(found.exc_type, f"{backend} rejects {collective}({op}, {first.dtype}): "
                                             f"{found.exc_type.__name__}: {found.message}")
    return [_as_raw(t, backend) for t in inputs]


# --------------------------------------------------------------------------- gloo rings
def ring_chunks(numel: int, element_size: int, world_size: int, *, kind: str = "all_reduce",
                max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> list[tuple[int, int]]:
    """Element ranges ``[lo, hi)`` of the N chunks of gloo's ring (chunk c ends complete on rank c).

    ``kind="all_reduce"`` uses gloo's allreduce segmenting, ``kind="reduce"`` its reduce
    segmenting (they differ only above 2N MiB).

    >>> ring_chunks(1000, 4, 3)
    [(0, 334), (334, 668), (668, 1000)]
    """
    total = numel * element_size
    max_seg = element_size * max(1, max_segment_bytes // element_size)
    n = world_size
    if kind == "all_reduce":
        num_seg = _round_up(max(-(-total // max_seg), 2 * n), n)
        seg_bytes = _round_up(-(-total // num_seg), element_size)
    elif kind == "reduce":
        seg_bytes = _round_up(min(-(-total // (2 * n)), max_seg), element_size)
        num_seg = _round_up(max(-(-total // max(seg_bytes, 1)), 2 * n), n)
    else:
        raise UsageError(f"ring_chunks: kind={kind!r}; expected 'all_reduce' or 'reduce'")
    chunk = (num_seg // n) * (seg_bytes // element_size)
    return [(min(numel, c * chunk), min(numel, (c + 1) * chunk)) for c in range(n)]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _gloo_ring(raw: list[torch.Tensor], f: _BinOp) -> torch.Tensor:
    """Chunk ``c`` is ``((x[c-1] op x[c-2]) op …) op x[c-N]``, in O(N·n) work whatever N is.

    Four ways to the same bits (same operands, same order, same rounding per step):
    chunks of at least :data:`_SEGMENT_FOLD_MIN` elements are folded chunk by chunk with
    whole-segment, in-place steps (N² operations, each big); other small problems gather
    every operand at once through a cached ``(N, n)`` index and fold N-1 whole-buffer
    steps; the rest (many ranks, small chunks) fold N-1 whole-buffer steps, step k taking
    rank ``(c-1-k) mod N``'s value of every element by a flat index or strided views
    (:func:`_fold_by_step`), or, for sums whose chunks are at most 16 bytes, from rows
    skewed once with each chunk moved as one element (:func:`_fold_skewed`).
    """
    n = len(raw)
    first = raw[0]
    if n == 1 or first.numel() == 0:
        return first.clone()
    numel = first.numel()
    if numel * n <= _GATHER_LIMIT and numel < _SEGMENT_FOLD_MIN * n:  # no chunk can be big: gather
        return _fold_gathered(raw, f)
    chunks = ring_chunks(numel, first.element_size(), n)
    if chunks[0][1] - chunks[0][0] >= _SEGMENT_FOLD_MIN:  # before the gather: docs/speed.md, stop 27
        return _fold_per_chunk(raw, f, chunks)
    if numel * n <= _GATHER_LIMIT:
        return _fold_gathered(raw, f)
    return _fold_by_step(raw, f, chunks)


_GATHER_LIMIT = 1 << 16
"""Up to this many elements (over all ranks) every operand is gathered through one index."""
_SEGMENT_FOLD_MIN = 2048
"""Chunks of at least this many elements are folded chunk by chunk (N² segment steps), even
when the whole problem is small enough to gather: ``torch.gather`` moves each element in a
scalar loop (~20 instructions an element), so at 2–5 ranks with such chunks the few segment
steps are 2–3× cheaper (world 2 × 4,096 float32: 14 µs against 44; docs/speed.md)."""
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Moves go through an integer view: torch's gather/take/copy need not keep bfloat16 NaN bits."""


def _in_place(f: _BinOp) -> Callable[[torch.Tensor, torch.Tensor], object] | None:
    """``acc.add_``/``acc.mul_`` for the plain steps: the same kernel as ``f(acc, x)``, no allocation."""
    if f is torch.add:
        return torch.Tensor.add_
    if f is torch.mul:
        return torch.Tensor.mul_
    return None


def _fold_gathered(raw: list[torch.Tensor], f: _BinOp) -> torch.Tensor:
    """Row ``k`` of the gathered stack holds, in chunk ``c``'s elements, rank ``(c-1-k) mod N``'s values."""
    first, n = raw[0], len(raw)
    order = _ring_order(first.numel(), first.element_size(), n)
    as_int = _AS_INT[first.element_size()]
    acc, *rest = torch.stack(raw).view(as_int).gather(0, order).view(first.dtype).unbind(0)  # one call for all rows
    step = _in_place(f)
    for row in rest:
        if step is not None:
            step(acc, row)
        else:
            acc = f(acc, row)
    return acc


def _fold_per_chunk(raw: list[torch.Tensor], f: _BinOp, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """Big chunks: fold each chunk's segment across ranks in ring order, in place in the result."""
    n, first = len(raw), raw[0]
    as_int = _AS_INT[first.element_size()]
    out = torch.empty_like(first)
    out_bits = out.view(as_int)
    step = _in_place(f)
    for c, (lo, hi) in enumerate(chunks):
        if lo >= hi:
            continue
        seg = out[lo:hi]
        if step is not None:  # the first step written straight into the result: no copy of its operand
            f(raw[(c - 1) % n][lo:hi], raw[(c - 2) % n][lo:hi], out=seg)
            for k in range(3, n + 1):
                step(seg, raw[(c - k) % n][lo:hi])
        else:
            acc = raw[(c - 1) % n][lo:hi]
            for k in range(2, n + 1):
                acc = f(acc, raw[(c - k) % n][lo:hi])
            out_bits[lo:hi].copy_(acc.view(as_int))
    return out


def _fold_by_step(raw: list[torch.Tensor], f: _BinOp, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """Many ranks, small chunks: N-1 whole-buffer steps over the stacked inputs.

    ``off[e] = c·n + e`` (element e of chunk c, n elements a rank). At step k, elements of
    chunks ``c <= k`` take row ``c-1-k+N`` (flat index ``off + (N-1-k)·n``: a take from
    the stack shifted by that many rows), the others row ``c-1-k`` (``off - (k+1)·n``).
    """
    n, first = len(raw), raw[0]
    step = _in_place(f)
    chunk = chunks[0][1] - chunks[0][0]
    if step is torch.Tensor.add_ and chunk * first.element_size() in _WIDE and first.dtype not in _HALF:
        return _fold_skewed(raw, step, chunk)
    if step is not None:
        return _fold_by_strides(raw, step, chunk)
    numel, dtype = first.numel(), first.dtype
    as_int = _AS_INT[first.element_size()]
    flat = torch.cat([x.view(as_int) for x in raw])
    off = _chunk_offsets(numel, first.element_size(), n)
    bounds = [lo for lo, _ in chunks[1:]] + [numel]
    step = _in_place(f)
    acc_bits = torch.empty(numel, dtype=as_int)
    vals_bits = torch.empty(numel, dtype=as_int)
    acc = acc_bits.view(dtype)
    for k in range(n):
        target = acc_bits if k == 0 else vals_bits
        p = bounds[k]
        if p:
            torch.take(flat[(n - 1 - k) * numel:], off[:p], out=target[:p])
        if p < numel:
            torch.take(flat, off[p:] - (k + 1) * numel, out=target[p:])
        if k == 0:
            continue
        if step is not None:
            step(acc, vals_bits.view(dtype))
        else:
            acc = f(acc, vals_bits.view(dtype))
            if acc.data_ptr() == vals_bits.data_ptr():  # f returned its operand: keep it apart
                acc = acc.clone()
    return acc


def _fold_by_strides(raw: list[torch.Tensor], step: Callable[[torch.Tensor, torch.Tensor], object],
                     chunk: int) -> torch.Tensor:
    """:func:`_fold_by_step` for ``add``/``mul``, with no index tensors: strided views.

    Each rank's buffer is padded to N whole chunks (``width = N·chunk``; gloo's chunks
    are ``chunk`` elements, the last ones clipped) and stacked, so chunk ``c`` of rank
    ``r`` starts at flat ``r·width + c·chunk``. At step k, chunk ``c > k`` takes rank
    ``c-1-k`` (start ``(k+1)·chunk``, then every ``width + chunk``) and chunk ``c <= k``
    rank ``c-1-k+N`` (start ``(N-1-k)·width``, same stride): two ``as_strided`` views,
    folded in place into the ``(N, chunk)`` result. Same operands in the same order as
    the take-based fold, so the same bits; padding is folded too and cut off.
    """
    n, first = len(raw), raw[0]
    numel, dtype = first.numel(), first.dtype
    as_int = _AS_INT[first.element_size()]
    stacked = _stacked_by_chunks(raw, chunk)
    flat_bits = stacked.view(-1)
    flat = flat_bits.view(dtype)
    width = n * chunk
    stride = (width + chunk, 1)
    acc_bits = torch.empty(n, chunk, dtype=as_int)
    acc = acc_bits.view(dtype)
    for k in range(n):
        hi = ((n - 1 - k, chunk), stride, (k + 1) * chunk)  # chunks k+1 .. N-1
        lo = ((k + 1, chunk), stride, (n - 1 - k) * width)  # chunks 0 .. k
        if k == 0:  # the first operand: moved as bits
            acc_bits[1:].copy_(flat_bits.as_strided(*hi))
            acc_bits[:1].copy_(flat_bits.as_strided(*lo))
            continue
        if k < n - 1:
            step(acc[k + 1:], flat.as_strided(*hi))
        step(acc[:k + 1], flat.as_strided(*lo))
    return acc.view(-1)[:numel]


_HALF = (torch.float16, torch.bfloat16)
"""Their NaN payloads depend on the kernel path that adds them (strided rows or contiguous
ones, measured on random bit patterns): they keep the strided fold. gloo never folds them
with a plain ``add_`` anyway (see :func:`_binop`). ``mul_`` keeps the strided fold for the
same reason: NaN × NaN keeps the accumulator's payload in rows of a few elements and the
operand's in long rows (docs/collectives.md §8)."""
_WIDE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
"""A dtype exactly one chunk wide, by the chunk's bytes: a whole chunk moves as one element."""


def _fold_skewed(raw: list[torch.Tensor], step: Callable[[torch.Tensor, torch.Tensor], object],
                 chunk: int) -> torch.Tensor:
    """:func:`_fold_by_strides` for chunks of at most 16 bytes (many ranks, small buckets).

    With chunks that small, a strided fold is N² rows of a few elements: the kernels'
    per-row overhead, not the arithmetic, sets its cost, which then grows as N². Here the
    stacked ``(N, N·chunk)`` buffer is viewed with one element per chunk (``uint8`` …
    ``complex128``: a move, not arithmetic, so the bits are kept); step k's operands, chunk
    c from rank ``(c-1-k) mod N``, are one ``gather`` of N such elements into a reused
    row, added to the accumulator in place. Same operands in the same order as the
    strided fold, so the same bits, in O(N·n) work with long inner loops. (Gathering all
    N rows at once is no faster: a second buffer of the stack's size, freshly mapped on
    every call, costs more in page faults than the per-row calls.)
    """
    n, first = len(raw), raw[0]
    numel, dtype = first.numel(), first.dtype
    as_int = _AS_INT[first.element_size()]
    stacked = _stacked_by_chunks(raw, chunk)
    wide_dtype = _WIDE[chunk * first.element_size()]
    wide = stacked.view(wide_dtype)  # (N, N): element [r, c] is rank r's chunk c
    index = _skew_index(n)
    acc_wide = torch.empty(1, n, dtype=wide_dtype)
    row_wide = torch.empty(1, n, dtype=wide_dtype)
    acc, row = acc_wide.view(as_int).view(dtype).view(-1), row_wide.view(as_int).view(dtype).view(-1)
    torch.gather(wide, 0, index[:1], out=acc_wide)
    for k in range(1, n):
        torch.gather(wide, 0, index[k:k + 1], out=row_wide)  # step k's operands, chunk by chunk
        step(acc, row)
    return acc[:numel]


def _stacked_by_chunks(raw: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """Every rank's bits stacked, ``(N, N·chunk)``: each rank padded with zeros to N whole
    ``chunk``-element chunks (gloo's last chunks are clipped), so chunk c of rank r starts at
    ``r·N·chunk + c·chunk``. The padding is folded like the rest and cut off after."""
    n, first = len(raw), raw[0]
    as_int = _AS_INT[first.element_size()]
    stacked = torch.stack([x.view(as_int) for x in raw])
    if n * chunk > first.numel():
        stacked = torch.cat([stacked, stacked.new_zeros(n, n * chunk - first.numel())], dim=1)
    return stacked


@functools.lru_cache(maxsize=4)
def _skew_index(n: int) -> torch.Tensor:
    """``index[k, c] = (c-1-k) mod N``: the rank whose chunk c is operand k of chunk c's fold."""
    steps = torch.arange(n, dtype=torch.int64).unsqueeze(1)
    chunks = torch.arange(n, dtype=torch.int64).unsqueeze(0)
    return (chunks - 1 - steps) % n


@functools.lru_cache(maxsize=8)
def _chunk_offsets(numel: int, element_size: int, n: int) -> torch.Tensor:
    """``off[e] = c·numel + e`` where ``c`` is element e's ring chunk."""
    off = torch.arange(numel, dtype=torch.int64)
    for c, (lo, hi) in enumerate(ring_chunks(numel, element_size, n)):
        off[lo:hi] += c * numel
    return off


@functools.lru_cache(maxsize=64)
def _ring_order(numel: int, element_size: int, n: int) -> torch.Tensor:
    """``order[k, e]``: the rank whose value is the k-th operand of element e's fold."""
    chunk_of = torch.empty(numel, dtype=torch.int64)
    for c, (lo, hi) in enumerate(ring_chunks(numel, element_size, n)):
        chunk_of[lo:hi] = c
    steps = torch.arange(1, n + 1, dtype=torch.int64).unsqueeze(1)
    return (chunk_of.unsqueeze(0) - steps) % n


def _nccl_fold(raw: list[torch.Tensor], f: _BinOp) -> torch.Tensor:
    acc = raw[0].clone()
    for x in raw[1:]:
        acc = f(acc, x)
    return acc


def _compute(raw: list[torch.Tensor], op: str, backend: str, factor: Factor, dtype: torch.dtype) -> torch.Tensor:
    n = len(raw)
    if backend == "gloo":
        out = _gloo_ring(raw, _binop(op, backend, raw[0].dtype))
        return out.div_(n) if op == "AVG" else out
    if dtype == torch.bool and op == "SUM":
        op = "MAX"  # ProcessGroupNCCL maps bool SUM to ncclMax
    if op == "AVG" and not raw[0].is_floating_point():  # NCCL SumPostDiv: wrapped sum, then x / N in C
        return torch.div(_nccl_fold(raw, torch.add), n, rounding_mode="trunc")
    if op in ("AVG", "PREMUL_SUM"):
        scale = 1.0 / n if op == "AVG" else factor
        if scale is None:
            raise UsageError("PREMUL_SUM needs premul_factor (from dist._make_nccl_premul_sum)")
        s = torch.as_tensor(scale, dtype=torch.float64).reshape(-1)[0].to(raw[0].dtype)
        raw = [x * s for x in raw]
    return _nccl_fold(raw, _binop(op, backend))


# --------------------------------------------------------------------------- public results
def reduce(inputs: Sequence[torch.Tensor], op: str, backend: str, *, premul_factor: Factor = None) -> torch.Tensor:
    """What ``all_reduce(op)`` leaves on every rank; ``inputs[r]`` is rank r's tensor.

    Raises a :class:`~simcluster.errors.BackendRejection` of the real error's class (with the
    backend's message) for calls the backend rejects.
    """
    raw = _prepare(inputs, op, backend, "all_reduce")
    return _from_raw(_compute(raw, op, backend, premul_factor, inputs[0].dtype), inputs[0])


def integer_wrap(inputs: Sequence[torch.Tensor], result: torch.Tensor) -> tuple[int, str] | None:
    """For a SUM of integers narrower than 64 bits: in how many elements ``result`` is not the
    exact sum of ``inputs`` (worked out in int64) — the sum went past the dtype's range and
    wrapped around, as torch's and gloo's integer adds do, with no error — and the first such
    element in words (``"64 + 64 + 64 + 64 = 256, held as 0 in uint8"``). None when no element
    wrapped, or the dtype is not such an integer one.

    >>> x = torch.tensor([100, 1], dtype=torch.int8)
    >>> integer_wrap([x, x], x + x)
    (1, '100 + 100 = 200, held as -56 in int8 (element 0)')
    """
    dtype = result.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or result.element_size() >= 8:
        return None
    flat = [x.reshape(-1).to(torch.int64) for x in inputs]
    exact = torch.stack(flat).sum(0)
    got = result.reshape(-1).to(torch.int64)
    wrong = (exact != got).nonzero()
    if not wrong.numel():
        return None
    i = int(wrong[0, 0])
    addends = [str(int(x[i])) for x in flat]
    shown = " + ".join(addends if len(addends) <= 8 else [*addends[:8], f"… ({len(addends)} addends)"])
    name = str(dtype).removeprefix("torch.")
    return int(wrong.shape[0]), f"{shown} = {int(exact[i])}, held as {int(got[i])} in {name} (element {i})"


def reduce_to_root(inputs: Sequence[torch.Tensor], op: str, backend: str, root: int, *,
                   premul_factor: Factor = None) -> list[torch.Tensor]:
    """Each rank's buffer after ``dist.reduce(op, dst=root)``: the result on ``root``.

    gloo (measured): non-root buffers are overwritten with the ring's partial results --
    on rank r, chunk c holds the fold of its ring order up to r, rank r's own chunk is
    complete, and above 2N MiB gloo's extra ring steps add the complete chunk r+1 onto
    rank r's partial one (segments ``0 .. spr-3``). NCCL: non-root buffers are left as
    they were (NCCL's reduce writes only the root's receive buffer).
    """
    raw = _prepare(inputs, op, backend, "reduce")
    n, like = len(raw), inputs[0]
    if not 0 <= root < n:
        raise UsageError(f"reduce: root={root} is not a rank of a {n}-rank group")
    if backend == "nccl":
        outs = [x.clone() for x in raw]
        outs[root] = _compute(raw, op, backend, premul_factor, like.dtype)
        return [_from_raw(o, like) for o in outs]
    f = _binop(op, backend, raw[0].dtype)
    outs = [x.clone() for x in raw]
    if n > 1 and raw[0].numel():
        chunks = ring_chunks(raw[0].numel(), raw[0].element_size(), n, kind="reduce")
        complete = []
        for c, (lo, hi) in enumerate(chunks):
            acc = raw[(c - 1) % n][lo:hi]
            for k in range(2, n + 1):
                r = (c - k) % n
                acc = f(acc, raw[r][lo:hi])
                outs[r][lo:hi] = acc
            outs[root][lo:hi] = acc
            complete.append(acc)
        _gloo_reduce_extra_steps(outs, raw, f, chunks, complete, root)
    if op == "AVG":
        for o in outs:
            o.div_(n)
    return [_from_raw(o, like) for o in outs]


def _gloo_reduce_extra_steps(outs: list[torch.Tensor], raw: list[torch.Tensor], f: _BinOp,
                             chunks: list[tuple[int, int]], complete: list[torch.Tensor], root: int) -> None:
    """gloo's reduce runs ``spr - 2`` ring steps too many (``spr`` segments per chunk).

    In them rank r receives segment j of the complete chunk r+1 and reduces it into its
    own partial copy of that chunk; only non-root buffers end up different.
    """
    n, es = len(raw), raw[0].element_size()
    total = raw[0].numel() * es
    seg = _round_up(min(-(-total // (2 * n)), es * max(1, GLOO_MAX_SEGMENT_BYTES // es)), es) // es
    spr = _round_up(max(-(-total // (seg * es)), 2 * n), n) // n
    for r in range(n):
        nxt = (r + 1) % n
        lo, hi = chunks[nxt]
        if r == root:
            continue
        for j in range(spr - 2):
            a, b = lo + j * seg, min(hi, lo + (j + 1) * seg)
            if a < b:
                outs[r][a:b] = f(complete[nxt][a - lo:b - lo], outs[r][a:b])


def reduce_scatter(inputs: Sequence[Sequence[torch.Tensor]], op: str, backend: str, *,
                   premul_factor: Factor = None) -> list[torch.Tensor]:
    """``dist.reduce_scatter`` (list form): ``inputs[r][k]`` is rank r's slot for rank k.

    gloo (measured, up to 2,000,001 elements a slot): rank k gets exactly the bits of
    ``reduce([inputs[r][k] for r], ...)`` -- an all_reduce of slot k, allreduce segmenting.
    NCCL: the rank-order fold of each slot.
    """
    n = len(inputs)
    _require_contiguous([t for ts in inputs for t in ts], "reduce_scatter")
    results = []
    for k in range(n):
        slot = [inputs[r][k] for r in range(n)]
        raw = _prepare(slot, op, backend, "reduce_scatter")
        results.append(_from_raw(_compute(raw, op, backend, premul_factor, slot[0].dtype), slot[0]))
    return results


def reduce_scatter_tensor(inputs: Sequence[torch.Tensor], op: str, backend: str, *,
                          premul_factor: Factor = None) -> list[torch.Tensor]:
    """``dist.reduce_scatter_tensor``: ``inputs[r]`` is rank r's whole input (N equal parts).

    gloo (measured): rank k gets part k of an all_reduce of the whole flat input (so the
    ring chunks are laid over N*n elements), and bool results come back normalised to 0/1.
    """
    n = len(inputs)
    _require_contiguous(inputs, "reduce_scatter_tensor")
    raw = _prepare(inputs, op, backend, "reduce_scatter_tensor")
    if raw[0].numel() % n:
        raise UsageError(f"reduce_scatter_tensor: {inputs[0].numel()} elements do not split into {n} parts")
    flat = _compute(raw, op, backend, premul_factor, inputs[0].dtype)
    like = inputs[0].reshape(-1)[: inputs[0].numel() // n]
    parts = flat.chunk(n) if flat.numel() else [flat] * n
    return [_from_raw(p, like).clone() for p in parts]  # own storage each; clone() normalises bool bytes


def all_reduce_coalesced(inputs: Sequence[Sequence[torch.Tensor]], op: str, backend: str, *,
                         premul_factor: Factor = None) -> list[torch.Tensor]:
    """``dist.all_reduce_coalesced``: ``inputs[r]`` is rank r's list; one result list for all ranks.

    gloo (measured): the tensors are concatenated and the concatenation is all-reduced,
    so ring chunk boundaries fall across tensor boundaries; results are copied back into
    the tensors, which normalises bool bytes to 0/1.
    """
    if not inputs or not inputs[0]:
        return []
    _require_contiguous([t for ts in inputs for t in ts], "all_reduce_coalesced")
    joined = reduce([torch.cat([t.detach().reshape(-1) for t in ts]) for ts in inputs], op, backend,
                    premul_factor=premul_factor)
    parts = [part.reshape(t.shape) for part, t in zip(joined.split([t.numel() for t in inputs[0]]), inputs[0])]
    return [p.clone() if p.dtype == torch.bool else p for p in parts]  # gloo copies back: bools normalised


def copy_bits_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Write a collective's result ``src`` into the caller's ``dst`` as a backend does: the
    bytes (bool bytes other than 0/1 kept, which ``copy_`` normalises), and without moving
    ``dst``'s version counter — gloo writes the memory; an all_reduce leaves
    ``tensor._version`` where it was (measured, ``docs/gloo-facts.md`` §13). The calls that
    do move it on gloo move it themselves (:func:`~torch.autograd.graph.increment_version`)."""
    raw = dst.data  # the same memory, its own version counter
    if dst.dtype == torch.bool and src.dtype == torch.bool:
        raw.view(torch.uint8).copy_(src.view(torch.uint8))
        return dst
    raw.copy_(src)
    return dst


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors (dtype, shape and every bit; NaNs compare by payload,
    ``-0.0`` is not ``0.0``)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as flat bytes. ``contiguous()`` leaves a one-element view's stride as it
    is (a dimension of size 1 is contiguous whatever its stride), and viewing that as bytes
    raises: such a tensor is copied first."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)
