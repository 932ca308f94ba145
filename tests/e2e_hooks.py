"""Hooks for tests/test_e2e.py: correct in the simulator, misbehaving on real gloo ranks only.

Real end-to-end ranks have ``SIMCLUSTER_E2E=real`` in their environment (simcluster.real.e2e).
"""

import functools
import os
import time

import torch
import torch.distributed as dist

_CALLS = {"n": 0}


def _mean(bucket):
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def _real_step() -> int | None:
    """On a real rank: the number of earlier calls (one bucket per step here); else None."""
    if os.environ.get("SIMCLUSTER_E2E") != "real":
        return None
    _CALLS["n"] += 1
    return _CALLS["n"] - 1


def killed_at_step_1_on_rank_1(state, bucket):
    """Rank 1's process is killed (SIGKILL) in its hook call of step 1."""
    if _real_step() == 1 and dist.get_rank() == 1:
        os.kill(os.getpid(), 9)
    return _mean(bucket)


def hangs_at_step_1_on_rank_1(state, bucket):
    """Rank 1 sleeps (for good) in its hook call of step 1; rank 0 waits in its all_reduce."""
    if _real_step() == 1 and dist.get_rank() == 1:
        time.sleep(3600)
    return _mean(bucket)


def returns_a_failing_collective(state, bucket):
    """BAND on float gradients, its future returned as it is: gloo fails it at wait()."""
    return dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.BAND, async_op=True).get_future()


def completes_with_set_exception(state, bucket):
    """The hook's own future, completed with set_exception: DDP gets the exception as the value."""
    import torch

    fut = torch.futures.Future()
    fut.set_exception(RuntimeError("given up"))
    return fut


def terngrad_like(state, bucket):
    """A stochastic compressor (after TernGrad): keeps each element with probability
    |x| / max|x| (torch's global RNG, per rank), then averages the ternary codes. Correct
    on both sides; its draws come from each rank's own generator."""
    buf = bucket.buffer()
    scale = buf.abs().max().clamp_min(1e-30)
    codes = torch.bernoulli(buf.abs() / scale) * buf.sign() * scale
    fut = dist.all_reduce(codes, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def scales_by_python_and_numpy_draws(state, bucket):
    """Scales each rank's bucket by a draw of Python's random and of numpy's global RNG (per
    rank, unseeded: the rank's own streams), then averages. Correct on both sides."""
    import random

    import numpy

    buf = bucket.buffer().mul_(random.random() + float(numpy.random.rand()))
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def monitored_barrier_then_mean(state, bucket):
    """dist.monitored_barrier (gloo only; not modelled by the simulator), then the mean."""
    dist.monitored_barrier()
    return _mean(bucket)


def mismatched_sizes(state, bucket):
    """Rank 1 all_reduces one element more than rank 0: a collective mismatch. Real gloo
    aborts the process of the rank with the smaller buffer (SIGABRT, gloo::EnforceNotMet
    'Received data size doesn't match expected size', docs/gloo-facts.md §6); the simulator
    reports a CollectiveMismatchError."""
    buf = bucket.buffer()
    send = buf if dist.get_rank() == 0 else torch.cat([buf, buf.new_zeros(1)])
    fut = dist.all_reduce(send, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0][:buf.numel()].div_(dist.get_world_size()))



def marks_its_grad_mode(state, bucket):
    """Writes the grad mode its body runs under into its result: +1 on each rank when grad
    mode is off, as real DDP calls a hook (inside backward(); measured), +0 when on."""
    buf = bucket.buffer().div_(dist.get_world_size())
    buf.add_(0.0 if torch.is_grad_enabled() else 1.0)
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def scales_by_its_param_grads(state, bucket):
    """Reads each parameter's ``p.grad`` — the local gradient autograd left there, which DDP
    copied into the bucket — and scales its share by the norm (a clipping-style hook)."""
    norm = sum(float(p.grad.norm()) ** 2 for p in bucket.parameters()) ** 0.5
    buf = bucket.buffer().div_(dist.get_world_size() * (1.0 + norm))
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


_PREVIOUS = {}


