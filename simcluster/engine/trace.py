"""The trace: what happened in a simulated run, as plain data.

Every event is a small frozen dataclass with only ints, strings and tuples in it —
no tensors, no ``id()``s, no timestamps — so two runs with the same seed produce
*equal* traces (``==``), and a trace can be printed, diffed, or dumped to JSON.

Events, in the order they happened:

* :class:`Posted` — a rank called a collective (``issue`` counts that rank's calls).
* :class:`Completed` — the scheduler completed a matched collective
  (``order`` counts completions in the run; ``choice``/``options`` is the pick).
* :class:`CallbackRan` — a ``.then``/``add_done_callback`` callback ran, and where:
  ``"inline"`` (the future was already complete, so it ran in the caller),
  ``"completion"`` (in the code that completed the future), or
  ``"gloo-worker <group>#<n>"`` (on one of gloo's worker threads of that group).
* :class:`Blocked` / :class:`Resumed` — a rank waited on a pending future.
* :class:`Polled` — the code under test first polled a pending work or future
  (``is_completed()``, ``done()``), and the schedule's answer: now, or after the others ran.
* :class:`Wrapped` — an integer SUM went past its dtype's range (it wraps, silently, on
  gloo and NCCL alike).
* :class:`CopiedBack` — DDP's reducer read a bucket's result from the future the hook
  returned and copied it into the gradients (or found it holding an error).
* :class:`ReadInFlight` — rank code read memory a collective it posted still had in flight
  (recorded only by a reported re-run).

``Trace.collectives()`` summarises each collective across ranks (op, group, ranks,
dtype, shape, bytes, issue and completion order): the table ``simcluster explain``
prints. ``Trace.dtypes()`` lists the dtypes the collectives carried, in order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Union

__all__ = ["Posted", "Completed", "Failed", "Wrapped", "CallbackRan", "Blocked", "Resumed", "Polled", "CopiedBack",
           "ReadInFlight", "Event", "Trace",
           "CollectiveSummary", "waits_in", "returns_from"]


@dataclass(frozen=True)
class Posted:
    rank: int
    op: str
    group: str
    seq: int  # position in the group's sequence of collectives
    issue: int  # this rank's n-th collective call in the run
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    detail: str = ""  # reduce op, root, …


@dataclass(frozen=True)
class Completed:
    op: str
    group: str
    seq: int
    ranks: tuple[int, ...]
    order: int  # n-th completion of the run
    choice: int  # index picked among `options` possible next steps (deliveries, ready collectives, later tasks)
    options: int


@dataclass(frozen=True)
class Failed:
    """The collective just completed failed (its futures hold ``error``): on every rank
    when a backend rejects the call at ``wait()``, as gloo does ``PREMUL_SUM`` and bitwise
    ops on floats; on ``ranks`` only when a gloo barrier re-raises the error of a failed
    collective it waited for there."""

    op: str
    group: str
    seq: int
    error: str
    ranks: tuple[int, ...] = ()  # () : every rank


@dataclass(frozen=True)
class Wrapped:
    """The collective just completed summed integers past its dtype's range in ``elements``
    elements: the sum wrapped around (two's complement, as torch's and gloo's integer adds
    do; no error anywhere). ``example``: the first such element's addends and results."""

    op: str
    group: str
    seq: int
    dtype: str
    elements: int
    example: str


@dataclass(frozen=True)
class CallbackRan:
    rank: int
    future: str
    callback: str
    where: str
    failed: bool = False  # the future it ran on holds an error (a then-callback before it raised)


@dataclass(frozen=True)
class CopiedBack:
    """DDP's reducer on ``rank`` read bucket ``bucket``'s result from the future the hook
    returned (``future``: its label) once it completed, at the end of ``backward()``, and
    copied it into the gradients — or, ``failed``, found it holding an error, which
    ``backward()`` raises (:class:`~simcluster.ddp.model.SimDDP`)."""

    rank: int
    bucket: int
    future: str
    failed: bool = False


@dataclass(frozen=True)
class Blocked:
    rank: int
    future: str
    context: str


@dataclass(frozen=True)
class Resumed:
    rank: int
    future: str


_INSIDE_A_CALL = ("dist.", "the synchronous ")
"""How the label of a wait torch makes *inside a call* begins — ``dist.new_group(…)``, a
collective called with ``async_op=False`` — where the code under test wrote no ``wait()``."""


