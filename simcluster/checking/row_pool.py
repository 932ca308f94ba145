"""Checking several rows at once: a small pool of forked worker processes (``check --jobs N``).

The rows of a ``simcluster check`` run are independent — each is one hook's property
search — and each spends its time on one core (the search of each backend runs in its own
supervised child, :mod:`simcluster.checking.supervisor`, one after the other). So with
``--jobs N`` the command line hands up to ``N`` rows at a time to **forked workers**:

1. Tasks start in the order given (row order), greedily: whenever fewer than ``N`` workers
   run, the next task's worker is forked. A worker runs ``task()`` — a call of
   :func:`~simcluster.checking.check.check_hook`, which forks its own supervised child per
   backend as it does in-process; the nesting is the same supervision one level down.
2. The worker sends back one pickled message through a pipe, then exits: the
   :class:`~simcluster.checking.report.CheckReport` (:class:`Done`), or what stopped it —
   a :class:`~simcluster.errors.UsageError` or ``KeyboardInterrupt`` to raise in the
   parent as an in-process run would, or the traceback text of a bug of ours
   (:class:`Broken`, exit 3).
3. The parent waits on every pipe at once (``select``, waking every :data:`_POLL` seconds
   to raise a Ctrl-C whose ``KeyboardInterrupt`` was swallowed elsewhere:
   :mod:`simcluster.checking.ctrl_c`) and reaps every worker (``waitpid``). A worker that
   ends without a whole message — killed, ``os._exit``, a crash — is :class:`Broken` too,
   saying how it ended: **never** a passing row.

Results arrive in whatever order the rows finish; :func:`run_tasks` yields each with its
task's index, and the caller puts them back in row order, so what it prints does not
depend on which row finished first.

A worker ignores ``SIGINT`` (Ctrl-C is the parent's: the terminal sends it to the whole
process group) and dies with its parent (:func:`~simcluster.checking.supervisor.die_with_parent`),
as do the supervised children it forks. On Ctrl-C the parent asks every running worker
where its checked code is: it sends ``SIGUSR2``, which raises ``KeyboardInterrupt`` in the
worker exactly where Ctrl-C lands in a ``--jobs 1`` run — the supervisor then collects
its child's stack and sends the interrupt back with that stack as a note — and waits at
most :data:`INTERRUPT_GRACE` seconds for the answers (a second Ctrl-C stops waiting).
The parent's ``KeyboardInterrupt`` then carries, for each running task in task order, a
note naming it (``names``) followed by its worker's notes. When the parent stops for any
reason — ``KeyboardInterrupt``, a usage error a worker sent, the caller closing the
generator — it ``SIGKILL``\\s and reaps every worker still running; their supervised
children follow.
Like the supervised child, a worker runs torch with one intra-op thread (torch's OpenMP
pool does not survive ``fork``).

    >>> sorted((index, outcome.value) for index, outcome in run_tasks([lambda: 6 * 7, lambda: "x"], jobs=2))
    [(0, 42), (1, 'x')]
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from simcluster.checking import ctrl_c
from simcluster.checking.supervisor import (die_with_parent, end_process, fork_child, how_it_ended, kill_and_reap,
                                            one_torch_thread, write_all)
from simcluster.errors import UsageError

__all__ = ["Done", "Broken", "run_tasks", "INTERRUPT_GRACE"]

INTERRUPT_GRACE = 3.0
"""Seconds the parent waits, after Ctrl-C, for the running workers to say where their
checked code was (a worker's supervisor itself allows 1 s for its child's stack dump)."""
_WHERE_SIGNAL = signal.SIGUSR2  # parent -> worker: "raise KeyboardInterrupt where you are"
_POLL = 0.1
"""Seconds between two looks for a Ctrl-C whose ``KeyboardInterrupt`` was swallowed
(:mod:`simcluster.checking.ctrl_c`) while the parent waits for its workers."""


@dataclass
class Done:
    """A task's return value (for ``check``: its :class:`~simcluster.checking.report.CheckReport`)."""

    value: Any


@dataclass
class Broken:
    """A task that broke: ``detail`` is the traceback of its exception, or how its worker ended."""

    detail: str


@dataclass
class _Worker:
    index: int
    pid: int
    pipe: int
    chunks: list[bytes]


def run_tasks(tasks: Sequence[Callable[[], Any]], *, jobs: int, started: Callable[[int], None] | None = None,
              names: Sequence[str] | None = None) -> Iterator[tuple[int, Done | Broken]]:
    """Run every task in a forked worker, at most ``jobs`` at a time; yield ``(index, outcome)``
    as each ends. ``started(index)`` is called (in this process) when a task's worker starts.

    A task's :class:`UsageError` or ``KeyboardInterrupt`` is raised here, after every other
    worker was killed; so is a ``KeyboardInterrupt`` arriving while waiting — with a note
    per running task (``names[index]``, default ``task <index>``) and what its worker said
    about where it was.
    """
    running: dict[int, _Worker] = {}  # by pipe
    upcoming = iter(enumerate(tasks))
    try:
        while True:
            ctrl_c.raise_if_lost()
            while len(running) < jobs and (task := next(upcoming, None)) is not None:
                # SIGINT waits until the worker is recorded (so killed below), and never reaches it;
                # the worker starts with the where-are-you signal blocked until its handler is in
                old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, _WHERE_SIGNAL})
                try:
                    worker = _start(*task, old_mask)
                    running[worker.pipe] = worker
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                if started is not None:
                    started(worker.index)
            if not running:
                return
            worker = _next_ended(running, _POLL)  # polled: a Ctrl-C swallowed elsewhere is raised above
            if worker is not None:
                yield worker.index, _finish(worker)
    except KeyboardInterrupt as stop:
        ctrl_c.seen()  # from here a new press only ends the wait for the answers
        _ask_where(running, stop, names)
        raise
    finally:  # KeyboardInterrupt, a raised UsageError, the caller stopping early: no worker survives
        for worker in running.values():
            _kill(worker)


