"""Re-measure the facts in docs/gloo-facts.md on this machine, and time the gloo runner.

    python benchmarks/measure_gloo_facts.py            # facts + timings (~1 min)
    python benchmarks/measure_gloo_facts.py facts      # facts only
    python benchmarks/measure_gloo_facts.py timings    # runner timings only
    python benchmarks/measure_gloo_facts.py census     # what a hook observes: real DDP vs SimDDP (~10 s)
    python benchmarks/measure_gloo_facts.py gather     # all_gather's future and result() at worlds 1, 2, 3

The census (docs/ddp-facts.md §1, §4) runs one recording hook inside real DDP (2 gloo
processes, then 1) and inside ``SimDDP`` with the same shapes, options and gradients, and
prints every observation that differs: grad/inference/autocast mode, rank, world size and
backend, the bucket's index, is_last, parameters and buffer (dtype, stride, offset,
requires_grad, storage across iterations), every parameter's ``p.grad`` (None? the local
gradient? last step's mean? a view of the buffer? the same object as last step?) and
values, threads, and the order of hook calls and callbacks; then the same in each
then-callback.

Each experiment is a job run on real gloo processes through simcluster.real.gloo_runner, so
a hang is a bounded GlooRunError (reported as "deadlock"), never a stuck script.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from simcluster.errors import GlooRunError
from simcluster.real.gloo_runner import GlooCluster, run_gloo


def _describe(value: Any, known: dict[str, Any]) -> str:
    """Name each tensor in ``value`` by identity (``is``) against the caller's tensors."""
    import torch

    if isinstance(value, torch.Tensor):
        for name, t in known.items():
            if value is t:
                return name
        for name, t in known.items():
            if value._base is t:
                return f"view(of {name}, offset {value.storage_offset()})"
        return f"new{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v, known) for v in value) + "]"
    return repr(value)


def future_values(rank: int, world_size: int, payload: Any) -> dict[str, str]:
    """What each async collective's future holds, or the error getting it raises."""
    import torch
    import torch.distributed as dist

    w = world_size
    out: dict[str, str] = {}
    cases: dict[str, Any] = {}
    t = torch.ones(2)
    cases["all_reduce"] = ({"t": t}, lambda: dist.all_reduce(t, async_op=True))
    outs = [torch.empty(2) for _ in range(w)]
    cases["all_gather"] = ({"t": t, **{f"outs[{i}]": o for i, o in enumerate(outs)}},
                           lambda: dist.all_gather(outs, t, async_op=True))
    flat = torch.empty(2 * w)
    cases["all_gather_into_tensor"] = ({"out": flat}, lambda: dist.all_gather_into_tensor(flat, t, async_op=True))
    rs_out = torch.empty(2)
    cases["reduce_scatter_tensor"] = ({"out": rs_out},
                                      lambda: dist.reduce_scatter_tensor(rs_out, torch.ones(2 * w), async_op=True))
    cases["broadcast"] = ({"t": t}, lambda: dist.broadcast(t, src=0, async_op=True))
    cases["barrier"] = ({}, lambda: dist.barrier(async_op=True))
    for name, (known, call) in cases.items():
        work = call()
        try:
            out[name] = _describe(work.get_future().wait(), known)
        except RuntimeError as exc:
            work.wait()
            out[name] = f"RuntimeError: {exc}"
    a, b = torch.ones(2), torch.ones(3)
    out["all_reduce_coalesced"] = _describe(dist.all_reduce_coalesced([a, b], async_op=True).wait(), {"a": a, "b": b})
    return out


