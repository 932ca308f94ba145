"""At import, points sys.stdout at a StringIO (to silence prints); the hook forgets to divide."""
import io
import sys

import torch.distributed as dist

sys.stdout = io.StringIO()


def hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
