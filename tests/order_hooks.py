"""A hook for the explicit *order* example (tests/test_check.py). Loaded as
``tests/order_hooks.py:NAME``.

:func:`world_three_only_hook` — modelled on a Trivance all-reduce from the wild (hooks from the
wild, round 8): it refuses every world size but 3 (a ``ValueError``: *liveness*, met by most
drawn examples), and at world 3 each rank adds the group's buffers itself, starting from its
own, so float rounding differs by rank and the replicas drift apart (*replicas_agree*). The
drawn search spent its examples on the refusals and reported the drift on 1 seed in 3.

No ``from __future__ import annotations``: DDP compares the ``bucket`` annotation itself.
"""

import torch
import torch.distributed as dist


def world_three_only_hook(process_group: dist.ProcessGroup | None,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = process_group if process_group is not None else dist.group.WORLD
    size = group.size()
    if size != 3:
        raise ValueError(f"this all-reduce needs a world of 3 ranks, got {size}")
    buffer = bucket.buffer()
    gathered = [torch.empty_like(buffer) for _ in range(size)]
    dist.all_gather(gathered, buffer, group=group)
    me = group.rank()
    total = gathered[me].clone()
    for step in range(1, size):  # in an order that starts at this rank: rounding differs by rank
        total.add_(gathered[(me + step) % size])
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer.copy_(total.div_(size)))
    return fut
