"""Reference DDP communication hooks, written for this project on the current (>= 1.10) API.

A communication hook replaces DDP's built-in gradient all-reduce.  DDP calls it once per
gradient *bucket* per iteration as ``hook(state, bucket)``; the hook must return a
``torch.futures.Future`` that resolves to a contiguous tensor (storage offset 0, at least
``bucket.buffer().numel()`` elements) holding the gradient every replica should apply —
normally the **mean over ranks**.  DDP copies that tensor back into the parameters'
``.grad``.  Register one with::

    ddp_model.register_comm_hook(process_group_or_None, mean_allreduce_hook)

Things every hook here respects, and that the buggy catalogue (:mod:`simcluster.hooks.buggy`) breaks:

* **Mean, not sum.**  ``all_reduce`` sums; the hook divides by the *group's* size.
* **Replicas agree bitwise.**  Every rank must return the same bits, or the model copies
  drift apart silently.  Anything a rank computes from its own data after the collective
  must be computed from data identical on all ranks, in the same order.
* **No state keyed by what DDP reshuffles.**  DDP rebuilds its buckets after iteration 0
  (iteration 0 has one bucket with every parameter; later buckets follow gradient-ready
  order), so ``bucket.index()`` names different parameters before and after the rebuild.
* **Several buckets are in flight.**  DDP calls the hook for bucket k+1 before bucket k's
  collective has completed, so a callback may only use what its own closure captured.
* **Portable future values.**  ``all_gather``'s future resolves to the list of output
  tensors on gloo but to ``[one (W, ...) tensor]`` on NCCL; :func:`gathered_rows` accepts both.
* **Never block a gloo worker.**  On gloo a ``.then`` callback runs on one of the group's
  2 worker threads; a callback that ``.wait()``\\ s on another collective holds that worker,
  and with two such callbacks in flight nothing is left to run the collectives they wait
  for (measured: deadlock with 2 buckets).  Wait in the hook body instead, as
  :func:`scaled_fp16_hook` does.

Every hook here takes ``state`` as ``None`` (meaning ``dist.group.WORLD``), a process group,
or an object with a ``process_group`` attribute; :class:`TopKState` is such an object.
This module imports only torch: it is user-style code, independent of simcluster.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "mean_allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "allgather_mean_hook",
    "scaled_fp16_hook",
    "TopKState",
    "topk_hook",
    "gathered_rows",
    "resolve_group",
    "round_toward_zero",
    "summand_bound",
    "compress_share",
    "first_tensor",
]

FP16_MAX = 65504.0  # torch.finfo(torch.float16).max


def resolve_group(state: object) -> dist.ProcessGroup:
    """The process group a hook should use: ``state`` itself, ``state.process_group``, or WORLD.

    ``None`` (and a state object whose ``process_group`` is ``None``) means the default
    group, ``dist.group.WORLD``, looked up at call time — so the hook follows whatever
    world the calling rank is in.
    """
    group = getattr(state, "process_group", state)
    if group is None:
        group = dist.group.WORLD
    if group is None:
        raise RuntimeError(
            "hook state names no process group and the default group is not initialised: "
            "pass a group as the hook state or call dist.init_process_group() first"
        )
    return group


def first_tensor(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    """``.then`` callback: a collective's future holds a *list* of tensors; DDP wants a tensor."""
    return fut.value()[0]


