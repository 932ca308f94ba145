"""Both engines keep one contract (simcluster.engine.contract) and speak with one matcher.

The baton engine (inline) and the free-running one (threaded) are interchangeable behind
``EngineContract``: these tests check that each has every member with the contract's
parameters, that the futures are ``Waitable`` through a public ``on_done``, and that a
mismatch and a compute failure read the same on both engines — the wording written out
here by hand from what a user needs to see, not copied from the code.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simcluster.ddp.real_ddp import _Runtime
from simcluster.engine.contract import Call, EngineContract, RunAborted, Waitable
from simcluster.engine.inline import Engine
from simcluster.engine.scheduler import make_scheduler
from simcluster.engine.threaded import ThreadedEngine
from simcluster.engine.trace import Completed, Posted, Trace
from simcluster.errors import CollectiveMismatchError, DeadlockError
from simcluster.fake.backends import backend_model
from simcluster.fake.cluster import SimCluster
from simcluster.fake.futures import DoneFlag, SimFuture
from simcluster.fake.process_group import Runtime


def inline_engine(posting_lines: bool = False) -> Engine:
    return Engine(scheduler=make_scheduler("in_order", 0), trace=Trace(), switch=lambda old, new: None,
                  workers_per_channel=None, posting_lines=posting_lines)


def threaded_engine() -> ThreadedEngine:
    return ThreadedEngine(world_size=2, trace=Trace(), worker_limit=2, timeout=10)


CONTRACT_MEMBERS = ["trace", "running", "failures", "current_rank", "where", "post", "block_until", "expect",
                    "check_thread", "pending_ops", "choose"]


# ------------------------------------------------------------------ the protocol
@pytest.mark.parametrize("make", [inline_engine, threaded_engine], ids=["inline", "threaded"])
def test_each_engine_implements_the_contract(make: Callable[[], Any]) -> None:
    engine = make()
    assert isinstance(engine, EngineContract)
    for name in CONTRACT_MEMBERS:
        assert hasattr(engine, name), name
    for name in ("post", "block_until", "expect", "check_thread", "pending_ops", "choose"):
        wanted = list(inspect.signature(getattr(EngineContract, name)).parameters)[1:]
        assert list(inspect.signature(getattr(engine, name)).parameters) == wanted, name
    assert isinstance(type(engine).current_rank, property) and isinstance(type(engine).where, property)


def test_the_contract_check_can_fail() -> None:
    class HalfEngine:
        trace, running, failures, current_rank, where = Trace(), False, [], None, ""

        def post(self, call: Call) -> None: ...

    assert not isinstance(HalfEngine(), EngineContract)


def test_futures_are_waitables_with_a_public_on_done() -> None:
    engine = inline_engine()
    future = SimFuture(engine, 0, "a future")
    flag = DoneFlag(future)
    for waitable in (future, flag):
        assert isinstance(waitable, Waitable)
        assert not hasattr(waitable, "_on_done")
    assert future.engine is engine and future.rank == 0
    seen: list[str] = []
    flag.on_done(lambda: seen.append("flag"))
    flag.set()
    flag.on_done(lambda: seen.append("at once"))
    assert seen == ["flag", "at once"]


def test_both_runtimes_are_runtimes_and_groups_expose_theirs() -> None:
    cluster = SimCluster(2)
    assert isinstance(cluster, Runtime)
    assert cluster.process_group(1).runtime is cluster
    runtime = _Runtime(threaded_engine(), backend_model("gloo"))
    assert isinstance(runtime, Runtime) and isinstance(runtime.engine, EngineContract)


# ------------------------------------------------------------------ shared matching
def _call(rank: int, op: str, signature: tuple[Any, ...], compute: Callable[..., dict[int, Any]] | None = None) -> Call:
    def default(calls: dict[int, Call]) -> dict[int, Any]:
        return {r: None for r in calls}

    return Call(rank=rank, channel="WORLD", ranks=(0, 1), op=op, signature=signature, compute=compute or default,
                deliver=lambda value: None, dtype="float32", shape=(2,), nbytes=8)


def _post_line(engine: Any, call: Call) -> None:
    engine.post(call)  # the user line a mismatch points at


def _rank_code(engine: Any, call: Call) -> None:
    _post_line(engine, call)  # the rank's code, which called the line that posted


def run_inline(calls: dict[int, Call], posting_lines: bool = False) -> CollectiveMismatchError:
    """Rank 0 posts, then rank 1 (the in-order schedule runs tasks in spawn order)."""
    engine = inline_engine(posting_lines)
    for rank in (0, 1):
        engine.spawn(rank, lambda rank=rank: _rank_code(engine, calls[rank]), f"rank {rank}'s code")
    with pytest.raises(CollectiveMismatchError) as info:
        engine.run()
    return info.value


def run_threaded(calls: dict[int, Call]) -> CollectiveMismatchError:
    """Rank 1 posts only after rank 0 has, so the same rank opens the collective as inline."""
    engine = threaded_engine()
    posted = threading.Event()

    def rank_fn(rank: int) -> Callable[[], None]:
        def run() -> None:
            if rank == 1:
                assert posted.wait(10)
            try:
                _rank_code(engine, calls[rank])
            finally:
                posted.set()

        return run

    with pytest.raises(CollectiveMismatchError) as info:
        engine.run([rank_fn(0), rank_fn(1)])
    return info.value


def without_replay(error: BaseException) -> str:
    return str(error).split("\n  replay: ")[0]


def test_a_mismatch_reads_the_same_on_both_engines() -> None:
    """With posting lines recorded (always on the threaded engine; on the baton engine when a
    run asks, as check's re-run of a reported failure and explain do), both calls' lines."""
    calls = {0: _call(0, "all_reduce", ("all_reduce", "float32", "SUM")),
             1: _call(1, "all_reduce", ("all_reduce", "float32", "MAX"))}
    inline = run_inline(calls, posting_lines=True)
    calls = {r: _call(r, c.op, c.signature) for r, c in calls.items()}
    threaded = run_threaded(calls)
    line = inspect.getsourcelines(_post_line)[1] + 1
    caller = inspect.getsourcelines(_rank_code)[1] + 1
    expected = (
        "mismatched collectives on WORLD (call #0 of that group): ranks issued different collectives at the same "
        "position of the group's sequence\n"
        "  rank 0: all_reduce(float32, SUM)\n"
        f"    rank 0 posted it at tests/test_engine_contract.py:{line} in _post_line: engine.post(call)"
        f"  # the user line a mismatch points at (called from tests/test_engine_contract.py:{caller} in _rank_code: "
        "_post_line(engine, call)  # the rank's code, which called the line that posted)\n"
        f"  rank 1: all_reduce(float32, MAX) at tests/test_engine_contract.py:{line} in _post_line: engine.post(call)"
        "  # the user line a mismatch points at\n"
        "On a real cluster this hangs, aborts a process (gloo: SIGABRT when sizes differ) or silently mixes up data."
    )
    assert without_replay(inline) == expected
    assert without_replay(threaded) == expected
    assert "\n  replay: schedule=[]" in str(inline)  # only the baton engine can replay


def test_a_compute_failure_reads_the_same_on_both_engines() -> None:
    def compute(calls: dict[int, Call]) -> dict[int, Any]:
        raise ValueError("rank 0 sends 2 elements to rank 1, which expects 1")

    def make() -> dict[int, Call]:
        return {r: _call(r, "all_to_all_single", ("all_to_all_single", "float32"), compute) for r in (0, 1)}

    expected = ("all_to_all_single #0 on WORLD: ranks' calls do not fit together: rank 0 sends 2 elements to "
                "rank 1, which expects 1\n  ranks [0, 1]: all_to_all_single(float32)")
    assert without_replay(run_inline(make())) == expected
    assert without_replay(run_threaded(make())) == expected


@pytest.mark.parametrize("make", [inline_engine, threaded_engine], ids=["inline", "threaded"])
def test_both_engines_number_and_trace_calls_alike(make: Callable[[], Any]) -> None:
    """Two all_reduces per rank: sequence numbers per channel, issue numbers per rank,
    one Completed per collective numbered in completion order."""
    engine = make()

    def rank_code(rank: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(2):
                engine.post(_call(rank, "all_reduce", ("all_reduce", "float32", "SUM")))

        return run

    if isinstance(engine, Engine):
        for rank in (0, 1):
            engine.spawn(rank, rank_code(rank), f"rank {rank}'s code")
        engine.run()
    else:
        engine.run([rank_code(0), rank_code(1)])
    posted = sorted((e.rank, e.seq, e.issue) for e in engine.trace.of(Posted))
    assert posted == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    completed = [(e.seq, e.order) for e in engine.trace.of(Completed)]
    assert completed == [(0, 0), (1, 1)]
    assert engine.failures == []


def test_run_aborted_is_not_an_exception_a_hook_swallows() -> None:
    assert not issubclass(RunAborted, Exception)


def test_a_sim_cluster_mismatch_names_both_calls() -> None:
    """The inline engine through the public API: the message names both calls and the user line."""
    def rank_fn(rank: int) -> None:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM)

    with pytest.raises(CollectiveMismatchError) as info:
        SimCluster(2, schedule="in_order").run(rank_fn)
    message = str(info.value)
    assert message.startswith("mismatched collectives on WORLD (call #0 of that group): ranks issued different "
                              "collectives at the same position of the group's sequence\n"
                              "  rank 0: all_reduce(float32, (2,), SUM)\n  rank 1: all_reduce(float32, (2,), MAX) "
                              "at tests/test_engine_contract.py:")
    assert "in rank_fn: dist.all_reduce(" in message


def test_a_deadlock_report_does_not_count_the_engines_own_threads_as_started_by_rank_code() -> None:
    """Rank 0 blocks, so the engine starts a pool thread to drive rank 1: that thread is the
    engine's, not one the rank's code started, and the report must not call it foreign."""
    def rank_fn(rank: int) -> None:
        if rank == 0:
            dist.all_reduce(torch.ones(2))

    with pytest.raises(DeadlockError) as info:
        SimCluster(2).run(rank_fn)
    assert "rank 0: blocked in the synchronous all_reduce#0 on WORLD (async_op=False" in str(info.value)
    assert "started a thread" not in str(info.value)


def test_no_module_reaches_into_the_engine_or_runtime_of_another_object() -> None:
    """Issue 9: ``future._engine.expect``, ``state._runtime``, ``engine._local`` were private
    members used from outside their class; each now has a public name. Only ``self.`` may
    touch these private attributes."""
    import re
    from pathlib import Path

    import simcluster

    pattern = re.compile(r"\b(?!self\b)[A-Za-z_]\w*\._(engine|runtime|local|on_done)\b")
    found = []
    for path in Path(simcluster.__file__).parent.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.name}:{number}: {line.strip()}")
    assert found == []


class _Gate:
    """A waitable the test opens by hand (stands for an earlier collective's "callbacks ran")."""

    label = "gate"

    def __init__(self) -> None:
        self._done = False
        self._resumers: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._done

    def on_done(self, resume: Callable[[], None]) -> None:
        with self._lock:
            if not self._done:
                self._resumers.append(resume)
                return
        resume()

    def open(self) -> None:
        with self._lock:
            self._done = True
            resumers, self._resumers = self._resumers, []
        for resume in resumers:
            resume()


def test_the_free_running_engine_holds_a_call_until_its_after_is_done() -> None:
    """The real-reducer mode (e2e's simulated side) runs on the threaded engine, which
    completes a collective when its last rank posts. A call's ``after`` (gloo's barrier:
    the group's earlier work on that rank) must hold it until done, as on the baton
    engine; the barrier completed at once before."""
    engine = threaded_engine()
    gates = {0: _Gate(), 1: _Gate()}
    events: list[str] = []
    both_posted = threading.Barrier(2)

    def rank_code(rank: int) -> Callable[[], None]:
        def run() -> None:
            call = _call(rank, "barrier", ("barrier",))
            call.deliver = lambda value: events.append(f"delivered {rank}")
            call.after = (gates[rank],)
            engine.post(call)
            both_posted.wait(10)
            if rank == 0:
                time.sleep(0.2)  # a completion at the last post would have been delivered by now
                events.append("gates open")
                gates[1].open()
                gates[0].open()

        return run

    engine.run([rank_code(0), rank_code(1)])
    deadline = time.monotonic() + 5
    while len(events) < 3 and time.monotonic() < deadline:  # deliveries run on the engine's workers
        time.sleep(0.01)
    assert events[0] == "gates open" and sorted(events[1:]) == ["delivered 0", "delivered 1"]
    assert engine.failures == []
