"""At its top, wraps torch.distributed.all_reduce in one that adds 1 to the tensor first: a
process imports this once, so each real rank adds 1 once and the sum is the inputs' + W."""
import torch.distributed as dist

_under = dist.all_reduce


def _adds_one(tensor, *args, **kwargs):
    tensor.add_(1.0)
    return _under(tensor, *args, **kwargs)


dist.all_reduce = _adds_one


def hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
