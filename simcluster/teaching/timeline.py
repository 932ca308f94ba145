"""A picture of a recorded run: one lane per rank and per gloo worker thread, as SVG or HTML.

The trace has no clock (determinism: equal seeds give equal traces), so the picture's
horizontal axis is **logical time**: event ``i`` of the run sits at column ``i``, steps
one after another. Every traced event gets exactly one mark (``class="ev …"``,
``data-event="<step>:<index>"``):

* a hook call — a grey bar on the rank's lane from the call to the return (the return
  is a tick; a raise is a red tick);
* a collective — a bar coloured by op from the rank's post to the collective's
  completion, labelled with dtype, shape and bytes; the completion is a vertical line
  across the participating ranks;
* a callback — a green box on the lane of the thread that ran it (a gloo worker, or the
  rank's own code when it ran inline);
* a blocked wait — a red bar from ``wait()`` to the resume (the resume is a tick).

Which thread posted a collective is not in the trace: the lane is the one that last
started running code on that rank (a hook call, a callback or a resume).

Below the lanes, a **modelled network** lane draws each collective on a second time axis,
in µs, under :mod:`simcluster.teaching.wire`'s α-β model: collectives one at a time, in
completion order, computation free. The step boundaries are marked, with the rebuilt
bucket layout where DDP rebuilt it. The file is self-contained (no scripts, fonts or
fetches) and byte-identical for identical arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from pathlib import Path

from simcluster.ddp.layout import rebuild_iteration
from simcluster.teaching.story import HookCall, Story
from simcluster.engine.trace import Blocked, CallbackRan, Completed, CopiedBack, Posted, Resumed
from simcluster.teaching.wire import Network, wire_rows

__all__ = ["Mark", "marks", "lanes", "render_svg", "write_timeline", "OP_COLOURS"]

OP_COLOURS = {
    "all_reduce": "#4e79a7", "all_reduce_coalesced": "#4e79a7", "all_gather": "#f28e2b",
    "all_gather_into_tensor": "#f28e2b", "reduce_scatter": "#e15759", "reduce_scatter_tensor": "#e15759",
    "broadcast": "#59a14f", "reduce": "#b07aa1", "gather": "#ff9da7", "scatter": "#ff9da7",
    "all_to_all": "#76b7b2", "all_to_all_single": "#76b7b2", "send": "#edc948", "recv": "#edc948",
    "barrier": "#9c755f",
}
_KIND_COLOURS = {"hook": "#d9d9d9", "callback": "#8cd17d", "blocked": "#d62728", "tick": "#555555",
                 "raise": "#d62728", "completed": "#222222"}
DX, LANE_H, LEFT, TOP, TRACKS = 14, 36, 250, 40, 3


@dataclass(frozen=True)
class Mark:
    """One traced event drawn: ``kind`` (hook, return, raise, post, completed, callback, blocked,
    resumed), its lanes, columns ``start``..``end`` (logical time), the label and the op's colour
    key; ``event`` is ``(step, index)``; ``modelled`` the α-β start/end in µs of its collective."""

    kind: str
    lanes: tuple[str, ...]
    start: int
    end: int
    label: str
    op: str
    event: tuple[int, int]
    modelled: tuple[float, float] | None = None


def _callback_label(e: CallbackRan) -> str:
    """A callback mark's words."""
    return f"{e.callback} of {e.future} ({e.where})"


def _where_lane(rank: int, where: str) -> str:
    return f"rank {rank} · {where}" if where.startswith("gloo-worker") else f"rank {rank}"


def _closers(events: list[object]) -> tuple[dict[int, int], dict[tuple[str, int], int]]:
    """Index of each hook call's return and blocked wait's resume; completion index per collective."""
    ends: dict[int, int] = {}
    open_calls: dict[tuple[int, int], int] = {}
    open_waits: dict[tuple[int, str], list[int]] = {}
    done: dict[tuple[str, int], int] = {}
    for i, e in enumerate(events):
        if isinstance(e, HookCall):
            if e.phase == "call":
                open_calls[(e.rank, e.bucket)] = i
            elif (e.rank, e.bucket) in open_calls:
                ends[open_calls.pop((e.rank, e.bucket))] = i
        elif isinstance(e, Blocked):
            open_waits.setdefault((e.rank, e.future), []).append(i)
        elif isinstance(e, Resumed) and open_waits.get((e.rank, e.future)):
            ends[open_waits[(e.rank, e.future)].pop(0)] = i
        elif isinstance(e, Completed):
            done[(e.group, e.seq)] = i
    return ends, done


def _modelled(events: list[object], story: Story, network: Network, t0: float) -> tuple[dict, float]:
    """(group, seq) → (start µs, end µs) of each completed collective, one at a time from ``t0``."""
    cost = {(r.group, r.seq): r.seconds * 1e6 for r in wire_rows(events, story.backend, network)}
    spans, t = {}, t0
    for e in events:
        if isinstance(e, Completed):
            spans[(e.group, e.seq)] = (t, t + cost.get((e.group, e.seq), 0.0))
            t += cost.get((e.group, e.seq), 0.0)
    return spans, t


