"""Hooks written the way users write them, for the tests of tolerances, --params, model-aware
state and --subgroups (tests/test_lossy_and_layouts.py). Loaded as ``tests/user_hooks.py:NAME``.

* :func:`int8_quantize_hook` — a correct symmetric int8 quantizer: one shared scale per
  bucket (the group's largest |gradient| / 127), integers summed in **int32**.
  :func:`int8_wrapping_hook` is the same hook summing the int8 tensors themselves: 127 + 127
  wraps to -2, so the "average" of two large gradients comes back small and negative.
* :class:`SketchState` / :func:`sketch_hook` — a count sketch whose size comes from the
  model: ``make_sketch_state(process_group, model)`` is a two-argument factory, and the
  state is keyed by the model's Parameter objects (as ``torch.optim`` keys its state), so
  the hook finds nothing unless the model holds exactly the parameters DDP buckets. Its
  default compression (4) cannot sketch a parameter of fewer than 4 elements.
* :func:`global_rank_hook` — each rank quantizes with its own scale, looked up with
  ``dist.get_rank()``: right on the whole world, wrong on a subgroup, where the index into
  the group's gathered scales is the rank *in the group*. :func:`group_rank_hook` uses
  ``process_group.rank()``. Both take :class:`GroupState` (a factory state).

An overflow (an ``inf`` or ``NaN`` in some rank's bucket) makes the group's largest |gradient|
``inf`` (a NaN counts as ``inf``), and then every rank skips the codes and returns its bucket
filled with ``inf`` for GradScaler: integer codes cannot carry it (``round(NaN)`` cast to
int32 is -2**31, an ``inf`` scale turns every code into 0 or NaN), and until the explicit
non-finite examples (2026-12-04, *keeps_nonfinite*) these quantizers returned finite garbage.

No ``from __future__ import annotations`` here: DDP's registration check compares the
``bucket`` annotation with ``dist.GradBucket`` itself, and a string never compares equal.
"""

import math
from typing import Any

import torch
import torch.distributed as dist


def _peak(buffer: torch.Tensor) -> torch.Tensor:
    """This rank's largest |gradient|, shape (1,); ``inf`` when the bucket holds an inf or NaN."""
    return buffer.abs().nan_to_num(nan=math.inf, posinf=math.inf).max().reshape(1) if buffer.numel() else torch.zeros(1)


def _overflowed(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A completed future holding ``buffer`` filled with ``inf``: what every rank hands
    GradScaler once the group agreed that some rank overflowed."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer.fill_(math.inf))
    return done


# --------------------------------------------------------------------------- int8 quantizers
def _int8_mean(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket,
               accumulate: torch.dtype) -> torch.futures.Future[torch.Tensor]:
    group = process_group if process_group is not None else dist.group.WORLD
    world = group.size()
    buffer = bucket.buffer()
    peak = _peak(buffer)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)  # the group's largest |gradient|
    if math.isinf(float(peak)):  # some rank overflowed: every rank knows it
        return _overflowed(buffer)
    scale = float(peak) / 127.0 if float(peak) > 0.0 else 1.0
    quantized = torch.round(buffer / scale).to(accumulate)  # in [-127, 127]
    future = dist.all_reduce(quantized, group=group, async_op=True).get_future()

    def dequantize(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return fut.value()[0].to(torch.float32) * (scale / world)

    return future.then(dequantize)


def int8_quantize_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Symmetric int8 quantization, summed in int32: error at most scale/2 = G/254."""
    return _int8_mean(process_group, bucket, torch.int32)


def int8_wrapping_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The same, summed in int8: the sum of W values up to 127 wraps (the bug)."""
    return _int8_mean(process_group, bucket, torch.int8)


# --------------------------------------------------------------------------- a model-sized sketch
class SketchState:
    """A count sketch per parameter: ``numel // compression`` columns, hashes and signs drawn
    from ``seed`` (the same on every rank), keyed by the model's Parameter objects."""

    def __init__(self, process_group: dist.ProcessGroup, model: torch.nn.Module, compression: int = 4,
                 seed: int = 0) -> None:
        self.group = process_group
        gen = torch.Generator().manual_seed(seed)
        self.columns: dict[torch.nn.Parameter, tuple[torch.Tensor, torch.Tensor, int]] = {}
        for p in model.parameters():
            width = p.numel() // compression
            if width == 0:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is too small to sketch at compression "
                                 f"{compression}")
            where = torch.randint(0, width, (p.numel(),), generator=gen)
            sign = torch.randint(0, 2, (p.numel(),), generator=gen).to(torch.float32) * 2 - 1
            self.columns[p] = (where, sign, width)


