"""The engine's promises: determinism, schedules, per-rank state, and diagnostics that never hang."""

from __future__ import annotations

import os
import re
import threading

import pytest
import torch
import torch.distributed as dist

from simcluster import (
    CollectiveMismatchError,
    DeadlockError,
    HookContractError,
    SimCluster,
    UsageError,
)
from simcluster.fake.futures import SimFuture


def two_buckets(rank: int) -> list[torch.Tensor]:
    """Rank code with three collectives in flight at once, chained with callbacks."""
    xs = [torch.full((5,), float(rank + k)) for k in range(3)]
    futs = [dist.all_reduce(x, async_op=True).get_future().then(lambda f: f.value()[0] * 2) for x in xs]
    return [f.wait() for f in futs]


def test_same_seed_same_bits_and_trace_50_runs() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(3001, generator=gen) for _ in range(4)]
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    first = SimCluster(4, seed=11).run_hook(allreduce_hook, grads)
    for _ in range(49):
        again = SimCluster(4, seed=11).run_hook(allreduce_hook, grads)
        assert again.trace == first.trace
        assert again.schedule == first.schedule
        for a, b in zip(again.outputs, first.outputs):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_same_seed_same_schedule_with_many_in_flight() -> None:
    runs = [SimCluster(3, seed=5).run(two_buckets) for _ in range(50)]
    assert all(r.trace == runs[0].trace for r in runs)


def test_different_seeds_give_different_completion_orders() -> None:
    orders = {tuple(SimCluster(3, seed=s).run(two_buckets).trace.completion_order()) for s in range(20)}
    assert len(orders) > 1


def test_in_order_and_reverse_schedules() -> None:
    in_order = SimCluster(2, schedule="in_order").run(two_buckets)
    assert [seq for _, _, seq in in_order.trace.completion_order()] == [0, 1, 2]
    # gloo: only 2 worker threads per group, so #2 cannot start before one of #0/#1 was
    # delivered on both ranks; "reverse" picks the newest option each time
    reverse_gloo = SimCluster(2, schedule="reverse", backend="gloo").run(two_buckets)
    assert [seq for _, _, seq in reverse_gloo.trace.completion_order()] == [1, 0, 2]


def test_nccl_model_completes_a_groups_collectives_in_issue_order() -> None:
    for schedule in ["reverse", "random"]:
        for seed in range(5):
            run = SimCluster(3, seed=seed, schedule=schedule, backend="nccl").run(two_buckets)
            assert [seq for _, _, seq in run.trace.completion_order()] == [0, 1, 2]


def test_gloo_model_lets_ranks_see_completions_in_different_orders() -> None:
    """Each gloo rank's workers finish on their own: rank 0 may see B before A while
    rank 1 sees A before B (measured: PowerSGD's inner all_reduces then mismatch)."""

    def rank_fn(rank: int) -> list[str]:
        seen: list[str] = []
        for name in "AB":
            fut = dist.all_reduce(torch.ones(1), async_op=True).get_future()
            fut.add_done_callback(lambda f, name=name: seen.append(name))
        dist.barrier()
        return seen

    orders = {tuple(map(tuple, SimCluster(2, seed=s).run(rank_fn).values)) for s in range(30)}
    assert any(o[0] != o[1] for o in orders), orders
    nccl = {tuple(map(tuple, SimCluster(2, seed=s, backend="nccl").run(rank_fn).values)) for s in range(10)}
    assert nccl == {(("A", "B"), ("A", "B"))}


def test_replay_line_reproduces_a_random_schedule() -> None:
    original = SimCluster(3, seed=123).run(two_buckets)
    replay = SimCluster(3, seed=0, schedule=original.schedule).run(two_buckets)
    assert replay.trace.completion_order() == original.trace.completion_order()
    assert f"schedule={original.schedule!r}" in original.replay


