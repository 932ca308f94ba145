"""The engine: N ranks' code on a baton, collectives matched and completed on command.

The engine knows nothing of torch. It sees *tasks* (a rank's code to run), *calls*
(a rank posting its part of a collective) and *waits* (code that cannot go on until
something completes). Its rules:

1. **One thread runs at a time.** Tasks run inline on whichever thread holds the
   baton. Code that waits on something pending parks its OS thread and hands the
   driving role to a pooled thread; when the awaited thing completes, the parked
   thread is resumed *in turn*, never concurrently. So thread timing never reaches a
   result.
2. **Nothing completes unless stepped.** Runnable tasks run first, in FIFO order.
   Only when nothing can run does the engine complete one *ready* collective — one
   that every participant has posted (and, where the backend has a limited number of
   worker threads per group, one that has a worker on every rank). Which one is the
   scheduler's choice (:mod:`simcluster.engine.scheduler`), recorded for replay.
3. **Completing a collective** computes every rank's result at once (ranks get the
   bits the backend would give them) and then, for each participant, runs a
   completion task in the backend's context (e.g. on a gloo worker of that group),
   which sets that rank's future and so runs its callbacks.
4. **No hang.** When nothing can run, nothing is ready and work is still pending,
   that is a deadlock: the engine unwinds every parked thread and raises
   :class:`~simcluster.errors.DeadlockError` listing each rank's blocked wait and
   every unmatched call. Code blocked *outside* the engine (a lock, a plain C++
   future, a spin) cannot be interrupted from inside the process: while the calling
   thread is parked a watchdog reports it as :class:`~simcluster.errors.StuckError`;
   :mod:`simcluster.checking.supervisor` ends it from outside (a checked example runs in a
   child process that is killed at its deadline).
5. **Only the engine's threads are ranks.** A collective, a wait or a future
   completion from any other thread (one a hook started) raises
   :class:`~simcluster.errors.ForeignThreadError` in that thread at once, before it
   touches the engine, so the run never depends on that thread's timing.
6. **Stop means stop.** ``KeyboardInterrupt`` and pytest's outcome exceptions
   (``pytest.fail``/``skip``/``exit``, pytest-timeout's signal-method ``Failed``) raised
   in rank code abort the whole run and propagate from :meth:`Engine.run` as
   themselves; every parked thread is unwound first. ``SystemExit`` is not one of
   them: a hook calling ``sys.exit`` is that hook's failure, recorded like any other.

How features interact: a mismatched collective is fatal at once (the run is
unwound and the mismatch raised); an exception escaping a rank's task is recorded,
the other ranks go on until nothing can move, and the task's exception wins over a
deadlock it caused (the deadlock is attached as a note).

Where the parts live: this module schedules, drives and aborts; matching posted calls
and the mismatch messages are :mod:`simcluster.engine.matching` (shared with the
free-running engine, behind :class:`~simcluster.engine.contract.EngineContract`); the
parked and woken OS threads are :mod:`simcluster.engine.slots`; which threads are ranks
(rule 5) and which exceptions mean stop (rule 6) is :mod:`simcluster.engine.guard`; the
deadlock report (rule 4) is :mod:`simcluster.engine.blockage`.
"""

from __future__ import annotations

import sys
import gc
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Any, NoReturn

from simcluster.errors import DeadlockError, SimClusterError, SimulatorBug, StuckError, UsageError
from simcluster.engine.blockage import Parked, describe_blockage
from simcluster.engine.contract import Call, RunAborted, Waitable, when_all_done
from simcluster.engine.frames import is_internal, posting_site, run_boundary, stack_user_frames
from simcluster.engine.guard import ThreadGuard, is_stop_request
from simcluster.engine.matching import Instance, Matcher, compute_failure, written_in_flight
from simcluster.engine.write_watch import WriteWatch
from simcluster.engine.scheduler import Scheduler
from simcluster.engine.slots import Slot, SlotPool
from simcluster.engine.trace import Blocked, Polled, Resumed, Trace

__all__ = ["Engine", "is_stop_request", "mark_forked"]  # is_stop_request lives in simcluster.engine.guard


_NO_ARG = object()


@dataclass(slots=True)
class _Task:
    """Rank code to run: ``fn()``, or ``fn(arg)`` for a completion (no closure per rank);
    a completion on a backend worker frees ``worker`` of ``pool`` when it ends."""

    rank: int
    fn: Callable[..., None]
    label: str
    where: str
    arg: object = _NO_ARG
    pool: "_Workers | None" = None
    worker: int = -1
    call: Call | None = None
    """For a completion: the call it completes (what its callbacks' posts were posted in)."""


_forked_exit: Callable[[int], Any] | None = None
"""Set in a process the code under test forked from a supervised child (:func:`mark_forked`):
the real ``os._exit``, with which that process ends once its code is back in the engine."""


