"""Turning a failed example into a report a reader can act on (text and JSON).

:mod:`simcluster.checking.check` finds failures; this module says what they mean: the full
diagnostic (every line of the exception and its notes, long lists summarised), the
user-code frames it arose at, the DDP step of the counterexample — which parameters each
bucket held at each step and where DDP rebuilt the layout, with a one-line hint when a
property fails after the rebuild — the gradients, and a replay command that runs as
printed from the current directory. :func:`failure` assembles all of it into the
:class:`~simcluster.checking.report.PropertyFailure` a report lists; :func:`death_failure`
does the same for an example whose process never answered.

>>> from simcluster.checking.strategies import Example, Layout, StepSpec, RankSpec
>>> ex = Example(1, Layout(((3,), (2,), (1,)), 8 / 2**20, (2, 1, 0)), StepSpec((RankSpec("const"),)), (1, 1))
>>> steps = bucket_steps(ex, 2)
>>> print(describe_steps(steps))
step 0: bucket 0 = params [0, 1, 2] (6 elements)
             step 1 (rebuilt): bucket 0 = params [2, 1] (3 elements), bucket 1 = params [0] (3 elements)
             step 2: same buckets as step 1
>>> rebuild_hint(steps, 2)
'DDP rebuilt its buckets after step 0: bucket 0 held params [0, 1, 2] at step 0 and [2, 1] from step 1'
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from simcluster.engine.frames import Frame, short_path, user_frames, without_library_dirs
from simcluster.ddp.layout import bucket_calls
from simcluster.checking.replay import decode_example, encode_example
from simcluster.checking.report import PropertyFailure
from simcluster.checking.strategies import DTYPES, Example
from simcluster.checking.supervisor import DEFAULT_DEADLINE, STACK_REQUEST_NAME, ChildDeath, format_stack
from simcluster.usercode.rank_local import RankLocal
from simcluster.usercode.targets import format_shapes
from simcluster.names import without_addresses

if TYPE_CHECKING:  # options imports render
    from simcluster.checking.options import Options

__all__ = ["error_text", "error_frames", "user_line", "bucket_steps", "describe_steps", "rebuild_hint",
           "abridged", "render_gradients", "describe_layout", "replay_command", "failure", "death_failure",
           "printed_output", "MAX_LINES", "MAX_LINE_CHARS", "MAX_OUTPUT_LINES"]

MAX_LINES = 40
"""Lines of one diagnostic shown before the rest is summarised as a count."""
MAX_LINE_CHARS = 2000
"""Characters of one line of a diagnostic shown before the rest is summarised as a count
(a hook's message can hold a whole tensor's repr on one line)."""
MAX_OUTPUT_LINES = 30
"""Lines of the hook's printed output shown with a failure (the first ones, or the last ones
of a run that got stuck: :func:`printed_output`; the replay command's report shows them all)."""