def make_sketch_state(process_group: dist.ProcessGroup, model: torch.nn.Module) -> SketchState:
    """The two-argument factory: the sketch is sized from the model."""
    return SketchState(process_group, model)


def sketch_hook(state: SketchState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sketch each parameter's gradient, all-reduce the sketches' mean, unsketch."""
    world = state.group.size()
    sketches = []
    for p, grad in zip(bucket.parameters(), bucket.gradients()):
        where, sign, width = state.columns[p]
        sketches.append(torch.zeros(width).index_add_(0, where, grad.reshape(-1) * sign))
    flat = torch.cat(sketches) / world
    future = dist.all_reduce(flat, group=state.group, async_op=True).get_future()

    def unsketch(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total, out, start = fut.value()[0], [], 0
        for p in bucket.parameters():
            where, sign, width = state.columns[p]
            out.append(total[start:start + width][where] * sign)
            start += width
        return torch.cat(out)

    return future.then(unsketch)


# --------------------------------------------------------------------------- global vs group rank
class GroupState:
    """A state factory's product: just the group the rank's DDP runs on."""

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        self.group = process_group


def _own_scale_mean(state: GroupState, bucket: dist.GradBucket, me: int) -> torch.futures.Future[torch.Tensor]:
    group, world = state.group, state.group.size()
    buffer = bucket.buffer()
    peak = _peak(buffer)
    scales = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(scales, torch.where(peak > 0, peak / 127.0, torch.ones(1)), group=group)
    if any(math.isinf(float(s)) for s in scales):  # some rank overflowed: every rank knows it
        return _overflowed(buffer)
    quantized = torch.round(buffer / scales[me]).to(torch.int8)  # this rank's own scale
    gathered = [torch.zeros_like(quantized) for _ in range(world)]
    future = dist.all_gather(gathered, quantized, group=group, async_op=True).get_future()

    def dequantize(fut: torch.futures.Future[object]) -> torch.Tensor:
        total = torch.zeros(buffer.shape, dtype=torch.float32)
        for r in range(world):  # rank order: the same bits on every rank
            total += gathered[r].to(torch.float32) * scales[r]
        return total / world

    return future.then(dequantize)


def global_rank_hook(state: GroupState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Picks its own scale with ``dist.get_rank()`` — the rank in the *world* (the bug)."""
    return _own_scale_mean(state, bucket, dist.get_rank())


def group_rank_hook(state: GroupState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Picks its own scale with ``state.group.rank()`` — the rank in its group (correct)."""
    return _own_scale_mean(state, bucket, state.group.rank())


def needs_bucket_views(state, bucket):
    """An optimizer-in-the-hook's precondition (OverlappedAdamW, hooks from the wild): DDP runs
    with ``gradient_as_bucket_view=True``, so every ``p.grad`` is the bucket's view of it."""
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        if p.grad is None or not p.grad.is_set_to(g):
            raise RuntimeError("DDP parameter gradient no longer matches its bucket view")
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def top1_percent_state(process_group: dist.ProcessGroup) -> Any:
    """The reference top-k hook keeping 1% of each bucket (at least one entry): correct error
    feedback that drains one entry per bucket per step, so a 13-entry residual needs 13 zero
    steps (round 10 of hooks from the wild: a top-1% hook from a research repo)."""
    from simcluster.hooks.reference import TopKState

    return TopKState(process_group, ratio=0.01)


def top_tenth_percent_state(process_group: dist.ProcessGroup) -> Any:
    """The reference top-k hook keeping 0.1% of each bucket (at least one entry), Deep Gradient
    Compression's ratio: on a 300-entry model it sends one entry per step, so a full residual
    needs 300 zero steps to drain — more than the first longer drain's 256 (stop 30)."""
    from simcluster.hooks.reference import TopKState

    return TopKState(process_group, ratio=0.001)


def top1_forgets_state(process_group: dist.ProcessGroup) -> Any:
    """The same, for :func:`top1_forgets_hook`."""
    from simcluster.hooks.reference import TopKState

    return TopKState(process_group, ratio=0.01)


def top1_forgets_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-1% that keeps a residual but never adds it back: what it does not send is lost."""
    buf = bucket.buffer()
    k = max(1, int(buf.numel() * 0.01)) if buf.numel() else 0
    state.residuals["forgotten"] = buf.clone()  # kept, never used: the error feedback is lost
    sparse = torch.zeros_like(buf)
    if k:
        idx = buf.abs().topk(k).indices
        sparse[idx] = buf[idx]
    sparse.div_(state.process_group.size())
    fut = dist.all_reduce(sparse, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _mean_allreduce(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer().div_(group.size())
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def local_sgd_step_hook(process_group: dist.ProcessGroup | None,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """An optimizer step inside the hook, on the rank's *local* gradients, before the
    all-reduce: the gradients are averaged, the parameters are not (round 10: a vendored
    ``_hook_then_optimizer`` stepped before communicating; real gloo: replicas' parameters
    differ after one step, gradients equal)."""
    with torch.no_grad():
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            p.add_(g, alpha=-0.1)
    return _mean_allreduce(process_group, bucket)


def averaged_sgd_step_hook(process_group: dist.ProcessGroup | None,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The same step in the all-reduce's callback, on the averaged gradients: every replica
    takes the same step."""
    def step(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                p.add_(g, alpha=-0.1)
        return fut.value()

    return _mean_allreduce(process_group, bucket).then(step)


class BF16ResidualState:
    """Per rank: each parameter's residual (what bf16 compression did not send), in float32."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self.residuals: dict[Any, torch.Tensor] = {}


def bf16_residual_state(process_group: dist.ProcessGroup | None) -> BF16ResidualState:
    return BF16ResidualState(process_group)


def _bf16_with_feedback(state: BF16ResidualState, bucket: dist.GradBucket, *, wire: torch.dtype,
                        residual_in_shares: bool) -> torch.futures.Future[torch.Tensor]:
    """Add each parameter's residual, send the bfloat16 share (summed on the wire in ``wire``),
    keep what it did not send: the whole gradient's (correct), or, with ``residual_in_shares``,
    the share's units mixed with the gradient's (the bug)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    size = group.size()
    buffer = bucket.buffer()
    slices = []
    offset = 0
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        slices.append((param, slice(offset, offset + grad.numel())))
        offset += grad.numel()
    for param, where in slices:
        if param in state.residuals:
            buffer[where].add_(state.residuals[param])
    share = (buffer / size).to(torch.bfloat16)
    sent = share.float() if residual_in_shares else share.float() * size
    left = buffer - sent
    for param, where in slices:
        state.residuals[param] = left[where].clone()
    fut = dist.all_reduce(share.to(wire), group=group, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def bf16_feedback_hook(state: BF16ResidualState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """bfloat16 compression with float32 error feedback, summed in bfloat16 (hooks from the wild, round 18)."""
    return _bf16_with_feedback(state, bucket, wire=torch.bfloat16, residual_in_shares=False)


def bf16_feedback_in_share_units(state: BF16ResidualState,
                                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The same, but the residual subtracts the share (gradient / W) from the gradient: the bug."""
    return _bf16_with_feedback(state, bucket, wire=torch.bfloat16, residual_in_shares=True)


class TupleKeyedState:
    """Per rank: residuals keyed by the bucket's tuple of parameters (DeepSpeed 1-bit style
    ports, round 18 of hooks from the wild): a rebuild makes new tuples, and the memory of the
    old buckets is never found again."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self.residuals: dict[tuple[Any, ...], torch.Tensor] = {}


def tuple_keyed_state(process_group: dist.ProcessGroup | None) -> TupleKeyedState:
    return TupleKeyedState(process_group)


def sign_with_tuple_keyed_residual(state: TupleKeyedState,
                                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sends each element's sign times the mean magnitude, keeps the rest as residual, keyed
    by ``tuple(bucket.parameters())``."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    key = tuple(bucket.parameters())
    buffer = bucket.buffer()
    if key in state.residuals:
        buffer.add_(state.residuals[key])
    scale = buffer.abs().mean()
    sent = buffer.sign() * scale
    state.residuals[key] = buffer - sent
    fut = dist.all_reduce(sent.div_(group.size()), group=group, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def fp16_for_large_buckets_hook(process_group: dist.ProcessGroup | None,
                                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Small buckets as they are, larger ones in float16 divided first (round 25 of hooks from
    the wild): the float16 branch has torch's world-3 overflow, which only a large bucket reaches."""
    buffer = bucket.buffer()
    world = dist.get_world_size(process_group)
    if buffer.numel() <= 1024:
        return dist.all_reduce(buffer.div_(world), group=process_group, async_op=True).get_future().then(
            lambda f: f.value()[0])
    half = buffer.to(torch.float16).div_(world)

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(half, group=process_group, async_op=True).get_future().then(decompress)
