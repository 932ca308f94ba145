"""At import, changes the working directory to /; the hook forgets to divide."""
import os

import torch.distributed as dist

os.chdir("/")


def hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