def test_ranks_have_their_own_rng_and_the_outside_rng_is_untouched() -> None:
    torch.manual_seed(999)
    before = torch.get_rng_state()

    def rank_fn(rank: int) -> torch.Tensor:
        first = torch.rand(2)
        dist.barrier()  # other ranks run in between
        return torch.cat([first, torch.rand(2)])

    per_rank = SimCluster(3, seed=7).run(rank_fn).values
    assert not torch.equal(per_rank[0], per_rank[1])
    for rank, got in enumerate(per_rank):  # each stream is unbroken by the other ranks' draws
        assert torch.equal(got, torch.rand(4, generator=torch.Generator().manual_seed(7 + rank)))
    same = SimCluster(3, seed=7, rng="same").run(rank_fn).values
    assert torch.equal(same[0], same[1]) and torch.equal(same[1], same[2])
    assert torch.equal(torch.get_rng_state(), before)


def test_manual_seed_inside_a_rank_does_not_leak() -> None:
    def rank_fn(rank: int) -> torch.Tensor:
        if rank == 0:
            torch.manual_seed(0)
        dist.barrier()
        return torch.rand(1)

    out = SimCluster(2, seed=3).run(rank_fn).values
    assert torch.equal(out[1], torch.rand(1, generator=torch.Generator().manual_seed(4)))


def test_no_threads_and_no_default_group_left_after_blocking_runs() -> None:
    before = set(threading.enumerate())
    SimCluster(4, seed=1).run(two_buckets)
    assert not set(threading.enumerate()) - before  # none started and left (another test's may end meanwhile)
    assert dist.group.WORLD is None


# -- diagnostics --------------------------------------------------------------------


def test_mismatched_shapes_name_each_rank_and_call() -> None:
    def rank_fn(rank: int) -> None:
        dist.all_reduce(torch.ones(4 + rank))

    with pytest.raises(CollectiveMismatchError) as info:
        SimCluster(2, seed=3).run(rank_fn)
    message = str(info.value)
    assert "rank 0: all_reduce(float32, (4,), SUM)" in message
    assert "rank 1: all_reduce(float32, (5,), SUM)" in message
    assert "replay: SimCluster(world_size=2, seed=3" in message


def test_mismatched_ops_and_reduce_ops() -> None:
    def different_op(rank: int) -> None:
        t = torch.ones(2)
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)

    with pytest.raises(CollectiveMismatchError, match="broadcast"):
        SimCluster(2).run(different_op)

    with pytest.raises(CollectiveMismatchError, match="MAX"):
        SimCluster(2).run(lambda r: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX if r else dist.ReduceOp.SUM))


def test_deadlock_lists_each_ranks_blocked_call() -> None:
    def rank_fn(rank: int) -> None:
        if rank == 0:  # rank 0 waits on a collective rank 1 never issues
            dist.all_reduce(torch.ones(2))

    with pytest.raises(DeadlockError) as info:
        SimCluster(2, seed=4).run(rank_fn)
    message = str(info.value)
    assert "rank 0: blocked in the synchronous all_reduce#0 on WORLD (async_op=False" in message
    assert "posted by ranks [0], never posted by ranks [1]" in message
    assert "replay:" in message


def test_gloo_worker_starvation_deadlocks_like_real_gloo() -> None:
    """docs/gloo-facts.md §4: two callbacks blocking on further collectives of the same
    group hold both gloo workers -> deadlock; one is fine; NCCL model has no workers."""

    def blocking_callbacks(count: int):
        def rank_fn(rank: int) -> list[float]:
            def cb(fut: torch.futures.Future) -> float:
                inner = torch.ones(1)
                dist.all_reduce(inner, async_op=True).wait()
                return inner.item()

            futs = [dist.all_reduce(torch.ones(1), async_op=True).get_future().then(cb) for _ in range(count)]
            return [f.wait() for f in futs]

        return rank_fn

    assert SimCluster(2, backend="gloo").run(blocking_callbacks(1)).values == [[2.0], [2.0]]
    with pytest.raises(DeadlockError, match="busy backend worker threads"):
        SimCluster(2, backend="gloo").run(blocking_callbacks(2))
    assert SimCluster(2, backend="nccl").run(blocking_callbacks(2)).values == [[2.0, 2.0]] * 2


