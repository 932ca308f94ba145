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

import re
from typing import Any

__all__ = [
    "SimClusterError",
    "UsageError",
    "TargetLoadError",
    "UnsupportedError",
    "HookFailure",
    "CollectiveMismatchError",
    "DeadlockError",
    "BackendRejection",
    "BackendError",
    "BackendTypeError",
    "BackendValueError",
    "backend_error",
    "HookContractError",
    "InFlightReadError",
    "InFlightWriteError",
    "SimulatorBug",
    "NOT_THE_HOOKS",
    "StuckError",
    "ForeignThreadError",
    "HookExited",
    "GradBucketMisuse",
    "GradBucketAttributeError",
    "GradBucketTypeError",
    "GradBucketRuntimeError",
    "CopyBackError",
    "CallbackError",
    "SharedSettingError",
    "ThreadedRankCodeError",
    "GlooRunError",
    "Violation",
    "add_context_note",
    "first_line",
    "innermost_error",
    "exit_meaning",
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


class BackendRejection(HookFailure):
    """The modelled backend rejects the call as the real one does: the base of
    :class:`BackendError`, :class:`BackendValueError` and :class:`BackendTypeError`."""


class BackendError(BackendRejection, RuntimeError):
    """The modelled backend rejects the call as the real one does (e.g. gloo and ``PREMUL_SUM``).

    A ``RuntimeError`` too, as the real backend's error is, so hook code that catches it
    behaves as it would on a cluster. Where the real backend raises another built-in class
    (NCCL: ``ValueError`` for ``BAND``, ``TypeError`` for an unsupported dtype), the error
    is a :class:`BackendValueError` or :class:`BackendTypeError` (:func:`backend_error`):
    an ``except RuntimeError`` in the hook must not catch what it would not catch on a cluster.
    """


class BackendValueError(BackendRejection, ValueError):
    """:class:`BackendError`'s kind for a backend whose real error is a ``ValueError``."""


class BackendTypeError(BackendRejection, TypeError):
    """:class:`BackendError`'s kind for a backend whose real error is a ``TypeError``."""


def backend_error(builtin: type[Exception], message: str) -> BackendRejection:
    """The backend's rejection as raised to the hook: of ``builtin``'s class (``RuntimeError``,
    ``ValueError`` or ``TypeError``), so the hook's ``except`` clauses see what they would.

    >>> isinstance(backend_error(ValueError, "Cannot use ReduceOp.BAND with NCCL"), RuntimeError)
    False
    """
    kind = {ValueError: BackendValueError, TypeError: BackendTypeError}.get(builtin, BackendError)
    return kind(message)


class HookContractError(HookFailure):
    """The hook's result breaks what DDP accepts (not a Future, a list, too short, …)."""


class _Race(HookContractError):
    """A failure that is a race on a real cluster: ``race`` says what raced in one clause
    (``rank 1 wrote to a tensor that all_reduce#0 on WORLD had in flight (float32[8])``),
    which ``simcluster e2e`` quotes as why a real run is one draw of it."""

    def __init__(self, message: str, race: str = "") -> None:  # race: a default, so a pickled copy rebuilds
        super().__init__(message)
        self.race = race or first_line(self)


class InFlightWriteError(_Race):
    """Rank code wrote to a tensor a collective had in flight: after posting it, before it
    completed. On a real backend the collective reads and writes that memory meanwhile, so
    the result mixes values from before and after the write, differently on each rank
    and each run (``docs/gloo-facts.md`` §14)."""


class InFlightReadError(_Race):
    """DDP used memory a collective the rank posted still had in flight: its copy-back read a
    bucket's result before the collective wrote it, or ``backward()`` returned with the
    collective still holding a bucket's buffer, which DDP refills at the next iteration. The
    future the hook returned completed before the collective did (it was not tied to it).
    Real DDP waits on that future only (measured on gloo, ``docs/ddp-facts.md``, "A
    collective the hook's future does not wait for")."""


class SimulatorBug(SimClusterError):
    """simcluster's own code broke while it simulated (an engine step raised): a bug of ours,
    never charged to the hook. Its ``__cause__`` is what raised; the CLI exits 3."""


NOT_THE_HOOKS: tuple[type[BaseException], ...] = (UsageError, UnsupportedError, SimulatorBug)
"""What a simulated step can raise that is not the hook's failure, and is raised on: a usage
error, what the simulator does not model, a bug of the simulator's."""


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


class GradBucketMisuse(HookFailure):
    """The hook used the bucket in a way torch's GradBucket rejects. The hook's to fix.

    Each subclass also derives from the builtin exception the real bucket raises, so
    ``except TypeError`` / ``hasattr`` behave as they would on a real cluster
    (raised by :mod:`simcluster.fake.bucket`).
    """


class GradBucketAttributeError(GradBucketMisuse, AttributeError):
    """A method this API generation lacks, or an attribute set on the bucket."""


class GradBucketTypeError(GradBucketMisuse, TypeError):
    """A non-tensor passed to ``set_buffer``, or an attempt to pickle or copy the bucket."""


class GradBucketRuntimeError(GradBucketMisuse, RuntimeError):
    """``gradients()`` on a buffer (from ``set_buffer``) that cannot hold the parameters."""


class CopyBackError(HookContractError, RuntimeError):
    """DDP's reducer cannot copy the hook's result back into ``p.grad``. The hook's to fix.

    The message begins with what real DDP raises from ``backward()`` (a
    ``RuntimeError``), then says where (rank, bucket, iteration) and how to replay
    (raised by :mod:`simcluster.fake.reducer`).
    """


class CallbackError(HookFailure, RuntimeError):
    """A ``then`` callback of the hook raised: the future DDP got is errored, and real DDP
    raises the callback's error from ``backward()`` on that rank while the other ranks go
    on. The hook's own exception, so charged to *liveness*, not to DDP's contract; the
    message begins with torch's own (``Got the following error when running the callback:
    …``), then says where (raised by :mod:`simcluster.fake.reducer`)."""


class SharedSettingError(UnsupportedError):
    """A rank changed a process-wide setting that every simulated rank shares
    (:mod:`simcluster.usercode.rank_state`)."""


class ThreadedRankCodeError(UnsupportedError):
    """Code on a thread a rank started posted a collective, waited or completed a future.

    The thread got a :class:`ForeignThreadError` at once, so the run never depended on its
    timing; but on a real cluster that call would have run on the rank's own process group,
    so what the simulation then saw (a deadlock, a fallback path) is not what a cluster would
    do. The check gives no verdict rather than a wrong one (raised by
    :mod:`simcluster.fake.cluster` when the run ends)."""


class GlooRunError(SimClusterError):
    """A real-gloo job failed: a rank raised, died, or did not finish in time.

    Whose problem: usually the job's (the function raised, or its ranks issued mismatched
    collectives); the message says which rank failed first and shows its traceback.
    Attributes: ``failures`` maps rank → traceback or exit description, ``unfinished``
    lists ranks that were killed by the watchdog, ``reproduce`` is a command line
    (raised by :mod:`simcluster.real.gloo_runner`).
    """

    def __init__(self, message: str, *, failures: dict[int, str], unfinished: list[int],
                 reproduce: str) -> None:
        super().__init__(message)
        self.failures = failures
        self.unfinished = unfinished
        self.reproduce = reproduce


class Violation(SimClusterError, AssertionError):
    """A property failed on one example (a finding of ``simcluster check``); ``prop`` names
    the property, ``info`` holds the failure's fields.

    An ``AssertionError`` too, as Hypothesis expects of a failing test. The checker makes
    one subclass per property (and per distinct bug), so Hypothesis tells failures apart.
    """

    prop = ""

    def __init__(self, message: str, info: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.info = {} if info is None else info
        self.reruns: dict[str, Any] = {}
        """The example run again up to the failing step, by generator mode: the baseline the
        report's experiments share (:func:`simcluster.checking.judge.order_hint` and the
        hints after it), simulated once."""


def first_line(exc: BaseException, *, typed: bool = False) -> str:
    """The first line of ``exc``'s message (``""`` if it has none); ``typed``: prefixed by its
    type, ``"ValueError: bad value"`` (just ``"ValueError"`` when the message is empty).

    >>> first_line(ValueError("\\n bad value\\nmore")), first_line(KeyError(), typed=True)
    ('bad value', 'KeyError')
    """
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if not typed:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def innermost_error(message: str) -> str | None:
    """The innermost exception type the first line of ``message`` names, ``None`` if none:
    a callback's error reaches DDP wrapped once per callback, by name only (``Got the
    following error when running the callback: RuntimeError: Got the following error when
    running the callback: IndexError: …``).

    >>> innermost_error("Got the following error when running the callback: IndexError: list index out of range")
    'IndexError'
    >>> innermost_error("no type here") is None
    True
    """
    lines = message.strip().splitlines()
    named = re.findall(r"\b([A-Z]\w*(?:Error|Exception)): ", lines[0] if lines else "")
    return named[-1] if named else None


def exit_meaning(error: BaseException, who: str = "the hook") -> str | None:
    """What a hook's (or ``who``'s: its state factory's) ``sys.exit(code)`` means on a real
    cluster (None for any other error).

    >>> exit_meaning(SystemExit(0))
    "the hook called sys.exit(0) (SystemExit): on a real cluster this rank's process ends here and its peers hang or crash"
    """
    if not isinstance(error, SystemExit):
        return None
    return (f"{who} called sys.exit({error.code!r}) (SystemExit): on a real cluster this rank's process ends here "
            "and its peers hang or crash")


TORCHRUN_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
})
"""The variables ``torchrun`` sets in every rank's process environment (torch.distributed.run)."""


