"""Buggy: a module-level ``random.Random(1234)`` picks an element to drop (random
sparsification) and the hook forgets to send it: the result is not the mean there."""

import random

import torch.distributed as dist

_rng = random.Random(1234)


def hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    send = buf.div(group.size())
    send[_rng.randrange(send.numel())] = 0.0  # BUG: the dropped element is lost, not kept as a residual
    fut = dist.all_reduce(send, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