def test_hook_exception_is_reraised_as_itself_with_rank_and_replay() -> None:
    def hook(state: object, bucket) -> torch.futures.Future:
        if dist.get_rank() == 1:
            raise KeyError("boom")
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    with pytest.raises(KeyError) as info:
        SimCluster(2, seed=9).run_hook(hook, [torch.ones(3), torch.ones(3)])
    notes = "\n".join(info.value.__notes__)
    assert "raised on rank 1 of 2" in notes
    assert "left blocked" in notes  # rank 0 waits forever on its all_reduce
    assert "replay with SimCluster(world_size=2, seed=9" in notes


def test_callback_exception_surfaces_like_torch() -> None:
    def hook(state: object, bucket) -> torch.futures.Future:
        def bad(fut: torch.futures.Future) -> torch.Tensor:
            raise ValueError("decompress failed")

        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(bad)

    with pytest.raises(RuntimeError, match="Got the following error when running the callback: ValueError: decompress failed"):
        SimCluster(2).run_hook(hook, [torch.ones(3), torch.ones(3)])


def test_hook_returning_a_tensor_is_a_contract_error() -> None:
    def hook(state: object, bucket) -> torch.Tensor:
        dist.all_reduce(bucket.buffer())
        return bucket.buffer()

    with pytest.raises(HookContractError, match=r"(?s)^Unable to cast .* must return a torch.futures.Future object, "
                                                r"but got torch.Tensor\n  simcluster: hook .* on rank 0, bucket 0"):
        SimCluster(2).run_hook(hook, [torch.ones(3), torch.ones(3)])


def test_hook_returning_none_gets_the_same_wording_as_in_a_ddp_step() -> None:
    with pytest.raises(HookContractError, match=r"^hook .* returned None on rank 0, bucket 0: real DDP .* SIGSEGV"):
        SimCluster(2).run_hook(lambda state, bucket: None, [torch.ones(3), torch.ones(3)])


def test_future_that_never_completes_is_a_deadlock_not_a_hang() -> None:
    def hook(state: object, bucket) -> torch.futures.Future:
        cluster_future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        never = SimFuture(cluster_future._engine, dist.get_rank(), "a future nobody completes")
        return never

    with pytest.raises(DeadlockError, match="waits on a future nobody completes, which never completes"):
        SimCluster(2).run_hook(hook, [torch.ones(3), torch.ones(3)])


def test_state_shared_across_ranks_is_reported() -> None:
    cluster = SimCluster(2)
    shared = cluster.process_group(0)

    def hook(state, bucket) -> torch.futures.Future:
        return dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()

    with pytest.raises(ValueError, match="not initialized in the world group map") as info:
        cluster.run_hook(hook, [torch.ones(2), torch.ones(2)], state=lambda pg: shared)
    assert "belongs to another simulated rank" in "\n".join(info.value.__notes__)

    def direct(rank: int) -> None:  # bypassing torch's front end reaches our own check
        shared.allreduce([torch.ones(1)])

    with pytest.raises(UsageError, match="rank 1's code called all_reduce on rank 0's process group"):
        cluster.run(direct)


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="world_size 0: must be an integer from 1 to 1,024"):
        SimCluster(0)
    with pytest.raises(UsageError, match="backend='mpi'"):
        SimCluster(2, backend="mpi")
    with pytest.raises(UsageError, match="grads has 1 tensors; the cluster has 2 ranks"):
        SimCluster(2).run_hook(lambda s, bucket: None, [torch.ones(1)])
    with pytest.raises(UsageError, match=r"same shape and dtype .* got rank 0: float32\[2\], rank 1: float32\[3\]"):
        SimCluster(2).run_hook(lambda s, bucket: None, [torch.ones(2), torch.ones(3)])
    with pytest.raises(UsageError, match=r"rank 1: float64\[2\], rank 2: float32\[2\]"):
        SimCluster(3).run_hook(lambda s, bucket: None, [torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(2)])
    with pytest.raises(UsageError, match="schedule="):
        SimCluster(2, schedule="sideways")