def _step_marks(story: Story, k: int, x0: int, network: Network, t0: float) -> tuple[list[Mark], float]:
    events = story.steps[k].events
    ends, done = _closers(events)
    spans, t_end = _modelled(events, story, network, t0)
    last = x0 + len(events)  # open spans (a failure, a deadlock) run to the step's end
    lane = {}
    out = []
    for i, e in enumerate(events):
        x, ev = x0 + i, (k, i)
        if isinstance(e, HookCall):
            if e.phase == "call":
                lane[e.rank] = f"rank {e.rank}"
                out.append(Mark("hook", (f"rank {e.rank}",), x, x0 + ends.get(i, last - x0), f"hook(bucket {e.bucket})", "", ev))
            else:
                out.append(Mark(e.phase, (f"rank {e.rank}",), x, x, f"hook {e.phase}s (bucket {e.bucket})", "", ev))
        elif isinstance(e, Posted):
            end = x0 + done[(e.group, e.seq)] if (e.group, e.seq) in done else last
            label = f"{e.op} #{e.seq} {e.dtype}{list(e.shape)} {e.nbytes} B" + (f" {e.detail}" if e.detail else "")
            out.append(Mark("post", (lane.get(e.rank, f"rank {e.rank}"),), x, end, label, e.op, ev,
                            spans.get((e.group, e.seq))))
        elif isinstance(e, Completed):
            out.append(Mark("completed", tuple(f"rank {r}" for r in e.ranks), x, x, f"{e.op} #{e.seq} completes",
                            e.op, ev, spans.get((e.group, e.seq))))
        elif isinstance(e, CallbackRan):
            lane[e.rank] = _where_lane(e.rank, e.where)
            out.append(Mark("callback", (lane[e.rank],), x, x + 1, _callback_label(e), "", ev))
        elif isinstance(e, CopiedBack):
            what = "holds an error, which backward() raises" if e.failed else "DDP copies it into the gradients"
            out.append(Mark("callback", (f"rank {e.rank}",), x, x + 1,
                            f"bucket {e.bucket}'s future is complete: {e.future} ({what})", "", ev))
        elif isinstance(e, Blocked):
            where = _where_lane(e.rank, e.context)
            out.append(Mark("blocked", (where,), x, x0 + ends.get(i, last - x0), f"wait() on {e.future}", "", ev))
        elif isinstance(e, Resumed):
            out.append(Mark("resumed", (lane.get(e.rank, f"rank {e.rank}"),), x, x, f"resumes: {e.future}", "", ev))
    return out, t_end


def marks(story: Story, network: Network) -> list[Mark]:
    """Every traced event of every step as a :class:`Mark`, steps one after another."""
    out: list[Mark] = []
    x0, t = 0, 0.0
    for k in range(len(story.steps)):
        step_marks, t = _step_marks(story, k, x0, network, t)
        out += step_marks
        x0 += len(story.steps[k].events) + 2
    return out


def lanes(story: Story, all_marks: list[Mark]) -> list[str]:
    """Lane names: per rank its code lane, then its gloo worker lanes (sorted)."""
    workers = sorted({name for m in all_marks for name in m.lanes if "·" in name})
    out = []
    for r in range(story.world_size):
        out.append(f"rank {r}")
        out += [w for w in workers if w.startswith(f"rank {r} ·")]
    return out


def _rect(m: Mark, y: float, h: float, fill: str, x1: float, x2: float, extra: str = "") -> str:
    tip = escape(m.label + (f"; modelled {m.modelled[0]:.1f}–{m.modelled[1]:.1f} µs" if m.modelled else ""))
    return (f'<rect class="ev {m.kind}" data-event="{m.event[0]}:{m.event[1]}" x="{x1:.1f}" y="{y:.1f}" '
            f'width="{max(x2 - x1, 2):.1f}" height="{h:.1f}" fill="{fill}"{extra}><title>{tip}</title></rect>')


def _tracks(all_marks: list[Mark]) -> dict[tuple[int, int], int]:
    """A sub-row (0..TRACKS-1) for each collective bar, so collectives in flight together on one
    lane sit one under another instead of on top of each other."""
    ends: dict[str, list[int]] = {}
    out = {}
    for m in all_marks:
        if m.kind == "post":
            lane_ends = ends.setdefault(m.lanes[0], [])
            free = next((t for t, end in enumerate(lane_ends) if end < m.start), len(lane_ends))
            if free == len(lane_ends):
                lane_ends.append(m.end)
            else:
                lane_ends[free] = m.end
            out[m.event] = free % TRACKS
    return out