def launcher_environment_note(error: BaseException) -> str | None:
    """The hint for a hook that read one of :data:`TORCHRUN_VARIABLES` from ``os.environ``
    and got ``KeyError`` (None for any other error): simcluster's simulated ranks — and e2e's
    real ones, unless e2e itself runs under torchrun — are not started by torchrun, so the
    failure is the harness's missing launcher environment, not necessarily the hook's bug
    (hivemind's ``custom_post_localSGD_hook``, hooks from the wild round 9, logs
    ``os.environ['LOCAL_RANK']``).

    >>> import os
    >>> try:
    ...     os.environ["LOCAL_RANK_NOT_SET_X"]
    ... except KeyError as e:
    ...     launcher_environment_note(e) is None   # not a torchrun variable
    True
    """
    if not isinstance(error, KeyError) or not error.args or error.args[0] not in TORCHRUN_VARIABLES:
        return None
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_code.co_name != "__getitem__" or tb.tb_frame.f_globals.get("__name__") != "os":
        return None
    return (f"simcluster: hint: os.environ[{error.args[0]!r}] is set by torchrun in each rank's process; simcluster's "
            "simulated ranks (and simcluster e2e's real ones, unless e2e itself runs under torchrun) are not started "
            "by torchrun and see none of its variables (RANK, LOCAL_RANK, WORLD_SIZE, ...), so this KeyError says "
            "the hook depends on its launcher, not that it fails under torchrun; --launcher torchrun "
            "(Python: launcher='torchrun') gives every simulated rank torchrun's variables with its own "
            "values; dist.get_rank() and dist.get_world_size() are what every launcher provides")


def add_context_note(exc: BaseException, note: str) -> BaseException:
    """Attach ``note`` to ``exc`` (PEP 678) without changing its type; returns ``exc``."""
    notes = getattr(exc, "__notes__", None)
    if notes is None or note not in notes:
        exc.add_note(note)
    return exc


class SimulatorFidelityError(SimClusterError):
    """The simulation and real gloo disagree on the same scenario: a fidelity bug of
    simcluster, not of the hook (so not an ``AssertionError``). Not the user's to fix: report it.

    Raised by the pytest plugin's ``assert_hook(..., e2e=True)``; the CLI's ``check --e2e``
    exits 4 instead. ``summary`` is the :class:`~simcluster.real.e2e_check.E2ESummary`.
    """

    def __init__(self, message: str, summary: Any) -> None:
        super().__init__(message)
        self.summary = summary
