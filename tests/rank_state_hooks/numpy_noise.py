"""Buggy: adds numpy noise to the averaged gradient, drawn on each rank (replicas drift apart)."""

import numpy
import torch
import torch.distributed as dist


def hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    noise = torch.from_numpy(numpy.random.normal(0.0, 1e-3, buf.numel()).astype("float32")).reshape(buf.shape)
    fut = dist.all_reduce(buf.div_(group.size()), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] + noise)
