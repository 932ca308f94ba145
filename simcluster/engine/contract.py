"""The engine contract: what the fake torch parts may ask of an engine, and what they hand it.

Two engines run simulated ranks: the deterministic baton engine
(:class:`simcluster.engine.inline.Engine`, every hook check) and the free-running one
(:class:`simcluster.engine.threaded.ThreadedEngine`, torch's real C++ reducer). The
process group and the futures (:mod:`simcluster.fake`) work with either, through
:class:`EngineContract` only:

* a process group builds a :class:`Call` for the rank's part of a collective and
  :meth:`~EngineContract.post`\\ s it;
* a future that code waits on is a :class:`Waitable`; ``wait()`` on a pending one calls
  :meth:`~EngineContract.block_until`, and the DDP model "waits" the reducer's way with
  :meth:`~EngineContract.expect` (no thread hand-over);
* completing a future first asks :meth:`~EngineContract.check_thread` (except where the
  simulator completes it itself, on a thread the engine runs: a delivery, a ``then`` child);
* callbacks are traced with :attr:`~EngineContract.current_rank` and
  :attr:`~EngineContract.where`.

Both protocols are ``runtime_checkable``, so ``isinstance(engine, EngineContract)`` checks
that every member is present (not their signatures; ``tests/test_engine_contract.py``
checks those). This module knows no torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, runtime_checkable

from simcluster.engine.trace import Trace
from simcluster.errors import SimClusterError

__all__ = ["Call", "EngineContract", "InFlight", "RunAborted", "Waitable", "when_all_done"]


class RunAborted(BaseException):
    """Raised inside rank code to unwind it when the run is aborted.

    A ``BaseException`` so that a hook's ``except Exception`` does not swallow it.
    """


@runtime_checkable
class Waitable(Protocol):
    """Something a rank can wait on (a simulated future, a work's "callbacks ran" flag).

    ``on_done(resume)`` calls ``resume`` once the waitable completes — at once if it
    already has; the engine uses it to resume a parked waiter or to retire an expectation.
    """

    label: str

    def done(self) -> bool: ...

    def on_done(self, resume: Callable[[], None]) -> None: ...


def when_all_done(waitables: Sequence[Waitable], then: Callable[[], None],
                  lock: contextlib.AbstractContextManager[Any] | None = None) -> None:
    """Call ``then`` once, when the last of ``waitables`` is done (each one's ``on_done``
    counts down; ``lock`` guards the count where they may finish on different threads).
    How a call's part waits for its :attr:`Call.after` in either engine."""
    left = [len(waitables)]
    guard = lock if lock is not None else contextlib.nullcontext()

    def one_done() -> None:
        with guard:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for waitable in waitables:
        waitable.on_done(one_done)


class InFlight(Protocol):
    """The layer above's record of what a posted call has in flight (its tensors, as the
    process group saw them at the post): the engine knows no tensors, only this question."""

    def written(self) -> tuple[str, str] | None:
        """None when nothing was written since the post; else which tensor was, in words
        (``float32[3]``, ``its tensor 2 of 2, float32[3]``), and a caveat on how the write
        was seen (``''`` when sure). Asked once, at the completion: what it kept is let go."""
        ...

    def holds(self, tensor: Any) -> bool:
        """Whether ``tensor``'s memory overlaps one of the tensors in flight (DDP reading a
        result the collective still writes: :class:`~simcluster.ddp.model.SimDDP`)."""
        ...

    def changed(self) -> bool:
        """Whether :meth:`written` would say a tensor was written, asked before the completion
        without letting anything go: after each user line of a reported re-run
        (:class:`~simcluster.engine.write_watch.WriteWatch`, which names the line that wrote)."""
        ...


@dataclass(slots=True)
class Call:
    """One rank's part of a collective (or point-to-point transfer).

    ``channel`` and the per-rank sequence number match calls across ranks: the k-th
    call of every rank on a channel belongs to the same collective. ``signature`` must
    be equal on every rank (its first item names the kind of call, the rest — dtypes,
    shapes, reduce op, root, … — also make up :attr:`describe`) or the run fails with
    :class:`~simcluster.errors.CollectiveMismatchError`. ``compute`` (called once, with
    every rank's call, in the order of ``ranks``) returns each rank's result; ``deliver``
    hands a rank its result. ``after`` holds what this rank's part waits for before it
    executes (it holds its backend worker meanwhile): gloo's ``barrier`` waits for every
    earlier collective of its group on that rank to finish, callbacks included.
    ``posted_at`` is the user line that posted it (and the user line that called that one:
    :func:`~simcluster.engine.frames.posting_site`), recorded only by a run that asks for
    posting lines (finding it walks the stack: never on the hot path); a deadlock report
    names it beside each call some rank never matched. ``posted_in`` (recorded with it) is
    what the rank's code was doing: ``in DDP iteration 1, bucket 0's hook call`` (the layer
    above says so: :attr:`~simcluster.engine.inline.Engine.doing`), or ``in a callback of
    all_reduce#0 on WORLD (posted in …)`` when a completion's callback posted it; ``""``
    when unknown.

    The process group builds one per collective and rank *positionally* (a class called with
    keywords costs a dict per call): a new field goes after ``after``, or every builder changes.
    ``in_flight`` (below) is set after, by attribute.
    """

    rank: int
    channel: str
    ranks: tuple[int, ...]
    op: str
    signature: tuple[Any, ...]
    compute: Callable[[dict[int, "Call"]], dict[int, Any]]
    deliver: Callable[[Any], None]
    dtype: str = ""
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    detail: str = ""
    uses_worker: bool = True
    payload: Any = None
    after: tuple[Waitable, ...] = ()
    seq: int = -1
    worker: int = -1
    posted_at: str | None = None
    posted_in: str = ""
    in_flight: "InFlight | None" = None
    """What the call reads or writes in flight, as it was when posted (the process group's
    record of its tensors), asked at the completion whether the rank wrote to it meanwhile:
    :func:`~simcluster.engine.matching.written_in_flight`."""
    written_at: str = ""
    """The user line that wrote to a tensor of :attr:`in_flight` before the completion
    (``hooks.py:21 in hook: view.copy_(bucket.buffer())``, as :attr:`posted_at`), found only by
    a run that records posting lines (:class:`~simcluster.engine.write_watch.WriteWatch`);
    ``""`` when not found."""
    written_in: str = ""
    """What the rank's code was doing when it wrote there (as :attr:`posted_in`)."""
    written_by: str = ""
    """Who wrote to a tensor of :attr:`in_flight` when it was not the rank's code but the layer
    above on its behalf — ``DDP's copy-back of bucket 0's result into p.grad, …`` (a view of the
    bucket's buffer under ``gradient_as_bucket_view``: :class:`~simcluster.ddp.model.SimDDP`);
    ``""`` when not known."""

    @property
    def describe(self) -> str:
        """``op(arg, …)`` for error messages, from the signature (built only when an error needs it)."""
        return f"{self.op}({', '.join(str(s) for s in self.signature[1:])})"


@runtime_checkable
class EngineContract(Protocol):
    """What both engines offer the process group, the futures and the DDP model.

    ``running`` is true while :meth:`run` is in progress; ``failures`` collects
    ``(rank, label, exception)`` for exceptions that escaped rank code; ``trace`` is the
    run's event log. Each engine's own ``run`` differs (tasks spawned beforehand vs one
    function per rank) and is not part of the contract.
    """

    trace: Trace
    running: bool
    failures: list[tuple[int, str, BaseException]]

    @property
    def current_rank(self) -> int | None:
        """The rank whose code runs now, on the calling thread (None outside the run)."""
        ...

    @property
    def where(self) -> str:
        """Where that code runs: ``"rank <r>"`` or a backend worker's name."""
        ...

    def post(self, call: Call) -> None:
        """Post the running rank's part of a collective; it completes later."""
        ...

    def block_until(self, waitable: Waitable, context: str = "") -> None:
        """Return once ``waitable`` is done; other ranks run meanwhile."""
        ...

    def let_others_run(self, polled: Waitable, at: str = "") -> None:
        """The running rank's code polled ``polled`` (at the user line ``at``) and found it
        pending: let the other ranks and the backend make progress before it looks again
        (or, on a first poll, when the schedule says), as a real backend's threads do while
        a rank polls."""
        ...

    def expect(self, rank: int, waitable: Waitable, context: str) -> None:
        """Note that ``waitable`` must complete before the run may end, blocking no one."""
        ...

    def choose(self, options: int) -> int:
        """A pick among ``options`` outcomes that real timing decides between (a gloo barrier
        behind a failed work: re-raise its error or not); 0 is what a quiet cluster mostly does."""
        ...

    def check_thread(self, what: str) -> None:
        """Raise if the calling thread may not do ``what`` (a collective, a wait, a completion)."""
        ...

    def pending_ops(self, channel: str) -> list[str]:
        """The ops of the calls posted on ``channel`` that have not completed yet."""
        ...

    def open_calls(self, rank: int) -> list[Call]:
        """The calls ``rank`` posted that have not completed yet, oldest collective first (what
        DDP's copy-back asks before it reads a result: :class:`~simcluster.ddp.model.SimDDP`)."""
        ...

    def abort(self, error: SimClusterError) -> NoReturn:
        """End the run with ``error`` — a rule of the real cluster the running rank's code
        broke, found outside a collective's matching (e.g. two groups made under one name)
        — as its outcome: raises :class:`RunAborted` into that code, which no ``except
        Exception`` in it can swallow."""
        ...
