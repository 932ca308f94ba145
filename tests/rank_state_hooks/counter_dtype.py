"""Correct on real processes: a module-level call counter picks the all_reduce dtype.

Every process counts its own calls, so all ranks switch from a float32 to a float64
all_reduce at the same (third) call. Ranks sharing one module would disagree.
"""

import torch
import torch.distributed as dist

_calls = {"n": 0}


def hook(process_group, bucket):
    _calls["n"] += 1
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    wide = _calls["n"] > 2
    send = buf.to(torch.float64) if wide else buf.clone()
    send.div_(group.size())
    fut = dist.all_reduce(send, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].to(buf.dtype))