def gathered_rows(value: list[torch.Tensor], like: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """One tensor per rank, in rank order, from an ``all_gather`` future's value, on any backend.

    ``like`` is the tensor each rank contributed.  gloo resolves the future to the output
    list itself, ``[t0, …, t{W-1}]``, each shaped like ``like``; NCCL resolves it to
    ``[flat]``, a single tensor of shape ``(W, *like.shape)``.  The two are told apart by
    shape, so ``W == 1`` is unambiguous too (``[t0]`` vs ``[(1, n)]``).

    >>> t = torch.arange(3.)
    >>> [r.tolist() for r in gathered_rows([t, t + 1], t, 2)]            # gloo
    [[0.0, 1.0, 2.0], [1.0, 2.0, 3.0]]
    >>> [r.tolist() for r in gathered_rows([torch.stack([t, t + 1])], t, 2)]  # NCCL
    [[0.0, 1.0, 2.0], [1.0, 2.0, 3.0]]
    """
    if len(value) == world_size and all(v.shape == like.shape for v in value):
        return list(value)
    if len(value) == 1 and tuple(value[0].shape) == (world_size, *like.shape):
        return list(value[0].unbind(0))
    shapes = [tuple(v.shape) for v in value]
    raise TypeError(
        f"all_gather future value has {len(value)} tensor(s) of shapes {shapes}; expected "
        f"{world_size} of shape {tuple(like.shape)} (gloo) or one of shape "
        f"{(world_size, *like.shape)} (NCCL)"
    )


def mean_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group with one ``all_reduce``; what DDP does without a hook.

    The buffer is divided by the group size *before* the sum, in place, so a sum of values
    near the dtype's largest finite value cannot overflow (``x/W + y/W`` stays finite where
    ``(x + y)/W`` would pass through ``inf``).  The future resolves to the buffer itself.

    Example (any backend, state ``None`` means ``dist.group.WORLD``)::

        ddp.register_comm_hook(None, mean_allreduce_hook)
        # after backward(): p.grad == mean over ranks of each rank's local gradient
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(first_tensor)