def test_waiting_on_a_plain_torch_future_made_in_a_hook_is_a_deadlock_not_a_hang() -> None:
    """torch.futures.Future() made by hook code during a run is a simulated future, so a
    wait on one that nobody completes parks the rank and is reported, instead of
    blocking the run's only thread inside C++ forever."""

    def hook(state: object, bucket) -> torch.futures.Future:
        gate = torch.futures.Future()
        assert isinstance(gate, torch.futures.Future)

        def wait_for_gate(fut: torch.futures.Future) -> torch.Tensor:
            gate.wait()  # BUG: nothing ever sets it
            return fut.value()[0]

        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(wait_for_gate)

    plain = torch.futures.Future
    with pytest.raises(DeadlockError, match=r"blocked in wait\(\) on torch.futures.Future\(\) #0 made by rank 0 at "
                       r"\S*test_engine.py:\d+ \(gloo-worker WORLD#0\)"):
        SimCluster(2, stuck_timeout=5).run_hook(hook, [torch.ones(2), torch.ones(2)])
    assert torch.futures.Future is plain  # restored after the run


def _lines_of(fn: object, *texts: str) -> list[int]:
    """The line numbers, in ``fn``'s file, of the first line of ``fn`` holding each of ``texts``."""
    import inspect

    source, start = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return [start + next(i for i, line in enumerate(source) if text in line) for text in texts]


def _skips_on_rank_3(state: object, bucket) -> torch.futures.Future:
    """Ranks 0 and 1 post an all_reduce at one line, rank 2 at another and waits for it; rank 3
    returns a future it completed itself."""
    buf = bucket.buffer()
    if dist.get_rank() == 3:
        done = torch.futures.Future()
        done.set_result(buf)
        return done
    if dist.get_rank() == 2:
        dist.all_reduce(buf, async_op=True).wait()  # rank 2 waits for it
    return dist.all_reduce(buf, async_op=True).get_future()


def test_posting_lines_name_where_each_unmatched_call_was_posted() -> None:
    """With ``posting_lines`` the deadlock report names the user line of each call some rank
    never matched (ranks sharing a line together), keeps the blocked rank's own line, and
    its replay line (carrying the option) reproduces the report as printed. Without it, no
    stack is walked at a post and the report has no such lines."""
    import os

    wait, post, made = _lines_of(_skips_on_rank_3, ".wait()  # rank 2", "return dist.all_reduce", "torch.futures.Future()")
    here = os.path.relpath(__file__) if not os.path.relpath(__file__).startswith("..") else __file__
    grads = [torch.ones(2)] * 4
    with pytest.raises(DeadlockError) as plain:
        SimCluster(4, seed=1).run_hook(_skips_on_rank_3, grads)
    assert "posted it at" not in str(plain.value)
    with pytest.raises(DeadlockError) as info:
        SimCluster(4, seed=1, posting_lines=True).run_hook(_skips_on_rank_3, grads)
    text = "\n".join([str(info.value), *info.value.__notes__])
    assert f"rank 2: blocked in wait() on work of all_reduce#0 on WORLD (its callbacks) (rank 2) at {here}:{wait} in " \
        "_skips_on_rank_3" in text  # a blocked rank keeps its own line
    assert ("all_reduce(float32, (2,), SUM) (call #0 on WORLD): posted by ranks [0, 1, 2], never posted by ranks [3]\n"
            f"    ranks [0, 1] posted it at {here}:{post} in _skips_on_rank_3: return dist.all_reduce(buf, async_op=True)"
            ".get_future()\n"
            f"    rank 2 posted it at {here}:{wait} in _skips_on_rank_3: dist.all_reduce(") in text
    # what the rank that never posted did instead: its future, named with the line that made it
    assert (f"rank 3: DDP (bucket 0) waits on nothing: the hook returned torch.futures.Future() #0 made by rank 3 at "
            f"{here}:{made}, which has completed") in text
    replay = info.value.replay
    assert replay is not None and replay.endswith("posting_lines=True)")
    with pytest.raises(DeadlockError) as again:
        eval(replay, {"SimCluster": SimCluster}).run_hook(_skips_on_rank_3, grads)
    assert str(again.value) == str(info.value) and again.value.__notes__ == info.value.__notes__


