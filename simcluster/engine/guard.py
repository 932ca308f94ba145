"""Which threads are ranks, and which exceptions mean "stop everything".

The baton engine (:mod:`simcluster.engine.inline`) runs rank code only on threads it owns:
the caller's and its pool's. A thread a hook starts is not a rank; its collectives,
waits and future completions are rejected at once with
:class:`~simcluster.errors.ForeignThreadError` (:meth:`ThreadGuard.check`), so no
result ever depends on that thread's timing. While a run is in progress,
:meth:`ThreadGuard.start_watching` notes every thread rank code starts, so a deadlock
report can say that a thread the hook started is not a simulated rank.

:func:`is_stop_request` tells a request to stop the whole program (Ctrl-C, pytest's
outcomes) from a hook's own failure.
"""

from __future__ import annotations

import sys
import os
import threading
from collections.abc import Callable

from simcluster.engine.frames import stack_user_frames
from simcluster.errors import ForeignThreadError

__all__ = ["ThreadGuard", "is_stop_request", "thread_description"]


def is_stop_request(exc: BaseException) -> bool:
    """Whether ``exc`` asks the whole program (not the hook) to stop: ``KeyboardInterrupt``,
    or — while pytest runs a test (``PYTEST_CURRENT_TEST`` set) — one of pytest's outcome
    exceptions (``Failed``, ``Skipped``, ``Exit``…, which pytest-timeout's signal method raises
    too). Such an exception is never a finding. Outside a test (``simcluster check``), a hook
    calling ``pytest.skip()`` raised a ``BaseException`` that ends a real rank's process, and it
    is the hook's failure like any other (an audit of hostile hooks: the command printed no
    report, only a traceback)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    return "PYTEST_CURRENT_TEST" in os.environ and any(
        getattr(klass, "__module__", "") == "_pytest.outcomes" for klass in type(exc).__mro__)


def thread_description(thread: threading.Thread) -> str:
    """A thread named by what it runs (its target's qualified name), not by its
    process-wide counter (``Thread-7``), so messages are the same run after run."""
    target = getattr(thread, "_target", None)
    name = getattr(target, "__qualname__", None) or type(thread).__qualname__
    return f"a thread running {name}" if target is not None else f"a {name} thread"


class ThreadGuard:
    """The set of threads that may run rank code, and the threads rank code started.

    ``started`` holds ``(rank, description)`` for each thread started by an owned thread
    while watching (:meth:`start_watching` until :meth:`stop_watching`) (rank ``-1``: started outside any rank's code).
    ``rejected`` says, for each call :meth:`check` rejected, which rank's thread made it and
    where (``rank 0's thread running work posted all_reduce on WORLD at hooks.py:47 in work: …``).
    """

    def __init__(self) -> None:
        self.owned: set[int] = set()
        self.started: list[tuple[int, str]] = []
        self.rejected: list[str] = []
        # a thread rank code started -> (that rank or -1, the thread described with the line that started it)
        self._starters: dict[threading.Thread, tuple[int, str]] = {}
        self._real_start = threading.Thread.start

    def own(self, thread: threading.Thread) -> None:
        """``thread`` (started) runs rank code from now on."""
        assert thread.ident is not None
        self.owned.add(thread.ident)

    def start_owned(self, thread: threading.Thread) -> None:
        """Start ``thread`` (one of the engine's own) and own it. Not noted in :attr:`started`:
        the engine's pool threads are ranks' threads, not threads rank code started."""
        self._real_start(thread)
        self.own(thread)

    def check(self, what: str) -> None:
        """Reject ``what`` (a collective, a wait, completing a future) unless the calling
        thread is owned: raise :class:`ForeignThreadError` in it, naming the thread."""
        if threading.get_ident() in self.owned:
            return
        thread = thread_description(threading.current_thread())
        rank, started = self._starters.get(threading.current_thread(), (-1, thread))
        who = f"rank {rank}'s code started {started}" if rank >= 0 else started[0].upper() + started[1:]
        user = stack_user_frames(sys._getframe(1), limit=1)
        self.rejected.append(f"{who}, which called {what}" + (f" at {user[-1]}" if user else ""))
        raise ForeignThreadError(
            f"{what} from {thread}, which is not a simulated rank: "
            "a thread a hook starts is not a rank, and simcluster rejects its collectives, waits and future "
            "completions (on a real cluster it would use its own process's group; run that work on the "
            "rank's own code path instead)"
        )

    def start_watching(self, current_rank: Callable[[], int | None], active: Callable[[], bool]) -> None:
        """From now until :meth:`stop_watching`, ``threading.Thread.start`` from an owned thread
        (while ``active()``) is noted in :attr:`started` with ``current_rank()``."""
        real_start = self._real_start = threading.Thread.start
        guard = self

        def start(thread: threading.Thread) -> None:
            if threading.get_ident() in guard.owned and active():
                rank = current_rank()
                rank = rank if rank is not None else -1
                user = stack_user_frames(sys._getframe(1), limit=1)  # the user line that started it (rare: no cost)
                where = f" (started at {user[-1]})" if user else ""
                guard.started.append((rank, thread_description(thread) + where))
                guard._starters[thread] = guard.started[-1]  # before it starts: its first call may come at once
                _quiet_outside_the_run(thread, active)
            real_start(thread)

        threading.Thread.start = start  # type: ignore[method-assign]

    def stop_watching(self) -> None:
        """Put the real ``threading.Thread.start`` back (see :meth:`start_watching`)."""
        threading.Thread.start = self._real_start  # type: ignore[method-assign]


def _quiet_outside_the_run(thread: threading.Thread, active: Callable[[], bool]) -> None:
    """``thread`` (started by rank code) ends silently when what escapes it is simcluster's
    rejection of one of its calls (:class:`ForeignThreadError`: reported with the run,
    :attr:`ThreadGuard.rejected`) or comes once the run is over (``active()`` false: the
    simulated world it used is gone — torch then says "Default process group has not been
    initialized" — so it is no finding of the hook's). Python's ``threading.excepthook``
    printed either to stderr whenever the thread got there: after the example's output was
    captured, in the middle of the report, on some runs and not others (round 22 of hooks
    from the wild). What escapes it during the run is printed as Python prints it, into the
    example's captured output."""
    real_run = thread.run

    def run() -> None:
        try:
            real_run()
        except ForeignThreadError:
            return
        except BaseException:  # noqa: BLE001 - decided below
            if active():
                raise
            return

    thread.run = run  # type: ignore[method-assign]