def _ask_where(running: dict[int, _Worker], stop: KeyboardInterrupt, names: Sequence[str] | None) -> None:
    """Ctrl-C in the parent: have every running worker raise ``KeyboardInterrupt`` where it
    is and send it back, then add to ``stop`` one note per task (in task order) with what
    its worker said. Workers that answer are reaped and leave ``running``; the rest are
    killed by the caller. Bounded by :data:`INTERRUPT_GRACE`; a second Ctrl-C ends the wait."""
    for worker in running.values():
        try:
            os.kill(worker.pid, _WHERE_SIGNAL)
        except ProcessLookupError:
            pass
    answered: dict[int, list[str]] = {}
    limit = time.monotonic() + INTERRUPT_GRACE
    try:
        while running and (left := limit - time.monotonic()) > 0:
            ctrl_c.raise_if_lost()
            worker = _next_ended(running, min(left, _POLL))
            if worker is not None:
                answered[worker.index] = _notes_of(worker)
    except KeyboardInterrupt:  # pressed again: stop waiting, report what arrived
        pass
    for worker in running.values():
        answered[worker.index] = ["(its worker did not answer in time)"]
    for index in sorted(answered):
        name = names[index] if names is not None else f"task {index}"
        stop.add_note(f"simcluster: {name} was being checked")
        for note in answered[index]:
            stop.add_note(note)


def _next_ended(running: dict[int, _Worker], timeout: float | None) -> _Worker | None:
    """Wait (at most ``timeout`` seconds; ``None``: until a pipe is readable), keep what the
    workers sent, and return one worker whose pipe reached its end — taken out of
    ``running``, its pipe closed, still to be reaped — or ``None``. One at a time, so
    every other worker stays in ``running`` (killed and reaped if the caller stops)."""
    readable, _, _ = select.select(list(running), [], [], timeout)
    for pipe in readable:
        chunk = os.read(pipe, 1 << 20)
        if chunk:
            running[pipe].chunks.append(chunk)
            continue
        worker = running.pop(pipe)
        os.close(pipe)
        return worker
    return None


def _notes_of(worker: _Worker) -> list[str]:
    """Reap a worker that answered the interrupt; the notes of the ``KeyboardInterrupt`` it sent."""
    os.waitpid(worker.pid, 0)
    try:
        kind, payload = pickle.loads(b"".join(worker.chunks))
    except Exception:  # noqa: BLE001 - it died without a whole answer
        return []
    if kind == "raise" and isinstance(payload, KeyboardInterrupt):
        return list(getattr(payload, "__notes__", ()))
    return []  # it finished its task just then; the run is interrupted all the same


def _start(index: int, task: Callable[[], Any], mask: Any) -> _Worker:
    """Fork a worker for ``task`` (the caller blocks SIGINT and ``SIGUSR2`` around this;
    ``mask`` is the signal mask to restore in the worker, once it ignores SIGINT and
    handles ``SIGUSR2``)."""
    def body(out: int, parent: int) -> None:  # pragma: no cover - the worker; its behaviour is the tests' subject
        _worker(task, out, parent, mask)

    pid, read_end = fork_child(body)
    return _Worker(index, pid, read_end, [])


def _worker(task: Callable[[], Any], out: int, parent: int, mask: Any) -> None:  # pragma: no cover - in the worker
    """Run ``task``, send its outcome, exit; never return into the caller's code."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as SIGINT: the parent's to act on (it kills the workers)
        ctrl_c.seen()  # the parent's state is not the worker's
        signal.signal(_WHERE_SIGNAL, ctrl_c.press)  # remembered: the worker's supervisor polls for it
        die_with_parent(parent)
        one_torch_thread()
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a where-are-you sent meanwhile arrives here
            message: tuple[str, Any] = ("value", task())
        except (UsageError, KeyboardInterrupt) as exc:  # raised again in the parent
            message = ("raise", exc)
        except BaseException:  # noqa: BLE001 - a bug of ours: its traceback goes to the parent
            message = ("broken", traceback.format_exc())
        try:
            data = pickle.dumps(message)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result: a bug of ours too
            data = pickle.dumps(("broken", f"the worker's result could not be pickled: {exc!r}\n"))
        write_all(out, data)
    except BaseException:  # noqa: BLE001
        code = 70
    finally:
        end_process(code)


def _finish(worker: _Worker) -> Done | Broken:
    """Reap ``worker`` (its pipe reached end of file) and decode what it sent."""
    _, status = os.waitpid(worker.pid, 0)
    try:
        kind, payload = pickle.loads(b"".join(worker.chunks))
    except Exception:  # noqa: BLE001 - nothing, or a message cut short: the worker died
        return Broken(f"the worker process (pid {worker.pid}) {how_it_ended(status)} without sending a result\n")
    if kind == "raise":
        raise payload
    if kind == "broken":
        return Broken(payload)
    return Done(payload)


def _kill(worker: _Worker) -> None:
    kill_and_reap(worker.pid)
    os.close(worker.pipe)