def test_posting_lines_name_an_unmatched_send() -> None:
    def rank_fn(rank: int) -> None:
        if rank == 0:
            dist.isend(torch.ones(2), dst=1)  # rank 1 never receives it

    (line,) = _lines_of(rank_fn, "dist.isend(")
    with pytest.raises(DeadlockError) as info:
        SimCluster(2, posting_lines=True).run(rank_fn)
    assert "rank 1 never posted the matching recv from rank 0" in str(info.value)
    assert f"test_engine.py:{line} in rank_fn: dist.isend(" in str(info.value).split("is unmatched:")[1]


def test_a_mismatch_names_the_earlier_collective_where_two_lines_met() -> None:
    """Rank 0 all-reduces a one-element count rank 1 never sends; rank 1's own one-element
    call meets it (collectives meet by position), and their next calls disagree. The
    mismatch at call #1 begins at call #0: the report names it with both lines, and only
    when the run records posting lines."""
    from simcluster.errors import CollectiveMismatchError

    def rank_fn(rank: int) -> None:
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # an extra count, rank 0 only
        else:
            dist.all_reduce(torch.zeros(1))  # rank 1's flag
        dist.all_reduce(torch.ones(3) if rank == 0 else torch.ones(2))

    extra, flag = _lines_of(rank_fn, "# an extra count", "# rank 1's flag")
    with pytest.raises(CollectiveMismatchError) as plain:
        SimCluster(2).run(rank_fn)
    assert "earlier," not in str(plain.value)
    with pytest.raises(CollectiveMismatchError) as info:
        SimCluster(2, posting_lines=True).run(rank_fn)
    text = str(info.value)
    assert "(call #1 of that group)" in text
    assert re.search(r"earlier, all_reduce\(float32, \(1,\), SUM\) \(call #0 on WORLD\) met calls posted at different "
                     rf"lines.*\n +rank 0 posted it at \S*test_engine\.py:{extra} in rank_fn: .*"
                     rf"\n +rank 1 posted it at \S*test_engine\.py:{flag} in rank_fn: ", text), text


@pytest.mark.parametrize("posting_lines", [False, True])
def test_a_run_leaves_nothing_for_the_cyclic_garbage_collector(posting_lines: bool) -> None:
    """When a run ends, its engine (and the futures, calls and tasks it holds) is freed by
    reference counting. An engine attribute that kept the last task run (a completion: its
    call, whose future holds the engine) made every step's objects a cycle, ~200 objects a
    step for the collector to walk: +70 % instructions per W=2 step (found by
    benchmarks/count_instructions.py, 2026-12-06)."""
    import gc

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    cluster = SimCluster(2, posting_lines=posting_lines)
    grads = [torch.ones(4), torch.arange(4.0)]
    cluster.run_hook(allreduce_hook, grads)  # first-use caches and imports
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            cluster.run_hook(allreduce_hook, grads)
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_a_rank_polling_its_work_lets_the_others_complete_it() -> None:
    """``while not work.is_completed()`` / ``while not fut.done()``: on a real rank the
    backend's threads complete the collective while the loop polls. The simulator completed
    one only when a rank waited or returned, so such a loop spun until the supervisor's
    deadline (round 18 of hooks from the wild). A poll that finds its work pending now lets
    the other ranks run and the ready collectives complete first; the run is the same on
    every run (the trace, the results)."""
    def rank_fn(rank: int) -> list[float]:
        work = dist.all_reduce(torch.full((2,), float(rank + 1)), async_op=True)
        while not work.is_completed():
            pass
        fut = dist.all_reduce(torch.ones(1) * rank, async_op=True).get_future()
        while not fut.done():
            pass
        return [*work.result()[0].tolist(), *fut.value()[0].tolist()]

    runs = [SimCluster(3, seed=4).run(rank_fn) for _ in range(2)]
    assert runs[0].values == [[6.0, 6.0, 3.0]] * 3
    assert runs[0].trace.events == runs[1].trace.events


