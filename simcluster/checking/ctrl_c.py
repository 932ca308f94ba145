"""Ctrl-C is never lost: a ``SIGINT`` handler that also *remembers* the press.

Python runs a signal's handler in the main thread at the next bytecode boundary — wherever
that is. When it is inside a garbage collector callback or a ``__del__``, the handler's
``KeyboardInterrupt`` is "ignored": printed as ``Exception ignored in: …`` and dropped, and the
program goes on as if no key had been pressed. Hypothesis installs such a callback
(``gc_cumulative_time``: it times every collection) in any process that ran a Hypothesis
test — the command line's own process does, once, in
:func:`~simcluster.checking.check.prepare_to_fork`. A collection there takes ~0.1 s with torch
loaded (~180,000 objects), longer on a loaded machine: a Ctrl-C arriving during one was lost,
and ``check --jobs 2`` of two spinning hooks then waited for its workers until the examples'
deadline (60 s), exit 1, not 130 (docs/supervision.md, "Ctrl-C during a garbage collection").

So the command line installs :func:`press` for the length of a command (:func:`remembering`):
it records the press, then raises as Python's own handler does. The loops in which ``check``,
``explain`` and ``e2e`` wait on other processes (the supervisor's, :func:`~simcluster.checking.row_pool.run_tasks`',
the real gloo ranks' in :mod:`simcluster.real.gloo_runner`) poll :func:`raise_if_lost` at
least every quarter second, which raises the ``KeyboardInterrupt`` of a press whose first
one was swallowed; so does :func:`~simcluster.cli.main` once the command returned. Outside the command line (the pytest plugin,
``check_hook`` in a program) nothing is installed and :func:`raise_if_lost` never raises.

    >>> raise_if_lost()  # no press recorded: nothing happens
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["remembering", "raise_if_lost", "seen", "press", "held_back", "Terminated"]

_pressed: int | None = None
"""The signal that arrived and no simcluster code has seen yet (:func:`seen`), or None."""


class Terminated(KeyboardInterrupt):
    """``SIGTERM`` arrived (a CI job's time limit, ``timeout``, ``kill``): the run stops as it
    does for Ctrl-C — the child's stack taken, every process ended, what was being checked
    and where said — and exits with 143 (128 + 15), as a process ended by ``SIGTERM`` does.
    Without it the command died at once with no word of where the checked code was (an
    audit of hostile hooks, 2026-12-07)."""


def _interrupt(signum: int) -> KeyboardInterrupt:
    """What signal ``signum`` raises: :class:`Terminated` for ``SIGTERM``, else ``KeyboardInterrupt``."""
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def press(signum: int = signal.SIGINT, frame: Any = None) -> None:
    """A signal handler: remember that an interrupt arrived, then raise ``KeyboardInterrupt``
    (:class:`Terminated` for ``SIGTERM``; also the handler of ``check --jobs``' where-are-you
    signal in a worker)."""
    global _pressed
    _pressed = signum
    raise _interrupt(signum)


def raise_if_lost() -> None:
    """Raise ``KeyboardInterrupt`` if an interrupt arrived and no simcluster code has seen it
    yet (:func:`seen`): its handler's exception was swallowed where it ran."""
    if _pressed is not None:
        raise _interrupt(_pressed)


def seen() -> None:
    """The interrupt reached simcluster's code (a ``except KeyboardInterrupt`` that goes on
    working — to ask the workers where they were, say): forget it, so that only a new
    press counts from here on. Also called in a freshly forked worker."""
    global _pressed
    _pressed = None


@contextmanager
def remembering() -> Iterator[None]:
    """For the length of a command: Ctrl-C raises as usual and is remembered. A ``SIGINT``
    that is ignored (a job started in the background by a non-interactive shell, ``nohup``)
    stays ignored, as Python leaves it; a handler someone else installed stays too, and so
    does everything off the main thread (only it may set handlers). The previous handler
    and state come back afterwards (tests call :func:`~simcluster.cli.main` in their own
    process)."""
    previous = signal.getsignal(signal.SIGINT)
    previous_term = signal.getsignal(signal.SIGTERM)
    ours = ours_term = False
    try:
        if previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, press)
            ours = True
        if previous_term == signal.SIG_DFL:  # SIGTERM too (:class:`Terminated`), unless someone set a handler
            signal.signal(signal.SIGTERM, press)
            ours_term = True
    except ValueError:  # not the main thread
        pass
    seen()
    try:
        yield
    finally:
        seen()
        if ours:
            signal.signal(signal.SIGINT, previous)
        if ours_term:
            signal.signal(signal.SIGTERM, previous_term)


@contextmanager
def held_back() -> Iterator[None]:
    """Block ``SIGINT`` for the block's length; a Ctrl-C pressed meanwhile stays pending and
    raises right after it. For imports that must not see an interrupt (measured, stop 25:
    ``SIGINT`` sent to ``simcluster check`` 0.3–0.7 s after it started, the window of torch's
    import):

    * **Ignored.** torch's C start-up imports numpy and, when that import raises, warns and
      goes on without it — ``KeyboardInterrupt`` included. The check then ran on as if no key
      had been pressed (a spinning hook: until its example's deadline).
    * **The wrong exit status.** With the interrupt landing in ``exec`` of a dataclass's
      generated method during torch's import, the process ended by ``SIGINT`` (status -2)
      after :func:`~simcluster.cli.main` had printed "interrupted" and returned 130 (seen,
      with the stack, once; not reproduced in three later tries).

    Blocking (``pthread_sigmask``, inherited by any thread started meanwhile) leaves the
    signal pending, not lost.
    """
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
