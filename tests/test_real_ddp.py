"""Real DDP (torch's C++ reducer) on simulated groups, one thread per rank.

Shows that (1) real DDP + ``allreduce_hook`` here yields the mean of the ranks' local
gradients, (2) the reducer's bucket layouts and hook call sequence per iteration are
what :mod:`simcluster.ddp.layout` predicts, (3) gradients and hook calls equal those of the
same job on real gloo processes (``-m gloo``), and (4) broken hooks end in an error
naming each rank, never a hang, with no thread left and torch's state restored.

Models are built from plain specs by :func:`build_model` (module-level: the gloo
children import it by name). No ``from __future__ import annotations`` here: DDP's
``register_comm_hook`` checks the hooks' annotations as objects and rejects strings.
"""

import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from simcluster.errors import CollectiveMismatchError, DeadlockError, StuckError, UsageError
from simcluster.real.gloo_runner import GlooCluster
from simcluster.ddp.layout import bucket_calls
from simcluster.ddp.real_ddp import for_reducer, run_real_ddp
from simcluster.fake.futures import SimFuture


# ------------------------------------------------------------------ models and inputs
class Net(torch.nn.Module):
    """Linear layers ``layers[k] = (in, out)``, applied in the order ``use`` (a layer left
    out of ``use`` gets no gradient)."""

    def __init__(self, layers: list[tuple[int, int]], use: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in layers)
        self.use = use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in self.use:
            x = torch.tanh(self.layers[k](x))
        return x


def build_model(spec: dict[str, Any]) -> Net:
    torch.manual_seed(spec.get("seed", 0))
    return Net(spec["layers"], spec["use"])


