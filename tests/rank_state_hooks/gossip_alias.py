"""Buggy: a gossip-style hook whose receive slot aliases its send buffer.

Each rank picks a gossip partner with Python's ``random`` and all-gathers every rank's
gradient; the slot for its partner is the bucket buffer itself (to save a copy). When a
rank's partner is another rank, the all_gather overwrites that rank's own gradient with
the partner's, and the mean it then computes counts the partner twice and itself not at
all. Whether it shows depends on the ranks' random draws.
"""

import random

import torch
import torch.distributed as dist


def hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    world, me = group.size(), dist.get_rank(group)
    buf = bucket.buffer()
    partner = random.randrange(world)
    slots = [torch.empty_like(buf) for _ in range(world)]
    if partner != me:
        slots[partner] = buf  # BUG: receives into the tensor it sends
    fut = dist.all_gather(slots, buf, group=group, async_op=True).get_future()

    def mix(_):
        others = [slots[q] for q in range(world) if q != me]
        return (buf + sum(others, torch.zeros_like(buf))) / world

    return fut.then(mix)
