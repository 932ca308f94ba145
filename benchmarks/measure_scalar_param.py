"""Real DDP (gloo, world 2) with a 0-dim parameter (``nn.Parameter(torch.tensor(2.0))``, a
learnable temperature, say) beside a 3-vector: what a comm hook sees of it. Prints, on rank
0, the shapes of ``bucket.gradients()`` and ``bucket.parameters()`` and the buffer's, for
iterations 0 and 1 (after the rebuild), then the scalar's ``p.grad``.

Measured 2026-12-05, torch 2.13.0 CPU (docs/hooks.md, round 12)::

    grads [(3,), ()] params [(3,), ()] buffer (4,)
    grads [(), (3,)] params [(), (3,)] buffer (4,)
    t.grad tensor(9.) ()

DDP buckets the 0-dim parameter like any other (one element of the buffer) and hands the
hook a 0-dim view: ``g.shape[0]`` raises ``IndexError``. ``simcluster check --params
3,scalar`` gives the hook the same.
"""
# no ``from __future__ import annotations``: DDP refuses a hook whose ``bucket`` annotation is a string
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from _gloo import gloo_world, spawn_worlds


class TwoParams(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.t = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum() * self.t


def shapes_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if dist.get_rank() == 0:
        print("grads", [tuple(g.shape) for g in bucket.gradients()],
              "params", [tuple(p.shape) for p in bucket.parameters()],
              "buffer", tuple(bucket.buffer().shape), flush=True)
    return allreduce_hook(None, bucket)


def run(rank: int, world: int, port: int) -> None:
    with gloo_world(rank, world, port):
        model = DDP(TwoParams())
        model.register_comm_hook(None, shapes_hook)
        for _ in range(2):
            model(torch.full((3,), float(rank + 1))).backward()
        if rank == 0:
            print("t.grad", model.module.t.grad, tuple(model.module.t.grad.shape), flush=True)


if __name__ == "__main__":
    spawn_worlds(run, [(2, 29561)])