def make_inputs(spec: dict[str, Any], world_size: int, iterations: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    width = spec["layers"][spec["use"][0]][0]
    return [[torch.randn(3, width, generator=g) for _ in range(iterations)] for _ in range(world_size)]


STACK = {"layers": [(8, 16), (16, 32), (32, 4)], "use": [0, 1, 2]}            # 512 64 2048 128 512 16 bytes
SWAPPED = {"layers": [(6, 3), (4, 6)], "use": [1, 0]}                        # defined last-layer first
UNUSED = {"layers": [(8, 16), (16, 4), (16, 5)], "use": [0, 1]}              # layer 2 never used
CAP = 600 / 2**20                                                           # 600 bytes: splits STACK

LAYOUT_CASES = [
    ("stack default cap", STACK, {}, None),
    ("stack cap splits", STACK, dict(bucket_cap_mb=CAP), None),
    ("stack tiny cap", STACK, dict(bucket_cap_mb=1e-9), None),
    ("stack static_graph", STACK, dict(bucket_cap_mb=CAP, static_graph=True), None),
    ("stack find_unused", STACK, dict(bucket_cap_mb=CAP, find_unused_parameters=True), None),
    ("stack bucket views", STACK, dict(bucket_cap_mb=CAP, gradient_as_bucket_view=True), None),
    # forward uses layer 1 first, so backward readies layer 0 (bias, weight) then layer 1
    ("swapped ready order", SWAPPED, dict(bucket_cap_mb=1e-9), [1, 0, 3, 2]),
    ("unused param found", UNUSED, dict(bucket_cap_mb=CAP, find_unused_parameters=True), None),
]


def local_mean_grads(spec: dict[str, Any], inputs: list[list[torch.Tensor]], iteration: int) -> list[Any]:
    """What DDP should give: the mean over ranks of each rank's own gradients."""
    per_rank = []
    for xs in inputs:
        model = build_model(spec)
        model(xs[iteration]).sum().backward()
        per_rank.append([p.grad for p in model.parameters()])
    return [None if gs[0] is None else torch.stack(gs).mean(0) for gs in zip(*per_rank)]


_THREADS_BEFORE: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _threads_before() -> None:
    """The threads alive when each test starts: another test's abandoned thread, still ending
    (the stuck in-process run of test_hostile ends its own within a bound), is not this one's."""
    _THREADS_BEFORE.clear()
    _THREADS_BEFORE.update(threading.enumerate())


def sim_threads() -> list[str]:
    """simcluster's threads started during this test and still alive."""
    return [t.name for t in threading.enumerate() if t.name.startswith("simcluster") and t not in _THREADS_BEFORE]


# ------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_hook_gives_the_mean_of_local_gradients(world_size: int) -> None:
    iterations = 3
    inputs = make_inputs(STACK, world_size, iterations)
    run = run_real_ddp(lambda: build_model(STACK), inputs, world_size=world_size, hook=allreduce_hook,
                       iterations=iterations, bucket_cap_mb=CAP)
    for k in range(iterations):
        expected = local_mean_grads(STACK, inputs, k)
        for rank in range(world_size):
            torch.testing.assert_close(run.grads[k][rank], expected)
            assert all(torch.equal(a, b) for a, b in zip(run.grads[k][rank], run.grads[k][0])), "replicas differ"
    assert len(run.hook_calls[0]) > iterations  # several buckets per iteration were exercised


def test_builtin_reducer_without_a_hook_also_averages() -> None:
    inputs = make_inputs(STACK, 2, 2)
    run = run_real_ddp(lambda: build_model(STACK), inputs, world_size=2, hook=None, iterations=2)
    assert run.hook_calls == [[], []]
    torch.testing.assert_close(run.grads[1][1], local_mean_grads(STACK, inputs, 1))


def test_ranks_start_from_rank_0s_parameters_as_ddp_broadcasts_them() -> None:
    seeds = iter(range(100))  # every rank's model is initialised differently

    def factory() -> Net:
        return build_model({**STACK, "seed": next(seeds)})

    inputs = make_inputs(STACK, 2, 1)
    run = run_real_ddp(factory, inputs, world_size=2, hook=allreduce_hook, iterations=1)
    # the mean of local gradients computed with rank 0's initial parameters (seed 0)
    torch.testing.assert_close(run.grads[0][1], local_mean_grads(STACK, inputs, 0))


@pytest.mark.parametrize("name,spec,kwargs,ready_order", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_hook_calls_match_the_layout_model(name: str, spec: dict[str, Any], kwargs: dict[str, Any],
                                           ready_order: list[int] | None) -> None:
    iterations = 4
    run = run_real_ddp(lambda: build_model(spec), make_inputs(spec, 2, iterations), world_size=2,
                       hook=allreduce_hook, iterations=iterations, **kwargs)
    params = list(build_model(spec).parameters())
    layout_kwargs = {k: v for k, v in kwargs.items() if k != "gradient_as_bucket_view"}
    for k in range(iterations):
        expected = [tuple(c) for c in bucket_calls(params, iteration=k, ready_order=ready_order, **layout_kwargs)]
        for rank in range(2):
            got = [call[1:] for call in run.hook_calls[rank] if call[0] == k]
            assert got == expected, f"{name}, iteration {k}, rank {rank}"


def test_unused_parameter_gets_no_gradient_and_used_ones_the_mean() -> None:
    inputs = make_inputs(UNUSED, 2, 2)
    run = run_real_ddp(lambda: build_model(UNUSED), inputs, world_size=2, hook=allreduce_hook, iterations=2,
                       find_unused_parameters=True)
    expected = local_mean_grads(UNUSED, inputs, 1)
    got = run.grads[1][0]
    assert got[4] is None and got[5] is None  # layer 2 never ran
    torch.testing.assert_close(got[:4], expected[:4])


def test_state_factory_is_called_per_rank_with_that_ranks_group() -> None:
    seen: list[tuple[int, int]] = []

    def factory(group: dist.ProcessGroup) -> dist.ProcessGroup:
        seen.append((group.rank(), dist.get_rank()))  # dist.get_rank() resolves per thread
        return group

    run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 1), world_size=2, hook=allreduce_hook,
                 state=factory, iterations=1)
    assert sorted(seen) == [(0, 0), (1, 1)]


def test_a_state_factory_may_make_subgroups_with_new_group() -> None:
    """Hierarchical hooks make their groups in the state factory (every rank calls
    ``dist.new_group`` for every group, members or not). At world 3, pairs ``[0, 1]`` and
    ``[2]``: each rank's result is the mean over its own pair, so ranks 0 and 1 get their
    pair's mean and rank 2 keeps its own gradient."""

    def factory(group: dist.ProcessGroup) -> Any:
        pairs = [dist.new_group([0, 1]), dist.new_group([2])]
        return next(g for g in pairs if g != dist.GroupMember.NON_GROUP_MEMBER)

    inputs = make_inputs(STACK, 3, 1)
    run = run_real_ddp(lambda: build_model(STACK), inputs, world_size=3, hook=allreduce_hook, state=factory,
                       iterations=1)
    pair = local_mean_grads(STACK, [inputs[0], inputs[1]], 0)
    alone = local_mean_grads(STACK, [inputs[2]], 0)
    torch.testing.assert_close(run.grads[0][0], pair)
    torch.testing.assert_close(run.grads[0][1], pair)
    torch.testing.assert_close(run.grads[0][2], alone)




