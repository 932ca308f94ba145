"""Matching posted calls into collectives: one home for both engines.

The k-th call a rank posts on a channel (a group, or one point-to-point direction and
tag) belongs to the k-th collective of that channel. :class:`Matcher` numbers each
posted call, records it in the trace (:class:`~simcluster.engine.trace.Posted`), files
it under its collective (an :class:`Instance`), checks that it agrees with the calls
already there, and closes a collective when it completes
(:class:`~simcluster.engine.trace.Completed`, numbered in completion order). Both
engines use it — the baton engine (:mod:`simcluster.engine.inline`) and the free-running
one (:mod:`simcluster.engine.threaded`) — so sequence numbers, trace events and the
wording of every matching error are the same in both.

The messages built here:

* :func:`mismatch_error` — ranks posted different calls at the same position;
* :func:`compute_failure` — the calls agree in signature but cannot be combined
  (e.g. ``all_to_all`` split sizes that do not fit);
* :func:`unmatched_line` — a collective some ranks never posted (deadlock reports), with
  the user line each rank that did post it posted it at, when the run recorded them
  (``Call.posted_at``);
* :attr:`Matcher.crossed` — when the run records posting lines, the first completed
  collective of each channel whose calls came from different user lines: matching goes by
  position alone (as on a real cluster), so a deadlock or mismatch later on that channel
  may have begun there — one rank's extra call met another rank's intended one.

Example (a two-rank group where rank 1 posts a different reduce op)::

    matcher = Matcher(trace)
    inst, error = matcher.post(call_of_rank_0)   # opens call #0 on WORLD: error is None
    inst, error = matcher.post(call_of_rank_1)   # error: "mismatched collectives on WORLD …"
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from simcluster.engine.contract import Call
from simcluster.engine.frames import stack_user_frames
from simcluster.engine.trace import Completed, Posted, Trace
from simcluster.errors import CollectiveMismatchError, InFlightWriteError, UnsupportedError

__all__ = [
    "Instance", "Matcher", "MAX_LISTED", "compute_failure", "crossed_lines", "mismatch_error", "posted_at_lines",
    "rank_list", "unmatched_line", "unmatched_lines", "written_in_flight",
]

MAX_LISTED = 8
"""Entries of one kind a deadlock message lists before summarising the rest."""


@dataclass
class Instance:
    """One collective of one channel: the calls posted for it so far.

    ``first`` is the call that opened it; ``executing`` the ranks whose part holds a
    backend worker (the baton engine's bookkeeping; the free-running one leaves it empty);
    ``gated`` the ranks whose part still waits for its ``Call.after`` (both engines).
    """

    channel: str
    seq: int
    ranks: tuple[int, ...]
    calls: dict[int, Call] = field(default_factory=dict)
    executing: set[int] = field(default_factory=set)
    first: Call | None = None
    gated: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        """Whether every participant has posted its call."""
        return len(self.calls) == len(self.ranks)


class Matcher:
    """Numbers posted calls and files them under their collective (see the module docstring).

    Not thread-safe: the free-running engine calls it under its lock.
    """

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.open: dict[tuple[str, int], Instance] = {}
        self.completions = 0
        self._seq: dict[tuple[int, str], int] = {}
        self._issued: dict[int, int] = {}
        self.crossed: dict[str, str] = {}
        """Per channel, the report lines of its first completed collective whose calls were
        posted at different user lines (:func:`crossed_lines`; only when the run records
        posting lines, ``Call.posted_at``)."""

    def post(self, call: Call) -> tuple[Instance, CollectiveMismatchError | None]:
        """Number ``call`` (its ``seq`` on its channel), trace it, and file it.

        Returns its collective and ``None``, or — if it disagrees with the calls already
        posted there — the mismatch error (the call is then not filed).
        """
        key = (call.rank, call.channel)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        call.seq = seq
        issue = self._issued.get(call.rank, 0)
        self._issued[call.rank] = issue + 1
        self.trace.log(
            (Posted, (call.rank, call.op, call.channel, seq, issue, call.dtype, call.shape, call.nbytes, call.detail))
        )
        inst = self.open.get((call.channel, seq))
        if inst is None:
            inst = self.open[(call.channel, seq)] = Instance(call.channel, seq, call.ranks, first=call)
        elif call.signature != inst.first.signature or call.ranks != inst.first.ranks or call.rank in inst.calls:  # type: ignore[union-attr]
            problem = _mismatch_problem(inst, call)  # the agreeing case, the common one, is decided above
            if problem is not None:
                return inst, mismatch_error(inst, call, problem, self.crossed.get(inst.channel))
        inst.calls[call.rank] = call
        return inst, None

    def posted(self) -> int:
        """How many calls every rank posted so far (a measure of progress)."""
        return sum(self._issued.values())

    def close(self, inst: Instance, op: str, choice: int = 0, options: int = 1) -> None:
        """``inst`` completes now: forget it and trace the completion (``choice`` of ``options``
        is the scheduler's pick that completed it; the free-running engine has no choice)."""
        del self.open[(inst.channel, inst.seq)]
        first = inst.first
        if first is not None and first.posted_at is not None and inst.channel not in self.crossed:
            lines = crossed_lines(inst)
            if lines is not None:
                self.crossed[inst.channel] = lines
        self.trace.log((Completed, (op, inst.channel, inst.seq, inst.ranks, self.completions, choice, options)))
        self.completions += 1

    def pending_ops(self, channel: str) -> list[str]:
        """The ops of the calls posted on ``channel`` that have not completed yet."""
        return [inst.first.op for inst in self.open.values() if inst.channel == channel and inst.first]

    def open_calls(self, rank: int) -> list[Call]:
        """The calls ``rank`` posted that have not completed yet, in the order their collectives opened."""
        return [inst.calls[rank] for inst in self.open.values() if rank in inst.calls]

    def take_open(self) -> list[Instance]:
        """Every open collective, forgotten (the run is being aborted)."""
        pending, self.open = list(self.open.values()), {}
        return pending


def _mismatch_problem(inst: Instance, call: Call) -> str | None:
    first = inst.first
    assert first is not None
    if call.rank in inst.calls:
        return f"rank {call.rank} posted twice at position {inst.seq} of {inst.channel}"
    if call.ranks != first.ranks:
        return f"ranks disagree on the group's members: {list(first.ranks)} vs {list(call.ranks)}"
    if call.signature != first.signature:
        return "ranks issued different collectives at the same position of the group's sequence"
    return None


def mismatch_error(inst: Instance, call: Call, problem: str, crossed: str | None = None) -> CollectiveMismatchError:
    """The error for ``call`` disagreeing with ``inst``'s first call: both calls, the user
    line that posted ``call`` (from the calling stack) and, when the run records posting
    lines (``Call.posted_at``), the one that posted the first — either may be the culprit
    (an extra call on one rank makes the *other* rank's innocent call the mismatched one) —
    and which ranks agree with the first; then ``crossed``, an earlier collective of the
    channel that met calls from different lines (:attr:`Matcher.crossed`), if any."""
    first = inst.first
    assert first is not None
    frames = stack_user_frames(sys._getframe(1))
    at = f" at {frames[-1]}" if frames else ""
    if call.posted_in:  # the run records posting lines: what the rank's code was doing, on a line of its own
        at = f"{at}\n    rank {call.rank} posted it {call.posted_in}"
    first_at = "".join(f"\n{line}" for line in posted_at_lines({first.rank: first}))
    others = sorted(r for r in inst.calls if r != first.rank)
    agree = f"\n  ranks {rank_list(others)} posted what rank {first.rank} posted" if others else ""
    error = CollectiveMismatchError(
        f"mismatched collectives on {inst.channel} (call #{inst.seq} of that group): {problem}\n"
        f"  rank {first.rank}: {first.describe}{first_at}\n  rank {call.rank}: {call.describe}{at}{agree}\n"
        f"{crossed + chr(10) if crossed else ''}"
        "On a real cluster this hangs, aborts a process (gloo: SIGABRT when sizes differ) or silently mixes up data."
    )
    error.simcluster_frames = frames  # type: ignore[attr-defined]
    error.simcluster_identity = _mismatch_identity(problem, first, call)  # type: ignore[attr-defined]
    return error


def _mismatch_identity(problem: str, first: Call, call: Call) -> str:
    """What makes a mismatch one bug, whichever rank posted first: the problem and the two
    calls' ops and dtypes, sorted (a branch on local data made rank 0 post bf16 and rank 1
    fp32 in one example and the reverse in another: two "distinct" bugs, reported twice as
    mirror images — a round of hooks written outside the project, 2026-12-07). Not the
    posting line: the report names the line of the call that completed the mismatch, which
    is either side's."""
    def kind(c: Call) -> str:
        head = c.signature[0] if c.signature and isinstance(c.signature[0], str) else ""
        return f"{c.op}({head})"
    return f"{problem}: {' vs '.join(sorted({kind(first), kind(call)}))}"


def compute_failure(inst: Instance, computed: Call, exc: Exception) -> CollectiveMismatchError | UnsupportedError:
    """The error for a collective whose calls agree in signature but whose ``compute``
    (``computed``'s) raised ``exc``: they do not fit together. Lists each distinct call once.

    An ``UnsupportedError`` (``compute`` met what the simulator does not model: a reduce_scatter
    of a non-contiguous tensor, a view with gaps) stays one: the run then has no verdict. It was
    reported as a mismatch — a finding — where real gloo runs such calls (probing through e2e,
    stop 42)."""
    if isinstance(exc, UnsupportedError):
        return UnsupportedError(f"{computed.op} #{inst.seq} on {inst.channel}: {exc}\n{_calls_by_description(inst.calls)}")
    return CollectiveMismatchError(
        f"{computed.op} #{inst.seq} on {inst.channel}: ranks' calls do not fit together: {exc}\n"
        f"{_calls_by_description(inst.calls)}"
    )


def written_in_flight(inst: Instance) -> InFlightWriteError | None:
    """The error for ``inst`` if some rank wrote to a tensor its call had in flight — after
    posting it, before this completion — else None: each call's :attr:`Call.in_flight` (the
    process group's record, :class:`~simcluster.fake.process_group.InFlightTensors`) says.
    Checked by the inline engine just before the collective computes; a write after that,
    before the rank saw the completion, is a race on a real cluster too but is not seen (the
    threaded engine, whose ranks run on their own, checks nothing: what it saw would be timing).
    A collective of a one-rank group is never reported: it moves no data, so a write meets no
    transfer (the shrinker took such failures to world 1, where the report's "differently on
    each rank" was no longer true)."""
    writers: list[int] = []
    told: tuple[str, str] | None = None  # the first writer's tensor, in words, and the caveat
    moves_data = len(inst.ranks) > 1  # a group of one rank does not: nothing to race with (round 23 of hooks from the wild)
    for rank in inst.ranks:
        in_flight = inst.calls[rank].in_flight
        written = in_flight.written() if in_flight is not None else None  # asked always: it lets go of its copies
        if written is not None and moves_data:
            writers.append(rank)
            told = told or written
    if told is None:
        return None
    call = inst.calls[writers[0]]
    what, caveat = told
    who = f"rank {writers[0]}" if len(writers) == 1 else f"ranks {rank_list(writers)}"
    race = f"{who} wrote to a tensor that {call.op}#{inst.seq} on {inst.channel} had in flight ({what})"
    return InFlightWriteError(
        f"{race}: after posting it, before it completed (the rank's code wrote it, or another collective of the rank wrote its result into "
        f"the same memory){caveat}. On a real backend the collective "
        "reads and writes that memory meanwhile (gloo: on its worker thread), so the result mixes values from before "
        "and after the write, differently on each rank and each run (measured on gloo, an in-place division right "
        "after posting an all_reduce: 165 of 300 results wrong at world 2, the ranks disagreeing in 108; "
        "docs/gloo-facts.md §14). Write to it only once the work completed (work.wait(), or in a then() callback), "
        "or post a copy\n" + "\n".join(posted_at_lines({r: inst.calls[r] for r in writers})
                                        + written_at_lines({r: inst.calls[r] for r in writers})), race)


def written_at_lines(calls: dict[int, Call], indent: str = "    ") -> list[str]:
    """``rank 1, in DDP iteration 1, bucket 1's hook call, wrote to it at hooks.py:21 in hook: …``
    for ``calls`` (rank -> call) whose writing line a reported re-run found
    (:attr:`Call.written_at`, :class:`~simcluster.engine.write_watch.WriteWatch`), as
    :func:`posted_at_lines` words the posting lines; before them, one line per rank whose
    writer was the layer above (:attr:`Call.written_by`: ``rank 0: DDP's copy-back …``)."""
    by = [f"{indent}{_ranks([rank])}: {call.written_by}" for rank, call in sorted(calls.items())
          if call.written_by and not call.written_at][:MAX_LISTED]
    return by + _site_lines([(rank, call.written_in, call.written_at) for rank, call in sorted(calls.items())
                             if call.written_at], "wrote to it", "written", indent)


def unmatched_line(inst: Instance) -> str | None:
    """The entry of a deadlock report for ``inst`` if some participant never posted its call
    (for point-to-point: the missing send or recv and its peer), else ``None``: one line,
    then one per user line the call was posted at when the run recorded them
    (:func:`posted_at_lines`)."""
    first = inst.first
    missing = [r for r in inst.ranks if r not in inst.calls]
    if first is None:
        return None
    if len(set(inst.ranks)) < len(inst.ranks):  # a rank's send/recv to itself
        line = _p2p_unmatched(first, inst, [first.rank])
    elif missing and first.op in ("send", "recv"):
        line = _p2p_unmatched(first, inst, missing)
    elif missing:
        line = (f"  {first.describe} (call #{inst.seq} on {inst.channel}): posted by ranks "
                f"{rank_list(sorted(inst.calls))}, never posted by ranks {rank_list(missing)}")
    else:
        return None
    return "\n".join([line, *posted_at_lines(inst.calls)])


def unmatched_lines(instances: Iterable[Instance], crossed: dict[str, str]) -> list[str]:
    """:func:`unmatched_line` for each of ``instances`` some rank never posted, in (group,
    position) order; after a group's first, that group's entry of ``crossed``
    (:attr:`Matcher.crossed`), where the ranks' sequences may have parted."""
    lines: list[str] = []
    told: set[str] = set()
    for inst in sorted(instances, key=lambda i: (i.channel, i.seq)):
        line = unmatched_line(inst)
        if line is None:
            continue
        if inst.channel in crossed and inst.channel not in told:
            told.add(inst.channel)
            line = f"{line}\n{crossed[inst.channel]}"
        lines.append(line)
    return lines


def crossed_lines(inst: Instance) -> str | None:
    """The report lines for a completed collective whose calls were posted at different
    user lines (``Call.posted_at``), else None: collectives are matched by their position
    in each rank's sequence alone, on a real cluster as here, so these met; when they were
    not meant to (one rank's extra call met another's intended one), a later deadlock or
    mismatch on the channel began here. Point-to-point calls (a send meets a recv at
    another line by design) are never listed."""
    first = inst.first
    if first is None or first.op in ("send", "recv") or len({c.posted_at for c in inst.calls.values()}) < 2:
        return None
    return "\n".join([f"  earlier, {first.describe} (call #{inst.seq} on {inst.channel}) met calls posted at "
                      "different lines — collectives meet by their order alone, on a real cluster too; if these "
                      "were not meant to meet, the ranks' sequences parted here:",
                      *posted_at_lines(inst.calls)])


def posted_at_lines(calls: dict[int, Call], indent: str = "    ") -> list[str]:
    """``rank 0 posted it at hooks.py:12 in hook: source`` for ``calls`` (rank -> call), ranks
    that posted at the same line (and in the same hook call or callback) together, in rank
    order, with what their code was doing when known (``rank 0, in DDP iteration 1, bucket 0's
    hook call, posted it at …``: ``Call.posted_in``); none for calls whose line was not
    recorded (``Call.posted_at``: only a run that asks for posting lines records them).
    At most :data:`MAX_LISTED` lines, then a count."""
    return _site_lines([(rank, call.posted_in, call.posted_at) for rank, call in sorted(calls.items())
                        if call.posted_at is not None], "posted it", "posted", indent)


def _site_lines(sites: list[tuple[int, str, str]], did: str, done: str, indent: str) -> list[str]:
    """One line per place — ``(rank, what its code was doing, where)`` — ranks at the same
    place together: ``ranks [0, 1], in …, <did> at <where>``; at most :data:`MAX_LISTED`
    lines, then a count of the places left out (``… and 3 more lines it was <done> at``)."""
    ranks_at: dict[tuple[str, str], list[int]] = {}
    for rank, doing, where in sites:
        ranks_at.setdefault((doing, where), []).append(rank)
    lines = [f"{indent}{_ranks(ranks)}{f', {doing},' if doing else ''} {did} at {where}"
             for (doing, where), ranks in ranks_at.items()]
    if len(lines) > MAX_LISTED:
        lines = lines[:MAX_LISTED] + [f"{indent}… and {len(lines) - MAX_LISTED} more lines it was {done} at"]
    return lines


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` for one rank, else ``ranks [0, 1]`` (:func:`rank_list`)."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


def rank_list(ranks: list[int], limit: int = 8) -> str:
    """``[0, 1, 2]``; a long run of ranks as ``[0..999] (1000 ranks)``; else the first few and a count."""
    if len(ranks) <= limit:
        return str(list(ranks))
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)} ranks)"
    return f"[{', '.join(map(str, ranks[:limit]))}, …] ({len(ranks)} ranks)"


def _calls_by_description(calls: dict[int, Call]) -> str:
    """Each distinct call once, with the ranks that posted it (``  ranks [0..6]: all_reduce(…)``)."""
    groups: dict[str, list[int]] = {}
    for rank, call in sorted(calls.items()):
        groups.setdefault(call.describe, []).append(rank)
    lines = [f"  {_ranks(rs)}: {d}" for d, rs in groups.items()]
    more = len(lines) - MAX_LISTED
    return "\n".join(lines[:MAX_LISTED] + ([f"  … and {more} more distinct calls"] if more > 0 else []))


def _p2p_unmatched(first: Call, inst: Instance, missing: list[int]) -> str:
    """A point-to-point call whose counterpart never came: who posted what, who owes which call."""
    peer = missing[0]
    other = "recv" if first.op == "send" else "send"
    name = "itself" if peer == first.rank else f"rank {peer}"
    direction = f"to {name}" if first.op == "send" else f"from {name}"
    back = "itself" if peer == first.rank else f"rank {first.rank}"
    back = f"from {back}" if other == "recv" else f"to {back}"
    return (f"  rank {first.rank}: {first.describe} {direction} (call #{inst.seq} on {inst.channel}) is unmatched: "
            f"rank {peer} never posted the matching {other} {back}")