def mixes_last_result_by_reference(state, bucket):
    """Mixes in last step's result, kept by reference: it is DDP's bucket buffer, which DDP
    keeps across steps and fills with the next step's local gradients before the hook."""
    buf = bucket.buffer()
    prev = _PREVIOUS.get(bucket.index())
    if prev is not None and prev.numel() == buf.numel():
        buf.mul_(0.5).add_(prev, alpha=0.5)
    fut = dist.all_reduce(buf.div_(dist.get_world_size()), async_op=True).get_future()

    def keep(f):
        _PREVIOUS[bucket.index()] = f.value()[0]
        return f.value()[0]

    return fut.then(keep)


_MY_CALLS = {"n": 0}


def adds_its_call_count(state, bucket):
    """Adds how many times it was called (a module global) to its share: each process
    imports the module afresh, so every rank counts its own calls from 1."""
    _MY_CALLS["n"] += 1
    buf = bucket.buffer().div_(dist.get_world_size()).add_(float(_MY_CALLS["n"]))
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def model_parameters(process_group, model):
    """State: the rank's model parameters (a factory taking the model)."""
    return list(model.parameters())


def scales_by_every_ready_grad(state, bucket):
    """Scales its share by the norm of every model parameter's ``p.grad`` that is set — a
    global clipping-style norm read inside the hook. With several buckets, a parameter whose
    gradient is not ready yet has ``p.grad`` None in real DDP (after the loop's
    ``zero_grad(set_to_none=True)``), so the norm covers the gradients ready so far."""
    norm = sum(float(p.grad.norm()) ** 2 for p in state if p.grad is not None) ** 0.5
    buf = bucket.buffer().div_(dist.get_world_size() * (1.0 + norm))
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def adds_last_steps_grad_by_reference(state, bucket):
    """Keeps each parameter's ``p.grad`` object of the last step and adds its *current*
    values to its share, if it is the very object ``p.grad`` is now (0 otherwise) — with
    ``gradient_as_bucket_view`` real DDP gives ``p.grad`` the same view object every step
    after the rebuild."""
    extra = 0.0
    for p in bucket.parameters():
        if _KEPT_GRADS.get(id(p)) is p.grad:
            extra += float(p.grad.sum())
        _KEPT_GRADS[id(p)] = p.grad
    buf = bucket.buffer().add_(extra).div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


_KEPT_GRADS = {}


def grad_not_bucket(state, grad):
    """A FSDP-style hook signature (``hook(state, grad)``): real DDP's register_comm_hook
    looks the parameter named ``bucket`` up and raises KeyError before any step runs."""
    dist.all_reduce(grad)


def own_group(process_group):
    """A second group of the same ranks, made with ``new_group`` (every rank calls it)."""
    return dist.new_group(dist.get_process_group_ranks(process_group))


def posts_world_from_group_callbacks(state, bucket):
    """All-reduce a copy on ``state`` (a group of its own); from that collective's callback —
    on one of that group's gloo worker threads — all-reduce the bucket on WORLD and wait
    there. Two buckets' callbacks post their WORLD collectives in an order that is timing:
    a race that can hang real gloo."""
    fut = dist.all_reduce(bucket.buffer().clone(), group=state, async_op=True).get_future()

    def on_world(_):
        buf = bucket.buffer()
        dist.all_reduce(buf, async_op=True).get_future().wait()
        return buf.div_(dist.get_world_size())

    return fut.then(on_world)


def _mean_hook(state, bucket):
    return _mean(bucket)


partial_mean = functools.partial(_mean_hook)
"""A correct hook as a functools.partial, which has no ``__name__``: real DDP's
register_comm_hook raises AttributeError (docs/ddp-facts.md, Registration (measured))."""