def all_gather_results(rank: int, world_size: int, payload: Any) -> dict[str, str]:
    """``all_gather(outs, t, async_op=True)``: what ``work.get_future().wait()``, ``.value()``
    and ``work.result()`` hold (by identity), and what NCCL-style indexing of ``value()[0]``
    as the gathered whole meets (``[rank]``, then ``[rank][0]``, as torch's quantization hooks
    index their scales and zero points)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([10.0 + rank, 20.0 + rank])
    outs = [torch.empty(2) for _ in range(world_size)]
    known = {"t": t, **{f"outs[{i}]": o for i, o in enumerate(outs)}}
    work = dist.all_gather(outs, t, async_op=True)
    fut = work.get_future()
    waited = fut.wait()
    out = {"fut.wait()": _describe(waited, known), "fut.value()": _describe(fut.value(), known),
           "work.result()": _describe(work.result(), known),
           "types": f"{type(waited).__name__} of {len(waited)} {type(waited[0]).__name__}"}
    first = fut.value()[0]
    out["value()[0]"] = f"shape {tuple(first.shape)}, values {first.tolist()}"
    for r in range(world_size):
        try:
            out[f"value()[0][{r}][0]"] = repr(first[r][0])
        except IndexError as exc:
            try:
                reached = f"value()[0][{r}] = {first[r]!r}"
            except IndexError:
                reached = f"value()[0][{r}] raises"
            out[f"value()[0][{r}][0]"] = f"IndexError: {exc} ({reached})"
    return out


def gather() -> None:
    for world in (1, 2, 3):
        with GlooCluster(world, timeout=10.0) as cluster:
            for rank, found in enumerate(cluster.run(all_gather_results)):
                for name, value in found.items():
                    print(f"all_gather world {world} rank {rank}: {name:20s} {value}")


def callback_threads(rank: int, world_size: int, payload: Any) -> dict[str, Any]:
    """Which threads run ``.then`` callbacks: per group, on pending and completed futures."""
    import torch
    import torch.distributed as dist

    groups = {"default": None, "new_group": dist.new_group(list(range(world_size)))}
    seen: dict[str, list[str]] = {}
    for label, group in groups.items():
        names: list[str] = []
        futures = [dist.all_reduce(torch.ones(1000), group=group, async_op=True).get_future()
                   .then(lambda f: names.append(threading.current_thread().name)) for _ in range(40)]
        for f in futures:
            f.wait()
        seen[label] = sorted(set(names))
    done = dist.all_reduce(torch.ones(1), async_op=True).get_future()
    done.wait()
    inline: list[str] = []
    done.then(lambda f: inline.append(threading.current_thread().name))
    return {"pending": seen, "completed": inline}


def grad_modes(rank: int, world_size: int, payload: Any) -> dict[str, list[bool]]:
    """``torch.is_grad_enabled()`` where real DDP runs hook code: the hook body, a callback
    on a completed future (inline), a collective's ``then`` callback, ``add_done_callback``;
    for ``backward()`` and ``backward(create_graph=True)``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    seen: dict[str, list[bool]] = {}

    def note(where: str) -> None:
        seen.setdefault(where, []).append(torch.is_grad_enabled())

    def hook(state, bucket):  # type: ignore[no-untyped-def] - DDP rejects a bucket annotated other than GradBucket
        note(f"{mode}: hook")
        done: Any = torch.futures.Future()
        done.set_result(None)
        done.then(lambda f: note(f"{mode}: then on a completed future"))
        fut = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future()
        fut.add_done_callback(lambda f: note(f"{mode}: add_done_callback"))
        return fut.then(lambda f: note(f"{mode}: then (collective's future)") or f.value()[0])

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    model.register_comm_hook(None, hook)
    for mode in ("backward()", "backward()", "backward(create_graph=True)"):
        model(torch.randn(3, 4)).sum().backward(create_graph=mode != "backward()")
    return seen


def p_grad_in_hook(rank: int, world_size: int, payload: Any) -> dict[str, list[bool]]:
    """What ``p.grad`` is while the hook runs, and after ``backward()``, per
    ``gradient_as_bucket_view``: set? equal to the bucket's gradient? the same object after?"""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    seen: dict[str, list[bool]] = {}
    for view in (False, True):
        kept: list[Any] = []

        def hook(state, bucket):  # type: ignore[no-untyped-def] - DDP rejects other bucket annotations
            p, g = bucket.parameters()[0], bucket.gradients()[0]
            kept[:] = [p, p.grad, p.grad is not None and bool(torch.equal(p.grad, g))]
            return dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future().then(
                lambda f: f.value()[0])

        torch.manual_seed(rank)
        model = DistributedDataParallel(torch.nn.Linear(3, 1, bias=False), gradient_as_bucket_view=view)
        model.register_comm_hook(None, hook)
        for _ in range(2):
            model(torch.randn(4, 3)).sum().backward()
            p, grad, equal = kept
            for name, value in ((f"view={view}: p.grad set in the hook", grad is not None),
                                (f"view={view}: p.grad == bucket gradient in the hook", equal),
                                (f"view={view}: the same p.grad object after backward", grad is p.grad)):
                seen.setdefault(name, []).append(value)
    return seen


