"""Correct on real processes: the dtype switch counts calls in ``rspkg.helpers``."""

import torch
import torch.distributed as dist

from rspkg import helpers


def hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    send = buf.to(torch.float64) if helpers.bump() > 2 else buf.clone()
    send.div_(group.size())
    fut = dist.all_reduce(send, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].to(buf.dtype))


def adds_its_helper_count(process_group, bucket):
    """Adds how many times it was called — counted in ``rspkg.helpers`` — to its share: on
    real processes every rank counts its own calls from 1, so the sum is exact; with the
    helper shared by the simulated ranks, their counts differ."""
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer().div_(group.size()).add_(float(helpers.bump()))
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])