def test_the_first_polls_answer_as_the_schedule_says_and_then_let_the_others_run() -> None:
    """A poll right after posting answers pending on real gloo 86-100 % of the time, complete
    otherwise (docs/gloo-facts.md §12). Every poll let the others run first, so such a check
    always answered complete here — the branch real runs mostly take was never run; then
    every poll after the first did, so a hook polling three times before it gives up never
    gave up (round 24 of hooks from the wild; on real gloo it did, in most steps). Each of
    the first POLL_PATIENCE polls of a work or future is now a schedule choice: the in-order
    schedule (all zeros, what shrinking leads to) looks at once and sees pending on every
    rank; ``reverse`` lets the others run first and sees complete; a seed picks per poll,
    the same every run. Past POLL_PATIENCE a poll lets the others run, so a polling loop ends."""
    from simcluster.engine.inline import POLL_PATIENCE
    from simcluster.engine.trace import Polled

    def rank_fn(rank: int) -> list[bool]:
        work = dist.all_reduce(torch.ones(1), async_op=True)
        fut = dist.all_reduce(torch.ones(1), async_op=True).get_future()
        answers = [work.is_completed(), fut.done()]
        answers.append(work.is_completed())  # a second look
        looks = 2
        while not work.is_completed():  # waits by polling
            looks += 1
        answers.append(looks == POLL_PATIENCE)  # pending at each of its first POLL_PATIENCE looks (in order)
        fut.wait()
        return answers

    in_order = SimCluster(3, schedule="in_order").run(rank_fn)
    assert in_order.values == [[False, False, False, True]] * 3
    assert [(e.rank, e.choice) for e in in_order.trace.of(Polled)] == [(r, 0) for r in range(3) for _ in range(2)]
    assert re.search(r"rank 0: polls work of all_reduce#0 on WORLD \(its callbacks\) at \S*test_engine.py:\d+, looks at once: "
                     "pending", in_order.trace.format())
    assert [e.complete for e in SimCluster(3, schedule="reverse").run(rank_fn).trace.of(Polled)] == [True] * 3  # then fut is done already
    assert [v[:3] for v in SimCluster(3, schedule="reverse").run(rank_fn).values] == [[True, True, True]] * 3
    seeded = [SimCluster(3, seed=seed).run(rank_fn) for seed in range(6) for _ in range(2)]
    assert len({tuple(map(tuple, run.values)) for run in seeded}) > 1  # the seed decides
    for again, first in zip(seeded[1::2], seeded[::2]):
        assert (again.values, again.trace.events) == (first.values, first.trace.events)


def test_a_rank_polling_a_collective_no_one_completes_is_a_deadlock() -> None:
    """Rank 1 never posts the all_reduce rank 0 polls: polls that see nothing posted or
    completed for POLL_ROUNDS rounds end the run as a deadlock naming the poll and its line
    (the loop would otherwise spin until the supervisor's deadline, with no story)."""
    def rank_fn(rank: int) -> None:
        if rank == 0:
            work = dist.all_reduce(torch.ones(2), async_op=True)
            while not work.is_completed():  # polls
                pass

    (line,) = _lines_of(rank_fn, "# polls")
    with pytest.raises(DeadlockError) as info:
        SimCluster(2).run(rank_fn)
    text = str(info.value)
    assert re.search(r"rank 0: polls work of all_reduce#0 on WORLD \(its callbacks\), which never completes "
                     rf"\(rank 0\) at \S*test_engine\.py:{line} in rank_fn", text), text
    assert "never posted by ranks [1]" in text


