"""The free-running engine: one OS thread per rank, collectives completed when the last rank posts.

The deterministic engine (:mod:`simcluster.engine.inline`) runs every rank's code on one
baton and completes collectives when its scheduler says. That only works while every
wait goes through :meth:`SimFuture.wait`. DDP's C++ reducer waits on the hook's future
*inside C++* (``reducer.cpp``), which no Python override can see; on the baton the
reducer would block the only running thread for good. This engine trades the
controlled schedule for the ability to run such code, as torch's threaded test
process group does:

* every rank's code runs on its **own OS thread**, concurrently (the GIL and
  ``torch``'s own released-GIL sections interleave them as the OS pleases);
* a collective is **computed in the thread of the last rank to post it** — the data
  exchange is done once, with every rank's inputs, and gives the bits the backend model
  gives (:mod:`simcluster.fake.collectives`, same code as the deterministic engine);
* each rank's result is then **delivered on that rank's backend worker threads** (gloo:
  up to 2 per group per rank, FIFO — :mod:`simcluster.fake.backends`), where
  ``set_result`` completes the C++ future (so C++ waiters wake) and runs the ``then``
  callbacks. Not in the last poster's thread: a callback belongs to its own rank (it
  may call ``dist.*`` and must see that rank's world) and may block on a further
  collective (PowerSGD does), which would stall the poster's own rank.

What is kept from the deterministic engine: the interface the process group and the
futures use (:class:`~simcluster.engine.contract.EngineContract`: :meth:`post`,
:meth:`block_until`, :meth:`expect`, :meth:`check_thread`, :meth:`pending_ops`,
:attr:`current_rank`, :attr:`where`, :attr:`running`, :attr:`trace`), call matching
across ranks with the same sequence numbers, trace events and mismatch and
compute-failure messages (one :class:`~simcluster.engine.matching.Matcher`, used under
this engine's lock), the gloo reduction bits. What is lost: the order in which ranks
interleave, and so the trace's event order, depends on thread timing; there is no
scheduler and no replay. Results that do not depend on that order (the values every
rank gets from a collective) are still exact and repeatable.

Never hangs: :meth:`run` watches the threads. A Python-visible wait (``fut.wait()``,
``work.wait()``) is known to the engine; when every live thread sits in one, or a
collective still misses a rank whose thread has ended and whose workers hold no work,
that is a :class:`~simcluster.errors.DeadlockError`. Both are decided from events, not
from time: a waiter is marked running by the code that completes its future (under the
engine's lock), and a worker is marked running before it takes a task off its queue, so
a slow-starting or descheduled thread can never be mistaken for a deadlocked one. Waits inside C++ cannot be seen: after
``timeout`` seconds without progress the run is aborted and a
:class:`~simcluster.errors.StuckError` names what each rank thread was doing. Aborting
fails every pending collective's futures with an error, which wakes C++ waiters on
them; only a thread blocked on something else entirely (a plain torch Future nobody
completes) is abandoned, and the error says so.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from simcluster.engine.contract import Call, RunAborted, Waitable, when_all_done
from simcluster.engine.frames import posting_site
from simcluster.engine.matching import Instance, Matcher, compute_failure, unmatched_lines
from simcluster.errors import DeadlockError, SimClusterError, StuckError, UsageError
from simcluster.engine.trace import Blocked, Resumed, Trace, waits_in

__all__ = ["ThreadedEngine"]

_POLL = 0.01  # seconds between watchdog looks and between abort checks in waits
_GRACE = 2.0  # seconds an aborted run waits for threads to unwind before abandoning them


class _Workers:
    """One rank's backend worker threads for one group: FIFO queue, at most ``limit`` threads
    (None: a new thread whenever all are busy)."""

    def __init__(self, engine: "ThreadedEngine", rank: int, channel: str, limit: int | None) -> None:
        self.engine, self.rank, self.channel, self.limit = engine, rank, channel, limit
        self.queue: deque[Callable[[], None]] = deque()
        self.threads: list[threading.Thread] = []
        self.idle = 0
        self.stop = False
        self.cond = threading.Condition()

    def submit(self, task: Callable[[], None]) -> None:
        with self.cond:
            self.queue.append(task)
            if self.idle == 0 and (self.limit is None or len(self.threads) < self.limit):
                index = len(self.threads)
                name = self.engine.worker_name(self.channel, index)
                thread = threading.Thread(target=self._main, args=(name,), name=f"simcluster r{self.rank} {name}",
                                          daemon=True)
                self.threads.append(thread)
                thread.start()
            else:
                self.cond.notify()

    def busy(self) -> bool:
        with self.cond:
            return bool(self.queue) or self.idle < len(self.threads)

    def _main(self, name: str) -> None:
        engine = self.engine
        engine.bind_thread(self.rank, name)
        key = (self.rank, name)  # what set_status() would read back from the thread binding, per call
        while True:
            with self.cond:
                self.idle += 1
                while not self.queue and not self.stop:
                    self.cond.wait()
                self.idle -= 1
                if not self.queue:
                    return
                task = self.queue.popleft()
                # marked running before the queue is seen empty: never "idle" with work in hand
                engine._set_status(key, "running a completion")
            try:
                task()
            except RunAborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported by run()
                engine.record_failure(self.rank, f"completion on {name}", exc)
            engine._set_status(key, "idle")


class ThreadedEngine:
    """Runs one free-running simulated run (see the module docstring).

    ``worker_limit``: backend worker threads per group per rank (gloo: 2; None: no
    limit). ``timeout``: seconds without any progress before the run is declared stuck.
    """

    def __init__(
        self,
        *,
        world_size: int,
        trace: Trace,
        worker_limit: int | None,
        worker_name: Callable[[str, int], str] = lambda channel, i: f"worker {channel}#{i}",
        timeout: float = 60.0,
    ) -> None:
        self.world_size = world_size
        self.trace = trace
        self.worker_name = worker_name
        self.running = False
        self.failures: list[tuple[int, str, BaseException]] = []
        self._worker_limit = worker_limit
        self._timeout = timeout
        self._lock = threading.Lock()
        self._local = threading.local()
        self._matcher = Matcher(trace)
        self._workers: dict[tuple[int, str], _Workers] = {}
        self._status: dict[tuple[int, str], str] = {}  # (rank, where) -> what that thread does
        self._finished: set[int] = set()
        self._steps = 0
        self._fatal: SimClusterError | None = None
        self._aborting = False
        self._abort_hooks: list[Callable[[], None]] = []

    # ----------------------------------------------------------------- public
    @property
    def current_rank(self) -> int | None:
        """The rank whose code runs on the calling thread (None on other threads)."""
        return getattr(self._local, "rank", None)

    @property
    def where(self) -> str:
        """``"rank <r>"`` on a rank's thread, the worker's name on a backend worker."""
        return getattr(self._local, "where", "")

    def bind_thread(self, rank: int, where: str) -> None:
        """The calling thread runs rank ``rank``'s code from now on, as ``where``
        (``"rank <r>"``, or a backend worker's name): sets :attr:`current_rank` and :attr:`where`."""
        self._local.rank, self._local.where = rank, where

    def check_thread(self, what: str) -> None:
        """Accept ``what`` from any thread: here every rank runs on threads of its own and
        no result depends on one baton, so a thread a hook starts is not policed (the
        baton engine rejects it; see :mod:`simcluster.engine.guard`)."""

    def pending_ops(self, channel: str) -> list[str]:
        """The ops of the calls posted on ``channel`` that have not completed yet."""
        with self._lock:
            return self._matcher.pending_ops(channel)

    def open_calls(self, rank: int) -> list[Call]:
        """The calls ``rank`` posted that have not completed yet, oldest collective first."""
        with self._lock:
            return self._matcher.open_calls(rank)

    def set_status(self, status: str) -> None:
        """Say what the calling rank thread is doing (shown if the run hangs)."""
        rank = self.current_rank
        if rank is not None:
            self._set_status((rank, self.where), status)

    def on_abort(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (on the watchdog's thread) when the run is aborted: the place to fail
        futures the engine does not own (e.g. a hook's own plain torch Future) so that C++
        waiters on them wake instead of hanging."""
        self._abort_hooks.append(fn)

    def run(self, rank_fns: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``rank_fns[r]()`` on rank ``r``'s own thread; return their values.

        Returns once every rank thread ended and every worker is idle; all threads are
        then stopped and joined. Raises the fatal error (mismatch, deadlock, stuck code)
        if there was one; exceptions escaping rank code are left in :attr:`failures`.
        """
        if len(rank_fns) != self.world_size:
            raise UsageError(f"{len(rank_fns)} rank functions for world_size={self.world_size}")
        values: list[Any] = [None] * self.world_size
        threads = [
            threading.Thread(target=self._rank_main, args=(r, fn, values), name=f"simcluster rank {r}", daemon=True)
            for r, fn in enumerate(rank_fns)
        ]
        self.running = True
        try:
            for t in threads:
                t.start()
            self._watch(threads)
        finally:
            self.running = False
            self._stop_workers()
        if self._fatal is not None:
            raise self._fatal
        return values

    def post(self, call: Call) -> None:
        """Post the calling rank's part of a collective; the last poster computes it."""
        if self._aborting:
            raise RunAborted()
        if not self.running or call.rank != self.current_rank:
            raise UsageError(
                f"{call.op} for rank {call.rank} posted from {self.where or 'a thread outside the run'}: each "
                "rank's collectives must be issued by that rank's own code (give each rank its own state)"
            )
        # the user line that posted it, for a deadlock report's unmatched calls: always recorded
        # here (the inline engine records it only when a run is re-run to be reported; this
        # engine's runs, the real reducer's, cannot be re-run in the same order)
        call.posted_at = posting_site(sys._getframe(1))
        pending = [w for w in call.after if not w.done()] if call.after else None
        with self._lock:
            inst, mismatch = self._matcher.post(call)
            if pending and mismatch is None:
                inst.gated.add(call.rank)
            complete = mismatch is None and inst.complete and not inst.gated
            if complete:
                self._matcher.close(inst, call.op)
            self._steps += 1
        if mismatch is not None:
            self._fail(mismatch)
            raise RunAborted()
        if pending:
            self._gate(inst, call.rank, pending)
        if complete:
            self._complete(inst)

    def _gate(self, inst: Instance, rank: int, pending: list[Waitable]) -> None:
        """Hold ``rank``'s part of ``inst`` until ``pending`` are done (gloo's barrier waits
        for its group's earlier work); whoever opens the last gate of a fully posted
        collective completes it (on the thread that finished the awaited work)."""

        def opened() -> None:
            with self._lock:
                inst.gated.discard(rank)
                complete = inst.complete and not inst.gated and not self._aborting
                if complete:
                    self._matcher.close(inst, inst.calls[rank].op)
                self._steps += 1
            if complete:
                try:
                    self._complete(inst)
                except RunAborted:
                    pass  # recorded by _fail; the rank threads see it

        when_all_done(pending, opened, self._lock)

    def expect(self, rank: int, waitable: Waitable, context: str) -> None:
        """Nothing to do: in this mode the code that needs the value waits for it itself."""

    def choose(self, options: int) -> int:
        """0, what a quiet cluster mostly does: this engine has no scheduler and no replay (the
        OS's timing decides the rest). It had no ``choose`` at all: a gloo barrier after a failed
        collective — which asks whether it re-raises that error — broke the run with
        ``'ThreadedEngine' object has no attribute 'choose'``, reported as the ranks' mismatch
        (``simcluster e2e``: an audit of hostile hooks, 2026-12-07)."""
        if options < 1:
            raise ValueError(f"choose({options}): there must be an option")
        return 0

    def let_others_run(self, polled: Waitable, at: str = "") -> None:
        """A poll of a pending ``polled``: the other rank threads and the workers run on their
        own here, as a real backend's do; only the interpreter is handed to them."""
        time.sleep(0)

    def block_until(self, waitable: Waitable, context: str = "") -> None:
        """Block the calling thread until ``waitable`` is done (other threads run on)."""
        rank, where = self.current_rank, self.where
        if rank is None:
            raise UsageError(f"wait() on pending {waitable.label} from a thread simcluster does not run")
        event = threading.Event()
        self.trace.add(Blocked(rank, waitable.label, context or where))
        key = (rank, where)
        with self._lock:
            previous = self._status.get(key, "")
            self._status[key] = f"blocked {waits_in(waitable.label)}"

        def wake() -> None:
            # The waiter counts as running from the moment its future completes — set by
            # the completing thread, under the lock — not from when the OS gets round to
            # waking it: so "every thread is blocked" is an event, not a timing guess.
            with self._lock:
                self._status[key] = "resuming after wait()"
                self._steps += 1
            event.set()

        waitable.on_done(wake)
        try:
            while not event.wait(_POLL):
                if self._aborting:
                    raise RunAborted()
        finally:
            with self._lock:
                self._status[key] = previous
                self._steps += 1
        self.trace.add(Resumed(rank, waitable.label))

    # ------------------------------------------------------------- internals
    def _rank_main(self, rank: int, fn: Callable[[], Any], values: list[Any]) -> None:
        self.bind_thread(rank, f"rank {rank}")
        self._set_status((rank, f"rank {rank}"), "running")
        try:
            values[rank] = fn()
        except RunAborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.record_failure(rank, f"rank {rank}'s code", exc)
        finally:
            with self._lock:
                self._finished.add(rank)
                self._status[(rank, f"rank {rank}")] = "finished"
                self._steps += 1

    def _complete(self, inst: Instance) -> None:
        first = inst.calls[inst.ranks[0]]
        try:
            results = first.compute({rank: inst.calls[rank] for rank in inst.ranks})
        except Exception as exc:  # noqa: BLE001 - the ranks' calls cannot be combined
            self._fail(compute_failure(inst, first, exc))
            raise RunAborted() from None
        for rank in inst.ranks:
            self._deliver(inst.calls[rank], results[rank])

    def _deliver(self, call: Call, outcome: Any) -> None:
        key = (call.rank, call.channel)
        with self._lock:
            pool = self._workers.get(key)
            if pool is None:
                pool = self._workers[key] = _Workers(self, call.rank, call.channel, self._worker_limit)
        pool.submit(lambda: call.deliver(outcome))

    def _set_status(self, key: tuple[int, str], status: str) -> None:
        with self._lock:
            self._status[key] = status
            self._steps += 1

    def record_failure(self, rank: int, label: str, exc: BaseException) -> None:
        """Record an exception that escaped rank code (or a completion) on ``rank``."""
        with self._lock:
            self.failures.append((rank, label, exc))

    def abort(self, error: SimClusterError) -> NoReturn:
        """End the run with ``error`` as its outcome (see the contract): raised into the calling
        rank thread as :class:`RunAborted`; :meth:`run` then raises ``error``."""
        self._fail(error)
        raise RunAborted()

    def _fail(self, error: SimClusterError) -> None:
        with self._lock:
            if self._fatal is None:
                self._fatal = error

    # --------------------------------------------------------------- watchdog
    def _watch(self, threads: list[threading.Thread]) -> None:
        last_steps, last_change = -1, time.monotonic()
        while True:
            alive = [t for t in threads if t.is_alive()]
            workers_busy = any(pool.busy() for pool in list(self._workers.values()))
            if not alive and not workers_busy:
                if self._matcher.open and self._fatal is None and not self.failures:
                    self._fail(DeadlockError(self.describe("every rank's code ended with collectives unmatched")))
                return
            now = time.monotonic()
            if self._steps != last_steps:
                last_steps, last_change = self._steps, now
            quiet = now - last_change
            if self._fatal is None and not self.failures:  # a rank's own exception is the root cause
                reason = self._deadlock_reason(alive, quiet)
                if reason is not None:
                    self._fail(DeadlockError(self.describe(reason)))
                elif quiet >= self._timeout:
                    self._fail(StuckError(self.describe(
                        f"no progress for {self._timeout:g}s: a thread is blocked where simcluster cannot see it "
                        "(e.g. the C++ reducer waiting on a future that never completes, a lock)")))
            if self._fatal is not None or self.failures:
                self._abort()
                if quiet >= max(self._timeout, 1.0) or (self._fatal is not None and quiet >= _GRACE):
                    self._note_abandoned(alive)
                    return
            time.sleep(_POLL)

    def _deadlock_reason(self, alive: list[threading.Thread], quiet: float) -> str | None:
        with self._lock:
            # A thread counts as stuck for good only while it sits in a wait the engine sees.
            everyone_waits = all(
                status.startswith(("blocked", "finished", "idle")) for status in self._status.values()
            )
            queued = any(pool.queue for pool in self._workers.values())
            if alive and everyone_waits and not queued and quiet >= _POLL * 5:
                return "every running thread is blocked in wait()"
            # A rank can post again only from its thread or a completion on its workers:
            # once its thread has finished and its workers hold no work, it never will.
            # read without the pool's condition: workers take it before this lock (lock order)
            active = {pool.rank for pool in self._workers.values() if pool.queue or pool.idle < len(pool.threads)}
            for p in self._matcher.open.values():
                missing = [r for r in p.ranks if r not in p.calls]
                if missing and all(r in self._finished and r not in active for r in missing):
                    return f"ranks {missing} ended without posting call #{p.seq} on {p.channel}"
        return None

    def _abort(self) -> None:
        """Fail every pending collective's futures (wakes C++ waiters) and unwind Python waits."""
        with self._lock:
            first = not self._aborting
            self._aborting = True
            pending = self._matcher.take_open()
        for p in pending:
            error = RuntimeError(f"simcluster aborted the run: call #{p.seq} on {p.channel} was never matched")
            for call in p.calls.values():
                self._deliver(call, (None, error))
        if first:
            for fn in self._abort_hooks:
                fn()

    def _note_abandoned(self, alive: list[threading.Thread]) -> None:
        still = [t.name for t in alive if t.is_alive()]
        if still and self._fatal is not None:
            self._fatal.args = (f"{self._fatal.args[0]}\n  abandoned (daemon) threads: {still}",)

    def _stop_workers(self) -> None:
        pools = list(self._workers.values())
        for pool in pools:
            with pool.cond:
                pool.stop = True
                pool.cond.notify_all()
        for pool in pools:
            for t in pool.threads:
                t.join(timeout=1.0)

    def describe(self, headline: str) -> str:
        """What every thread is doing and which collectives are unmatched."""
        with self._lock:
            lines = [f"deadlock or hang: {headline}"]
            for (rank, where), status in sorted(self._status.items(), key=_thread_order):
                if where == f"rank {rank}":
                    lines.append(f"  rank {rank}: {status}")
                elif status != "idle":
                    lines.append(f"  rank {rank}, {where}: {status}")
            lines += unmatched_lines(self._matcher.open.values(), self._matcher.crossed)
        return "\n".join(lines)


def _thread_order(item: tuple[tuple[int, str], str]) -> tuple[int, int, str]:
    (rank, where), _ = item
    return (rank, 0 if where == f"rank {rank}" else 1, where)
