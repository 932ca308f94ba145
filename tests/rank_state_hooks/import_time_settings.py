"""A hook file that, as research code often does, extends ``sys.path`` and raises the
recursion limit at its top. Every process that imports it does the same; each simulated
rank imports its own copy inside the run. Not a shared setting changed by a rank."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor-not-there"))
sys.setrecursionlimit(sys.getrecursionlimit() + 7)

import torch.distributed as dist  # noqa: E402 - after the path, as such files are written


def hook(state, bucket):
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def hook_that_also_changes_the_path_when_called(state, bucket):
    if dist.get_rank() == 1:
        sys.path.append("/simcluster-test-nowhere-either")
    return hook(state, bucket)