def _top_half_spacing(dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype``'s top binade: the most a rounding to nearest below the
    largest finite value can add (float16: 16, bfloat16: 2**119, float32: 2**103)."""
    top = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
    below = torch.nextafter(top, torch.zeros_like(top))
    return (float(top) - float(below)) / 2


def round_toward_zero(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` rounded toward zero into ``dtype`` (torch's casts round to nearest).

    The cast to nearest is stepped one ulp back toward zero wherever it landed farther
    from zero than the exact value, so ``|result| <= |values|`` elementwise.  A finite
    value beyond ``dtype``'s range saturates to its largest finite value; ``inf`` and NaN
    stay as they are.

    >>> round_toward_zero(torch.tensor([21834.67, -21834.67, 1e-9, 7e4]), torch.float16).tolist()
    [21824.0, -21824.0, 0.0, 65504.0]
    """
    nearest = values.to(dtype)
    away = nearest.to(values.dtype).abs() > values.abs()
    return torch.where(away, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)


def summand_bound(dtype: torch.dtype, world_size: int) -> float:
    """B_W: the largest magnitude a rank may send so that **any** sum of W of them stays finite.

    Let M be ``dtype``'s largest finite value and h half the spacing of its top binade
    (float16: M = 65504, h = 16).  Rounding to nearest is monotone, M is representable,
    and every value below M moves by at most h when rounded.  Claim: if every summand
    has ``|y_r| <= B``, every partial sum the backend forms — a ring fold, a tree, any
    order — over k summands satisfies ``|s| <= sum_of_those_|y_r| + (k - 1)·h``.
    Induction on the adding of two partial sums of k1 and k2 summands: the exact sum is
    at most ``sum|y| + (k1 + k2 - 2)·h``; if that is below M, rounding adds at most h.
    So with ``W·B + (W - 1)·h <= M`` every partial sum, the last included, is at most M,
    hence finite.  B_W is ``(M - (W - 1)·h) / W`` rounded down into ``dtype``:

    >>> [summand_bound(torch.float16, w) for w in (1, 2, 3, 4, 8)]
    [65504.0, 32736.0, 21824.0, 16360.0, 8172.0]

    Rounding ``65504 / 3`` to nearest gives 21840 > B_3, and indeed
    ``21840 + 21840 + 21840`` is 65520, which float16 rounds to ``inf``.
    """
    top = torch.finfo(dtype).max
    exact = (top - (world_size - 1) * _top_half_spacing(dtype)) / world_size
    return float(round_toward_zero(torch.tensor([exact], dtype=torch.float64), dtype)[0])


def compress_share(buffer: torch.Tensor, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's share ``x / W`` of the mean, in ``dtype``, such that W shares cannot overflow.

    1. Divide in at least float32 (float64 buffers in float64): one rounding, u = 2**-24.
    2. Round **toward zero** into ``dtype``: error below one ulp of the share
       (relative < 2u, or < one subnormal step), never an increase in magnitude.
    3. Clamp to ``±summand_bound(dtype, W)`` so that no sum of W shares overflows.

    The clamp only touches shares above B_W, i.e. inputs within ``(W - 1)·h + W·ulp`` of
    ±M (float16, W = 8: shares of 8172 < |x/8| <= 8188, a loss of at most 16, relative
    2**-9 of the share).  Inputs beyond ``dtype``'s range altogether (``|x/W| > M``, not
    carried by the compression at all) become ``±inf``, as the plain cast makes them, rather
    than being silently clipped.  NaN stays NaN.
    """
    wide = torch.float64 if buffer.dtype == torch.float64 else torch.float32
    share = buffer.detach().to(wide) / world_size
    bound = summand_bound(dtype, world_size)
    compressed = round_toward_zero(share, dtype).clamp(-bound, bound)
    out_of_range = share.abs() > torch.finfo(dtype).max
    return torch.where(out_of_range, share.to(dtype), compressed)


def _cast_mean_hook(
    dtype: torch.dtype, process_group: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Send ``compress_share(buffer, W, dtype)``, sum, copy the sum back into the buffer."""
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    if torch.empty((), dtype=dtype).element_size() >= buffer.element_size():
        # Nothing to save: a float16 bucket cast to bfloat16 (or back) keeps 2 bytes per
        # element but loses range or precision — 65504 in bfloat16 rounds to 65536, which
        # is inf once copied back into a float16 bucket.  Communicate in the bucket's dtype.
        dtype = buffer.dtype
    # Order matters: x / W is computed in (at least) float32 and only then rounded toward
    # zero into the narrow type and clamped (compress_share), so every finite input the
    # narrow type can hold gives a finite mean.  Casting first overflows at the cast for
    # |x| > max; summing first overflows in the sum (simcluster.hooks.buggy.fp16_divide_after_allreduce);
    # rounding x / W to nearest can still overflow the sum (65504 / 3 -> 21840, x3 -> inf).
    compressed = compress_share(buffer, group.size(), dtype)

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        # Copy into the existing buffer: the result keeps the bucket's dtype, is contiguous
        # with storage offset 0, and no second full-size buffer is allocated.
        buffer.copy_(fut.value()[0])
        return buffer

    work = dist.all_reduce(compressed, group=group, async_op=True)
    return work.get_future().then(decompress)


def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Mean over ranks, communicated in float16 (half the bytes of float32).

    Divides by the group size in float32 (float64 for float64 buckets), *then* rounds
    toward zero into float16 and clamps to ``±summand_bound(float16, W)`` (see
    :func:`compress_share`), sums, and copies the float16 sum back into the bucket.

    * **Finite**: every input that is finite in float16 (``|x| <= 65504``) gives a finite
      mean at every world size, in any summation order.  Dividing first is not enough on
      its own: at W = 3, ``65504 / 3`` rounds to nearest as 21840 and ``3 × 21840`` rounds
      to ``inf`` — torch's own ``fp16_compress_hook`` (cast, then divide in float16) does
      exactly that; the checker finds it (``simcluster check`` with tolerance ``fp16``).
    * **Accurate**: within the ``fp16`` tolerance of ``docs/properties.md``
      (``γ_{W+2}(2**-11)·mean|x|``): the float32 division and the round-toward-zero cast
      are within the two roundings per summand it allows; the clamp only touches inputs
      within a few float16 ulps of ±65504.  Measured on 200,000 near-maximal mixtures per
      W = 1…8, summed in every ring order and as a tree: at most 0.73 of the bound.
    * Values below float16's smallest subnormal (~6e-8) flush to zero.  Buckets that are
      already 2 bytes per element (float16, bfloat16) are communicated in their own dtype
      (with the same clamp for that dtype).

    Example::

        ddp.register_comm_hook(None, fp16_compress_hook)
    """
    return _cast_mean_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Mean over ranks, communicated in bfloat16: float32's range, 8 bits of mantissa.

    Same shape as :func:`fp16_compress_hook`, with bfloat16's bound
    (``summand_bound(bfloat16, W)``, from M = 3.3895e38 and h = 2**119).  bfloat16 has
    nearly float32's range, so overflow only threatens inputs near bfloat16's maximum —
    which the ``bf16`` tolerance promises to handle; precision is the usual risk
    (relative ~2**-8 per rounding).  A float16
    bucket is communicated in float16: casting it to bfloat16 would save nothing and
    round 65504 up to 65536, which is ``inf`` back in float16.

    Registration trap (measured on torch 2.13 CPU): ``DistributedDataParallel`` refuses
    any hook whose ``__name__`` is ``"bf16_compress_hook"`` unless CUDA+NCCL>=2.10 or
    XPU+XCCL is present (``TypeError: BF16 all reduce communication hook required …``),
    although gloo all-reduces bfloat16 correctly.  The check is by *name*, so to use this
    hook with DDP on gloo register a renamed wrapper, e.g.
    ``def bf16_mean(s, bucket): return bf16_compress_hook(s, bucket)``.
    """
    return _cast_mean_hook(torch.bfloat16, process_group, bucket)


def allgather_mean_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Gather every rank's bucket, then average locally in rank order.

    Costs W times the traffic of an all-reduce; it is the template for aggregations a sum
    cannot express (medians, trimmed means, sparse merges).  Two things make it correct:

    * :func:`gathered_rows` turns the future's value into one tensor per rank under both
      gloo (``[t0, t1, …]``) and NCCL (``[flat]`` of shape ``(W, n)``).
    * The rows are folded in **rank order, in float64**, then divided and rounded once.
      Every rank holds the same rows, so every rank does the same operations in the same
      order and gets the same bits.  (Starting the fold from one's own row — the natural
      "mine plus the others" — gives each rank a different rounding: see
      ``simcluster.hooks.buggy.allgather_own_first``.)
    """
    group = resolve_group(process_group)
    world = group.size()
    buffer = bucket.buffer()
    outputs = [torch.empty_like(buffer) for _ in range(world)]

    def aggregate(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        rows = gathered_rows(fut.value(), buffer, world)
        total = torch.zeros(buffer.shape, dtype=torch.float64)
        for row in rows:  # rank 0, 1, …, W-1: the same order on every rank
            total += row
        buffer.copy_(total / world)
        return buffer

    work = dist.all_gather(outputs, buffer, group=group, async_op=True)
    return work.get_future().then(aggregate)


def _power_of_two_scale(amax: float) -> float:
    """The largest power of two s with s * amax <= FP16_MAX / 2 (1.0 for 0, inf or nan).

    Each rank sends ``x / W * s``; the sum of W such values is at most ``amax * s``, kept
    below half of float16's maximum for headroom.  Powers of two scale exactly.
    """
    if not math.isfinite(amax) or amax <= 0.0:
        return 1.0
    exponent = math.floor(math.log2(FP16_MAX / 2 / amax))
    return 2.0 ** max(-1000, min(1000, exponent))


def scaled_fp16_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """float16 mean with a shared per-bucket power-of-two scale: a correct two-collective hook.

    Phase 1 all-reduces (MAX) the largest local ``|g|``, so every rank knows the same
    ``amax`` and picks the same power-of-two scale that lifts the bucket to the top of
    float16's range: small gradients keep their bits instead of flushing to zero, large
    ones cannot overflow.  Phase 2 all-reduces the scaled float16 payload; the callback
    unscales into the buffer.

    **Where it waits matters.**  Phase 1 is waited for *in the hook body*, on the training
    thread.  Two tempting alternatives are broken:

    * ``.wait()`` on phase 2 inside phase 1's ``.then`` callback (torch's PowerSGD does
      this) holds a gloo worker thread per bucket; with two buckets in flight both of the
      group's 2 workers wait and nothing runs phase 2: deadlock (measured;
      ``simcluster.hooks.buggy.scaled_fp16_blocking``).
    * Issuing phase 2 from phase 1's callback without waiting avoids the deadlock but
      issues the phase-2 collectives in *completion* order, which gloo's two workers do
      not keep the same on every rank; collectives are matched by issue order, so rank 0's
      bucket A may be summed with rank 1's bucket B.

    Waiting in the hook body costs one scalar round trip per bucket and keeps the issue
    order identical on every rank.  Buckets of 2-byte dtypes are averaged in their own
    dtype (:func:`mean_allreduce_hook`): float16 would save nothing, and a bfloat16
    bucket's range does not fit float16's dynamic range.  The precision for inputs above
    32752 is one bit coarser at the subnormal end than :func:`fp16_compress_hook` (the
    scale keeps a factor-2 headroom so the float16 sum cannot round up to ``inf``).
    """
    group = resolve_group(process_group)
    world = group.size()
    buffer = bucket.buffer()
    if buffer.element_size() <= 2:  # the same on every rank: the buckets' dtypes agree
        return mean_allreduce_hook(group, bucket)
    amax = torch.zeros(1, dtype=torch.float32)
    if buffer.numel():
        amax[0] = buffer.detach().abs().max()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)  # synchronous: waits here
    scale = _power_of_two_scale(float(amax.item()))
    payload = (buffer.to(torch.float64) / world * scale).to(torch.float16)

    def unscale(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0].to(torch.float64) / scale)
        return buffer

    work = dist.all_reduce(payload, group=group, async_op=True)
    return work.get_future().then(unscale)


@dataclass(eq=False)
class TopKState:
    """Per-rank state of :func:`topk_hook`: the group, the kept fraction, the error memory.

    ``TopKState(process_group)`` is the factory a harness calls once per rank.  Each rank
    must own its state: the residuals are *local* (what this rank has not sent yet).

    **Why residuals are keyed by parameter.**  DDP rebuilds its buckets after iteration 0,
    so ``bucket.index()`` is no stable name: index 0 holds every parameter in iteration 0
    and a few of them afterwards.  A residual keyed by index would be added to the wrong
    gradients or fail on a size mismatch (``simcluster.hooks.buggy.topk_residual_keyed_by_index``).
    The parameters themselves are stable — DDP hands the model's own ``Parameter`` objects
    to ``bucket.parameters()`` every iteration — so the residual is stored per parameter,
    as ``torch.optim`` stores its state (a dict keyed by the parameter object; lookups
    only, never iterated for results).  A bucket's flat residual is the concatenation of
    its parameters' residuals in the bucket's order, matching ``bucket.gradients()``.

    Residuals are kept in float64 so that the error-feedback identity (below) holds to
    float64 precision; a production version would keep them in the gradient dtype.
    """

    process_group: dist.ProcessGroup | None = None
    ratio: float = 0.25
    residuals: dict[object, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"TopKState: ratio={self.ratio!r} must be in (0, 1]")

    def k_for(self, numel: int) -> int:
        """How many entries a bucket of ``numel`` elements sends: ceil(ratio * numel), >= 1."""
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def _layout(self, bucket: dist.GradBucket) -> tuple[list[object], list[int]]:
        """Residual keys and sizes for ``bucket``: one per parameter (or one per index, see below)."""
        params = list(bucket.parameters())
        sizes = [g.numel() for g in bucket.gradients()]
        if params and len(params) == len(sizes):
            return params, sizes
        if params:
            raise ValueError(
                f"TopKState: bucket {bucket.index()} reports {len(params)} parameters but "
                f"{len(sizes)} gradients"
            )
        # No parameters reported (a bare single-bucket call): fall back to the index, and
        # refuse loudly if that bucket's size ever changes rather than misapply memory.
        return [("bucket", bucket.index())], [bucket.buffer().numel()]

    def take(self, bucket: dist.GradBucket) -> tuple[list[object], list[int], torch.Tensor]:
        """(keys, sizes, flat float64 residual) for ``bucket``; zeros where nothing is stored."""
        keys, sizes = self._layout(bucket)
        pieces = []
        for key, size in zip(keys, sizes):
            stored = self.residuals.get(key)
            if stored is None:
                stored = torch.zeros(size, dtype=torch.float64)
            elif stored.numel() != size:
                raise ValueError(
                    f"TopKState: residual for {key!r} has {stored.numel()} elements, bucket "
                    f"{bucket.index()} now has {size}: pass bucket.parameters() so memory "
                    "can follow the parameters across DDP's bucket rebuild"
                )
            pieces.append(stored)
        flat = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
        return keys, sizes, flat

    def put(self, keys: list[object], sizes: list[int], flat: torch.Tensor) -> None:
        """Store ``flat`` back per key, as *views*: later in-place edits of ``flat`` show."""
        for key, piece in zip(keys, flat.split(sizes)):
            self.residuals[key] = piece


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k sparsification with error feedback; every replica applies the same update.

    Each rank adds its residual (what it did not send before) to its gradient, keeps the
    ``k`` entries of largest magnitude, and sends them as ``(index, value)`` pairs through
    one ``all_gather`` — packed in one float64 tensor (indices are exact below 2**53).
    What it did not send becomes its new residual.  Every rank then scatters the *same*
    gathered pairs, rank by rank in rank order, into a float64 zero vector, divides by W
    and rounds once into the bucket, so all replicas get identical bits although each
    rank chose different indices.

    The rounding of that mean into the bucket's dtype is error too: its difference (the
    same on every rank) is added to every rank's residual, so nothing is ever lost.  Hence
    the **error-feedback identity**, exact up to float64 rounding: after T steps,

        sum_t output_t == sum_t mean_r(grad_{r,t}) - mean_r(residual_{r,T})

    and the residuals stay bounded (top-k is a contraction), so the accumulated output
    tracks the accumulated mean with a lag that does not grow with T; fed zero gradients,
    the residuals drain to zero within ceil(1 / ratio) steps.

    Not an average per step: check it with tolerance ``none`` plus the error-feedback,
    replica and schedule properties.  Register with a per-rank state::

        ddp.register_comm_hook(TopKState(process_group, ratio=0.01), topk_hook)
    """
    group = resolve_group(state)
    world = group.size()
    buffer = bucket.buffer()
    numel = buffer.numel()
    keys, sizes, residual = state.take(bucket)
    corrected = buffer.detach().to(torch.float64) + residual
    k = state.k_for(numel)
    chosen = corrected.abs().topk(k).indices.sort().values
    payload = torch.cat([chosen.to(torch.float64), corrected[chosen]])
    new_residual = corrected.index_fill(0, chosen, 0.0)
    state.put(keys, sizes, new_residual)
    outputs = [torch.empty_like(payload) for _ in range(world)]

    def merge(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total = torch.zeros(numel, dtype=torch.float64)
        for row in gathered_rows(fut.value(), payload, world):  # rank order, on every rank
            total.index_add_(0, row[:k].to(torch.int64), row[k:])
        mean = total / world
        buffer.copy_(mean)
        new_residual.add_(mean - buffer.to(torch.float64))  # feed the output rounding back
        return buffer

    work = dist.all_gather(outputs, payload, group=group, async_op=True)
    return work.get_future().then(merge)