def bucket_buffers(rank: int, world_size: int, payload: Any) -> dict[str, list[Any]]:
    """Each iteration's bucket buffers (index, storage pointer) under real DDP: kept across
    iterations? renewed at the rebuild? moved by the hook's ``set_buffer``?"""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    seen: dict[str, list[Any]] = {}
    for view in (False, True):
        for moves in (False, True):
            calls: list[tuple[int, int]] = []
            alive: list[Any] = []  # every buffer kept alive: a freed one's address could be reused

            def hook(state, bucket):  # type: ignore[no-untyped-def] - DDP rejects other bucket annotations
                alive.append(bucket.buffer())
                calls.append((bucket.index(), bucket.buffer().data_ptr()))
                if moves:
                    bucket.set_buffer(bucket.buffer().clone())
                return dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future().then(
                    lambda f: f.value()[0])

            torch.manual_seed(0)
            model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)]),
                                            gradient_as_bucket_view=view, bucket_cap_mb=0.02)
            model.register_comm_hook(None, hook)
            first: dict[int, int] = {}
            for it in range(4):
                calls.clear()
                model(torch.randn(4, 64)).sum().backward()
                names = []
                for index, ptr in calls:
                    names.append(first.setdefault(ptr, len(first)))
                seen.setdefault(f"view={view}, set_buffer={moves}: buffers (numbered by first use)", []).append(names)
    return seen


def blocking_callbacks(rank: int, world_size: int, payload: Any) -> str:
    """``payload`` callbacks in flight on one group, each waiting on a further all_reduce."""
    import torch
    import torch.distributed as dist

    def callback(fut: Any) -> Any:
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        return fut.value()

    futures = [dist.all_reduce(torch.ones(4), async_op=True).get_future().then(callback) for _ in range(payload)]
    for f in futures:
        f.wait()
    return "ok"


def swapped_order(rank: int, world_size: int, payload: Any) -> list[float]:
    """Rank 0 issues all_reduce A then B, the others B then A (same shapes)."""
    import torch
    import torch.distributed as dist

    a, b = torch.full((4,), 1.0 + rank), torch.full((4,), 100.0 + 10 * rank)
    for t in ([a, b] if rank == 0 else [b, a]):
        dist.all_reduce(t)
    return [a[0].item(), b[0].item()]


def self_p2p(rank: int, world_size: int, payload: Any) -> dict[str, str]:
    """What send/isend/irecv/recv to the calling rank itself do (docs/gloo-facts.md, point to point)."""
    import torch
    import torch.distributed as dist

    out = {}
    for name in ("send", "isend", "irecv", "recv"):
        t = torch.ones(3)
        try:
            if name in ("send", "recv"):
                getattr(dist, name)(t, rank)
            else:
                getattr(dist, name)(t, rank).wait()
            out[name] = "returned"
        except Exception as exc:  # noqa: BLE001 - the outcome is the fact
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


# --------------------------------------------------------------------------- hook census

CENSUS_SHAPES = ((4, 5), (5,), (3,))
CENSUS_CONFIGS = {  # name -> DDP options; cap 16 bytes: two buckets after the rebuild ([2, 1], [0])
    "one bucket": {},
    "two buckets": {"bucket_cap_mb": 16 / 2**20},
    "two buckets, view": {"bucket_cap_mb": 16 / 2**20, "gradient_as_bucket_view": True},
    "two buckets, static_graph": {"bucket_cap_mb": 16 / 2**20, "static_graph": True},
    "two buckets, find_unused": {"bucket_cap_mb": 16 / 2**20, "find_unused_parameters": True},
    "two buckets, set_buffer": {"bucket_cap_mb": 16 / 2**20, "set_buffer": True},
    "two buckets, view, set_buffer": {"bucket_cap_mb": 16 / 2**20, "gradient_as_bucket_view": True,
                                      "set_buffer": True},
}
CENSUS_STEPS = 3