def _mark_svg(m: Mark, row: dict[str, int], track: int = 0) -> str:
    xs, xe = LEFT + m.start * DX, LEFT + m.end * DX
    y = TOP + row[m.lanes[0]] * LANE_H
    if m.kind == "completed":
        ys = [TOP + row[name] * LANE_H for name in m.lanes if name in row]
        return (f'<line class="ev completed" data-event="{m.event[0]}:{m.event[1]}" x1="{xs + DX / 2:.1f}" '
                f'y1="{min(ys) + 2:.1f}" x2="{xs + DX / 2:.1f}" y2="{max(ys) + LANE_H - 2:.1f}" '
                f'stroke="{OP_COLOURS.get(m.op, "#222")}" stroke-width="2"><title>{escape(m.label)}</title></line>')
    if m.kind == "post":
        top = y + 3 + track * 10
        body = _rect(m, top, 9, OP_COLOURS.get(m.op, "#bab0ac"), xs + 2, xe + DX / 2, ' opacity="0.8"')
        if xe + DX / 2 - xs - 4 < 4.2 * len(m.label):  # no room: the tooltip has it
            return body
        return body + f'<text x="{xs + 4:.1f}" y="{top + 7.5:.1f}" font-size="7" fill="#fff">{escape(m.label)}</text>'
    if m.kind in ("hook", "blocked"):
        fill = _KIND_COLOURS[m.kind]
        return _rect(m, y + 1, LANE_H - 2, fill, xs, xe + DX, ' opacity="0.35"' if m.kind == "blocked" else "")
    if m.kind == "callback":
        return _rect(m, y + 3, LANE_H - 6, _KIND_COLOURS["callback"], xs + 1, xe - 1)
    fill = _KIND_COLOURS["raise" if m.kind == "raise" else "tick"]
    return _rect(m, y + 2, LANE_H - 4, fill, xs + DX / 2 - 1, xs + DX / 2 + 1)


def render_svg(story: Story, network: Network, *, title: str = "") -> str:
    """The timeline as an SVG document (see the module docstring for what is drawn)."""
    all_marks = marks(story, network)
    names = lanes(story, all_marks)
    row = {name: i for i, name in enumerate(names)}
    columns = sum(len(s.events) + 2 for s in story.steps)
    net_y = TOP + len(names) * LANE_H + 20
    width, height = LEFT + columns * DX + 40, net_y + LANE_H + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="9">',
           f'<text x="8" y="16" font-size="13">{escape(title)}</text>']
    for name, i in row.items():
        y = TOP + i * LANE_H
        out.append(f'<rect class="lane" x="0" y="{y}" width="{width}" height="{LANE_H}" '
                   f'fill="{"#f7f7f7" if i % 2 else "#ffffff"}"/><text x="8" y="{y + 21}" font-size="11">{escape(name)}</text>')
    out += _step_headers(story, net_y)
    tracks = _tracks(all_marks)
    out += [_mark_svg(m, row, tracks.get(m.event, 0)) for m in all_marks]
    out += _network_lane(all_marks, net_y, columns)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _step_headers(story: Story, bottom: int) -> list[str]:
    out, x0, previous = [], 0, None
    for step in story.steps:
        x = LEFT + x0 * DX
        layout = " ".join(f"b{k}={ps}" for k, ps in enumerate(step.bucket_params))
        rebuilt = previous is not None and step.iteration == rebuild_iteration()  # new buffers, even if same layout
        text = f"step {step.step} (iteration {step.iteration}){' — REBUILT' if rebuilt else ''}: {layout}"
        out.append(f'<line class="step" x1="{x - 4}" y1="22" x2="{x - 4}" y2="{bottom + LANE_H}" stroke="#000" '
                   f'stroke-dasharray="{"6,3" if rebuilt else "2,2"}"/><text x="{x}" y="32" font-size="10">'
                   f'{escape(text)}{" — FAILED" if step.error is not None else ""}</text>')
        x0, previous = x0 + len(step.events) + 2, step.bucket_params
    return out


def _network_lane(all_marks: list[Mark], y: int, columns: int) -> list[str]:
    """The second time axis: each collective's α-β slot, scaled to the picture's width."""
    slots = sorted({(m.modelled, m.label) for m in all_marks if m.kind == "completed" and m.modelled})
    total = max((s[0][1] for s in slots), default=0.0) or 1.0
    scale = columns * DX / total
    out = [f'<text x="8" y="{y + 15}" font-size="11">network, modelled (0–{total:.1f} µs)</text>']
    for (start, end), label in slots:
        out.append(f'<rect class="net" x="{LEFT + start * scale:.1f}" y="{y + 3}" width="{max((end - start) * scale, 1):.1f}" '
                   f'height="{LANE_H - 6}" fill="#4e79a7" stroke="#fff"><title>{escape(label)}: '
                   f'{start:.1f}–{end:.1f} µs</title></rect>')
    return out


def write_timeline(story: Story, path: str, network: Network, *, title: str = "") -> None:
    """Write the timeline to ``path``: ``.svg`` as is, ``.html`` wrapped in a page with a legend."""
    svg = render_svg(story, network, title=title or f"{story.world_size} ranks, {story.backend}, seed {story.seed}")
    if path.endswith(".html"):
        legend = ", ".join(f'<span style="color:{c}">■ {escape(op)}</span>' for op, c in sorted(OP_COLOURS.items()))
        svg = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>simcluster timeline</title></head>"
               f"<body>\n<p>Collectives: {legend}. Grey: hook call; green: callback; red: blocked wait. "
               f"Hover a mark for details. Network lane: {escape(network.describe())}.</p>\n{svg}</body></html>\n")
    Path(path).write_text(svg, encoding="utf-8")