def waits_in(label: str) -> str:
    """Where code waiting on ``label`` waits, in words (after "blocked"/"blocks"): ``in wait()
    on all_reduce#0 on WORLD`` for a future or work; ``in dist.new_group([0, 1]) …`` or ``in the
    synchronous all_reduce#0 …`` for a wait inside a call. The one wording of the trace, the
    deadlock report and ``explain``."""
    return f"in {label}" if label.startswith(_INSIDE_A_CALL) else f"in wait() on {label}"


def returns_from(label: str) -> str:
    """What the code that waited on ``label`` does when it is done (:func:`waits_in`'s pair)."""
    return f"returns from {label}" if label.startswith(_INSIDE_A_CALL) else f"resumes, {label} is done"


@dataclass(frozen=True)
class Polled:
    """Rank ``rank``'s code polled the pending ``future`` (a work's ``is_completed()``, a
    future's ``done()``) for the first time, and the schedule picked when it looks:
    ``choice`` 0, at once (it answers pending, as a poll right after posting mostly does on
    real gloo); 1, after the others ran as far as they could (recorded then, with what it
    saw: ``complete``)."""

    rank: int
    future: str
    choice: int
    at: str  # the poll's line of user code, ``hooks.py:12``
    complete: bool


@dataclass(frozen=True)
class ReadInFlight:
    """Rank ``rank``'s code read memory that its ``op`` #``seq`` on ``group`` still had in
    flight — posted, not yet complete — with ``how`` (the torch function, ``Tensor.max``) at
    ``site`` (``hooks.py:12 in hook: …``), ``doing`` what (``in DDP iteration 0, bucket 0's
    hook call``). Recorded only by a reported re-run (:class:`~simcluster.engine.write_watch.WriteWatch`)."""

    rank: int
    op: str
    group: str
    seq: int
    how: str
    site: str
    doing: str


Event = Union[Posted, Completed, Failed, Wrapped, CallbackRan, CopiedBack, Blocked, Resumed, Polled, ReadInFlight]


@dataclass(frozen=True)
class CollectiveSummary:
    """One matched collective, seen across ranks."""

    op: str
    group: str
    seq: int
    ranks: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    issue: tuple[int, ...]  # per participating rank
    order: int | None  # completion order, None if it never completed