def test_a_state_factory_making_only_its_own_subgroup_is_a_mismatch() -> None:
    """Each rank making only the pair it is in: torch names both pairs '1' (a process counts
    its new_group calls) and on real gloo their ranks connect across them (docs/gloo-facts.md
    §7). The rank threads make their groups at once; the run ends with the mismatch."""

    def factory(group: dist.ProcessGroup) -> Any:
        return dist.new_group([0, 1] if dist.get_rank() < 2 else [2, 3])

    with pytest.raises(CollectiveMismatchError, match=r"made the group \[.*\] as its group '1', but"):
        run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 4, 1), world_size=4, hook=allreduce_hook,
                     state=factory, iterations=1)
def test_torch_state_is_restored_and_no_thread_is_left() -> None:
    world, rng = c10d._world, torch.get_rng_state()
    flag = torch._C._is_multithreading_enabled()
    run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 1), world_size=2, hook=allreduce_hook,
                 iterations=1)
    assert c10d._world is world and not dist.is_initialized()
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch._C._is_multithreading_enabled() == flag
    assert sim_threads() == []


def test_what_a_rank_thread_sets_in_torch_distributed_is_that_ranks_own_and_gone_after_the_run() -> None:
    """A process's ``dist.x = …`` (a hook file wrapping ``dist.all_reduce`` at its top) is its
    own: each rank thread's writes to ``torch.distributed`` and ``torch.futures`` land in that
    rank's attributes, which its reads see first and no other rank's do (they were shared: each
    rank's copy of a wrapping module wrapped the wrapper the copy before it had left); a delete
    is the rank's own too; after the run both modules are as they were."""
    seen: dict[int, list[Any]] = {0: [], 1: []}

    def setup(ddp: Any, group: Any) -> tuple[Any, Any, None]:
        rank = dist.get_rank()
        dist._simcluster_probe = f"rank {rank}'s"  # type: ignore[attr-defined]
        if rank == 1:
            del torch.futures.collect_all
            with pytest.raises(AttributeError, match="module 'torch.futures' has no attribute 'collect_all'"):
                del torch.futures.collect_all

        def hook(state, bucket):  # noqa: ANN001 - DDP refuses a bucket annotated other than dist.GradBucket
            seen[rank].append((dist._simcluster_probe, hasattr(torch.futures, "collect_all")))  # type: ignore[attr-defined]
            return allreduce_hook(state, bucket)

        return hook, group, None

    collect_all = torch.futures.collect_all
    run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 2), world_size=2, hook=None, setup=setup,
                 iterations=2)
    assert seen == {0: [("rank 0's", True)] * 2, 1: [("rank 1's", False)] * 2}
    assert not hasattr(dist, "_simcluster_probe") and torch.futures.collect_all is collect_all
    assert type(dist) is type(torch) and type(torch.futures) is type(torch)


def test_a_hook_pickling_its_group_fails_as_with_a_real_group() -> None:
    """The groups of this run are a subclass of the simulated group, which wore no torch name:
    pickling one said "cannot pickle '_DDPGroup' object", real gloo's group
    "'torch._C._distributed_c10d.ProcessGroup'", and e2e called the difference a FIDELITY BUG."""
    import pickle

    with pytest.raises(TypeError) as real:
        pickle.dumps(dist.ProcessGroup(0, 1))

    def pickles(state, bucket):  # noqa: ANN001 - DDP checks the hook's annotations
        pickle.dumps(state)
        return allreduce_hook(state, bucket)

    with pytest.raises(TypeError) as simulated:
        run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 1), world_size=2, hook=pickles, iterations=1)
    assert str(simulated.value) == str(real.value) == "cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object"


def test_a_barrier_after_a_failed_collective_runs_under_the_real_reducer() -> None:
    """A gloo barrier behind a failed collective asks the engine whether it re-raises that
    error (real timing decides); the free-running engine could not answer, and the run broke
    with "'ThreadedEngine' object has no attribute 'choose'", reported as a mismatch of the
    ranks' calls. It answers 0, no re-raise — one of the outcomes measured on real gloo."""
    def fails_then_barriers(state, bucket):  # noqa: ANN001 - DDP checks the hook's annotations
        try:
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)  # gloo fails it at wait()
        except RuntimeError:
            pass
        dist.barrier()
        return allreduce_hook(state, bucket)

    inputs = make_inputs(STACK, 2, 1)
    run = run_real_ddp(lambda: build_model(STACK), inputs, world_size=2, hook=fails_then_barriers, iterations=1)
    for got, want in zip(run.grads[0][0], local_mean_grads(STACK, inputs, 0)):
        torch.testing.assert_close(got, want)


