"""Callables of every kind benchmarks/measure_registration.py registered with real DDP, as a
TARGET file (tests/test_registration.py): each averages its bucket when it runs."""

import functools

import torch.distributed as dist


def mean(state, bucket):
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def mean_with_scale(scale, state, bucket):
    return mean(state, bucket)


class CallableHook:
    def __call__(self, state, bucket):
        return mean(state, bucket)


class Holder:
    def hook(self, state, bucket):
        return mean(state, bucket)


def one_param(bucket):
    return mean(None, bucket)


def three_params(state, bucket, extra):
    return mean(state, bucket)


def no_bucket(state, grad_bucket):
    return mean(state, grad_bucket)


lambda_hook = lambda state, bucket: mean(state, bucket)  # noqa: E731 - the case measured
partial_hook = functools.partial(mean)
partial_with_scale = functools.partial(mean_with_scale, 2.0)
partial_named = functools.partial(mean)
partial_named.__name__ = "mean"
instance_hook = CallableHook()
instance_named = CallableHook()
instance_named.__name__ = "hook"
instance_fully_named = CallableHook()
instance_fully_named.__name__ = instance_fully_named.__qualname__ = "hook"
instance_named_none = CallableHook()
instance_named_none.__name__ = instance_named_none.__qualname__ = None
bound_method = Holder().hook
