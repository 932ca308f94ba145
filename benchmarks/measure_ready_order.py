"""Measure in which order e2e's ``GradientModel`` makes gradients ready in real DDP on gloo.

    python benchmarks/measure_ready_order.py          # worlds 1 and 2, ~10 s

``simcluster check --e2e`` replays a counterexample's gradient-ready order on real DDP
(``Scenario.ready_order``, docs/e2e.md). This script checks that real DDP follows it: for
every permutation of 1 to 4 parameters (and the default, ``ready_order=None``: what
``GradientModel`` did before it took an order), under several DDP settings, each gloo rank
builds ``GradientModel(shapes, dtype, ready_order)``, wraps it in real
``DistributedDataParallel`` and records, every iteration,

* the order in which the parameters' ``AccumulateGrad`` nodes ran
  (``register_post_accumulate_grad_hook``; DDP's own autograd hook is a post hook of the
  same node), and
* every comm hook call ``(iteration, bucket.index(), bucket.is_last(), parameter indices)``
  — with a 1-byte cap every parameter has its own bucket, so after the rebuild (iteration 1;
  2 with ``static_graph``) the buckets' order *is* DDP's recorded ready order.

Then it compares them with the order asked for and with the hook calls
:func:`simcluster.ddp.layout.bucket_calls` predicts from that order (what the simulated
side runs), and prints every difference (none: "every order followed"). Each job runs on
real gloo processes through :class:`~simcluster.real.gloo_runner.GlooCluster` (FileStore in
a private temp dir), so a hang is a bounded error, never a stuck script.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

SHAPES = ((3,), (2, 2), (5,), (1,))
TINY = 1 / 2**20  # 1 byte: one parameter per bucket
SETTINGS: dict[str, dict[str, Any]] = {
    "tiny cap": dict(bucket_cap_mb=TINY),
    "default cap": {},
    "static_graph": dict(bucket_cap_mb=TINY, static_graph=True),
    "find_unused_parameters": dict(bucket_cap_mb=TINY, find_unused_parameters=True),
    "gradient_as_bucket_view": dict(bucket_cap_mb=TINY, gradient_as_bucket_view=True),
}
DTYPES = ("float32", "float16", "bfloat16", "float64")


def cases() -> list[dict[str, Any]]:
    """Every (shapes, order, setting, dtype) measured: every order of 1-4 parameters under every
    setting in float32; the default order and a few others in the other dtypes."""
    out = []
    for n in range(1, len(SHAPES) + 1):
        orders: list[tuple[int, ...] | None] = [None, *itertools.permutations(range(n))]
        for setting, ddp in SETTINGS.items():
            for order in orders:
                out.append(dict(shapes=SHAPES[:n], order=order, setting=setting, ddp=ddp, dtype="float32"))
    for dtype in DTYPES[1:]:
        for order in (None, (0, 1, 2, 3), (2, 0, 3, 1)):
            out.append(dict(shapes=SHAPES, order=order, setting="tiny cap", ddp=SETTINGS["tiny cap"], dtype=dtype))
    return out


def record(rank: int, world_size: int, payload: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """In each gloo rank: every case's ready order and hook calls, per iteration."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from simcluster.real.e2e import GradientModel

    saved = os.environ.pop("DDP_SET_LAST_BUCKET_CAP", None)  # it changes the rebuilt layout (docs/ddp-facts.md)
    out = []
    try:
        for case in payload:
            model = GradientModel(case["shapes"], getattr(torch, case["dtype"]), case["order"])
            params = list(model.parameters())
            where = {"it": 0}
            ready: list[tuple[int, int]] = []
            calls: list[tuple[int, int, bool, tuple[int, ...]]] = []
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(lambda p, i=i: ready.append((where["it"], i)))

            def hook(state, bucket):  # type: ignore[no-untyped-def] - DDP rejects annotations as strings
                ids = [next(i for i, q in enumerate(params) if q is p) for p in bucket.parameters()]
                calls.append((where["it"], bucket.index(), bucket.is_last(), tuple(ids)))
                fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut

            ddp = DistributedDataParallel(model, **case["ddp"])
            ddp.register_comm_hook(None, hook)
            numel = sum(p.numel() for p in params)
            for it in range(4):
                where["it"] = it
                ddp(torch.randn(numel).to(params[0].dtype)).backward()
                ddp.zero_grad(set_to_none=True)
            del ddp  # docs/gloo-facts.md §10: no DDP object outlives the job
            out.append({"ready": ready, "calls": calls})
    finally:
        if saved is not None:
            os.environ["DDP_SET_LAST_BUCKET_CAP"] = saved
    return out


def differences(world_size: int) -> tuple[list[str], dict[int, list[int]]]:
    """Every case where real DDP did not follow the order asked for; and the default order
    observed, by number of parameters."""
    import torch

    from simcluster.ddp.layout import bucket_calls, ready_order_of
    from simcluster.real.gloo_runner import GlooCluster

    todo = cases()
    with GlooCluster(world_size, timeout=120.0) as cluster:
        ranks = cluster.run(record, [todo] * world_size)
    problems, default = [], {}
    for case, *per_rank in zip(todo, *ranks):
        name = f"world {world_size}, {case['setting']}, {case['dtype']}, {len(case['shapes'])} params, " \
               f"order {case['order']}"
        wanted = ready_order_of(case["order"], len(case["shapes"]))
        params = [torch.empty(s, dtype=getattr(torch, case["dtype"]), device="meta") for s in case["shapes"]]
        ddp = {k: v for k, v in case["ddp"].items() if k != "gradient_as_bucket_view"}
        for rank, got in enumerate(per_rank):
            for it in range(4):
                seen = [i for k, i in got["ready"] if k == it]
                if case["order"] is None and rank == 0 and it == 0 and case["setting"] == "tiny cap" \
                        and case["dtype"] == "float32":
                    default[len(case["shapes"])] = seen
                if seen != wanted:
                    problems.append(f"{name}, rank {rank}, iteration {it}: ready {seen}, asked {wanted}")
                sim = [(it, c.index, c.is_last, c.params) for c in bucket_calls(params, iteration=it,
                                                                                 ready_order=wanted, **ddp)]
                real = [tuple(c[:3]) + (tuple(c[3]),) for c in got["calls"] if c[0] == it]
                if real != sim:
                    problems.append(f"{name}, rank {rank}, iteration {it}: hook calls {real}, layout model {sim}")
    return problems, default


def main() -> int:
    import torch

    print(f"torch {torch.__version__}; {len(cases())} cases per world")
    bad = 0
    for world in (1, 2):
        problems, default = differences(world)
        print(f"world {world}: default order (ready_order=None) by number of params: {default}")
        for line in problems:
            print("  DIFFERS:", line)
        print(f"world {world}: {'every order followed' if not problems else f'{len(problems)} differences'}")
        bad += len(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