def census_local_grads(step: int, rank: int) -> list[Any]:
    """Rank ``rank``'s local gradients at ``step`` (the census model makes them exactly these)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) for s in CENSUS_SHAPES]


def _grad_state(t: Any, step: int, rank: int, world: int, i: int, buffer: Any) -> str:
    """What a gradient tensor holds, named against what it could be."""
    import torch

    if t is None:
        return "None"
    where = ""
    if buffer is not None and t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
        where = " (views the bucket buffer)"
    if torch.equal(t, census_local_grads(step, rank)[i]):
        return "local grad" + where
    if step > 0:
        mean = sum(census_local_grads(step - 1, r)[i] for r in range(world)) / world
        if torch.allclose(t, mean):
            return "last step's mean" + where
        if torch.equal(t, census_local_grads(step - 1, rank)[i]):
            return "last step's local grad" + where
    mean = sum(census_local_grads(step, r)[i] for r in range(world)) / world
    if torch.allclose(t, mean):
        return "this step's mean" + where
    return "other" + where


def census_hook(log: dict[int, list[Any]], params: dict[int, list[Any]], steps: dict[int, int],
                set_buffer: bool) -> Any:
    """A hook recording what it can observe, in the hook and in its then-callback; an
    all-reduce mean otherwise. ``steps[rank]`` is the current step (the caller sets it)."""
    import threading

    import torch
    import torch.distributed as dist

    threads: dict[int, dict[str, Any]] = {}
    buffers: dict[tuple[int, int], Any] = {}
    grads_seen: dict[tuple[int, int], Any] = {}

    def hook(state, bucket):  # type: ignore[no-untyped-def] - DDP rejects other bucket annotations
        rank, world = dist.get_rank(), dist.get_world_size()
        step, mine = steps[rank], params[rank]
        idx = [next(i for i, q in enumerate(mine) if q is p) for p in bucket.parameters()]
        buf = bucket.buffer()
        seen = threads.setdefault(rank, {"hook": threading.get_ident()})
        prev = buffers.get((rank, bucket.index()))
        buffers[(rank, bucket.index())] = buf
        rec: dict[str, Any] = {
            "step": step, "where": "hook", "index": bucket.index(), "is_last": bucket.is_last(), "params": idx,
            "grad_enabled": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
            "autocast": torch.is_autocast_enabled(), "rank/world/backend": (rank, world, dist.get_backend()),
            "buffer": (str(buf.dtype), tuple(buf.shape), buf.stride(), buf.storage_offset(), buf.requires_grad,
                       buf.is_leaf, buf.grad_fn is None, bucket.buffer() is buf),
            "same buffer storage as last step": None if prev is None else
            prev.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(),
            "gradients share the buffer": [g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                                           for g in bucket.gradients()],
            "p.grad": [_grad_state(p.grad, step, rank, world, i, buf) for i, p in enumerate(mine)],
            "p.grad is leaf/requires_grad": [None if p.grad is None else (p.grad.is_leaf, p.grad.requires_grad)
                                             for p in mine],
            "requires_grad": [p.requires_grad for p in mine], "p.data[0]": [p.data.reshape(-1)[0].item() for p in mine],
            "same thread as first hook call": threading.get_ident() == seen["hook"],
            "p.grad is last step's p.grad object": [
                None if (rank, i) not in grads_seen else mine[i].grad is grads_seen[(rank, i)] for i in idx],
            "main thread": threading.current_thread() is threading.main_thread(),
        }
        for i in idx:
            grads_seen[(rank, i)] = mine[i].grad
        if set_buffer:
            bucket.set_buffer(buf.clone())
            rec["after set_buffer: p.grad"] = [_grad_state(p.grad, step, rank, world, i, bucket.buffer())
                                               for i, p in enumerate(mine)]
            buf = bucket.buffer()
        log.setdefault(rank, []).append(rec)
        fut = dist.all_reduce(buf.div_(world), async_op=True).get_future()

        def callback(f):  # type: ignore[no-untyped-def]
            cb = seen.setdefault("callback", threading.get_ident())
            log[rank].append({
                "step": step, "where": "callback", "index": bucket.index(), "grad_enabled": torch.is_grad_enabled(),
                "inference": torch.is_inference_mode_enabled(),
                "p.grad": [_grad_state(p.grad, step, rank, world, i, buf) for i, p in enumerate(mine)],
                "value is the buffer": f.value()[0] is buf,
                "same thread as hook": threading.get_ident() == seen["hook"],
                "same thread as first callback": threading.get_ident() == cb,
            })
            return f.value()[0]

        return fut.then(callback)

    return hook


def census_real(rank: int, world_size: int, payload: Any) -> dict[str, Any]:
    """The census hook inside real DDP: ``payload`` is a :data:`CENSUS_CONFIGS` entry."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    options = dict(payload)
    set_buffer = options.pop("set_buffer", False)
    model = torch.nn.Module()
    for i, s in enumerate(CENSUS_SHAPES):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.full(s, float(rank + 1))))
    mine = list(model.parameters())
    log: dict[int, list[Any]] = {}
    steps = {rank: 0}
    ddp = DistributedDataParallel(_CensusModel(model), **options)
    ddp.register_comm_hook(None, census_hook(log, {rank: mine}, steps, set_buffer))
    results = []
    for step in range(CENSUS_STEPS):
        steps[rank] = step
        ddp(torch.cat([g.reshape(-1) for g in census_local_grads(step, rank)])).backward()
        results.append([_grad_state(p.grad, step, rank, world_size, i, None) for i, p in enumerate(mine)])
        ddp.zero_grad(set_to_none=True)
    return {"log": log[rank], "after backward": results, "num_threads": torch.get_num_threads()}


