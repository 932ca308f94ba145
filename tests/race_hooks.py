"""Two hooks for the explicit *race* example (tests/test_check.py): the same skip-on-overflow
mean, one posting a collective from its ``then`` callback. Loaded as ``tests/race_hooks.py:NAME``.

* :func:`callback_broadcast_hook` — agrees on "does any rank hold a non-finite gradient?" with a
  *blocking* MAX all_reduce inside the hook, posts the bucket's SUM all_reduce, and in the
  callback posts ``dist.broadcast(result.clone(), src=0, async_op=True)`` "to keep replicas in
  step", never waited on (of a copy: a broadcast of the bucket itself, left in flight past
  ``backward()``, is a race of its own, reported first since round 23 of hooks from the wild —
  tests/test_ddp.py — and these hooks are about the order of collectives). With two buckets in flight, a rank whose bucket-0 SUM completes while it is
  blocked in bucket 1's MAX posts the broadcast first; a rank that got bucket 1's MAX first
  posts bucket 1's SUM first: broadcast meets all_reduce, and a real gloo cluster hangs.
* :func:`no_callback_collective_hook` — the same hook without the broadcast: every collective
  is posted from the hook, in bucket order, on every rank. It passes.

On an agreed overflow both fill the bucket with ``inf``, so that GradScaler sees it on every
rank; they zeroed it until the explicit non-finite examples (2026-12-04) showed that this hides
the overflow (*keeps_nonfinite*; tests/nonfinite_hooks.py keeps the zeroing variant).

No ``from __future__ import annotations`` here: DDP's registration check compares the
``bucket`` annotation with ``dist.GradBucket`` itself, and a string never compares equal.
"""

import torch
import torch.distributed as dist


def _skip_nonfinite_mean(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket,
                         sync_in_callback: bool) -> torch.futures.Future[torch.Tensor]:
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    bad = torch.tensor([0.0 if bool(torch.isfinite(buffer).all()) else 1.0])
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)  # blocking: every rank skips, or none
    if float(bad) > 0.0:
        buffer.fill_(float("inf"))  # every rank's GradScaler sees the overflow
    future = dist.all_reduce(buffer.div_(group.size()), group=group, async_op=True).get_future()

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        result = fut.value()[0]
        if sync_in_callback:
            dist.broadcast(result.clone(), src=0, group=group, async_op=True)  # never waited on (a copy: the bucket is not left in flight)
        return result

    return future.then(done)


def callback_broadcast_hook(process_group: dist.ProcessGroup | None,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _skip_nonfinite_mean(process_group, bucket, sync_in_callback=True)


def no_callback_collective_hook(process_group: dist.ProcessGroup | None,
                                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _skip_nonfinite_mean(process_group, bucket, sync_in_callback=False)


def one_rank_refused_racy_hook(process_group: dist.ProcessGroup | None,
                               bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`callback_broadcast_hook` that also raises on a one-rank group — a second bug,
    which the drawn search finds at once (as a flex-quantisation hook from the wild failed
    *contract* at world 1, hooks.md 2026-12-04)."""
    group = process_group if process_group is not None else dist.group.WORLD
    if group.size() == 1:
        raise ValueError("needs two ranks or more")
    return _skip_nonfinite_mean(process_group, bucket, sync_in_callback=True)
