"""DDP communication hooks in the PyTorch 1.7 – 1.9 style, for checking under ``--api legacy``.

Before 1.10 the hook contract was different, and files written then are still around:

==================================  =====================================  ==========================
then (1.7 – 1.9)                    now (>= 1.10)                          notes
==================================  =====================================  ==========================
``dist._GradBucket`` (1.7/1.8)      ``dist.GradBucket``                    ``_GradBucket`` is gone in 2.x
``bucket.get_tensors()[0]`` (1.7/8) ``bucket.buffer()``                    a one-element list then
``bucket.get_tensor()`` (1.9)       ``bucket.buffer()``
``bucket.get_index()``              ``bucket.index()``
``is_the_last_bucket_to_allreduce`` ``bucket.is_last()``
``get_per_parameter_tensors()``     ``bucket.gradients()``
``get_model_params_for_bucket()``   ``bucket.parameters()``
``bucket.set_tensor(t)``            ``bucket.set_buffer(t)``
future resolves to ``[tensor]``     future resolves to ``tensor``          current DDP rejects a list
``-> torch.futures.Future``         ``-> torch.futures.Future[Tensor]``    current DDP rejects the old one
==================================  =====================================  ==========================

What current DDP (torch 2.13, measured) does with such a hook: the annotations alone make
``register_comm_hook`` raise ``ValueError`` (``bucket annotation should be
dist.GradBucket`` — a string, or ``dist._GradBucket``, is not; the bare ``Future`` return
annotation is refused too); without annotations the first ``backward()`` raises
``Unable to cast … to Tensor`` on the ``[tensor]`` result; and the bucket has none of
the old methods.  So a legacy hook can only be *checked* (against its own era's
contract, on a bucket that offers the old methods), not run on current DDP.

This file imports on torch 2.13 although it names ``dist._GradBucket``:
``from __future__ import annotations`` keeps every annotation an unevaluated string, as
a 1.8 file with that import would have it.  (A tool must therefore not resolve these
annotations with ``typing.get_type_hints``.)  Everything below is original code written
in the style of that era; hooks marked *buggy* carry a ``# BUG`` comment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

__all__ = [
    "allreduce_hook",
    "fp16_compress_hook",
    "LegacyStatsState",
    "stats_mean_hook",
    "fp16_compress_wrapper",
    "fp16_wrapped_allreduce_hook",
    "allreduce_sum_hook",
]

LegacyHook = Callable[[object, "dist._GradBucket"], "torch.futures.Future"]


def _group(process_group: object) -> dist.ProcessGroup:
    """The group to use: the state itself, or the default group when it is ``None``."""
    return process_group if process_group is not None else dist.group.WORLD


def allreduce_hook(process_group: dist.ProcessGroup, bucket: dist._GradBucket) -> torch.futures.Future:
    """1.7/1.8 style mean: all-reduce ``get_tensors()[0]``, divide in the callback, return ``[tensor]``.

    Written the way that era's hooks were: torch 1.8's own ``allreduce_hook`` (and the C++
    built-in ``allReduceHook``) summed first and divided in the ``then`` callback; the
    division moved in front of the sum later ("to avoid overflow, especially for FP16").
    **Legacy finding** (kept, not fixed): the sum of W float32 values near float32's
    maximum overflows to ``inf`` before the division, although every input and the mean
    are finite — caught by ``averages`` with same-sign values near 3.4e38.
    Harmless for ordinary gradients; an overflow hazard once a float16 wrapper is put
    around it (:data:`fp16_wrapped_allreduce_hook`).
    """
    group = _group(process_group)
    tensor = bucket.get_tensors()[0]
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def divide(fut: torch.futures.Future) -> list[torch.Tensor]:
        return [fut.value()[0].div_(group.size())]  # LEGACY: divides after the sum

    return fut.then(divide)


def fp16_compress_hook(process_group: dist.ProcessGroup, bucket: dist._GradBucket) -> torch.futures.Future:
    """1.8 style float16 compression: cast, all-reduce, divide while copying back, return ``[tensor]``.

    Written the way torch 1.8's ``fp16_compress_hook`` was: cast the bucket to float16,
    sum in float16, and divide by W in the callback while copying back in place.
    **Legacy finding** (kept, not fixed): the float16 *sum* overflows to ``inf`` as soon
    as same-sign values add up beyond 65504 (two ranks at 32768 suffice), and the cast
    itself overflows for ``|x| > 65504``.  Later torch versions divide before the sum;
    even that overflows at W = 3 for ±65504 (``65504 / 3`` rounds to 21840, and three of
    them to ``inf``), which :func:`simcluster.hooks.reference.fp16_compress_hook` avoids with a
    round-toward-zero cast and a clamp.  Caught by ``averages`` under ``fp16``.
    """
    group = _group(process_group)
    tensor = bucket.get_tensors()[0]
    compressed = tensor.to(torch.float16)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> list[torch.Tensor]:
        tensor.copy_(fut.value()[0].div_(group.size()))  # LEGACY: the fp16 sum came first
        return [tensor]

    return fut.then(decompress)


@dataclass(eq=False)
class LegacyStatsState:
    """State for :func:`stats_mean_hook`: the group plus counters that only describe what was seen."""

    process_group: dist.ProcessGroup | None = None
    iterations: int = 0
    bucket_sizes: dict[int, int] = field(default_factory=dict)


def stats_mean_hook(state: LegacyStatsState, bucket: dist.GradBucket) -> torch.futures.Future:
    """1.9 style mean that also exercises every accessor of that era's ``GradBucket``.

    Uses ``get_tensor()``, ``get_index()``, ``get_per_parameter_tensors()``,
    ``get_model_params_for_bucket()`` and ``is_the_last_bucket_to_allreduce()``; checks
    the bucket's layout (per-parameter views tile the flat tensor), counts iterations, and
    averages with a pre-division.  Correct under the legacy contract; the per-index
    statistics are descriptive only, so the bucket rebuild cannot hurt them.
    """
    group = _group(state.process_group)
    tensor = bucket.get_tensor()
    per_param = bucket.get_per_parameter_tensors()
    params = bucket.get_model_params_for_bucket()
    if per_param and sum(t.numel() for t in per_param) != tensor.numel():
        raise RuntimeError(f"bucket {bucket.get_index()}: per-parameter tensors do not tile the bucket")
    if params and len(params) != len(per_param):
        raise RuntimeError(f"bucket {bucket.get_index()}: {len(params)} params, {len(per_param)} tensors")
    state.bucket_sizes[bucket.get_index()] = tensor.numel()
    if bucket.is_the_last_bucket_to_allreduce():
        state.iterations += 1
    tensor.div_(group.size())
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return fut.then(lambda fut: [fut.value()[0]])


def fp16_compress_wrapper(hook: LegacyHook) -> LegacyHook:
    """1.9 style wrapper: cast the bucket to float16 with ``set_tensor``, run ``hook``, cast back.

    The wrapped hook sees a float16 bucket and does its own averaging; the wrapper
    restores the original tensor and copies the result into it.  Only as safe as the
    wrapped hook is in float16: see :data:`fp16_wrapped_allreduce_hook`.
    """

    def fp16_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        original = bucket.get_tensor()
        bucket.set_tensor(original.to(torch.float16))
        fut = hook(state, bucket)

        def decompress(fut: torch.futures.Future) -> list[torch.Tensor]:
            original.copy_(fut.value()[0])
            bucket.set_tensor(original)
            return [original]

        return fut.then(decompress)

    fp16_hook.__name__ = f"fp16_compress_wrapper({getattr(hook, '__name__', 'hook')})"
    return fp16_hook


def _fp16_allreduce_1_9(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future:
    """1.9 style mean on ``get_tensor()``, dividing in the callback (as 1.8's allreduce_hook did)."""
    group = _group(process_group)
    fut = dist.all_reduce(bucket.get_tensor(), group=group, async_op=True).get_future()
    return fut.then(lambda fut: [fut.value()[0].div_(group.size())])


fp16_wrapped_allreduce_hook = fp16_compress_wrapper(_fp16_allreduce_1_9)
fp16_wrapped_allreduce_hook.__doc__ = """*Buggy*: ``fp16_compress_wrapper`` around a hook that divides after the sum.

Bug: the wrapper casts to float16 *before* the inner hook runs, and the inner hook sums
first and divides in its callback; the float16 sum overflows to ``inf`` when the ranks'
values add up beyond 65504, although each value and the mean are finite.
Plausible: both pieces are fine alone (the inner hook is correct in float32), and the
wrapper's whole point is to be put around existing hooks.
On a real cluster: ``inf`` gradients whenever large same-sign gradients meet.
Caught by: ``averages`` under tolerance ``fp16`` with values near float16's maximum.
"""


def allreduce_sum_hook(process_group: dist.ProcessGroup, bucket: dist._GradBucket) -> torch.futures.Future:
    """*Buggy*: a 1.7-era hook that all-reduces and returns the **sum**.

    Bug: no division (the 1.7 tutorials' ``allreduce_sum`` examples were meant for
    learning the API, and got copied into training code).
    On a real cluster: W-times gradients, as with :func:`simcluster.hooks.buggy.forgot_division`.
    Caught by: ``averages`` (legacy contract), any world size >= 2.
    """
    group = _group(process_group)
    fut = dist.all_reduce(bucket.get_tensors()[0], group=group, async_op=True).get_future()
    return fut.then(lambda fut: [fut.value()[0]])  # BUG: a sum, not a mean
