"""A hook module whose import takes a while (a big model config, a compiled extension...),
with its state factory in the same file: each rank's copy must be its own, complete one
even when ranks import at the same time (real DDP on threads, under ``simcluster e2e``)."""
import time

import torch.distributed as dist

time.sleep(0.05)  # the import is slow: other ranks' imports overlap it

LOADS = []  # this copy's loads


def factory(process_group):
    return {"pg": process_group}


def hook(state, bucket):
    fut = dist.all_reduce(bucket.buffer().div_(state["pg"].size()), group=state["pg"], async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
