"""Correct on real processes: a module-level ``random.Random(1234)`` seeded alike everywhere.

Every process draws the same sequence, so every rank picks the same all_reduce dtype at
every call. Ranks sharing one generator would draw different values and disagree.
"""

import random

import torch
import torch.distributed as dist

_rng = random.Random(1234)


def hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    send = buf.to(torch.float64) if _rng.random() < 0.5 else buf.clone()
    send.div_(group.size())
    fut = dist.all_reduce(send, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].to(buf.dtype))
