"""Measure real DDP on gloo: do an earlier bucket's then-callbacks run before a rank's next
hook call of the same backward pass?

Why: simcluster's DDP model called every hook of a step before any collective completed, so
a hook reading state its own callbacks advance (a warm-up counted in callbacks choosing each
bucket's dtype) always saw the same value on every rank and passed; real gloo aborted it
(round 24 of hooks from the wild). The gloo model now lets a schedule complete a collective,
and run its callbacks, between two hook calls of a rank (docs/ddp-facts.md, "Callbacks
between hook calls").

    python benchmarks/measure_callbacks_between_hooks.py

Real ``DistributedDataParallel`` (torch 2.13, CPU) over three ``Linear(256, 256)`` layers with
a 64 KiB bucket cap (several buckets after the rebuild), on real gloo worlds of 2 and 3
(localhost), 100 iterations; rank 1 sleeps 2 ms before ``backward`` every third iteration. The
hook all-reduces the bucket and counts, in a ``then`` callback, the callbacks this rank has run
in this iteration; at each hook call it records that count. One line per rank: of the hook
calls after an iteration's first, in how many had at least one callback of the same iteration
already run, and in how many iterations the ranks saw different counts at the same bucket.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _gloo import gloo_world, spawn_worlds

ITERATIONS = 100
_ran = [0]  # callbacks run in this iteration, on this rank
_seen: list[int] = []  # at each hook call of this iteration: callbacks run before it


def counting_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses other annotations
    _seen.append(_ran[0])
    buffer = bucket.buffer().div_(dist.get_world_size())

    def callback(fut):  # noqa: ANN001, ANN202
        _ran[0] += 1
        return fut.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(callback)


def run(rank: int, world: int, port: int) -> None:
    with gloo_world(rank, world, port):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(3))), bucket_cap_mb=0.0625)
        model.register_comm_hook(None, counting_hook)
        calls = early = 0
        per_iteration = []
        for i in range(ITERATIONS):
            _ran[0] = 0
            _seen.clear()
            model.zero_grad(set_to_none=True)
            loss = model(torch.randn(8, 256)).sum()
            if rank == 1 and i % 3 == 0:
                time.sleep(0.002)
            loss.backward()
            if i > 0:  # after the rebuild
                calls += len(_seen) - 1
                early += sum(1 for n in _seen[1:] if n > 0)
                per_iteration.append(tuple(_seen))
        everyone: list = [None] * world
        dist.all_gather_object(everyone, per_iteration)
        differ = sum(len({r[i] for r in everyone}) > 1 for i in range(len(per_iteration)))
        print(f"world {world} rank {rank}: {len(per_iteration[0])} buckets; {early}/{calls} hook calls after an "
              f"iteration's first came after a callback of the same iteration had run; the ranks' counts differed "
              f"in {differ}/{len(per_iteration)} iterations", flush=True)


if __name__ == "__main__":
    spawn_worlds(run, [(2, 29641), (3, 29642)])