def ring_batch_p2p_mean(state, bucket):
    """A ring all-gather by point to point (``dist.P2POp`` + ``dist.batch_isend_irecv``): each
    of W-1 rounds passes on what came in the round before, so every rank ends with every
    rank's buffer and sums them in rank order — the same bits everywhere — then divides by
    W. The sync hook returns a completed future. ``P2POp`` checks its op *is* torch's
    ``isend``/``irecv``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = bucket.buffer()
    parts = {rank: buf.clone()}
    passing = parts[rank]
    for k in range(1, world):
        incoming = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, passing, (rank + 1) % world),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        parts[(rank - k) % world] = passing = incoming
    total = parts[0].clone()
    for r in range(1, world):
        total.add_(parts[r])
    fut = torch.futures.Future()
    fut.set_result(total.div_(world))
    return fut


def fails_on_real_ranks(state, bucket):
    """Raises on a real end-to-end rank; the mean in the simulation."""
    if os.environ.get("SIMCLUSTER_E2E") == "real":
        raise RuntimeError("a real rank")
    return _mean(bucket)


def callback_returns_its_future(state, bucket):
    """A then-callback returning the future it was given, not a tensor (an observability
    runbook's timing hook, hooks from the wild 2026-12-04): torch does not unwrap it, and
    DDP's reducer says ``Unable to cast <torch.Future object at 0x…> to Tensor``."""
    def timed(f):
        return f

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(timed)


def one_rank_group(process_group):
    """Each rank's one-rank group (every rank makes all of them, in the same order)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def splits_by_world_size(state, bucket):
    """Counts all_to_all_single's splits and sizes an all_gather_into_tensor's output with
    WORLD's size on ``state``, a one-rank group (ColossalAI's fp8 hook, hooks from the wild
    2026-12-04): real gloo posts the all_to_all and fails it at wait() only; the all_gather
    raises at the call, in gloo's words."""
    buf, world = bucket.buffer(), dist.get_world_size()
    n = buf.numel()
    dist.all_to_all_single(torch.empty(n * world), buf.repeat(world), [n] * world, [n] * world,
                           group=state, async_op=True)
    dist.all_gather_into_tensor(torch.empty(world), torch.ones(1), group=state, async_op=True)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


from torch.distributed.algorithms._quantization.quantization import DQuantType, auto_quantize  # noqa: E402

_fp16_all_gather = auto_quantize(dist.all_gather, DQuantType.FP16)
"""torch's quantizing wrapper made at import, as a module of helpers would: at call time it
dispatches on ``func is dist.all_gather`` (the function it captured against the one
``torch.distributed`` holds then) and raises "not supported yet" when they differ."""


def fp16_gather_mean(state, bucket):
    """Gathers every rank's buffer through ``auto_quantize``'s float16 all_gather (made at
    import), averages in rank order, returns a completed future."""
    buf = bucket.buffer()
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    _fp16_all_gather(parts, buf)
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    fut = torch.futures.Future()
    fut.set_result(total.div_(len(parts)))
    return fut


def kills_its_process_on_rank_1(state, bucket):
    """On every side, simulated or real: rank 1's hook call kills its own process (SIGKILL)."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), 9)
    return _mean(bucket)


def kills_its_process_in_rank_0s_callback(state, bucket):
    """Rank 0's completion callback kills its process: at world 3 every rank's hook call has
    started by then, so only the running rank, not the last hook call, names rank 0."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def done(f):
        if dist.get_rank() == 0:
            os.kill(os.getpid(), 9)
        return f.value()[0].div_(dist.get_world_size())

    return fut.then(done)


def kills_its_process_off_the_main_thread(state, bucket):
    """Kills its process only when called off the process's main thread: under the real
    reducer's rank threads, never under the DDP model's baton (which starts on the main thread)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        os.kill(os.getpid(), 9)
    return _mean(bucket)


def returns_the_collectives_future(state, bucket):
    """Returns the all_reduce's own future (gpubridge's ``ddp_comm_hook``, hooks from the wild
    round 9): its value is a C++ tensor list, which real DDP's Python-hook path refuses with
    ``result.isPyObject() INTERNAL ASSERT FAILED …`` — not the ``Unable to cast [...]`` of a
    list a Python future holds (measured: benchmarks/measure_hook_future_kinds.py)."""
    bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()


def returns_collect_alls_future(state, bucket):
    """Returns ``torch.futures.collect_all``'s future (a C++ list of futures): refused alike."""
    return torch.futures.collect_all([dist.all_reduce(bucket.buffer(), async_op=True).get_future()])


