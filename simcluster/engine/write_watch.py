"""Which user line wrote to a tensor a collective had in flight: the reported re-run's line tracer.

A hook that writes to memory a collective still has in flight races the backend (gloo
reads and writes it on its worker thread meanwhile). The engine finds such a write at the
completion, by the call's record of its tensors
(:class:`~simcluster.engine.contract.InFlight`): the version counters moved, the values
changed. That says *that* a rank wrote, not *where*: the write may be the next line of
the hook, or — as often in the wild — another bucket's hook call copying into a staging
buffer it shares with this one.

When a run records posting lines (the re-run of a failure that is being reported,
:func:`simcluster.checking.judge.with_posting_lines`, and ``simcluster explain``), the
engine also runs a :class:`WriteWatch`: a line tracer (``sys.settrace``) on the engine's
own threads that, after each line of *user* code (never the simulator's, torch's or the
standard library's: :func:`~simcluster.engine.frames.is_internal`), asks the running
rank's calls still in flight whether their tensors changed. The first line after which
one did is the writer, noted on the call (``Call.written_at``, ``Call.written_in``): the
report then says ``rank 0, in DDP iteration 1, bucket 1's hook call, wrote to it at
hooks.py:21 in hook: view.copy_(bucket.buffer())``.

It also names the first user line that *read* such a tensor (a hook that quantises with a
scale whose MAX-reduce it never waited for): through a per-thread hook the layer above
installs (``enter_thread``: the process group's torch function mode,
:mod:`simcluster.fake.read_watch`, which asks :meth:`WriteWatch.read` about each torch call
a user line makes), recorded as a :class:`~simcluster.engine.trace.ReadInFlight` event that
the report of a wrong value quotes. On gloo such a read sees the rank's own value or the
reduced one, depending on timing; the simulator gives the value from before the collective.

What it can and cannot name:

- a write inside torch or a library called from a user line is named by that user line;
- a write made where no user line ran since the engine last switched code (a collective
  of the rank writing its result into the same memory, DDP's own copies) is not blamed on
  anyone: the report then says only that the rank wrote (``Call.written_at`` stays empty);
- tracing makes the re-run ~2.6x slower (a world-4 step of torch's ``fp16_compress_hook``
  recording posting lines: 366 -> 959 µs); the search itself never traces.

A line event fires *before* its line runs, so what changed since the previous event was
done by the line that ran last: :attr:`WriteWatch._last`, the frame and line of the
previous event — cleared when a user frame returns to the engine and whenever a rank parks
in a wait or resumes, so a line of one rank's code is never blamed for what ran after it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from threading import get_ident
from types import FrameType
from typing import Any

from simcluster.engine.contract import Call
from simcluster.engine.frames import is_internal, line_site
from simcluster.engine.trace import ReadInFlight

__all__ = ["WriteWatch"]

Tracer = Callable[[FrameType, str, Any], Any]


class WriteWatch:
    """The line tracer of a reported run (see the module): ``running_rank()`` is the rank
    whose code runs now, ``doing(rank)`` what it is doing in words (``in DDP iteration 1,
    bucket 0's hook call``; ``""`` when unknown)."""

    def __init__(self, running_rank: Callable[[], int | None], doing: Callable[[int], str],
                 log: Callable[[Any], None] | None = None,
                 enter_thread: "Callable[[WriteWatch], Callable[[], None]] | None" = None) -> None:
        self._running_rank = running_rank
        self._doing = doing
        self._watched: dict[int, list[Call]] = {}
        """Per rank, its posted calls with tensors in flight whose writer is not known yet."""
        self._unread: dict[int, list[Call]] = {}
        """Per rank, its posted calls with tensors in flight that no user line read yet."""
        self._log = log
        """The run's trace (``Trace.log``): where a read is recorded (:meth:`read`)."""
        self._enter_thread = enter_thread
        """Installs the layer above's read detection on the calling thread; returns its undo."""
        self._exits: dict[int, Callable[[], None]] = {}
        self._last: tuple[FrameType, int] | None = None
        """The user frame and line of the previous line event (None: none since the last switch)."""

    # -- what is watched -------------------------------------------------------
    def add(self, call: Call) -> None:
        """Watch ``call`` (just posted, with tensors in flight) until :meth:`drop`."""
        self._watched.setdefault(call.rank, []).append(call)
        self._unread.setdefault(call.rank, []).append(call)

    def drop(self, calls: Any) -> None:
        """Stop watching ``calls`` (a collective completes: its record is judged now)."""
        for call in calls:
            for kept in (self._watched.get(call.rank), self._unread.get(call.rank)):
                if kept is not None and call in kept:
                    kept.remove(call)

    def watching_reads(self) -> bool:
        """Whether the running rank has a call in flight no user line read yet (the cheap
        question the read detection asks before it looks at a torch call's arguments)."""
        rank = self._running_rank()
        return rank is not None and bool(self._unread.get(rank))

    def read(self, objects: list[Any], how: str, frame: FrameType) -> None:
        """The user line running in ``frame`` passed ``objects`` (tensors) to ``how`` (a torch
        function that reads them): record, as a :class:`ReadInFlight` event, the first such
        read of each of the running rank's calls whose in-flight memory one of them overlaps."""
        rank = self._running_rank()
        unread = self._unread.get(rank) if rank is not None else None
        if not unread or self._log is None:
            return
        for call in list(unread):
            in_flight = call.in_flight
            if in_flight is not None and any(in_flight.holds(o) for o in objects):
                unread.remove(call)
                self._log(ReadInFlight(call.rank, call.op, call.channel, call.seq, how,
                                       line_site(frame, frame.f_lineno), self._doing(call.rank)))

    def switched(self) -> None:
        """The engine switches code in the middle of a user line (a rank parks in a wait, and
        resumes): nothing that changes meanwhile was done by that line. (A task that ends
        needs no call: its outermost user frame returning to the engine clears the line.)"""
        self._last = None

    # -- tracing ---------------------------------------------------------------
    def start(self) -> Tracer | None:
        """Trace the calling thread from now on (and watch its reads, when the layer above
        gave a way to); returns the tracer that was set (for :meth:`stop`)."""
        previous = sys.gettrace()
        sys.settrace(self.trace)
        if self._enter_thread is not None:
            self._exits[get_ident()] = self._enter_thread(self)
        return previous

    def stop(self, previous: Tracer | None) -> None:
        """Put the calling thread's previous tracer back, and undo its read watch."""
        sys.settrace(previous)
        undo = self._exits.pop(get_ident(), None)
        if undo is not None:
            undo()

    def trace(self, frame: FrameType, event: str, arg: Any) -> Tracer | None:
        """The global tracer: a user function's frame gets :meth:`_trace_line`; others none."""
        if event != "call" or is_internal(frame.f_code.co_filename):
            return None
        self._look()  # a write in the calling user line, before this call
        return self._trace_line

    def _trace_line(self, frame: FrameType, event: str, arg: Any) -> Tracer | None:
        if event == "line":
            self._look()
            self._last = (frame, frame.f_lineno)
        elif event == "return":
            self._look()
            caller = frame.f_back  # the caller's line goes on once this returns
            self._last = (caller, caller.f_lineno) if caller is not None and not is_internal(
                caller.f_code.co_filename) else None
        return self._trace_line

    def _look(self) -> None:
        rank = self._running_rank()
        watched = self._watched.get(rank) if rank is not None else None
        if not watched:
            return
        for call in list(watched):
            in_flight = call.in_flight
            if in_flight is not None and in_flight.changed():
                watched.remove(call)  # the first writer is the one to name
                if self._last is not None:
                    frame, line = self._last
                    call.written_at, call.written_in = line_site(frame, line), self._doing(call.rank)