def printed_output(text: str, *, last: bool = False, whole: bool = False) -> str:
    """What the hook printed in a failing run, as the report shows it: blank lines dropped,
    at most :data:`MAX_OUTPUT_LINES` lines of at most :data:`MAX_LINE_CHARS` characters —
    the first ones, or with ``last`` (a run that got stuck: what it did last) the last ones;
    every line, ``whole`` (the replay command's report)."""
    lines = [_clip(line.rstrip()) for line in text.splitlines() if line.strip()]
    if len(lines) > MAX_OUTPUT_LINES and not whole:
        more = len(lines) - MAX_OUTPUT_LINES + 1
        if last:
            lines = [f"… {more} earlier lines (the replay command prints them all)"] + lines[-(MAX_OUTPUT_LINES - 1):]
        else:
            lines = lines[:MAX_OUTPUT_LINES - 1] + [f"… and {more} more lines (the replay command prints them all)"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the diagnostic
def _keep_note(note: str) -> bool:
    """Notes that add to the story (not the Python-API replay line or the step already named)."""
    return not (note.startswith("simcluster: replay with ") or note.startswith("simcluster: in SimDDP.step"))


_OTHER_RANK = re.compile(r"^simcluster: rank (\d+) also (?:failed|raised)(?: \([^)]*\))?: (.*)$", re.DOTALL)


def _same(a: str, b: str) -> bool:
    """Equal up to rank numbers, the exception type prefix and blank lines."""
    def norm(text: str) -> str:
        text = re.sub(r"^\w+: ", "", text.strip())
        return "\n".join(_lines(re.sub(r"rank \d+", "rank N", text)))
    return norm(a) == norm(b)


def _lines(text: str) -> list[str]:
    return [_clip(l) for l in text.splitlines() if l.strip() and not l.strip().startswith("replay: SimCluster(")]


def _clip(line: str) -> str:
    if len(line) <= MAX_LINE_CHARS:
        return line
    return f"{line[:MAX_LINE_CHARS]} … and {len(line) - MAX_LINE_CHARS} more characters"


def error_text(exc: BaseException) -> str:
    """``Type: message`` with every line of the message and of its notes — the
    Python-API ``replay:`` lines and blank lines dropped, other ranks that failed the same
    way named in one line — at most :data:`MAX_LINES` lines (then ``… and N more lines``),
    each at most :data:`MAX_LINE_CHARS` characters (then ``… and N more characters``). A
    default ``repr``'s address (``<mod.State object at 0x7fee…>`` in the hook's own message)
    is masked: it differs from run to run, and a replay prints the report it printed; a
    library's file is named by its import path (:func:`~simcluster.engine.frames.without_library_dirs`)."""
    message = as_reported(str(exc))
    lines = _lines(message)
    head = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    same: list[int] = []
    for note in getattr(exc, "__notes__", None) or []:
        other = _OTHER_RANK.match(str(note))
        if other is not None and _same(other.group(2), message):
            same.append(int(other.group(1)))
        elif _keep_note(note):
            lines += _lines(as_reported(str(note)))
    if same:
        lines.append(f"simcluster: {'rank' if len(same) == 1 else 'ranks'} {', '.join(map(str, same))} "
                     "also failed the same way")
    body = [head] + lines[1:]
    if len(body) > MAX_LINES:
        body = body[: MAX_LINES - 1] + [f"… and {len(body) - MAX_LINES + 1} more lines"]
    return "\n".join(body)


def as_reported(text: str) -> str:
    """An error's text as a report shows it: the same on every run and wherever the
    environment lives (default-``repr`` addresses masked, library folders dropped)."""
    return without_library_dirs(without_addresses(text))


def error_frames(exc: BaseException) -> list[Frame]:
    """The last frames of user code the exception went through (outermost first)."""
    return user_frames(exc)


def user_line(exc: BaseException | None) -> str:
    """``file:line`` of the innermost user frame of ``exc`` ("" if none): part of a bug's identity."""
    if exc is None:
        return ""
    frames = user_frames(exc, limit=1)
    return f"{short_path(frames[0].file)}:{frames[0].line}" if frames else ""


# --------------------------------------------------------------------------- the DDP step
def bucket_steps(example: Example, upto: int) -> list[dict[str, Any]]:
    """Steps ``0..upto`` of the example's DDP run: per step its buckets (index, parameter
    indices, elements) and whether DDP rebuilt the layout before it (JSON-ready)."""
    lay = example.layout
    dtype = DTYPES[example.dtype]
    params = [torch.empty(tuple(s), dtype=dtype) for s in lay.shapes]
    out: list[dict[str, Any]] = []
    for t in range(upto + 1):
        calls = bucket_calls(params, iteration=t, bucket_cap_mb=lay.bucket_cap_mb, static_graph=lay.static_graph,
                             find_unused_parameters=lay.find_unused_parameters, ready_order=list(lay.ready_order))
        buckets = [{"index": c.index, "params": list(c.params),
                    "numel": sum(int(params[i].numel()) for i in c.params)} for c in calls]
        rebuilt = bool(out) and [b["params"] for b in buckets] != [b["params"] for b in out[-1]["buckets"]]
        out.append({"step": t, "rebuilt": rebuilt, "buckets": buckets})
    return out


def describe_steps(steps: Sequence[dict[str, Any]], indent: str = " " * 13) -> str:
    """One line per step: ``step 1 (rebuilt): bucket 0 = params [2, 1] (3 elements), …``."""
    lines: list[str] = []
    for i, step in enumerate(steps):
        mark = " (rebuilt)" if step["rebuilt"] else ""
        if i and not step["rebuilt"]:
            last = lines[-1]
            if last.startswith("step") and " same buckets as step " in last:  # extend "steps 2-4: same …"
                first = last.split(":")[0].removeprefix("steps ").removeprefix("step ").split("-")[0]
                lines[-1] = f"steps {first}-{step['step']}: {last.split(': ', 1)[1]}"
            else:
                lines.append(f"step {step['step']}: same buckets as step {steps[i - 1]['step']}")
            continue
        shown = [f"bucket {b['index']} = params {b['params']} ({b['numel']} element{'s' * (b['numel'] != 1)})"
                 for b in step["buckets"][:8]]
        more = len(step["buckets"]) - 8
        tail = f", … and {more} more buckets" if more > 0 else ""
        lines.append(f"step {step['step']}{mark}: " + ", ".join(shown) + tail)
    return f"\n{indent}".join(lines)


_SIZES = (re.compile(r"shape \[([\d, ]*)\]"), re.compile(r"size of tensor \w \((\d+)\)"),
          re.compile(r"input of size (\d+)"))
"""Where torch's shape errors name a tensor's size: ``output with shape [1] doesn't match the
broadcast shape [4]``, ``The size of tensor a (4) must match the size of tensor b (1)``,
``shape '[4]' is invalid for input of size 1``."""


def bucket_mixup_hint(error: BaseException, steps: Sequence[dict[str, Any]], at: int) -> str:
    """When ``error`` (a shape error raised at step ``at``) names tensors whose sizes are two
    different buckets' of that step, and the step has several buckets in flight: a line
    saying so — hook state holding "the" bucket (a compressor keeping the buffer in
    ``self``) meets the next bucket's while this one's collective is in flight
    (``buggy.inflight_shared_compressor``). Else ``""``."""
    if at >= len(steps) or len(steps[at]["buckets"]) < 2:
        return ""
    text = str(error)
    sizes: list[int] = []
    for pattern in _SIZES:
        for found in pattern.findall(text):
            dims = [int(d) for d in found.replace(" ", "").split(",") if d]
            sizes.append(math.prod(dims))
    numel = {b["numel"]: b["index"] for b in reversed(steps[at]["buckets"])}  # the lowest index per size
    named = sorted({size for size in sizes if size in numel}, key=lambda size: numel[size])
    if len(named) < 2:
        return ""
    which = " and ".join(f"bucket {numel[size]}'s ({size} element{'s' * (size != 1)})" for size in named[:2])
    return (f"\n(the error names the sizes of {which} at step {steps[at]['step']}, where "
            f"{len(steps[at]['buckets'])} buckets are in flight at once: one bucket's data met another's — hook "
            "state holding \"the\" bucket while DDP calls the hook for the next one before this one's collective "
            "completed?)")


def rebuild_hint(steps: Sequence[dict[str, Any]], at: int) -> str | None:
    """When the failing step ``at`` runs on a rebuilt layout: which bucket changed
    parameters, e.g. ``bucket 0 held params [0, 1, 2] at step 0 and [2, 1] from step 1``."""
    if at < 1 or at >= len(steps) or not any(s["rebuilt"] for s in steps[1 : at + 1]):
        return None
    now = {b["index"]: b["params"] for b in steps[at]["buckets"]}
    since = max(s["step"] for s in steps[1 : at + 1] if s["rebuilt"])
    before = steps[since - 1]
    for b in before["buckets"]:
        if now.get(b["index"]) != b["params"]:
            after = now.get(b["index"])
            change = f"and {after}" if after is not None else "and no longer exists"
            change += f" from step {since}"
            return (f"DDP rebuilt its buckets after step {since - 1}: bucket {b['index']} held params {b['params']} "
                    f"at step {before['step']} {change}")
    extra = sorted(set(now) - {b["index"] for b in before["buckets"]})
    return (f"DDP rebuilt its buckets after step {since - 1}: {len(before['buckets'])} bucket(s) at step "
            f"{before['step']}, {len(now)} from step {since} (new: {extra})")


# --------------------------------------------------------------------------- inputs
def abridged(t: torch.Tensor, *, whole: int = 6, head: int = 6, tail: int = 0) -> str:
    """``t``'s values, flat, in a line a person reads: all of them up to ``whole`` elements,
    else the first ``head``, ``…``, the last ``tail`` and how many there are; more than one
    element all alike (bit for bit: ``-0.0`` is not ``0.0``) as one and a count. The one
    abridger of tensors in reports (the gradients line) and in ``explain``, e.g.
    ``[-1.0, -5.0, …, 3.0] (400,000 values)``, ``[0.0 ×3]``.

    >>> abridged(torch.tensor([1.0, 2.0]))
    '[1.0, 2.0]'
    >>> abridged(torch.zeros(3))
    '[0.0 ×3]'
    >>> abridged(torch.arange(10.0), whole=4, head=2, tail=1)
    '[0.0, 1.0, …, 9.0] (10 values)'
    """
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n > 1 and bool((flat == flat[0]).all()) and (
            not flat.dtype.is_floating_point or bool((torch.signbit(flat) == torch.signbit(flat[0])).all())):
        return f"[{flat[0].item()!r} ×{n:,}]"
    if n <= whole:
        return f"[{', '.join(map(repr, flat.tolist()))}]"
    shown = [repr(v) for v in flat[:head].tolist()] + ["…"] + [repr(v) for v in flat[n - tail:].tolist()] * bool(tail)
    return f"[{', '.join(shown)}] ({n:,} values)"


def render_gradients(example: Example, upto: int, max_ranks: int = 4, named: Sequence[int] = ()) -> str:
    """Steps ``0..upto``, rank by rank, each parameter abridged to a few values: the first
    ``max_ranks`` ranks, and beyond them the ranks the message ``named`` and any rank whose
    gradients hold an inf or NaN — the culprit is never the rank cut away (rank 7's inf at
    world 8 was hidden behind ``(+4 ranks)``: an audit of reports); ``…`` marks a gap."""
    grads = example.grads()
    lines = []
    for t, step in enumerate(grads[: upto + 1]):
        keep = set(range(min(max_ranks, len(step)))) | {r for r in named if 0 <= r < len(step)}
        keep |= {r for r, rank in enumerate(step) if not all(bool(torch.isfinite(g).all()) for g in rank)}
        shown, last = [], -1
        for r in sorted(keep):
            if r > last + 1:
                shown.append("…")
            shown.append(f"r{r}: " + " ".join(abridged(g) for g in step[r]))
            last = r
        more = f" (+{len(step) - len(keep)} ranks)" if len(step) > len(keep) else ""
        lines.append(f"step {t}: " + " | ".join(shown) + more)
    return "\n             ".join(lines)


def describe_layout(example: Example, steps: int) -> str:
    """The parameters, cap, ready order, flags, step count and dtypes in one line."""
    text = example.layout.describe() + f", {steps} steps, {example.dtype} gradients"
    if example.values != example.dtype:
        text += f" holding {example.values} values"
    if example.subgroups > 1:
        text += f", DDP on {example.subgroups} subgroups of {example.world_size // example.subgroups} ranks"
    return text


# --------------------------------------------------------------------------- replay
def replay_command(opts: Options, backend: str, world: int | None, token: str | None, steps: int) -> str:
    """The ``simcluster check … --replay TOKEN`` line that reruns one counterexample as found
    (no world and no token: the search itself, with the options that found it)."""
    parts = ["simcluster check", opts.replay_target or opts.target]
    if opts.state_name != "none":
        parts.append(f"--state {opts.state_name}")
    parts += [f"--tolerance {opts.tolerance}"]
    if opts.params is not None:
        parts.append("--params " + format_shapes(opts.params))
    if opts.subgroups and opts.state.kind != "group":
        parts.append("--subgroups")
    if opts.bucket_view:
        parts.append("--gradient-as-bucket-view")
    if opts.api != "current":
        parts.append(f"--api {opts.api}")
    if opts.rng != "per_rank":
        parts.append(f"--rng {opts.rng}")
    if opts.launcher != "none":
        parts.append(f"--launcher {opts.launcher}")
    if isinstance(opts.hook, RankLocal) and opts.hook.isolate:
        parts.append(f"--isolate {','.join(opts.hook.isolate)}")
    parts += [f"--backend {backend}", *([f"--world-sizes {world}"] if world is not None else []), f"--steps {steps}",
              f"--seed {opts.seed}"]
    if opts.deadline != DEFAULT_DEADLINE:
        parts.append(f"--deadline {opts.deadline:g}")
    if token is not None:
        parts.append(f"--replay {token}")
    return " ".join(parts)


# --------------------------------------------------------------------------- the failure
def failure(opts: Options, prop: str, message: str, info: dict[str, Any], steps: int) -> PropertyFailure:
    """The report entry of a violated property: ``info`` holds the example, backend, step,
    schedule and (when the hook raised) the error, its type and its user-code line."""
    example: Example = info["example"]
    backend: str = info["backend"]
    at = info.get("step", 0)
    token = encode_example(example, backend)
    ddp_steps = bucket_steps(example, at)
    hint = rebuild_hint(ddp_steps, at)
    error = info.get("error")
    frames = error_frames(error) if error is not None else []
    if error is not None:
        message += bucket_mixup_hint(error, ddp_steps, at)
    return PropertyFailure(
        property=prop, backend=backend, message=message, world_size=example.world_size,
        layout=describe_layout(example, steps),
        gradients=render_gradients(example, at, named=[int(r) for r in re.findall(r"\brank (\d+)", message)]),
        schedule=list(info.get("schedule", [])),
        replay=replay_command(opts, backend, example.world_size, token, steps),
        error_type=info.get("error_type", ""), frames=[str(f) for f in frames], buckets=describe_steps(ddp_steps),
        hint=hint or "", output=printed_output(info.get("output", ""), whole=info.get("whole_output", False)),
        details={"step": at, "token": token, "line": info.get("line", ""), "ddp_steps": ddp_steps,
                 "frames": [{"file": f.file, "line": f.line, "function": f.function, "source": f.source,
                             "repeated": f.repeated, "cycle": f.cycle}
                            for f in frames]},
    )


def death_failure(opts: Options, backend: str, death: ChildDeath, steps: int) -> PropertyFailure:
    """The liveness failure of an example whose process never answered."""
    stack = format_stack(death.stacks)
    message = death.summary("the example")
    if stack:  # a sample: a spinning loop's line varies run to run; the line above does not
        message += "\n  stack sampled when it was stopped (outermost call first):\n" + stack
    elif death.kind == "deadline":  # asked for and not given: said, not left out (an audit of hostile hooks)
        message += (f"\n  no stack: its process did not answer the request for one (signal {STACK_REQUEST_NAME}, "
                    "which faulthandler answers: the checked code blocks or ignores it, or set a handler of its own)")
    error_type = "Stuck" if death.kind == "deadline" else "ProcessDied"
    token = (death.payload or death.previous or {}).get("token")
    if token is None:  # before the first example: the search's own command reruns it
        return PropertyFailure("liveness", backend, message, 0, "-", "-", [],
                               replay_command(opts, backend, None, None, steps),
                               error_type=error_type, details={"stack": death.stacks},
                               output=printed_output(death.output, last=True))
    example, _ = decode_example(token)
    step = death.position[1] if death.position else 0
    info = {"example": example, "backend": backend, "schedule": [], "step": step, "error_type": error_type}
    result = failure(opts, "liveness", message, info, steps)
    result.output = printed_output(death.output, last=True)
    result.details["stack"] = death.stacks
    return result