class _MeetsInForward(torch.nn.Module):
    """Each rank's forward waits for the other's to begin, then notes which DDP module torch
    says is in its forward (what torch.compile's DDPOptimizer reads), and waits again so both
    look while both are inside."""

    def __init__(self, barrier: threading.Barrier, seen: list[bool]) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.barrier, self.seen = barrier, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.barrier.wait()  # both ranks are inside their forwards
        active = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
        self.seen.append(active is not None and active.module is self)
        self.barrier.wait()  # both looked before either leaves its forward (and puts a mark back)
        return self.linear(x)


def test_each_rank_thread_has_its_own_inside_ddp_forward_mark() -> None:
    """DDP marks "inside forward" in one class attribute — one per process on a cluster, one
    for every rank thread here: with two forwards at once each rank saw the other's module,
    and the mark outlived the run (4 runs in 30), so a later torch.compile in the process
    failed DDPOptimizer's assertion (a flaky test_rank_state failure, 2026-12-06). Each rank
    thread now has its own mark, and the class attribute is what it was before the run."""
    DDP = torch.nn.parallel.DistributedDataParallel
    barrier, seen = threading.Barrier(2, timeout=30), []
    before = DDP._active_ddp_module
    run_real_ddp(lambda: _MeetsInForward(barrier, seen), [[torch.ones(3, 4)], [torch.ones(3, 4)]], world_size=2,
                 hook=allreduce_hook, iterations=1)
    assert seen == [True, True]
    assert DDP._active_ddp_module is before and DDP._get_active_ddp_module() is before


# --------------------------------------------------------------------- broken hooks
def test_mismatched_collectives_across_ranks_are_reported() -> None:
    def fp16_on_rank_1(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if dist.get_rank() == 1:
            buffer = buffer.half()
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: bucket.buffer())

    with pytest.raises(CollectiveMismatchError, match=r"rank 1: all_reduce\(float16"):
        run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 2), world_size=2, hook=fp16_on_rank_1,
                     iterations=2, timeout=10)
    assert sim_threads() == []


def test_a_rank_that_ends_without_its_collective_is_a_deadlock() -> None:
    calls = [0, 0]

    def skip_last_on_rank_1(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        rank = dist.get_rank()
        calls[rank] += 1
        if rank == 1 and calls[rank] == 2:  # rank 1 skips the collective of its second (last) bucket
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        return allreduce_hook(state, bucket)

    with pytest.raises(DeadlockError, match=r"ranks \[1\] ended without posting call #\d+ on WORLD") as info:
        run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 2), world_size=2,
                     hook=skip_last_on_rank_1, iterations=2, timeout=10)
    assert "rank 0: in backward() of iteration 1" in str(info.value)
    # the line of the code under test (torch's hook) that posted the unmatched call: the
    # free-running engine records it always
    assert re.search(r"rank 0 posted it at \S*default_hooks\.py:\d+ in _allreduce_fut: dist\.all_reduce\(tensor",
                     str(info.value)), str(info.value)
    assert sim_threads() == []


def test_a_future_nobody_completes_is_reported_stuck_and_its_waiters_are_released() -> None:
    def never(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future()

    with pytest.raises(StuckError, match="rank 0: in backward\\(\\) of iteration 0") as info:
        run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 1), world_size=2, hook=never,
                     iterations=1, timeout=0.5)
    assert "rank 1: in backward() of iteration 0" in str(info.value)
    assert "abandoned" not in str(info.value)
    assert sim_threads() == []


def test_an_exception_in_the_hook_is_raised_as_itself_with_the_rank() -> None:
    def boom_on_rank_1(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if dist.get_rank() == 1:
            raise KeyError("boom")
        return allreduce_hook(state, bucket)

    with pytest.raises(KeyError, match="boom") as info:
        run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 1), world_size=2, hook=boom_on_rank_1,
                     iterations=1, timeout=10)
    assert any("raised on rank 1 of 2" in note for note in info.value.__notes__)
    assert sim_threads() == []


def test_a_raising_then_callback_fails_backward_as_on_real_gloo() -> None:
    """The message real DDP gives (docs/ddp-facts.md, measured): torch's C++ ``then`` wraps
    the callback's exception once and errors the future; no ``Unable to cast``."""
    def boom(fut: torch.futures.Future) -> torch.Tensor:
        raise ValueError("boom in callback")

    def raising_callback(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return allreduce_hook(state, bucket).then(boom)

    with pytest.raises(RuntimeError) as info:
        run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 1), world_size=2, hook=raising_callback,
                     iterations=1, timeout=10)
    line = boom.__code__.co_firstlineno + 1
    assert str(info.value).startswith("Got the following error when running the callback: ValueError: boom in "
                                      f"callback\n\nAt:\n  {__file__}({line}): boom\n"), str(info.value)
    assert sim_threads() == []


