"""Every exception simcluster raises on its own account.

One root, :class:`SimClusterError`. Each class says whose problem it is:

* **the hook's** — the code under test did something a real cluster would punish
  (mismatched collectives, a deadlock, a result DDP rejects). These are findings.
* **the caller's** — simcluster was called wrongly (bad option, unloadable target).
  These are usage errors: fix the call.
* **ours** — simcluster met something it does not model. It says so loudly rather
  than guessing (:class:`UnsupportedError`).

Messages quote the bad value, name the rank, the collective and the bucket where
they apply, and end with a replay line when a seed and schedule produced them.
An exception raised *by the hook itself* is never wrapped in one of these: it is
re-raised as itself with notes attached (see :func:`add_context_note`).
"""

from __future__ import annotations

__all__ = [
    "SimClusterError",
    "UsageError",
    "TargetLoadError",
    "UnsupportedError",
    "HookFailure",
    "CollectiveMismatchError",
    "DeadlockError",
    "BackendError",
    "HookContractError",
    "StuckError",
    "ForeignThreadError",
    "HookExited",
    "add_context_note",
]


class SimClusterError(Exception):
    """Root of every exception simcluster raises on its own account."""

    replay: str | None = None

    def with_replay(self, replay: str | None) -> "SimClusterError":
        """Attach a replay line (``seed=… schedule=…``) and return ``self``."""
        if replay and self.replay is None:
            self.replay = replay
            self.args = (f"{self.args[0]}\n  replay: {replay}",) + tuple(self.args[1:])
        return self


class UsageError(SimClusterError, ValueError):
    """The caller passed something invalid (an option, a shape, a rank). Yours to fix."""


class TargetLoadError(UsageError):
    """``module:name`` or ``file.py:name`` could not be loaded or is not callable. Yours to fix."""


class UnsupportedError(SimClusterError, NotImplementedError):
    """The hook used a feature simcluster does not model. Ours: the message names it."""


class HookFailure(SimClusterError):
    """Base of findings: the hook under test broke a rule a real cluster enforces."""


class CollectiveMismatchError(HookFailure):
    """Ranks issued different collectives at the same position of a group's sequence.

    On a real cluster this hangs or silently corrupts data; here it is reported
    with each rank's call.
    """


class DeadlockError(HookFailure):
    """No rank can make progress while futures are still pending.

    On a real cluster every rank hangs in ``backward()``; here the message lists
    each rank's blocked call and what it waits for.
    """


class BackendError(HookFailure, RuntimeError):
    """The modelled backend rejects the call as the real one does (e.g. gloo and ``PREMUL_SUM``).

    A ``RuntimeError`` too, as the real backend's error is, so hook code that catches it
    behaves as it would on a cluster.
    """


class HookContractError(HookFailure):
    """The hook's result breaks what DDP accepts (not a Future, a list, too short, …)."""


class StuckError(SimClusterError):
    """Code blocked outside the simulator's control (a lock, a socket, a plain C++ future).

    simcluster cannot interrupt such a wait; the stuck thread is abandoned as a
    daemon and the run is reported instead of hanging.
    """


class ForeignThreadError(HookFailure):
    """Code on a thread the simulator does not run (one a hook started) touched the simulation.

    On a real cluster a helper thread talks to its own process's group; in the simulation
    it is not a rank, so its collectives, waits and future completions are rejected — at
    once, in that thread, before they reach the engine — and the run never depends on it.
    """


class HookExited(HookFailure):
    """User code tried to end the process (``os._exit``) or ended it (killed, a signal).

    On a real cluster that rank's process dies and its peers hang or crash; here the
    check reports it as a *liveness* failure of the hook, never as the program's exit.
    """


def add_context_note(exc: BaseException, note: str) -> BaseException:
    """Attach ``note`` to ``exc`` (PEP 678) without changing its type; returns ``exc``."""
    notes = getattr(exc, "__notes__", None)
    if notes is None or note not in notes:
        exc.add_note(note)
    return exc
