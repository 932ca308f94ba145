"""The baton engine's deadlock report: what every rank is stuck on, and why.

When nothing can run, nothing is ready and work is still pending
(:mod:`simcluster.engine.inline`, rule 4), :func:`describe_blockage` lists, each kind at
most :data:`~simcluster.engine.matching.MAX_LISTED` times:

* each parked wait, with the user line it waits at (read from the parked thread's stack), and
  each rank polling a pending work or future (``Work.is_completed()``, ``Future.done()``);
* each expectation (a future the reducer waits on) that never completes;
* each collective some rank never posted (:func:`~simcluster.engine.matching.unmatched_lines`),
  then, for its group, an earlier collective that met calls from different user lines
  (:attr:`~simcluster.engine.matching.Matcher.crossed`: where the ranks' sequences may have parted);
* each call queued behind busy backend worker threads, or (gloo's barrier) waiting for its
  group's earlier collectives;
* each thread rank code started (not a rank: its collectives are rejected).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from simcluster.engine.frames import stack_user_frames
from simcluster.engine.matching import MAX_LISTED, Instance, rank_list, unmatched_lines
from simcluster.engine.trace import waits_in

__all__ = ["Parked", "describe_blockage"]


@dataclass(frozen=True)
class Parked:
    """A rank's code parked in a wait: on which OS thread, which rank, on what, where."""

    thread_ident: int | None
    rank: int
    label: str
    where: str


def describe_blockage(
    parked: Iterable[Parked],
    expected: Iterable[tuple[int, str, str]],
    instances: Iterable[Instance],
    workers_per_channel: int | None,
    started_threads: list[tuple[int, str]],
    crossed: dict[str, str] | None = None,
) -> str:
    """The deadlock message: ``expected`` holds ``(rank, label, context)`` per pending
    expectation, ``instances`` the open collectives, ``started_threads`` ``(rank, description)``,
    ``crossed`` the lines of :attr:`~simcluster.engine.matching.Matcher.crossed` per channel."""
    current = sys._current_frames()
    waits = []
    for p in sorted(parked, key=lambda p: (p.rank, p.label)):
        frames = stack_user_frames(current.get(p.thread_ident or -1))
        at = f" at {frames[-1]}" if frames else ""
        polled = p.label.removeprefix("polling ")
        how = f"polls {polled}, which never completes" if polled != p.label else f"blocked {waits_in(p.label)}"
        waits.append(f"  rank {p.rank}: {how} ({p.where}){at}")
    pending = [f"  rank {rank}: {context} waits on {label}, which never completes"
               for rank, label, context in sorted(expected)]
    instances = list(instances)
    unmatched, starved = unmatched_lines(instances, crossed or {}), _starved(instances, workers_per_channel)
    lines = ["deadlock: no rank can make progress and work is still pending"]
    for group, what in ((waits, "blocked ranks"), (pending, "pending results"),
                        (unmatched, "unmatched calls"), (starved, "starved calls")):
        lines += group[:MAX_LISTED]
        if len(group) > MAX_LISTED:
            lines.append(f"  … and {len(group) - MAX_LISTED} more {what}")
    for rank, thread in started_threads[:MAX_LISTED]:
        lines.append(f"  rank {rank} started {thread}: it is not a simulated rank: any collective, wait or "
                     "future completion it makes is rejected (ForeignThreadError, raised in that thread)")
    return "\n".join(lines)


def _starved(instances: Iterable[Instance], workers_per_channel: int | None) -> list[str]:
    starved: list[str] = []
    for inst in sorted(instances, key=lambda i: (i.channel, i.seq)):
        desc = inst.first.describe if inst.first else "?"
        if inst.gated:
            starved.append(
                f"  {desc} (call #{inst.seq} on {inst.channel}): on ranks {rank_list(sorted(inst.gated))} it waits, "
                "as gloo's barrier does, for that rank's earlier collectives of the group to finish (callbacks included)"
            )
        waiting = [r for r in inst.ranks if r in inst.calls and r not in inst.executing and r not in inst.gated]
        if waiting:
            starved.append(
                f"  {desc} (call #{inst.seq} on {inst.channel}): queued on ranks {rank_list(waiting)} behind "
                f"{workers_per_channel} busy backend worker threads of that group"
            )
    return starved