class _Idle:
    """Stands in for an engine that is not running (futures completed by the test itself)."""
    running, where, current_rank = False, None, None


def test_only_a_callback_exception_errors_the_future_handed_to_the_reducer() -> None:
    def boom(fut: torch.futures.Future) -> None:
        raise ValueError("boom in callback")

    parent = SimFuture(_Idle(), 0, "parent")  # type: ignore[arg-type]
    handed = for_reducer(parent.then(boom))
    parent.set_result(1.0)
    with pytest.raises(RuntimeError, match=r"^Got the following error when running the callback: ValueError: "
                                           r"boom in callback\n\nAt:\n  \S+\(\d+\): boom\n"):
        handed.wait()
    # A future user code completed with set_exception holds the exception as its *value*, as
    # torch stores it: the reducer then says "Unable to cast <it> to Tensor" (docs/ddp-facts.md).
    from simcluster.fake.rank_context import user_future_class

    user = user_future_class(_Idle, torch.futures.Future, lambda rank: 0)()  # torch.futures.Future() in a run
    handed = for_reducer(user)
    error = ValueError("boom via set_exception")
    user.set_exception(error)
    assert torch._C.Future.value(handed) is error


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="inputs_per_rank"):
        run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 1, 1), world_size=2, hook=allreduce_hook)
    with pytest.raises(UsageError, match="state="):
        run_real_ddp(lambda: build_model(STACK), make_inputs(STACK, 2, 1), world_size=2, hook=allreduce_hook,
                     state="world", iterations=1)


# ----------------------------------------------------------------- against real gloo
GLOO_CASES = [
    (STACK, dict(bucket_cap_mb=CAP)),
    (SWAPPED, dict(bucket_cap_mb=1e-9, static_graph=True)),
    (UNUSED, dict(bucket_cap_mb=CAP, find_unused_parameters=True)),
]
GLOO_ITERATIONS = 3


def gloo_ddp_job(rank: int, world_size: int, payload: Any) -> list[dict[str, Any]]:
    """In a real gloo process: the same training loop as run_real_ddp, for each case."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    results = []
    for spec, kwargs in payload["cases"]:
        model = build_model(spec)
        params = list(model.parameters())
        ddp = DistributedDataParallel(model, **kwargs)
        it = [0]
        calls: list[tuple[int, int, bool, tuple[int, ...]]] = []

        def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            ids = tuple(next(i for i, q in enumerate(params) if q is p) for p in bucket.parameters())
            calls.append((it[0], bucket.index(), bucket.is_last(), ids))
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        grads = []
        inputs = make_inputs(spec, world_size, GLOO_ITERATIONS)[rank]
        for k in range(GLOO_ITERATIONS):
            it[0] = k
            ddp(inputs[k]).sum().backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in params])
            ddp.zero_grad(set_to_none=True)
        del ddp
        gc.collect()
        results.append({"grads": grads, "calls": calls})
    return results


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2])
def test_same_gradients_bits_and_hook_calls_as_real_gloo(world_size: int,
                                                        gloo_world: Callable[[int], GlooCluster]) -> None:
    real = gloo_world(world_size).run(gloo_ddp_job, [{"cases": GLOO_CASES}] * world_size)
    for c, (spec, kwargs) in enumerate(GLOO_CASES):
        sim = run_real_ddp(lambda spec=spec: build_model(spec), make_inputs(spec, world_size, GLOO_ITERATIONS),
                           world_size=world_size, hook=allreduce_hook, iterations=GLOO_ITERATIONS, **kwargs)
        for rank in range(world_size):
            assert sim.hook_calls[rank] == real[rank][c]["calls"], f"case {c}, rank {rank}"
            for k in range(GLOO_ITERATIONS):
                for i, (a, b) in enumerate(zip(sim.grads[k][rank], real[rank][c]["grads"][k])):
                    assert (a is None) == (b is None), f"case {c}, rank {rank}, iteration {k}, param {i}"
                    if a is not None:
                        assert torch.equal(a, b), f"case {c}, rank {rank}, iteration {k}, param {i}: bits differ"


def test_hook_and_setup_together_are_refused_before_any_model_is_built() -> None:
    built: list[int] = []

    def model() -> torch.nn.Module:
        built.append(1)
        return torch.nn.Linear(2, 2)

    with pytest.raises(UsageError, match="pass hook= or setup=, not both"):
        run_real_ddp(model, [[torch.ones(2)]] * 2, world_size=2, iterations=1,
                     hook=lambda state, bucket: None, setup=lambda ddp, group: None)
    assert built == []