class Trace:
    """An append-only list of events. Equal seeds give equal traces.

    The engine's hot path records an event as its class and fields,
    ``trace.log((kind, fields))`` (the list's own C ``append``: no Python frame per
    event); the event objects are built only when someone reads
    :attr:`events` (most runs' traces are never read), in the order they were recorded.
    """

    def __init__(self, events: list[Event] | None = None) -> None:
        self._items: list[Event | tuple[type, tuple[object, ...]]] = list(events or [])
        self._built = 0  # items before this index are events already
        self.log: Callable[[Event | tuple[type, tuple[object, ...]]], None] = self._items.append
        """Append ``(kind, fields)``; ``kind(*fields)`` is built when :attr:`events` is read."""

    @property
    def events(self) -> list[Event]:
        items = self._items
        built = min(self._built, len(items))  # (a caller may have shortened the list it was given)
        if built < len(items):
            items[built:] = [item[0](*item[1]) if type(item) is tuple else item for item in items[built:]]
            self._built = len(items)
        return items  # type: ignore[return-value]

    def add(self, event: Event) -> None:
        self._items.append(event)

    def __getstate__(self) -> list[Event]:  # copies and pickles bind their own ``log`` to their own list
        return self.events

    def __setstate__(self, events: list[Event]) -> None:
        self._items = list(events)
        self._built = len(self._items)
        self.log = self._items.append

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trace) and self.events == other.events

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Trace(events={self.events!r})"

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self._items)

    def of(self, kind: type) -> list[Event]:
        """All events of one class, in order."""
        return [e for e in self.events if isinstance(e, kind)]

    def completion_order(self) -> list[tuple[str, str, int]]:
        """``(op, group, seq)`` of each completed collective, in completion order."""
        return [(e.op, e.group, e.seq) for e in self.events if isinstance(e, Completed)]

    def dtypes(self) -> tuple[str, ...]:
        """The dtypes of the tensors the run's collectives carried (``"float16"``, …),
        each once, in the order a rank first posted one of that dtype — what a report
        reasons from when it explains a result's overflow
        (:func:`simcluster.checking.properties.averages`). Calls that carry no tensor
        (a barrier) add nothing."""
        seen: dict[str, None] = {}
        for e in self.events:
            if isinstance(e, Posted) and e.dtype:
                seen.setdefault(e.dtype, None)
        return tuple(seen)

    def wrapped(self) -> list[str]:
        """Each collective whose integer SUM wrapped around (:class:`Wrapped`), in words, in
        the order it happened: ``"all_reduce#0 on WORLD summed uint8 past its range in 3
        elements, e.g. 64 + 64 + 64 + 64 = 256, held as 0 in uint8 (element 0)"``."""
        return [f"{e.op}#{e.seq} on {e.group} summed {e.dtype} past its range in {e.elements} "
                f"element{'s' if e.elements > 1 else ''}, e.g. {e.example}" for e in self.events if isinstance(e, Wrapped)]

    def collectives(self) -> list[CollectiveSummary]:
        """Each collective across ranks, in the order it was first posted."""
        posts: dict[tuple[str, int], list[Posted]] = {}
        for e in self.events:
            if isinstance(e, Posted):
                posts.setdefault((e.group, e.seq), []).append(e)
        done = {(e.group, e.seq): e.order for e in self.events if isinstance(e, Completed)}
        out = []
        for key, ps in posts.items():
            first = ps[0]
            out.append(
                CollectiveSummary(
                    op=first.op,
                    group=first.group,
                    seq=first.seq,
                    ranks=tuple(p.rank for p in ps),
                    dtype=first.dtype,
                    shape=first.shape,
                    nbytes=sum(p.nbytes for p in ps),
                    issue=tuple(p.issue for p in ps),
                    order=done.get(key),
                )
            )
        return out

    def to_json(self) -> str:
        return json.dumps([{"event": type(e).__name__, **asdict(e)} for e in self.events])

    def format(self) -> str:
        """A readable, line-per-event rendering (used by ``simcluster explain``)."""
        lines = []
        for e in self.events:
            if isinstance(e, Posted):
                lines.append(
                    f"rank {e.rank}: posts {e.op} #{e.seq} on {e.group} "
                    f"({e.dtype}{list(e.shape)}, {e.nbytes} B{', ' + e.detail if e.detail else ''})"
                )
            elif isinstance(e, Completed):
                pick = f" (picked {e.choice} of {e.options} ready)" if e.options > 1 else ""
                lines.append(f"         {e.op} #{e.seq} on {e.group} completes on ranks {list(e.ranks)}{pick}")
            elif isinstance(e, Failed):
                where = f"on rank{'s' if len(e.ranks) > 1 else ''} {', '.join(map(str, e.ranks))}" if e.ranks else "on every rank"
                lines.append(f"         {e.op} #{e.seq} on {e.group} FAILS {where}: {e.error}")
            elif isinstance(e, Wrapped):
                lines.append(f"         {e.op} #{e.seq} on {e.group}: the {e.dtype} SUM WRAPS AROUND in {e.elements} "
                             f"element{'s' if e.elements > 1 else ''}, e.g. {e.example} (integer adds wrap silently)")
            elif isinstance(e, CallbackRan):
                lines.append(f"rank {e.rank}: callback {e.callback} of {e.future} runs {e.where}")
            elif isinstance(e, CopiedBack):
                lines.append(f"rank {e.rank}: DDP reads bucket {e.bucket}'s future ({e.future}): "
                             + ("it holds an error, which backward() raises" if e.failed else "copies it into the gradients"))
            elif isinstance(e, Blocked):
                lines.append(f"rank {e.rank}: blocks {waits_in(e.future)} ({e.context})")
            elif isinstance(e, Resumed):
                lines.append(f"rank {e.rank}: {returns_from(e.future)}")
            elif isinstance(e, Polled):
                answer = "complete" if e.complete else "pending"
                when = "at once" if e.choice == 0 else "after the others ran as far as they could (picked 1 of 2)"
                lines.append(f"rank {e.rank}: polls {e.future}{f' at {e.at}' if e.at else ''}, looks {when}: {answer}")
            elif isinstance(e, ReadInFlight):
                lines.append(f"rank {e.rank}: reads memory {e.op} #{e.seq} on {e.group} still has in flight "
                             f"({e.how} at {e.site})")
        return "\n".join(lines)
