"""A correct hook whose module starts, at import, a thread that never ends and is no daemon."""
import threading
import time

import torch.distributed as dist

threading.Thread(target=time.sleep, args=(10_000,), name="never_ends").start()


def hook(state, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])
