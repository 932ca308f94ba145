"""Hooks for the explicit non-finite examples (tests/test_nonfinite.py): what a hook does with an
``inf`` or ``NaN`` in one rank's gradient. Loaded as ``tests/nonfinite_hooks.py:NAME``.

* :func:`marks_overflow_hook` — the correct way to skip communication on overflow: every rank
  posts a MAX all_reduce of its "overflowed?" flag, so all decide alike; on overflow every rank
  skips the mean and returns its bucket filled with ``inf`` (GradScaler then skips the step on
  every rank). Passes.
* :func:`zero_on_agreed_overflow_hook` — agrees the same way, then *zeroes* the bucket: no rank
  hangs, but GradScaler never sees the overflow (*keeps_nonfinite*, on every rank).
* :func:`clamp_after_allreduce_hook` — a mean whose callback clamps the result to ±1e4 "against
  exploding gradients": an ``inf`` becomes 1e4 (hidden); a ``NaN`` passes a clamp.
* :func:`zero_nans_hook` — a mean that replaces NaNs by 0 before sending: an ``inf`` passes,
  a ``NaN`` is hidden — only the NaN example shows it.
* :func:`rank0_sanitises_hook` — rank 0 alone runs ``nan_to_num_`` on its result ("rank 0
  logs and checkpoints, keep it clean"): hidden on rank 0, kept on the others.

No ``from __future__ import annotations`` here: DDP's registration check compares the
``bucket`` annotation with ``dist.GradBucket`` itself, and a string never compares equal.
"""

import torch
import torch.distributed as dist

Future = torch.futures.Future


def _mean(bucket: dist.GradBucket) -> Future[torch.Tensor]:
    group = dist.group.WORLD
    buffer = bucket.buffer().div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _agreed_overflow(buffer: torch.Tensor) -> bool:
    flag = torch.tensor([0.0 if bool(torch.isfinite(buffer).all()) else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank posts it: all decide alike
    return float(flag) > 0.0


def marks_overflow_hook(state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    buffer = bucket.buffer()
    if _agreed_overflow(buffer):
        done: Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer.fill_(float("inf")))
        return done
    return _mean(bucket)


def zero_on_agreed_overflow_hook(state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    buffer = bucket.buffer()
    if _agreed_overflow(buffer):
        done: Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer.zero_())  # hides the overflow from GradScaler
        return done
    return _mean(bucket)


def clamp_after_allreduce_hook(state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    return _mean(bucket).then(lambda fut: fut.value().clamp_(-1e4, 1e4))


def zero_nans_hook(state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    buffer = bucket.buffer()
    buffer.copy_(torch.where(buffer.isnan(), torch.zeros_like(buffer), buffer))
    return _mean(bucket)


def rank0_sanitises_hook(state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    def clean(fut: Future[torch.Tensor]) -> torch.Tensor:
        result = fut.value()
        return result.nan_to_num_() if dist.get_rank() == 0 else result

    return _mean(bucket).then(clean)
