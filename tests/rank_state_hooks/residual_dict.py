"""Correct on real processes: module-level dictionaries keyed by bucket index.

``_sent`` counts, per bucket index, how many times this process reduced that bucket;
from the second time on the hook reduces in float64 and keeps the float32 rounding
residual of its share in ``_residual`` (reported, never fed back, so results stay the
mean). Every process keeps its own dictionaries, so every rank picks the same dtype for
the same call; ranks sharing one module would count each other's calls and disagree.
"""

import torch
import torch.distributed as dist

_sent: dict[int, int] = {}
_residual: dict[int, torch.Tensor] = {}


def hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    index = bucket.index()
    _sent[index] = _sent.get(index, 0) + 1
    buf = bucket.buffer()
    if _sent[index] > 1:
        send = buf.to(torch.float64).div_(group.size())
        _residual[index] = send - send.to(torch.float32).to(torch.float64)
    else:
        send = buf.clone().div_(group.size())
    fut = dist.all_reduce(send, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].to(buf.dtype))
