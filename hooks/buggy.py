"""A catalogue of realistic buggy DDP communication hooks, one per bug class.

Each hook is code a careful person could write — most are one token away from a correct
hook in :mod:`simcluster.hooks.reference` — and each docstring says:

* **Bug** — what is wrong, pointing at the line;
* **Why it is plausible** — how such code comes to be written;
* **On a real cluster** — what goes wrong, and when (often: not in a one-bucket unit test);
* **Caught by** — the simcluster property meant to catch it (``averages``,
  ``replicas_agree``, ``contract``, ``liveness``, ``schedule_independence``,
  ``keeps_nonfinite``, ``error_feedback``) and the inputs it needs.

The bug lines carry a ``# BUG`` comment.  :mod:`simcluster.hooks.catalogue` lists every hook here with
its state, tolerance and expected failure.  Like the reference hooks, this module imports
only torch and :mod:`simcluster.hooks.reference`.

No ``from __future__ import annotations`` here (nor in any hook module): DDP compares the
``bucket`` and return annotations with the real objects at registration and refuses
strings — see :func:`string_annotations`.
"""

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from simcluster.hooks.reference import first_tensor, gathered_rows, resolve_group

__all__ = [
    # averages
    "forgot_division",
    "fp16_divide_after_allreduce",
    "fp16_no_division",
    "divides_by_global_world_size",
    "CompressorState",
    "inflight_shared_compressor",
    "allgather_assumes_gloo_list",
    # replicas_agree
    "allgather_own_first",
    "dp_noise_per_rank_rng",
    "fp16_copy_wrong_direction",
    # schedule_independence
    "NoiseState",
    "dp_noise_shared_generator",
    # contract
    "returns_offset_view",
    "returns_strided_view",
    "returns_list",
    "returns_future_value",
    "returns_tensor_not_future",
    "misnamed_bucket_param",
    "string_annotations",
    "allgather_assumes_nccl_flat",
    # liveness
    "rank0_logs_global_norm",
    "skip_allreduce_if_zero",
    "scaled_fp16_blocking",
    "ClipState",
    "clip_waits_for_last_bucket",
    "skips_on_local_overflow",
    # keeps_nonfinite
    "hides_overflow",
    # error_feedback
    "IndexedResidualState",
    "topk_residual_keyed_by_index",
    "topk_forgets_inplace_add",
]

_log = logging.getLogger(__name__)

Future = torch.futures.Future


# --------------------------------------------------------------------------- averages


def forgot_division(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Returns the **sum** over ranks, not the mean.

    Bug: ``all_reduce`` sums; nothing divides by the group size.
    Plausible: "all_reduce averages the gradients" is a common belief (NCCL has an AVG op,
    ``ReduceOp.SUM`` is the silent default), and with one rank the sum *is* the mean.
    On a real cluster: gradients are W times too large — training looks like a W-times
    larger learning rate, often diverging only when the job is scaled out.
    Caught by: ``averages`` at any world size >= 2 with a non-zero gradient.
    """
    group = resolve_group(process_group)
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)  # BUG: no division
    return work.get_future().then(first_tensor)


def fp16_divide_after_allreduce(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> Future[torch.Tensor]:
    """float16 compression that divides **after** the float16 sum: overflow to ``inf``.

    Bug: the cast happens first, the sum runs in float16, the division comes last; a sum of
    W values can exceed 65504 although every value and their mean are finite in float16.
    Plausible: "sum, then divide" is how a mean is written on paper and how 1.7-era hooks
    divided (``fut.value()[0].div_(world_size)``).
    On a real cluster: ``inf``/``nan`` gradients as soon as two ranks see large gradients of
    the same sign (e.g. 40000 and 30000); the loss scaler skips steps or the model is ruined.
    Caught by: ``averages`` under tolerance ``fp16`` with values near float16's maximum.
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16)

    def decompress(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0].div_(group.size()))  # BUG: divides a sum that already overflowed
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def fp16_no_division(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """float16 compression that never divides: the sum, and overflow on top.

    Bug: ``forgot_division`` and ``fp16_divide_after_allreduce`` at once.
    Plausible: adapted from an fp16 *cast* wrapper around a hook that divided, with the
    inner hook dropped.
    On a real cluster: W-times gradients, and ``inf`` where the sum leaves float16's range.
    Caught by: ``averages`` (tolerance ``fp16``), any world size >= 2.
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()

    def decompress(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    compressed = buffer.to(torch.float16)  # BUG: no division anywhere
    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def divides_by_global_world_size(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> Future[torch.Tensor]:
    """Averages over a subgroup but divides by the size of the *whole* world.

    Bug: ``dist.get_world_size()`` is the default group's size; the sum runs over ``group``.
    Plausible: correct whenever DDP uses the default group — the usual case, and every
    single-group test — and ``get_world_size()`` is what every tutorial calls.
    On a real cluster: with DDP over subgroups (hybrid sharding, model-parallel x
    data-parallel, hierarchical setups) gradients shrink by ``W_world / W_group``.
    Caught by: ``averages`` with state ``group`` and DDP on a proper subgroup.
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())  # BUG: should be group.size()
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(first_tensor)


