"""The OS threads the baton engine runs rank code on, parked and woken one at a time.

:mod:`simcluster.engine.inline` runs every rank's code on one baton: exactly one thread
runs, the rest are parked. A :class:`Slot` is one such thread with a binary semaphore to
park it on; its ``command`` says what to do when woken (``"drive"`` the run, go
``"idle"``, ``"stop"``, or — for the caller's own slot — the run is ``"finished"``).
:class:`SlotPool` holds the caller's slot (the *home* slot, index ``-1``) and the pooled
threads, created only when code blocks and another thread must take over driving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from simcluster.engine.guard import ThreadGuard

__all__ = ["Slot", "SlotPool"]


class Slot:
    """An OS thread the engine can park and wake (a binary semaphore per thread)."""

    __slots__ = ("index", "lock", "command", "abort", "thread")

    def __init__(self, index: int, thread: threading.Thread | None = None,
                 target: Callable[["Slot"], None] | None = None) -> None:
        self.index = index
        self.lock = threading.Lock()
        self.lock.acquire()
        self.command = "idle"
        self.abort = False
        if thread is None:
            thread = threading.Thread(target=target, args=(self,), name=f"simcluster-{index}", daemon=True)
        self.thread = thread

    def park(self) -> None:
        self.lock.acquire()

    def wake(self) -> None:
        self.lock.release()


class SlotPool:
    """The home slot and the pooled threads; each new pool thread runs ``main(slot)`` and is
    owned by ``guard`` (it may run rank code)."""

    def __init__(self, guard: ThreadGuard, main: Callable[[Slot], None]) -> None:
        self._guard = guard
        self._main = main
        self._created = 0
        self.idle: list[Slot] = []
        self.home: Slot | None = None

    def take_home(self) -> Slot:
        """The calling thread's slot: it drives first."""
        self.home = Slot(-1, thread=threading.current_thread())
        self._guard.owned.add(threading.get_ident())  # own(), for the running thread (its ident is known)
        return self.home

    def take_idle(self) -> Slot:
        """An idle slot (the most recently idled), or a new pool thread."""
        if self.idle:
            return self.idle.pop()
        slot = Slot(self._created, target=self._main)
        self._created += 1
        self._guard.start_owned(slot.thread)
        return slot

    def give_back(self, slot: Slot) -> None:
        """``slot`` goes idle: it parks until taken again."""
        slot.command = "idle"
        self.idle.append(slot)

    def stop(self) -> None:
        """End every idle pool thread and wait for each (the home slot is the caller's)."""
        if not self.idle:  # the common end of a run: no pool thread was needed
            return
        idle = [slot for slot in self.idle if slot.index >= 0]
        for slot in idle:
            slot.command = "stop"
            slot.wake()
        for slot in idle:
            slot.thread.join()
        self.idle.clear()

    def close(self) -> None:
        """Forget ``main`` (the engine's bound method) once the run is over, so the engine
        is freed by reference counting, not left in a cycle for the garbage collector
        (~110 objects per run: docs/speed.md)."""
        self.stop()
        self._main = _closed


def _closed(slot: Slot) -> None:
    raise RuntimeError("simcluster: this engine's run is over; its thread pool is closed")
