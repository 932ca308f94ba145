"""The recorded run in the Chrome Trace Event format, for Perfetto (ui.perfetto.dev) and chrome://tracing.

Same marks as :mod:`simcluster.teaching.timeline`: one *process* per rank (``pid`` = rank), one
*thread* for the rank's own code (``tid`` 0) and one per gloo worker it used (``tid``
1, 2, … in name order), named with ``"M"`` metadata events. Hook calls, collectives
(post → completion), callbacks and blocked waits are complete events (``"ph": "X"``,
``ts``/``dur`` in µs of *logical* time: 10 µs per traced event, since the trace has no
clock); returns, completions and resumes are instant events (``"i"``). A flow arrow
(``"s"`` at the post, ``"f"`` at the completion, shared ``id``) joins each rank's post to
its collective's completion. Every event's ``args`` carry the label, the step, the
event's index and, for collectives, the α-β modelled start/end (``modelled_us``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from simcluster.teaching.story import Story
from simcluster.teaching.timeline import Mark, lanes, marks
from simcluster.teaching.wire import Network

__all__ = ["chrome_events", "write_chrome_trace", "US_PER_EVENT"]

US_PER_EVENT = 10
"""Logical time: microseconds per traced event."""


def _ids(names: list[str]) -> dict[str, tuple[int, int]]:
    """Lane name → (pid, tid): pid the rank, tid 0 its code, 1.. its workers in order."""
    out: dict[str, tuple[int, int]] = {}
    for name in names:
        rank = int(name.split()[1])
        out[name] = (rank, sum(1 for other in out.values() if other[0] == rank))
    return out


def _metadata(ids: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, (pid, tid) in ids.items():
        if tid == 0:
            out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "ts": 0, "args": {"name": f"rank {pid}"}})
        thread = "rank's code (hooks, DDP)" if tid == 0 else name.split("·", 1)[1].strip()
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": {"name": thread}})
    return out


def _event(m: Mark, pid: int, tid: int) -> dict[str, Any]:
    args: dict[str, Any] = {"label": m.label, "step": m.event[0], "event": m.event[1]}
    if m.modelled is not None:
        args["modelled_us"] = [round(m.modelled[0], 3), round(m.modelled[1], 3)]
    name = m.label if m.kind in ("post", "callback") else m.kind if m.kind != "hook" else m.label
    base = {"name": name, "cat": m.kind, "pid": pid, "tid": tid, "ts": m.start * US_PER_EVENT, "args": args}
    if m.kind in ("hook", "post", "callback", "blocked"):
        return {**base, "ph": "X", "dur": max(m.end - m.start, 1) * US_PER_EVENT}
    return {**base, "ph": "i", "s": "t"}


def chrome_events(story: Story, network: Network) -> list[dict[str, Any]]:
    """The trace events (metadata first, then marks in trace order, flows after their post)."""
    all_marks = marks(story, network)
    ids = _ids(lanes(story, all_marks))
    out = _metadata(ids)
    flow = 0
    for m in all_marks:
        for lane in m.lanes if m.kind == "completed" else m.lanes[:1]:
            if lane in ids:
                out.append(_event(m, *ids[lane]))
        if m.kind == "post" and m.lanes[0] in ids:
            pid, tid = ids[m.lanes[0]]
            flow += 1
            common = {"name": "issue → completion", "cat": "flow", "id": flow, "pid": pid}
            out.append({**common, "ph": "s", "tid": tid, "ts": m.start * US_PER_EVENT})
            out.append({**common, "ph": "f", "bp": "e", "tid": 0, "ts": m.end * US_PER_EVENT})
    return out


def write_chrome_trace(story: Story, path: str, network: Network) -> None:
    """Write ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` to ``path`` (deterministic)."""
    doc = {"traceEvents": chrome_events(story, network), "displayTimeUnit": "ms",
           "otherData": {"world_size": story.world_size, "backend": story.backend, "seed": story.seed,
                         "time": f"logical: {US_PER_EVENT} µs per traced event; modelled_us: {network.describe()}"}}
    Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
