"""Buggy: adds ``torch.rand`` noise to the averaged gradient, drawn on each rank."""

import torch
import torch.distributed as dist


def hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    noise = torch.rand(buf.shape) * 1e-3
    fut = dist.all_reduce(buf.div_(group.size()), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] + noise)
