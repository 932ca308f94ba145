"""Measure real DDP on gloo: a hook that posts its all_reduce and returns a completed future
of the bucket without waiting for it ("fire and forget").

Why: simcluster's DDP model copied each bucket back only once every collective of the step
had completed, so such a hook passed every property (round 22 of hooks from the wild). Real
DDP's reducer waits on the future the hook returned and nothing else: this is what it then
copies into ``p.grad``.

    python benchmarks/measure_unwaited_collective.py

Real ``DistributedDataParallel`` (torch 2.13, CPU) over ``Linear(1000, 1, bias=False)`` on a
real gloo world (localhost), per world size 2 and 3: rank ``r``'s input is ``r + 1`` everywhere
(so its gradient is ``r + 1`` per element), 200 iterations of ``forward``/``backward``, rank 1
sleeping 2 ms before ``backward`` every third iteration. Two hooks, each returning a
``torch.futures.Future`` it completed with the bucket:

- ``fire_and_forget`` divides the bucket by the world size and posts ``all_reduce(buffer,
  async_op=True)`` without waiting (a barrier after each iteration);
- ``equal_then_forgotten_broadcast`` divides, all-reduces synchronously (every rank holds the
  mean), then posts a broadcast from rank 0 of those values without waiting — no barrier, and
  the inputs scaled by 3 every other iteration (the gradient read is divided back), so a
  broadcast still in flight meets the next iteration's gradients.

The mean every rank should get is ``(1 + … + W) / W``. One line per rank and hook: in how
many iterations ``p.grad`` right after ``backward()`` was not the mean, in how many the ranks'
gradients disagreed, and the values seen.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _gloo import gloo_world, spawn_worlds, tally_race

ITERATIONS = 200


def fire_and_forget(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    buffer = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(buffer, async_op=True)  # never waited on
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def equal_then_forgotten_broadcast(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    buffer = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(buffer)  # every rank holds the mean
    dist.broadcast(buffer, src=0, async_op=True)  # values every rank already holds; never waited on
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def run(rank: int, world: int, port: int) -> None:
    with gloo_world(rank, world, port):
        for hook in (fire_and_forget, equal_then_forgotten_broadcast):
            torch.manual_seed(0)
            model = DDP(torch.nn.Linear(1000, 1, bias=False))
            model.register_comm_hook(None, hook)
            seen = []
            for i in range(ITERATIONS):
                scale = 1.0 if i % 2 == 0 or hook is fire_and_forget else 3.0  # the broadcast's: new values each step
                x = torch.full((1, 1000), float(rank + 1) * scale)
                model.zero_grad(set_to_none=True)
                loss = model(x).sum()
                if rank == 1 and i % 3 == 0:
                    time.sleep(0.002)
                loss.backward()
                seen.append(model.module.weight.grad[0, 0].item() / scale)  # read at once, as an optimizer would
                if hook is fire_and_forget:
                    dist.barrier()  # the stray all_reduce has long finished before the next iteration
            tally_race(rank, world, seen, f"{hook.__name__}: gradients")
            dist.barrier()
            time.sleep(0.1)  # a broadcast still in flight lands before the next case


if __name__ == "__main__":
    spawn_worlds(run, [(2, 29631), (3, 29632)])