@dataclass(eq=False)
class CompressorState:
    """A tidy-looking compressor object — whose ``buffer`` attribute is shared by every bucket.

    ``CompressorState(process_group)`` is the per-rank factory.  See
    :func:`inflight_shared_compressor` for what goes wrong.
    """

    process_group: dist.ProcessGroup | None = None
    buffer: torch.Tensor | None = field(default=None, repr=False)

    def compress(self, bucket: dist.GradBucket) -> torch.Tensor:
        """Remember the bucket being worked on and return its float16 mean-share."""
        self.buffer = bucket.buffer()  # BUG: one slot for several buckets in flight
        return torch.div(self.buffer, resolve_group(self).size()).to(torch.float16)

    def decompress(self, fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        """Copy the reduced float16 tensor back into "the" bucket — whichever was compressed last."""
        assert self.buffer is not None
        self.buffer.copy_(fut.value()[0])
        return self.buffer


def inflight_shared_compressor(state: CompressorState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """fp16 compression through a stateful compressor that confuses buckets in flight.

    Bug: ``state.compress`` stores the bucket's buffer in ``state.buffer``; DDP calls the
    hook for bucket k+1 before bucket k's all-reduce completes, so bucket k's callback
    (``state.decompress``) copies bucket k's result into bucket k+1's buffer and returns it.
    Plausible: object-oriented compressors with ``compress``/``decompress`` methods are a
    common design, and a single-bucket unit test (DDP's iteration 0 has one bucket) passes.
    On a real cluster: from iteration 1 on, parameters receive another bucket's gradients
    when bucket sizes match, or the callback raises (``copy_`` size mismatch) when they do
    not; either way training is broken only once the model has several buckets.
    Caught by: ``averages`` (tolerance ``fp16``) with >= 2 buckets in flight; the raise
    surfaces as the hook's own exception.
    """
    compressed = state.compress(bucket)
    work = dist.all_reduce(compressed, group=resolve_group(state), async_op=True)
    return work.get_future().then(state.decompress)


def allgather_assumes_gloo_list(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> Future[torch.Tensor]:
    """all_gather-then-mean that is right on gloo and silently wrong on NCCL.

    Bug: ``torch.stack(fut.value()).mean(0)`` assumes the future holds W tensors (gloo).
    On NCCL it holds ``[flat]`` of shape (W, n): the stack is (1, W, n), the "mean" is the
    (W, n) tensor itself, and DDP reads its first n elements — **rank 0's gradient**.
    Plausible: developed and unit-tested on CPU with gloo, deployed on GPUs with NCCL.
    On a real cluster (NCCL): every replica trains on rank 0's gradient alone; replicas
    agree, nothing crashes, the effective batch is 1/W of what was paid for.
    Caught by: ``averages`` under the ``nccl`` backend model (passes under ``gloo``).
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    outputs = [torch.empty_like(buffer) for _ in range(group.size())]

    def aggregate(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        return torch.stack(fut.value()).mean(dim=0)  # BUG: gloo's value shape only

    return dist.all_gather(outputs, buffer, group=group, async_op=True).get_future().then(aggregate)


# --------------------------------------------------------------------------- replicas_agree


def allgather_own_first(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """all_gather-then-mean that starts from the rank's own gradient: replicas differ in the last bits.

    Bug: ``total = buffer.clone()`` then "add the others": rank r sums in the order r, 0,
    1, …; floating-point addition is not associative, so ranks round differently.
    Plausible: "I already have my own gradient, I only need the others'" — it even saves
    an addition.  Every value is within float32 rounding of the mean, so accuracy tests
    pass; with W = 2 both orders coincide (a + b == b + a), so 2-rank tests pass too.
    On a real cluster (W >= 3): replicas drift apart by an ulp per step; after thousands of
    steps the "replicated" models differ, checkpoints depend on which rank saved them,
    and evaluations disagree.
    Caught by: ``replicas_agree`` (bitwise) at world size >= 3; ``averages`` passes.
    """
    group = resolve_group(process_group)
    me, world = group.rank(), group.size()
    buffer = bucket.buffer()
    outputs = [torch.empty_like(buffer) for _ in range(world)]

    def aggregate(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        rows = gathered_rows(fut.value(), buffer, world)
        total = rows[me].clone()  # BUG: the fold starts at a rank-dependent place
        for rank, row in enumerate(rows):
            if rank != me:
                total += row
        return buffer.copy_(total.div_(world))

    return dist.all_gather(outputs, buffer, group=group, async_op=True).get_future().then(aggregate)


NOISE_STD = 1e-3  # relative to nothing: a fixed standard deviation, as in simple DP-SGD demos


def dp_noise_per_rank_rng(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """"Differentially private" mean: noise added after the all-reduce, from each rank's own RNG.

    Bug: ``torch.randn_like`` draws from the process-wide generator, whose state differs
    per rank (training scripts seed with ``seed + rank`` for data augmentation), so each
    replica adds different noise to the same mean.
    Plausible: adding noise to the aggregated gradient is the textbook DP-SGD step, and
    ``randn_like`` is the obvious call.
    On a real cluster: the replicas silently diverge from the first step; every rank's
    model is a different random walk.  (With identical seeds on every rank it may go
    unnoticed until anything consumes random numbers unevenly.)
    Caught by: ``replicas_agree`` with ranks starting from different RNG states
    (tolerance ``none``: the noise is intended).
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())

    def add_noise(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        mean = fut.value()[0]
        return mean.add_(torch.randn_like(mean), alpha=NOISE_STD)  # BUG: rank-local randomness

    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(add_noise)


def fp16_copy_wrong_direction(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> Future[torch.Tensor]:
    """float16 compression whose decompression copies the wrong way: each rank keeps its own gradient.

    Bug: ``reduced.copy_(buffer)`` overwrites the reduced tensor with the local gradient;
    ``dst.copy_(src)`` was meant (``buffer.copy_(reduced)``).  The hook returns the
    untouched local buffer.
    Plausible: ``copy_``'s direction is a classic slip (``memcpy`` argument order), and the
    code runs without any error.
    On a real cluster: no synchronisation at all — each replica trains on its own shard
    and the models drift apart while the job reports normal throughput.
    Caught by: ``replicas_agree`` (and ``averages``) with ranks holding different gradients.
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    compressed = torch.div(buffer, group.size()).to(torch.float16)

    def decompress(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        fut.value()[0].copy_(buffer)  # BUG: should be buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


# --------------------------------------------------------------------------- schedule_independence


@dataclass(eq=False)
class NoiseState:
    """Per-rank state for :func:`dp_noise_shared_generator`: one generator seeded alike on every rank."""

    process_group: dist.ProcessGroup | None = None
    seed: int = 1234
    std: float = NOISE_STD
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(self.seed)


def dp_noise_shared_generator(state: NoiseState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """The "fix" of :func:`dp_noise_per_rank_rng`: a shared seed — but drawn in completion order.

    Bug: every rank owns a generator with the same seed, so the noise *streams* agree; but
    the draws happen in the ``.then`` callbacks, i.e. in the order the buckets' all-reduces
    complete.  Which bucket receives which noise depends on the schedule.
    Plausible: the shared seed fixes the divergence in every test that completes buckets
    in order — including any one-bucket test.
    On a real cluster: completion order varies between runs and between ranks (gloo
    completes on two worker threads, which also race on the generator), so replicas
    diverge intermittently and no run is reproducible.  Measured on gloo, 2 ranks, a
    large bucket issued before two small ones: in 5 of 5 runs some rank drew noise out
    of bucket order, and in 4 of 5 the replicas differed.
    Caught by: ``schedule_independence`` with >= 2 buckets in flight (replicas still agree
    in a simulation that completes each collective on all ranks at once).  Fix: draw the
    noise in the hook body, which DDP calls in bucket order.
    """
    group = resolve_group(state)
    buffer = bucket.buffer()
    buffer.div_(group.size())

    def add_noise(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        mean = fut.value()[0]
        noise = torch.randn(mean.shape, generator=state.generator)  # BUG: drawn in completion order
        return mean.add_(noise.to(mean.dtype), alpha=state.std)

    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(add_noise)


# --------------------------------------------------------------------------- contract


def returns_offset_view(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Packs a contributor count in front of the gradients and returns ``packed[1:]``: storage offset 1.

    Bug: the values of ``packed[1:] / count`` are the right mean, but the view starts at
    storage element 1.  DDP does not copy *the view*: it reads the result's storage from
    element 0 as a contiguous block (measured on torch 2.13), so every gradient receives
    its predecessor's value and the first one receives the count.
    Plausible: one collective instead of two ("divide by the ranks that really
    contributed", for uneven inputs) is a good idea; slicing the header off is the
    natural way to unpack.  Putting the count *last* and returning ``packed[:-1]`` is fine.
    On a real cluster: gradients shifted by one element, no error raised.
    Caught by: ``contract`` (``storage_offset() != 0``).
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    packed = torch.cat([torch.ones(1, dtype=buffer.dtype), buffer])

    def unpack(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]
        return reduced[1:].div_(reduced[0])  # BUG: a view at storage offset 1

    return dist.all_reduce(packed, group=group, async_op=True).get_future().then(unpack)


def fire_and_forget_allreduce(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Divides, posts the all_reduce, and returns a future it completed itself with the bucket.

    Bug: nothing ties the returned future to the all_reduce.  DDP's reducer waits on the
    future the hook returned and nothing else, and copies its tensor into ``p.grad`` at once:
    the bucket as it was *before* the all_reduce wrote the sum into it.
    Plausible: the all_reduce works in place on the very tensor returned, so "it will be
    there"; on one rank (and in any simulator that completes every collective before DDP
    reads) the result is right.
    On a real cluster: measured on gloo (docs/ddp-facts.md), 193-200 of 200 gradients are
    each rank's own share, the ranks disagreeing in nearly every step; no error.
    Caught by: ``contract`` (``InFlightReadError``: DDP read a bucket a collective of the
    rank still had in flight, which it then changed).  Fix: return the collective's future,
    ``dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])``.
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer().div_(group.size())
    dist.all_reduce(buffer, group=group, async_op=True)  # BUG: never waited on
    fut: Future[torch.Tensor] = Future()
    fut.set_result(buffer)
    return fut


def returns_strided_view(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Reduces g and g*g together for a gradient-noise monitor, returns a stride-2 column.

    Bug: ``torch.stack([g, g * g], dim=1)`` interleaves the two; ``reduced[:, 0]`` is a
    non-contiguous view (stride 2).  DDP reads the storage contiguously from element 0,
    so gradients get the interleaved sequence ``m0, s0, m1, s1, …``.
    Plausible: batching two reductions into one collective is standard; stacking on
    ``dim=1`` instead of ``dim=0`` is a one-character slip and the values look right.
    On a real cluster: half of every bucket receives squared gradients, the rest is
    scrambled; no error.
    Caught by: ``contract`` (result not contiguous).
    """
    group = resolve_group(process_group)
    world = group.size()
    buffer = bucket.buffer()
    packed = torch.stack([buffer, buffer * buffer], dim=1)  # BUG: dim=1 interleaves

    def unpack(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0].div_(world)
        variance = (reduced[:, 1] - reduced[:, 0] ** 2).sum()
        _log.debug("bucket %d gradient variance %.3g", bucket.index(), float(variance))
        return reduced[:, 0]

    return dist.all_reduce(packed, group=group, async_op=True).get_future().then(unpack)


def returns_list(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """A correct mean that resolves to ``[tensor]``, the pre-1.10 convention.

    Bug: ``.then(lambda fut: [fut.value()[0]])`` — a one-element list.  PyTorch 1.7-1.9
    required that; since 1.10 DDP requires a tensor.  The return annotation is the one
    the docs show, and the body breaks it: DDP checks the annotation at registration
    (an honest ``Future[list[Tensor]]`` is refused there with ``ValueError``) but not the
    value until ``backward()``.
    Plausible: half-ported legacy code (``bucket.buffer()`` updated, the callback not).
    On a real cluster: ``backward()`` raises ``Unable to cast … to Tensor`` (measured,
    torch 2.13) on every rank at the first iteration.
    Caught by: ``contract``.
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: [fut.value()[0]])  # BUG: a list


def returns_future_value(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Returns the collective's own future, whose value is the list ``[tensor]``.

    Bug: ``work.get_future()`` resolves to the list of the collective's tensors; the
    ``.then(lambda fut: fut.value()[0])`` that unwraps it is missing.
    Plausible: the pre-division makes the tensor itself right, and "the future already
    holds my buffer" sounds true; the annotation (copied from the docs) says so too.
    On a real cluster: every ``backward()`` raises — on torch 2.13 (measured) not the
    ``Unable to cast`` of a Python list but ``result.isPyObject() INTERNAL ASSERT FAILED
    … python_comm_hook.cpp … expected the hook result is a PyObject``: the collective's
    future holds a C++ tensor list, which DDP's Python-hook path cannot even inspect.
    Caught by: ``contract``.
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future()  # BUG: not unwrapped


def returns_tensor_not_future(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Synchronous all-reduce, returns the tensor instead of a Future.

    Bug: the hook must return a ``torch.futures.Future``; the annotation (copied from the
    docs) promises one, the body returns the tensor.  (Annotated ``-> torch.Tensor``, DDP
    would refuse it at registration instead.)
    Plausible: the synchronous form is what every non-hook tutorial shows.
    On a real cluster: ``backward()`` raises ``Unable to cast Python instance of type
    <class 'torch.Tensor'> …``, and the reducer is left in a bad state: every later
    iteration fails with ``!unmarked_param_indices.empty() INTERNAL ASSERT FAILED``
    (measured, torch 2.13).
    Caught by: ``contract``.
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    dist.all_reduce(buffer.div_(group.size()), group=group)
    return buffer  # type: ignore[return-value]  # BUG: not a Future


def misnamed_bucket_param(process_group: dist.ProcessGroup | None, grad_bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """A correct mean whose second parameter is called ``grad_bucket``.

    Bug: DDP looks the parameter up *by name* when registering
    (``inspect.signature(hook).parameters["bucket"]``).
    Plausible: nothing in Python suggests a parameter's name matters.
    On a real cluster: ``register_comm_hook`` raises ``KeyError: 'bucket'`` (measured).
    Caught by: ``contract`` (registration rules); the numbers themselves are right.
    """
    group = resolve_group(process_group)
    buffer = grad_bucket.buffer()
    buffer.div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(first_tensor)


def string_annotations(
    process_group: "dist.ProcessGroup | None", bucket: "dist.GradBucket"
) -> "torch.futures.Future[torch.Tensor]":
    """A correct mean whose annotations are strings (quoted, or via ``from __future__ import annotations``).

    Bug: DDP compares ``bucket``'s annotation with ``dist.GradBucket`` and the return
    annotation with ``torch.futures.Future[torch.Tensor]`` by equality; a string is
    neither.  (The unparametrised ``-> torch.futures.Future`` of 1.8-era hooks is refused
    the same way.)
    Plausible: ``from __future__ import annotations`` at the top of a module is common
    style, and quoting is the standard answer to import cycles.
    On a real cluster: ``register_comm_hook`` raises ``ValueError: Communication hook:
    bucket annotation should be dist.GradBucket.`` (measured, torch 2.13).
    Caught by: ``contract`` (registration rules).
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(first_tensor)


def allgather_assumes_nccl_flat(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> Future[torch.Tensor]:
    """all_gather-then-mean that is right on NCCL and broken on gloo.

    Bug: ``fut.value()[0].mean(dim=0)`` assumes the value is ``[flat]`` of shape (W, n)
    (NCCL).  On gloo ``value()[0]`` is rank 0's 1-D tensor, and its mean over dim 0 is a
    0-d scalar.
    Plausible: written against NCCL, then run in CPU CI with gloo.
    On a real cluster (gloo): ``backward()`` raises ``setStorage: … out of bounds`` —
    the result is shorter than the bucket.
    Caught by: ``contract`` under the ``gloo`` backend model (passes under ``nccl``).
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    outputs = [torch.empty_like(buffer) for _ in range(group.size())]

    def aggregate(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        return fut.value()[0].mean(dim=0)  # BUG: NCCL's value shape only

    return dist.all_gather(outputs, buffer, group=group, async_op=True).get_future().then(aggregate)


# --------------------------------------------------------------------------- liveness


def rank0_logs_global_norm(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Rank 0 logs the bucket's global gradient norm — with a collective only rank 0 issues.

    Bug: the ``all_reduce`` for the norm sits inside ``if dist.get_rank() == 0``.  Rank 0's
    k-th collective is the norm (1 element) while every other rank's k-th collective is
    the bucket: collectives are matched by issue order, not by intent.
    Plausible: "log only on rank 0" is everywhere in training scripts, and the reduction
    for the log line is added later, inside the same ``if``.
    On a real cluster: the ranks' collectives pair up wrongly — sizes differ, so gloo
    fails or hangs (NCCL hangs until the watchdog kills the job); with matching sizes the
    data would be silently mixed.
    Caught by: ``liveness`` (mismatched collectives) at world size >= 2.
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    if dist.get_rank() == 0:
        norm_sq = buffer.detach().pow(2).sum().reshape(1)
        dist.all_reduce(norm_sq, group=group)  # BUG: only rank 0 issues this collective
        _log.info("bucket %d global grad norm %.4g", bucket.index(), float(norm_sq.sqrt()))
    buffer.div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(first_tensor)


def _mean_unless(process_group: dist.ProcessGroup | None, buffer: torch.Tensor, skip: bool) -> Future[torch.Tensor]:
    """The mean all-reduce of ``buffer`` on the group — or, when ``skip``, ``buffer`` as it is
    and no collective posted: the body of :func:`skip_allreduce_if_zero` and
    :func:`skips_on_local_overflow`. The
    bug is in the caller, where ``skip`` is decided from this rank's data alone."""
    group = resolve_group(process_group)
    if skip:
        done: Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    buffer.div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(first_tensor)


def skip_allreduce_if_zero(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Skips the all-reduce when the local bucket is all zeros: a data-dependent collective.

    Bug: whether a rank issues the collective depends on its own data.  A rank whose
    gradient happens to be zero (frozen embedding rows, a masked batch, no samples for a
    task head) skips, its peers do not.
    Plausible: "nothing to send" sounds like a free optimisation, and on one machine with
    dense gradients it never triggers.
    On a real cluster: the first time one rank's bucket is all zero, its later collectives
    pair with its peers' earlier ones: mismatched sizes (error or hang) or, worse, sums
    of different buckets; the skipping rank also keeps zeros instead of the mean.
    Caught by: ``liveness`` with one rank's gradient all zero.
    """
    buffer = bucket.buffer()
    all_zero = not bool(buffer.any())
    return _mean_unless(process_group, buffer, skip=all_zero)  # BUG: a rank-local decision about a collective


def scaled_fp16_blocking(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """:func:`simcluster.hooks.reference.scaled_fp16_hook` written PowerSGD-style: ``.wait()`` inside a callback.

    Bug: phase 1's ``.then`` callback issues phase 2 and blocks on it.  On gloo the
    callback runs on one of the group's **2** worker threads; each bucket in flight parks
    one there, and with two parked nothing is left to execute the phase-2 collectives.
    Plausible: it is exactly how torch's own ``powerSGD_hook`` is written, and it works
    with one bucket — and on NCCL, where callbacks run inline and collectives "complete"
    on enqueue.
    On a real cluster (gloo), measured with 2 ranks: 1 bucket in flight is fine; 2
    equal-size buckets hang every rank in ``backward()``; 3 buckets of different sizes
    hung in some runs and in others aborted the job with ``gloo::EnforceNotMet …
    Received data size doesn't match expected size`` — the phase-2 collectives are issued
    from callbacks in *completion* order, which differed between the ranks.  torch's ``powerSGD_hook`` under real DDP on
    gloo hangs the same way with 2 buckets.
    Caught by: ``liveness`` under the ``gloo`` backend model with >= 2 buckets.
    """
    group = resolve_group(process_group)
    world = group.size()
    buffer = bucket.buffer()
    amax = torch.zeros(1, dtype=torch.float32)
    if buffer.numel():
        amax[0] = buffer.detach().abs().max()

    def phase_two(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        found = float(fut.value()[0].item())
        scale = 2.0 ** math.floor(math.log2(32752.0 / found)) if 0.0 < found < math.inf else 1.0
        payload = (buffer.to(torch.float64) / world * scale).to(torch.float16)
        dist.all_reduce(payload, group=group, async_op=True).get_future().wait()  # BUG: blocks a worker
        return buffer.copy_(payload.to(torch.float64) / scale)

    work = dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group, async_op=True)
    return work.get_future().then(phase_two)


@dataclass(eq=False)
class ClipState:
    """Per-rank state for :func:`clip_waits_for_last_bucket`."""

    process_group: dist.ProcessGroup | None = None
    max_norm: float = 1.0
    squares: list[torch.Tensor] = field(default_factory=list, repr=False)
    norm: Future[torch.Tensor] | None = field(default=None, repr=False)


def clip_waits_for_last_bucket(state: ClipState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Global-norm clipping inside the hook: each callback waits for the last bucket.

    Bug: every bucket's callback blocks on ``state.norm``, a future that only the *last*
    bucket's callback completes — a wait on work that has not been issued yet when the
    wait starts.
    Plausible: clipping needs the norm over all buckets, and waiting for it where it is
    needed looks natural.  Iteration 0 has a single bucket (it is the last), so a short
    test passes.
    On a real cluster: NCCL runs callbacks inline in the hook call, so bucket 0's callback
    blocks the training thread before bucket 1 is even reduced: hang from iteration 1 on
    with >= 2 buckets.  On gloo, each waiting callback parks one of the 2 worker threads:
    hang with >= 3 buckets.
    Caught by: ``liveness`` with several buckets (>= 2 under ``nccl``, >= 3 under ``gloo``);
    the wait is on a plain ``torch.futures.Future``, not on a collective.
    """
    group = resolve_group(state)
    buffer = bucket.buffer()
    if bucket.index() == 0:  # a new iteration begins
        state.norm, state.squares = torch.futures.Future(), []
    norm = state.norm
    assert norm is not None
    buffer.div_(group.size())

    def clip(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        mean = fut.value()[0]
        state.squares.append(mean.detach().to(torch.float64).pow(2).sum())
        if bucket.is_last():
            norm.set_result(torch.stack(state.squares).sum().sqrt())
        total = float(norm.wait())  # BUG: waits for a bucket that may not even be issued yet
        return mean.mul_(min(1.0, state.max_norm / (total + 1e-6)))

    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(clip)


def skips_on_local_overflow(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Skips the all-reduce when the local bucket holds an inf or NaN: "don't send an overflow".

    Bug: whether a rank issues the collective depends on a *local* overflow check.  In
    mixed-precision training one rank's gradients overflow (a loss-scale too high for its
    batch) while its peers' do not; it skips, they post the all_reduce.
    Plausible: mixed-precision code skips work on overflow everywhere — GradScaler skips
    the optimizer step — and "why send gradients the scaler will throw away?" sounds like
    a free saving; the overflow branch never runs in a test with ordinary gradients.
    On a real cluster: the first overflow on one rank leaves its peers' all_reduce
    unmatched — real gloo hung (2 processes under torch's DDP, measured with ``simcluster
    check ... --e2e``: docs/properties.md, "Explicit examples") or pairs the next bucket's
    collective with it; the skipping rank also keeps its own gradients while the peers'
    never see the overflow.
    Caught by: ``liveness`` with one rank's gradient holding an inf (the explicit
    non-finite example; no drawn gradient is non-finite).
    """
    buffer = bucket.buffer()
    overflow = not bool(torch.isfinite(buffer).all())
    return _mean_unless(process_group, buffer, skip=overflow)  # BUG: a rank-local decision about a collective


# --------------------------------------------------------------------------- keeps_nonfinite


def hides_overflow(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """A mean all-reduce that "sanitises" the bucket with ``nan_to_num`` first: the overflow is hidden.

    Bug: ``nan_to_num_`` turns an ``inf`` into float32's largest value and a ``NaN`` into
    0 before the all-reduce, so every rank's result is finite.
    Plausible: a NaN once crashed a long run, and "make the gradients safe before sending
    them" looks defensive; with a fixed loss scale (no GradScaler) it even seems to help.
    On a real cluster: ``torch.amp.GradScaler`` skips ``optimizer.step()`` only when it
    finds an inf or NaN in the rank's own gradients — it never sees this overflow, steps on
    gradients of ~1e38 (or zeros), and does not lower the loss scale, so it overflows again.
    Caught by: ``keeps_nonfinite`` with one rank's gradient holding an inf or NaN (the
    explicit non-finite examples).
    """
    group = resolve_group(process_group)
    buffer = bucket.buffer()
    buffer.nan_to_num_()  # BUG: hides the overflow from GradScaler
    buffer.div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(first_tensor)


# --------------------------------------------------------------------------- error_feedback


@dataclass(eq=False)
class IndexedResidualState:
    """Per-rank top-k state that keys the error memory by ``bucket.index()``."""

    process_group: dist.ProcessGroup | None = None
    ratio: float = 0.25
    residuals: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)


def _topk_payload(values: torch.Tensor, ratio: float) -> tuple[torch.Tensor, int]:
    """(indices, values) of the largest-magnitude entries, packed as one float64 tensor."""
    k = min(values.numel(), max(1, int(ratio * values.numel() + 0.999999))) if values.numel() else 0
    chosen = values.abs().topk(k).indices.sort().values
    return torch.cat([chosen.to(torch.float64), values[chosen].to(torch.float64)]), k


def _topk_merge(
    state: object, buffer: torch.Tensor, payload: torch.Tensor, k: int
) -> Future[torch.Tensor]:
    """all_gather the packed pairs and average them in rank order into ``buffer`` (correct part)."""
    group = resolve_group(state)
    world = group.size()
    outputs = [torch.empty_like(payload) for _ in range(world)]

    def merge(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        total = torch.zeros(buffer.numel(), dtype=torch.float64)
        for row in gathered_rows(fut.value(), payload, world):
            total.index_add_(0, row[:k].to(torch.int64), row[k:])
        return buffer.copy_(total / world)

    return dist.all_gather(outputs, payload, group=group, async_op=True).get_future().then(merge)


def topk_residual_keyed_by_index(state: IndexedResidualState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Top-k with error feedback whose memory is keyed by ``bucket.index()``; breaks at the rebuild.

    Bug: ``state.residuals[bucket.index()]``.  Iteration 0 has one bucket holding every
    parameter; from iteration 1 DDP rebuilds buckets in gradient-ready order, so index 0
    names a smaller bucket of other parameters, and the stored residual no longer fits.
    Plausible: torch's own PowerSGD keys its error memory the same way (and documents
    that compression must start after the rebuild); ``index()`` looks like a stable id.
    On a real cluster: iteration 1 raises a size-mismatch ``RuntimeError`` inside the hook
    on every rank; had the sizes matched, the memory would be added to the wrong
    parameters without a word.
    Caught by: ``error_feedback`` (any multi-step run with >= 2 buckets after the rebuild
    fails with the hook's exception); :class:`simcluster.hooks.reference.TopKState` keys by parameter.
    """
    buffer = bucket.buffer()
    residual = state.residuals.get(bucket.index())  # BUG: index() changes meaning after iteration 0
    corrected = buffer.detach().to(torch.float64)
    if residual is not None:
        corrected = corrected + residual  # raises once the rebuilt bucket has another size
    payload, k = _topk_payload(corrected, state.ratio)
    state.residuals[bucket.index()] = corrected.index_fill(0, payload[:k].to(torch.int64), 0.0)
    return _topk_merge(state, buffer, payload, k)


def topk_forgets_inplace_add(state: IndexedResidualState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Top-k whose error feedback is silently off: ``add`` where ``add_`` was meant.

    Bug: ``buffer.add(residual)`` returns a new tensor, which is discarded; selection and
    the new residual are computed from the raw gradient, and what was not sent is lost
    each step.  (Memory is keyed by index too, but the rebuild cannot hurt: the residual
    is never read back.)
    Plausible: one missing underscore; nothing crashes, shapes are right, and a single
    step is indistinguishable from the correct hook.
    On a real cluster: plain top-k without error feedback — coordinates with persistently
    small gradients are never updated and convergence stalls or degrades.
    Caught by: ``error_feedback``: the gap between accumulated output and accumulated mean
    grows with the number of steps (linearly for gradients that repeat across steps).
    """
    buffer = bucket.buffer()
    residual = state.residuals.get(bucket.index())
    if residual is not None and residual.numel() == buffer.numel():
        buffer.add(residual.to(buffer.dtype))  # BUG: out of place; the sum is thrown away
    payload, k = _topk_payload(buffer.detach(), state.ratio)
    state.residuals[bucket.index()] = buffer.detach().to(torch.float64).index_fill(
        0, payload[:k].to(torch.int64), 0.0
    )
    return _topk_merge(state, buffer, payload, k)
