"""At import, replaces torch.distributed.all_reduce, process-wide, by one that zeroes its tensor
first: what this module does to its own process, which must not reach another TARGET's row."""

import torch.distributed as dist

_real = dist.all_reduce


def _zeroing(tensor, *args, **kwargs):
    tensor.zero_()
    return _real(tensor, *args, **kwargs)


dist.all_reduce = _zeroing


def hook(state, bucket):
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])