def mark_forked(real_exit: Callable[[int], Any]) -> None:
    """This process is a fork the code under test made (``os.fork``, a ``multiprocessing``
    fork) of a process running a simulation: it runs the user's code on, as a fork of a real
    rank would, but once that code returns to the engine — or blocks on the simulation, whose
    other ranks and threads the fork does not have — it ends (code 0; 1 if the code raised),
    never running simcluster's own search on beside the process it was forked from (a hook's
    forked child used to carry the search on, and refresh the deadline its parent watches,
    for ever: an audit of hostile hooks, 2026-12-07)."""
    global _forked_exit
    _forked_exit = real_exit


def _leave_fork(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to keep
            pass
    assert _forked_exit is not None
    _forked_exit(code)
    raise AssertionError("os._exit returned")  # pragma: no cover


POLL_ROUNDS = 1000
"""How many rounds of polls (:meth:`Engine.let_others_run`) in a row, with nothing posted or
completed between them, before the run is a deadlock: a loop that polls a collective no
rank can complete would spin forever (the supervisor's deadline would stop it, without the
story). A hook that polls a bounded number of times and then goes another way gets that many
rounds, up to this."""


POLL_PATIENCE = 8
"""How many polls in a row of one pending work or future may each answer at once — a scheduler
choice each (:meth:`Engine.let_others_run`): 0, pending, as a poll on real gloo mostly answers
(the all-zero schedule does this), 1, after the others ran. The next poll lets the others run
first, with no choice, so a loop that waits by polling ends. A hook that polls a few times and
then gives up (a straggler timeout) takes its give-up path in order, and its other path under
other schedules (round 24 of hooks from the wild: three polls, then the local gradient —
every later poll let the others run, so the give-up path was never taken; on real gloo it was,
in most steps)."""


class _PollTurn:
    """What a polling rank parks on (:meth:`Engine.let_others_run`): done when the engine
    next lets the pollers look again; named after what it polls."""

    __slots__ = ("_pollers", "label")

    def __init__(self, pollers: list[Callable[[], None]], polled: Waitable) -> None:
        self._pollers = pollers
        self.label = f"polling {polled.label}"

    def done(self) -> bool:
        return False

    def on_done(self, resume: Callable[[], None]) -> None:
        self._pollers.append(resume)


@dataclass(slots=True)
class _Resume:
    slot: Slot
    rank: int
    where: str
    label: str


@dataclass(slots=True)
class _Workers:
    """A backend's worker threads of one group on one rank (gloo: 2), and their queue.
    Made for each rank and group in every run: built positionally (a class called with
    keywords costs a dict)."""

    size: int
    busy: list[bool]
    free: int  # how many of ``busy`` are False
    queue: deque[tuple[Instance, Call]] = field(default_factory=deque)


class Engine:
    """Runs one simulated run: tasks on a baton, calls matched, completions scheduled.

    ``switch(old_rank, new_rank)`` is called whenever the code about to run belongs to
    another rank than the code that ran last (``None`` = outside the run): the caller
    swaps per-rank state (torch's world, RNG) there.
    """

    # Slotted: a run makes one engine and sets ~40 attributes on it; a dict instance grows
    # its dict past the shared-keys size on each construction (~1 µs: docs/speed.md).
    __slots__ = (
        "scheduler", "trace", "choices", "_replay", "_switch", "_workers_per_channel", "_worker_name",
        "_worker_names", "_stuck_timeout", "_runnable", "_matcher", "_ready", "_deliveries", "_later", "_soon", "_finished_seq",
        "_fifo", "_per_rank_delivery", "_workers", "_parked", "_expected", "_expected_count", "_current",
        "_rank", "_where", "_steps", "_fatal", "_aborting", "_done", "failures", "deadlock", "running",
        "_stop", "_dead", "_guard", "_owned", "_pool", "started_threads", "foreign_calls", "posting_lines", "doing",
        "_task", "_pollers", "_poll_mark", "_poll_rounds", "_polled_once", "_watch",
    )

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        trace: Trace,
        switch: Callable[[int | None, int | None], None],
        workers_per_channel: int | None,
        fifo_per_channel: bool = False,
        per_rank_delivery: bool = False,
        worker_name: Callable[[str, int], str] = lambda channel, i: f"worker {channel}#{i}",
        stuck_timeout: float = 60.0,
        replay: Callable[[list[int]], str] = lambda choices: f"schedule={choices!r}",
        posting_lines: bool = False,
        watch_reads: "Callable[[WriteWatch], Callable[[], None]] | None" = None,
    ) -> None:
        self.scheduler = scheduler
        self.posting_lines = posting_lines
        """Whether :meth:`post` records the user line that posted each call (``Call.posted_at``,
        named by the deadlock report): a walk of the stack per call, so off unless a run is
        re-run to be reported (:func:`simcluster.checking.judge.with_posting_lines`)."""
        self._watch = WriteWatch(lambda: self._rank, self._posted_in, trace.log, watch_reads) if posting_lines else None
        """Names the user line that wrote to a tensor in flight (:mod:`simcluster.engine.write_watch`),
        and with ``watch_reads`` (the layer above's per-thread read detection) the first that read one:
        only in a run that records posting lines — a line tracer, never on the search's path."""
        self.doing: dict[int, str] = {}
        """What each rank's code is doing, in words, as the layer above says — SimDDP: ``in
        DDP iteration 1, bucket 0's hook call`` — for the posting lines (``Call.posted_in``)."""
        self._task: _Task | None = None  # the task whose code runs now (kept across a wait)
        self._pollers: list[Callable[[], None]] = []  # ranks polling a pending work or future (let_others_run)
        self._poll_mark: tuple[int, int] | None = None  # (completions, posts) when the pollers last looked
        self._poll_rounds = 0  # rounds of polls since either moved
        self._polled_once: dict[Waitable, int] = {}  # pending waitables the code under test polled: how often (let_others_run)
        self.trace = trace
        self.choices: list[tuple[int, int]] = []
        self._replay = replay
        self._switch = switch
        self._workers_per_channel = workers_per_channel
        self._worker_name = worker_name
        self._worker_names: dict[tuple[str, int], str] = {}
        self._stuck_timeout = stuck_timeout
        self._runnable: deque[_Task | _Resume] = deque()
        self._matcher = Matcher(trace)
        self._ready: list[Instance] = []
        self._deliveries: list[_Task] = []
        self._later: list[_Task] = []  # rank code to run when the scheduler picks it (run_later), oldest first
        self._soon: list[_Task] = []  # rank code paused where completions may come first (go_on_later), oldest first
        self._finished_seq: dict[str, int] = {}
        self._fifo = fifo_per_channel
        self._per_rank_delivery = per_rank_delivery
        self._workers: dict[tuple[int, str], _Workers] = {}
        self._parked: dict[int, tuple[Slot, int, str, str]] = {}  # slot index -> (slot, rank, label, where)
        self._expected: dict[int, tuple[int, str, str]] = {}  # -> (rank, label, context)
        self._expected_count = 0
        self._current: Slot | None = None
        self._rank: int | None = None
        self._where = ""
        self._steps = 0
        self._fatal: SimClusterError | None = None
        self._aborting = False
        self._done = False
        self.failures: list[tuple[int, str, BaseException]] = []
        self.deadlock: DeadlockError | None = None
        self.running = False
        self._stop: BaseException | None = None
        self._dead = False
        self._guard = ThreadGuard()
        self._owned = self._guard.owned
        self._pool = SlotPool(self._guard, self._pool_main)
        self.started_threads = self._guard.started  # (rank, description) of threads rank code started
        self.foreign_calls = self._guard.rejected  # what those threads called and was rejected, and where

    # ----------------------------------------------------------------- public
    def replay(self) -> str:
        """The replay line for everything up to now (computed only when an error needs it)."""
        return self._replay([choice for _, choice in self.choices])

    # Read-only, and read at every callback a future runs (hot): C getters, no Python frame.
    current_rank = property(attrgetter("_rank"), doc="The rank whose code is running now (None outside a run).")
    where = property(attrgetter("_where"), doc='Where the running code runs: ``"rank <r>"`` or a backend worker\'s name.')

    def spawn(self, rank: int, fn: Callable[[], None], label: str, where: str | None = None) -> None:
        """Queue ``fn`` to run as rank ``rank``'s code; exceptions escaping it are recorded."""
        self._runnable.append(_Task(rank, fn, label, where or f"rank {rank}"))

    def run_later(self, rank: int, fn: Callable[[], None], label: str) -> None:
        """Run ``fn`` as rank ``rank``'s code when the scheduler picks it, among what else may
        happen next — after every pending delivery and ready collective in its order of
        options, so the in-order schedule (choice 0) runs it only once nothing else can
        happen, and other schedules run it earlier. What a rank does on a thread of its own
        that a real run may interleave either way with the backend's completions (DDP's copy
        of a bucket once its future completed: :class:`~simcluster.ddp.model.SimDDP`).

        A choice only where each rank sees completions at its own moment (``per_rank_delivery``:
        the gloo model, whose worker threads were measured); the NCCL model, whose timing on a
        GPU is not measured here, runs it once nothing else can happen, with no choice — as
        it always copied back, and with the same choices as before."""
        self._later.append(_Task(rank, fn, label, f"rank {rank}"))

    def go_on_later(self, rank: int, fn: Callable[[], None], label: str) -> bool:
        """Pause rank ``rank``'s code here, to go on with ``fn`` when the scheduler picks it, if
        anything else could happen meanwhile: True then (the caller returns at once), False
        when nothing could (the caller goes on itself; no choice is made).

        What a rank's own thread does while the backend's completions run alongside it: DDP's
        autograd thread launches the next bucket's hook while a gloo worker completes an
        earlier bucket's collective and runs its callbacks (:class:`~simcluster.ddp.model.SimDDP`).
        The paused code is the *first* option of the next pick, so the in-order schedule
        (choice 0) goes on at once, as if the rank had not paused; other schedules let
        deliveries and completions — their callbacks included — come first. Only where each
        rank sees completions at its own moment (``per_rank_delivery``: the gloo model); the
        NCCL model's timing on a GPU is not measured here, and it goes on with no choice."""
        if not self._per_rank_delivery or not (self._deliveries or self._ready or self._later):
            return False
        self._soon.append(_Task(rank, fn, label, f"rank {rank}"))
        return True

    def run(self) -> None:
        """Drive until every task finished and every collective completed.

        The calling thread drives first, so a hook that never blocks runs without a
        single thread hand-over. Pool threads appear only when code blocks; while the
        calling thread is parked it watches for code stuck outside the simulator.
        Raises a stop request (rule 6) or the fatal error (mismatch, deadlock, stuck
        code) if there was one; task failures are left in :attr:`failures` for the
        caller to report. However it ends, the caller's torch state is restored and
        every parked simulator thread is unwound and ended.
        """
        self.running = True
        home = self._pool.take_home()
        collecting = gc.isenabled()
        gc.disable()  # see docs/speed.md: a run allocates many short-lived objects; full passes cost ~30 %
        tracer = self._watch.start() if self._watch is not None else None
        try:
            self._guard.start_watching(lambda: self._rank, lambda: self.running)
            try:
                home.command = "drive"
                while True:
                    if home.command == "drive":
                        self._drive(home)
                    if self._done or self._dead:
                        break
                    self._park_watching(home)
            finally:
                self._guard.stop_watching()
        finally:
            self.running = False
            watch, self._watch = self._watch, None  # it holds this engine (a cycle), the calls it watched and a frame
            if self._rank is not None:
                self._switch(self._rank, None)
                self._rank = None
            if watch is not None:  # after the last switch: its settings audit saw the read watch's mode all run long
                watch.stop(tracer)
            if collecting:
                gc.enable()
        self._pool.close()
        if self._stop is not None:
            raise self._stop
        if self._fatal is not None:
            raise self._fatal

    def check_thread(self, what: str) -> None:
        """Reject ``what`` (a collective, a wait, completing a future) unless the calling
        thread is one this engine runs rank code on (rule 5)."""
        if threading.get_ident() not in self._owned:  # an owned thread (every call on the hot path) passes here
            self._guard.check(what)

    def _abandon(self) -> None:
        """The calling thread is leaving a run that did not finish (interrupted, stuck):
        unwind every parked thread, one at a time, end the idle pool threads, and mark
        the engine dead so any code still running gets ``RunAborted`` from it."""
        self._dead = self._aborting = True
        self.running = False
        me = threading.current_thread()
        for index in sorted(self._parked):
            slot = self._parked[index][0]
            if slot.thread is me:
                continue
            slot.abort = True
            slot.wake()
            slot.thread.join(timeout=5.0)
        self._parked.clear()
        self._pool.stop()

    def _park_watching(self, home: "Slot") -> None:
        """Park the calling thread until it is handed the baton. If the code holding the
        baton makes no progress for ``stuck_timeout`` seconds (blocked outside the
        simulator, or spinning), or a signal raises here (Ctrl-C, pytest-timeout), the
        run is abandoned: :attr:`_dead` is set and the caller unwinds."""
        last_steps, quiet = self._steps, 0.0
        try:
            while not home.lock.acquire(timeout=0.5):
                if self._steps != last_steps:
                    last_steps, quiet = self._steps, 0.0
                    continue
                quiet += 0.5
                if quiet >= self._stuck_timeout:
                    self._fail(StuckError(
                        f"rank {self._rank}'s code ({self._where}) has been blocked outside the simulator for "
                        f"{self._stuck_timeout:.0f}s — e.g. waiting on a plain torch Future, a lock or a socket, "
                        "or spinning. simcluster cannot interrupt it in this process; its thread is abandoned "
                        "(check_hook runs examples in a supervised child process, which is killed instead)."
                    ))
                    self._abandon()
                    return
        except BaseException as exc:  # noqa: BLE001 - a signal: Ctrl-C, pytest-timeout's Failed
            if self._stop is None:
                self._stop = exc
            self._abandon()

    def post(self, call: Call) -> None:
        """Post ``call`` for the running rank; completes later, when scheduled."""
        if threading.get_ident() not in self._owned:  # the message is built only for a foreign thread
            self.check_thread(f"{call.op} on {call.channel} (rank {call.rank})")
        if self._aborting or self._fatal is not None or self._stop is not None or self._dead or not self.running:
            self._check_alive()  # raises what fits
        if call.rank != self._rank:
            raise UsageError(
                f"rank {self._rank}'s code called {call.op} on rank {call.rank}'s process group. Simulated ranks "
                "share one Python process, so state built once is shared by every rank; give each rank its own "
                "(pass a factory called once per rank with that rank's process group)."
            )
        if self.posting_lines:
            call.posted_at = posting_site(sys._getframe(1))
            call.posted_in = self._posted_in(call.rank)
            if self._watch is not None and call.in_flight is not None:
                self._watch.add(call)
        inst, mismatch = self._matcher.post(call)
        if mismatch is not None:
            self._fail(mismatch)
            raise RunAborted()
        key = (call.rank, call.channel)
        if call.uses_worker and self._workers_per_channel is not None:
            pool = self._workers.get(key)
            if pool is None:
                size = self._workers_per_channel
                pool = self._workers[key] = _Workers(size, [False] * size, size)
            pool.queue.append((inst, call))
            self._start_queued(pool)
        else:
            self._execute(inst, call)

    def pending_ops(self, channel: str) -> list[str]:
        """The ops of the calls posted on ``channel`` that have not completed yet."""
        return self._matcher.pending_ops(channel)

    def open_calls(self, rank: int) -> list[Call]:
        """The calls ``rank`` posted that have not completed yet, oldest collective first."""
        return self._matcher.open_calls(rank)

    def expect(self, rank: int, waitable: Waitable, context: str) -> None:
        """Record that ``waitable`` must complete before the run may end, without
        blocking anyone — how the harness "waits" on a hook's future, as DDP's reducer
        does, at no thread hand-over. If it never completes, that is a deadlock."""
        if waitable.done():
            return
        key = self._expected_count
        self._expected_count += 1
        self._expected[key] = (rank, waitable.label, context)
        waitable.on_done(partial(self._expected.pop, key, None))  # a C call when it completes, no Python frame

    def _posted_in(self, rank: int) -> str:
        """What ``rank``'s code is doing now (:attr:`Call.posted_in`): a completion's
        callbacks, named by the call they complete and what that call was posted in; else
        what the layer above said (:attr:`doing`)."""
        task = self._task
        origin = task.call if task is not None else None
        if origin is None:
            return self.doing.get(rank, "")
        posted = f" (posted {origin.posted_in})" if origin.posted_in else ""
        return f"in a callback of {origin.op}#{origin.seq} on {origin.channel}{posted}"

    def let_others_run(self, polled: Waitable, at: str = "") -> None:
        """The running rank's code polls ``polled`` — ``Work.is_completed()`` or
        ``Future.done()`` found it pending — as a hook does that checks once whether its
        collective is done, a few times before it gives up, or a loop that waits by polling
        (a Horovod ``poll`` port, an asyncio gather). On a real rank the backend's threads
        complete collectives meanwhile, so a poll's answer is timing: measured on gloo, a
        poll right after posting answers pending 86-100 % of the time, complete otherwise
        (``docs/gloo-facts.md`` §12). Here each of the first :data:`POLL_PATIENCE` polls of
        a work or future is a scheduler choice (the first traced:
        :class:`~simcluster.engine.trace.Polled`): 0, look now — it answers pending, as
        mostly on gloo, and the all-zero schedule does this; 1, let the others run first.
        Past them a poll always lets the others run: the poller parks until nothing else can
        run — every other rank waits, returns or polls, every collective that can complete
        has — and then looks again. Polls that see nothing move for :data:`POLL_ROUNDS`
        rounds end the run as a deadlock. ``at``: the poll's user line, for the trace; later
        polls are not traced (a spinning poller would fill it)."""
        if not self.running or self._current is None or self._current.thread is not threading.current_thread():
            return  # outside the run, or a thread simcluster does not run (its own check reports it)
        looks = self._polled_once.get(polled, 0)
        first = looks == 0
        rank = self._rank
        assert rank is not None
        if looks < POLL_PATIENCE:
            self._polled_once[polled] = looks + 1
            if self._choose(2) == 0:
                if first:
                    self.trace.add(Polled(rank, polled.label, 0, at, False))
                return
        self._park(_PollTurn(self._pollers, polled), "", traced=False)
        if first:  # traced when it looks, with what it sees
            self.trace.add(Polled(rank, polled.label, 1, at, polled.done()))

    def block_until(self, waitable: Waitable, context: str = "") -> None:
        """Park the running code until ``waitable`` is done; other ranks run meanwhile."""
        self._park(waitable, context, traced=True)

    def _park(self, waitable: Waitable, context: str, *, traced: bool) -> None:
        self.check_thread(f"wait() on pending {waitable.label}")
        self._check_alive()
        slot = self._current
        if slot is None or slot.thread is not threading.current_thread():
            raise UsageError(
                f"wait() on pending {waitable.label} from a thread simcluster does not run; "
                "simulated futures can only be waited on by hook code inside a run"
            )
        rank, where, task = self._rank, self._where, self._task
        assert rank is not None
        if traced:
            self.trace.add(Blocked(rank, waitable.label, context or where))
        self._parked[slot.index] = (slot, rank, waitable.label, context or where)
        if self._watch is not None:  # the line that waits is not the one that wrote what changes meanwhile
            self._watch.switched()
        waitable.on_done(lambda: self._runnable.append(_Resume(slot, rank, where, waitable.label)))
        driver = self._pool.take_idle()
        driver.command = "drive"
        self._current = None
        driver.wake()
        if slot is self._pool.home:
            self._park_watching(slot)
        else:
            slot.park()
        self._current = slot
        self._task = task
        self._parked.pop(slot.index, None)
        if slot.abort or self._dead:
            raise RunAborted()
        self._enter(rank, where)
        if self._watch is not None:
            self._watch.switched()
        if traced:
            self.trace.add(Resumed(rank, waitable.label))

    # ------------------------------------------------------------- matching
    def _start_queued(self, pool: _Workers) -> None:
        while pool.free and pool.queue:
            inst, call = pool.queue.popleft()
            call.worker = pool.busy.index(False)  # the lowest free worker
            pool.busy[call.worker] = True
            pool.free -= 1
            self._execute(inst, call)

    def _execute(self, inst: Instance, call: Call) -> None:
        """Start ``call``'s part — once everything in its ``after`` is done (gloo's barrier
        waits on its worker for the group's earlier work; until then the collective is
        not ready, so no schedule can complete it first)."""
        pending = [w for w in call.after if not w.done()] if call.after else None
        if not pending:
            self._mark_executing(inst, call.rank)
            return
        rank = call.rank
        inst.gated.add(rank)

        def opened() -> None:
            inst.gated.discard(rank)
            self._mark_executing(inst, rank)

        when_all_done(pending, opened)

    def _mark_executing(self, inst: Instance, rank: int) -> None:
        inst.executing.add(rank)
        if len(inst.executing) == len(inst.ranks):
            self._ready.append(inst)

    def _eligible(self) -> list[Instance]:
        """Ready collectives that may complete now. With ``fifo_per_channel`` (NCCL: one
        stream per communicator) only the oldest unfinished collective of each group."""
        if not self._fifo:
            return self._ready
        return [inst for inst in self._ready if inst.seq == self._finished_seq.get(inst.channel, 0)]

    def choose(self, options: int) -> int:
        """A pick among ``options`` for the layer above, where real timing decides between
        outcomes (a gloo barrier behind a failed work: re-raise its error or not), recorded
        in the schedule as every pick is (0: what a quiet cluster mostly does)."""
        return self._choose(options)

    def _choose(self, options: int) -> int:
        """The scheduler's pick among ``options`` (index 0: what a quiet cluster mostly
        does), checked and recorded for the replay line."""
        choice = self.scheduler.choose(options)
        if not 0 <= choice < options:
            raise UsageError(f"scheduler {self.scheduler.describe()} chose {choice} of {options} options")
        self.choices.append((options, choice))
        return choice

    def _complete_one(self) -> bool:
        """Make one scheduled step: go on with a paused rank's code, deliver a computed result
        to one rank, or complete (compute) one ready collective. Options: paused rank code
        first (:meth:`go_on_later`), then pending deliveries (oldest first), then eligible
        ready collectives (oldest first), then :meth:`run_later` tasks — so choice 0 always
        continues what is under way and the all-zero schedule is in-order."""
        eligible = self._eligible() if self._fifo else self._ready
        later = self._later if self._per_rank_delivery else ()
        paused = len(self._soon)
        options = paused + len(self._deliveries) + len(eligible) + len(later)
        if options == 0:
            if self._later:  # NCCL model: once nothing else can happen, and no choice (see run_later)
                self._runnable.append(self._later.pop(0))
                return True
            return False
        choice = self._choose(options)
        if choice < paused:  # run at once, as deliveries: _runnable is empty
            self._run_task(self._soon.pop(choice))
            return True
        delivering = paused + len(self._deliveries)
        if choice < delivering:  # run at once: the caller runs nothing else before it (_runnable is empty)
            self._run_task(self._deliveries.pop(choice - paused))
            return True
        if choice >= delivering + len(eligible):
            self._run_task(self._later.pop(choice - delivering - len(eligible)))
            return True
        inst = eligible[choice - delivering]
        self._ready.remove(inst)
        self._finished_seq[inst.channel] = inst.seq + 1
        assert inst.first is not None
        self._matcher.close(inst, inst.first.op, choice, options)
        if self._watch is not None:
            self._watch.drop(inst.calls.values())  # judged now: a later write is no longer this call's
        written = written_in_flight(inst)
        if written is not None:
            self._fail(written)
            return True
        try:
            results = inst.first.compute({rank: inst.calls[rank] for rank in inst.ranks})
        except DeadlockError as exc:  # the layer above knows some ranks' parts never finish (a gloo barrier)
            self._fail(exc)
            return True
        except Exception as exc:  # noqa: BLE001 - ranks' calls cannot be combined: a mismatch
            self._fail(compute_failure(inst, inst.first, exc))
            return True
        tasks = []
        for rank in inst.ranks:
            call = inst.calls[rank]
            label = f"completion of {call.op}"  # per call: a matched send and recv differ
            if call.worker >= 0:
                where = self._worker_names.get((inst.channel, call.worker))
                if where is None:
                    where = self._worker_names[(inst.channel, call.worker)] = self._worker_name(inst.channel, call.worker)
                tasks.append(_Task(rank, call.deliver, label, where, results[rank],
                                   self._workers[(rank, inst.channel)], call.worker, call))
            else:
                tasks.append(_Task(rank, call.deliver, label, f"rank {rank}", results[rank], None, -1, call))
        if self._per_rank_delivery and len(tasks) > 1:
            self._deliveries.extend(tasks)  # each rank sees the completion when the scheduler says
        else:
            self._runnable.extend(tasks)
        return True

    # -------------------------------------------------------------- driving
    def _pool_main(self, slot: Slot) -> None:
        if self._watch is not None:  # the thread ends with the run: no tracer to put back
            self._watch.start()
        while True:
            slot.park()
            if slot.command == "stop" or self._dead:
                return
            self._drive(slot)
            if self._dead:
                return

    def _drive(self, slot: Slot) -> None:
        self._current = slot
        while True:
            if self._dead:
                return
            self._steps += 1
            if (self._fatal is not None or self._stop is not None) and not self._aborting:
                self._begin_abort()
            if self._runnable:
                item = self._runnable.popleft()
                if isinstance(item, _Task):
                    self._run_task(item)
                    continue
                # Hand the baton to the parked thread; this one returns to the pool.
                self._pool.give_back(slot)
                self._current = None
                item.slot.wake()
                return
            try:
                if not self._aborting and self._complete_one():
                    continue
                if self._pollers and not self._aborting and self._poll_again():
                    continue
                if not self._aborting and (self._parked or self._matcher.open or self._expected or self._deliveries):
                    self._on_deadlock()
                    continue
            except Exception as exc:  # noqa: BLE001 - the engine's own step broke: ours, never the hook's
                # On a pool thread it would end the thread and leave the run waiting for its
                # deadline, charged to the hook as a hang: the run aborts and raises it instead.
                if self._stop is None:
                    if isinstance(exc, SimClusterError):
                        self._stop = exc
                    elif _raised_through_user_code(exc):
                        # code under test that ran inside the engine's step raised: its failure
                        exc.add_note(f"simcluster: raised by the code under test while simcluster's engine "
                                     f"ran (last ran: rank {self._rank}'s code): code it left to run later "
                                     f"(a trace or profile function, a __del__, a gc callback) or gave the "
                                     f"engine (a schedule)")
                        self._stop = exc
                    else:
                        self._stop = SimulatorBug(f"simcluster's engine broke completing a step: {exc!r}")
                        self._stop.__cause__ = exc
                continue
            self._done = True
            self._current = None
            if slot.index >= 0:  # a pool thread finished: hand the baton home
                self._pool.give_back(slot)
                home = self._pool.home
                assert home is not None
                home.command = "finished"
                home.wake()
            return

    @run_boundary  # a frame outside it is the code that started the run, not a rank's
    def _run_task(self, task: _Task) -> None:
        self._task = task
        self._enter(task.rank, task.where)
        try:
            if task.arg is _NO_ARG:
                task.fn()
            else:
                task.fn(task.arg)
        except RunAborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - recorded and re-raised to the caller by the cluster
            if _forked_exit is not None:
                _leave_fork(1)
            if is_stop_request(exc):
                if self._stop is None:
                    exc.add_note(f"simcluster: raised on rank {task.rank} ({task.label}, {task.where})")
                    self._stop = exc
            else:
                self.failures.append((task.rank, task.label, _printable(exc)))
        finally:
            if _forked_exit is not None:  # the code under test forked, and this is the fork: it ends here
                _leave_fork(0)
            self._task = None  # not kept past its task: it holds its call, whose future holds this engine (a cycle)
            pool = task.pool
            if pool is not None and not self._aborting:  # the worker is free: it takes the next queued call
                pool.busy[task.worker] = False
                pool.free += 1
                if pool.queue:
                    self._start_queued(pool)

    def _enter(self, rank: int, where: str) -> None:
        if rank != self._rank:
            self._switch(self._rank, rank)
            self._rank = rank
        self._where = where

    # ---------------------------------------------------------------- failure
    def _check_alive(self) -> None:
        if _forked_exit is not None:  # a fork of a rank, about to wait on what only its parent runs
            _leave_fork(0)
        if self._aborting or self._fatal is not None or self._stop is not None or self._dead:
            raise RunAborted()
        if not self.running:
            raise UsageError("simulated collectives and waits only work inside a SimCluster run")

    def abort(self, error: SimClusterError) -> NoReturn:
        """End the run with ``error`` as its outcome (see the contract): raised into the running code as
        :class:`RunAborted`; the run then unwinds and raises ``error``, with its replay line."""
        self._fail(error)
        raise RunAborted()

    def _fail(self, error: SimClusterError) -> None:
        if self._fatal is None:
            self._fatal = error.with_replay(self.replay())

    def _poll_again(self) -> bool:
        """Nothing else can run: the ranks polling a pending work or future look again
        (:meth:`let_others_run`), in the order they began to poll — unless nothing was
        posted or completed for :data:`POLL_ROUNDS` rounds of polls, when nothing they
        poll can ever complete (False: the caller reports the deadlock, the pollers
        listed as parked)."""
        mark = (self._matcher.completions, self._matcher.posted())
        if mark != self._poll_mark:
            self._poll_mark, self._poll_rounds = mark, 0
        self._poll_rounds += 1
        if self._poll_rounds > POLL_ROUNDS:
            return False
        pollers, self._pollers = self._pollers, []
        for resume in pollers:
            resume()
        return True

    def _begin_abort(self) -> None:
        """Drop queued tasks and resume every parked thread with ``abort`` set, so each
        unwinds (``RunAborted`` out of its wait) one at a time, in slot order."""
        self._aborting = True
        self._pollers.clear()  # a poller is parked: resumed below like every parked thread
        self._runnable = deque(item for item in self._runnable if isinstance(item, _Resume))
        pending = {item.slot.index for item in self._runnable if isinstance(item, _Resume)}
        for index in sorted(self._parked):
            slot = self._parked[index][0]
            slot.abort = True
            if index not in pending:
                self._runnable.append(_Resume(slot, -1, "", "abort"))

    def _on_deadlock(self) -> None:
        error = DeadlockError(self.describe_blockage()).with_replay(self.replay())
        current = sys._current_frames()
        first = min(self._parked.values(), key=lambda p: (p[1], p[2]), default=None)
        error.simcluster_frames = (  # type: ignore[attr-defined]
            stack_user_frames(current.get(first[0].thread.ident or -1)) if first is not None else [])
        if self.failures:
            self.deadlock = error  # the task failure is the root cause; keep this as context
            self._begin_abort()
        else:
            self._fail(error)

    def describe_blockage(self) -> str:
        """What every rank is stuck on: parked waits (with the user's line), unmatched
        calls (for point-to-point: the missing send or recv and its peer), starved workers
        (see :func:`simcluster.engine.blockage.describe_blockage`)."""
        parked = [Parked(slot.thread.ident, rank, label, where) for slot, rank, label, where in self._parked.values()]
        return describe_blockage(parked, self._expected.values(), self._matcher.open.values(),
                                 self._workers_per_channel, self.started_threads, self._matcher.crossed)


def _printable(exc: BaseException) -> BaseException:
    """``exc``, or — when its ``str()`` raises — a stand-in of the same name whose message says
    so (its cause: ``exc``, its traceback: ``exc``'s). Every report, note and comparison reads
    an error's text; an exception whose ``__str__`` raised was reported as that inner error,
    ``ValueError: str fails at hooks.py:66 in __str__``, and not as the one the hook raised
    (an audit of hostile hooks)."""
    try:
        str(exc)
        return exc
    except Exception as inner:  # noqa: BLE001 - whatever its __str__ raises
        kind = type(exc)
        base = Exception if isinstance(exc, Exception) else BaseException
        stand_in_class = type(kind.__name__, (base,), {"__module__": kind.__module__, "__qualname__": kind.__qualname__})
        stand_in = stand_in_class(f"<its str() raised {type(inner).__name__}: {inner}>")
        stand_in.__cause__ = exc
        return stand_in.with_traceback(exc.__traceback__)


def _raised_through_user_code(exc: BaseException) -> bool:
    """Whether a frame of code under test (not simcluster's, torch's or Python's own) is in
    ``exc``'s traceback: an exception from the engine's own step that went through user code."""
    tb = exc.__traceback__
    while tb is not None:
        if not is_internal(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False
