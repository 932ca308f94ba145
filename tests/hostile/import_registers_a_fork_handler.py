"""A correct hook whose module registers, at import, a fork handler that ends every forked child."""
import os

import torch.distributed as dist

os.register_at_fork(after_in_child=lambda: os._exit(0))


def hook(state, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])