def test_a_copied_or_unpickled_trace_logs_into_its_own_events() -> None:
    import copy
    import pickle

    from simcluster.engine.trace import Completed, Trace

    original = Trace()
    original.log((Completed, ("all_reduce", "WORLD", 0, (0, 1), 0, 0, 1)))
    for other in (copy.deepcopy(original), copy.copy(original), pickle.loads(pickle.dumps(original))):
        other.log((Completed, ("all_reduce", "WORLD", 1, (0, 1), 1, 0, 1)))
        assert [e.seq for e in other.of(Completed)] == [0, 1]
    assert [e.seq for e in original.of(Completed)] == [0]


def test_the_seeded_schedule_draws_what_random_randrange_draws() -> None:
    import random

    from simcluster.engine.scheduler import SeededRandom

    for seed in range(20):
        ours, theirs = SeededRandom(seed), random.Random(seed)
        for n in [1, 2, 3, 5, 8, 9, 16, 17, 100] * 10:
            assert ours.choose(n) == (theirs.randrange(n) if n > 1 else 0)


def test_the_trace_lists_the_dtypes_the_collectives_carried_in_order() -> None:
    """What an overflow report reasons from: each dtype once, in the order it first travelled;
    a barrier carries none. Two runs give the same tuple."""

    def rank_fn(rank: int) -> None:
        dist.barrier()
        dist.all_reduce(torch.ones(2, dtype=torch.float16))
        dist.all_gather([torch.empty(2), torch.empty(2)], torch.ones(2))
        dist.all_reduce(torch.ones(2, dtype=torch.float16))
        dist.broadcast(torch.ones(1, dtype=torch.bfloat16), src=0)

    traces = [SimCluster(2, seed=0).run(rank_fn).trace for _ in range(2)]
    assert traces[0].dtypes() == ("float16", "float32", "bfloat16") == traces[1].dtypes()
    assert SimCluster(2, seed=0).run(lambda rank: dist.barrier()).trace.dtypes() == ()


def test_futures_a_rank_makes_are_numbered_per_rank_over_the_cluster_s_life() -> None:
    """A rank is a process: its torch.futures.Future()s count on across runs (steps), each
    rank its own count; labels never hold id(), so a fresh cluster labels them alike."""

    def rank_fn(rank: int) -> list[str]:
        return [torch.futures.Future().label for _ in range(rank + 1)]

    cluster = SimCluster(2, seed=0)
    first, second = cluster.run(rank_fn).values, cluster.run(rank_fn).values
    numbers = [[label.split(" ")[1] for label in labels] for labels in first + second]
    assert numbers == [["#0"], ["#0", "#1"], ["#1"], ["#2", "#3"]]
    assert all(label.startswith(f"torch.futures.Future() #") and f"made by rank {r} at " in label
               and "test_engine.py:" in label
               for r, labels in enumerate(first) for label in labels)
    assert SimCluster(2, seed=0).run(rank_fn).values == first


def test_a_future_s_label_names_its_file_relative_to_the_directory_the_run_is_in(tmp_path, monkeypatch) -> None:
    """The file:line in a torch.futures.Future()'s label is worked out once per file and
    directory (it is on the hot path): run from another directory, the same line is named
    from there, not as the first run saw it."""

    def rank_fn(rank: int) -> str:
        return torch.futures.Future().label

    here = SimCluster(1, seed=0).run(rank_fn).values[0]
    assert " at tests/test_engine.py:" in here or " at test_engine.py:" in here
    monkeypatch.chdir(tmp_path)
    there = SimCluster(1, seed=0).run(rank_fn).values[0]
    assert there.endswith(here.rsplit(" at ", 1)[1].rsplit("/", 1)[-1])
    assert f" at {os.path.abspath(__file__)}:" in there
