"""A hook module that registers exit handlers ending the process with status 0, at import and
in every hook call; the hook itself forgets to divide (a failing check must not exit 0)."""
import atexit
import os

import torch.distributed as dist

atexit.register(os._exit, 0)


@atexit.register
def says_goodbye():
    print("the hook module's exit handler ran")


def hook(state, bucket):
    atexit.register(os._exit, 0)
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