class _CensusModel(__import__("torch").nn.Module):
    """``forward(x) = Σ_i (p_i * x_i).sum()``: each ``p_i.grad`` is exactly ``x_i``."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Any) -> Any:
        total, offset = 0, 0
        for p in self.inner.parameters():
            total = total + (p * x[offset:offset + p.numel()].view(p.shape)).sum()
            offset += p.numel()
        return total


def census_sim(world_size: int, payload: Any) -> list[dict[str, Any]]:
    """The same census through the DDP model (``SimDDP``)."""
    import torch

    from simcluster.ddp.model import DDPConfig, SimDDP
    from simcluster.fake.cluster import SimCluster

    options = dict(payload)
    set_buffer = options.pop("set_buffer", False)
    params = {r: [torch.nn.Parameter(torch.full(s, float(r + 1))) for s in CENSUS_SHAPES] for r in range(world_size)}
    log: dict[int, list[Any]] = {}
    steps = {r: 0 for r in range(world_size)}
    ddp = SimDDP(SimCluster(world_size, seed=0), census_hook(log, params, steps, set_buffer),
                 parameters=[params[r] for r in range(world_size)], config=DDPConfig(**options))
    results: dict[int, list[Any]] = {r: [] for r in range(world_size)}
    for step in range(CENSUS_STEPS):
        for r in steps:
            steps[r] = step
        ddp.step([census_local_grads(step, r) for r in range(world_size)])
        for r in range(world_size):
            results[r].append([_grad_state(p.grad, step, r, world_size, i, None) for i, p in enumerate(params[r])])
    return [{"log": log[r], "after backward": results[r], "num_threads": torch.get_num_threads()}
            for r in range(world_size)]


def census_diff(world_size: int = 2, configs: Sequence[str] | None = None) -> list[str]:
    """Run the census on real DDP and on SimDDP; one line per differing observation."""
    lines = []
    with GlooCluster(world_size, timeout=60.0) as cluster:
        for name in configs or CENSUS_CONFIGS:
            real = cluster.run(census_real, [CENSUS_CONFIGS[name]] * world_size)
            sim = census_sim(world_size, CENSUS_CONFIGS[name])
            for rank in range(world_size):
                lines += [f"[{name}] rank {rank}: {d}" for d in _census_rank_diff(real[rank], sim[rank])]
    return lines


def _census_rank_diff(real: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    out = []
    if real["after backward"] != sim["after backward"]:
        out.append(f"after backward: real {real['after backward']} sim {sim['after backward']}")
    order = lambda log: [(r["step"], r["where"], r["index"]) for r in log]  # noqa: E731
    if order(real["log"]) != order(sim["log"]):
        out.append(f"event order: real {order(real['log'])}\n    sim  {order(sim['log'])}")
    key = lambda r: (r["step"], r["where"], r["index"])  # noqa: E731
    sim_by = {key(r): r for r in sim["log"]}
    for r in real["log"]:
        s = sim_by.get(key(r))
        if s is None:
            out.append(f"{key(r)} only on real")
            continue
        for k in r:
            if r[k] != s.get(k):
                out.append(f"step {r['step']} {r['where']} bucket {r['index']}: {k}: real {r[k]!r} sim {s.get(k)!r}")
    return out


def census() -> None:
    lines = census_diff() + [f"world 1: {line}" for line in census_diff(1, ["one bucket", "two buckets"])]
    for line in lines:
        print(line)
    print(f"census: {len(lines)} differing observations (docs/ddp-facts.md §4 says which are timing)")


def noop(rank: int, world_size: int, payload: Any) -> int:
    return rank


def facts() -> None:
    with GlooCluster(2, timeout=10.0) as cluster:
        for name, value in cluster.run(future_values)[0].items():
            print(f"future value  {name:24s} {value}")
        print("callback threads (rank 0):", cluster.run(callback_threads)[0])
        for where, modes in cluster.run(grad_modes)[0].items():
            print(f"grad mode (rank 0) {where:52s} {modes}")
        for what, values in cluster.run(bucket_buffers)[0].items():
            print(f"bucket buffers per iteration (rank 0) {what:60s} {values}")
        for what, values in cluster.run(p_grad_in_hook)[0].items():
            print(f"p.grad (rank 0, 2 iterations) {what:52s} {values}")
        print("swapped order A,B / B,A  ->", cluster.run(swapped_order), "(correct: A=3, B=210)")
        for name, outcome in cluster.run(self_p2p)[0].items():
            print(f"{name} to itself (rank 0) -> {outcome}")
        for n in (1, 2, 3):
            try:
                print(f"{n} blocking callback(s) in flight ->", cluster.run(blocking_callbacks, [n, n], timeout=5.0))
            except GlooRunError:
                print(f"{n} blocking callback(s) in flight -> deadlock (no progress in 5 s)")


def _median(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def timings() -> None:
    baseline = 1.05  # docs/gloo-facts.md §9: 2-rank spawn + init + destroy
    rows: list[tuple[str, float]] = []
    for method in ("subprocess", "spawn", "forkserver"):
        run_gloo(noop, 2, start_method=method)  # warm-up (starts the fork server)
        rows.append((f"run_gloo start_method={method}", _median(lambda: run_gloo(noop, 2, start_method=method), 5)))
    with GlooCluster(2) as cluster:
        rows.append(("GlooCluster first run (world start)", _median(lambda: cluster.run(noop), 1)))
        rows.append(("GlooCluster.run, no-op job", _median(lambda: cluster.run(noop), 50)))
    measured = rows[0][1]  # this run's own subprocess baseline (machine load varies)
    for label, seconds in rows:
        print(f"{label:40s} {seconds * 1e3:9.1f} ms   {baseline / seconds:7.1f}x vs {baseline} s"
              f"   {measured / seconds:7.1f}x vs this run's subprocess")


if __name__ == "__main__":
    which = sys.argv[1:] or ["facts", "timings"]
    if "facts" in which:
        facts()
    if "timings" in which:
        timings()
    if "census" in which:
        census()
    if "gather" in which:
        gather()
