"""Buggy: a module-level dict caches each bucket's result by index and serves it again
on later steps (stale gradients from step 1 on)."""

import torch.distributed as dist

_results: dict[int, tuple[int, object]] = {}


def hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    index, numel = bucket.index(), bucket.buffer().numel()
    if index in _results and _results[index][0] == numel:
        return _results[index][1]  # BUG: last step's result, whatever this step's gradients are
    fut = dist.all_reduce(bucket.buffer().div_(group.size()), group=group, async_op=True).get_future()
    result = fut.then(lambda f: f.value()[0].clone())
    _results[index] = (numel, result)
    return result