def gathers_rank_sized_then_indexes_with_floats(state, bucket):
    """all_gathers 2 elements more on rank 0 than on rank 1 (a deep gradient compression hook
    from the wild, round 9: top-k by a threshold keeps ties), then indexes with float indices.
    Real gloo aborts rank 1 (the smaller buffer; SIGABRT, gloo::EnforceNotMet) and completes
    rank 0's part, whose callback raises IndexError; the simulator reports the mismatch."""
    buf = bucket.buffer()
    mine = torch.cat([buf, buf.new_zeros(2)]) if dist.get_rank() == 0 else buf
    outs = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    fut = dist.all_gather(outs, mine, async_op=True).get_future()

    def decompress(f):
        out = torch.zeros_like(buf)
        out[f.value()[0][:1]] = 1.0  # float indices: IndexError
        return out

    return fut.then(decompress)


def prints_then_raises(state, bucket):
    """Prints a line naming its rank and bucket, then raises on every rank."""
    print(f"rank {dist.get_rank()}: bucket {bucket.index()} of {bucket.buffer().numel()} elements")
    raise ValueError("the hook gave up")


def _functional_sgd():
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import _OptimizerHookState
    from torch.distributed.optim import _FunctionalSGD

    with warnings.catch_warnings():  # torch 2.13: TorchScript support for functional optimizers is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        return _OptimizerHookState(_FunctionalSGD([], lr=0.5, _allow_empty_param_list=True))


def _hook_then_sgd():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import _hook_then_optimizer

    return _hook_then_optimizer(allreduce_hook, _functional_sgd())


def __getattr__(name: str):
    """``allreduce_then_sgd``: torch's own optimizer overlap (``_hook_then_optimizer``, what
    DDP's ``_register_fused_optim`` registers): the mean all-reduce, then an SGD step (lr 0.5)
    on ``bucket.parameters()`` with ``bucket.gradients()`` in the future's callback. State: the
    process group (``group``). Built when asked for, not at import: TorchScript-compiling the
    functional SGD took this module's every import (one per simulated rank) from ~0.01 s to
    ~0.6 s, and under a loaded CI past a hang test's 8 s deadline, in a hook that never used it."""
    if name == "allreduce_then_sgd":
        return _hook_then_sgd()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sgd_on_param_data(state, bucket):
    """The mean, then ``p.data -= 0.25 * grad`` on the bucket's parameters in the callback:
    ``.data`` does not move ``p._version``."""
    def step(fut):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            p.data.add_(g, alpha=-0.25)
        return fut.value()

    return _mean(bucket).then(step)


def scaled_by_launcher_rank(state, bucket):
    """Scales its bucket by torchrun's RANK + 1 before the mean: each real rank reads its own
    from its process's environment, so the simulation must give each simulated rank the real
    rank's (under torchrun it runs in rank 0's process, whose RANK is 0)."""
    buf = bucket.buffer()
    buf.mul_(int(os.environ["RANK"]) + 1).div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def divides_by_launcher_world_size(state, bucket):
    """The mean, dividing by torchrun's WORLD_SIZE (alike on every rank) instead of the group's size."""
    buf = bucket.buffer().div_(int(os.environ["WORLD_SIZE"]))
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def polls_its_work(state, bucket):
    """Waits by polling (a Horovod ``hvd.poll`` port): ``while not work.is_completed()``, then
    a completed future. Correct on real gloo; the simulator completed a collective only when
    a rank waited or returned, so the poll never ended (a false alarm: hooks from the wild, round 18)."""
    buf = bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(buf, async_op=True)
    while not work.is_completed():
        time.sleep(0.0005)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def polls_its_future(state, bucket):
    """The same with ``while not fut.done()``, then that future's ``then``."""
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    while not fut.done():
        pass
    return fut.then(lambda f: f.value()[0])


def returns_a_future_nobody_completes(state, bucket):
    """Defers every bucket to a flush that never comes (a deferred-flush hook that flushes at
    the wrong bucket): the future it returns never completes, on every rank alike."""
    return torch.futures.Future()
