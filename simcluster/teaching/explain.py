"""``simcluster explain``: run a hook under simulated DDP for a few steps and say what it did.

For learning what a communication hook does. By default a small model of three
parameters (``2x2,3,3``, float32) with a 12-byte bucket cap: DDP's iteration 0 is one
bucket in parameter order, then the rebuild puts each parameter in a bucket of its own,
in gradient-ready order — so from step 1 three buckets are in flight. Every rank's
gradients are small whole numbers (exact in every float type, so the mean is readable).
It opens with a ``registration:`` line when real DDP's ``register_comm_hook`` would refuse
the hook (what it raises and why: :func:`~simcluster.checking.properties.registration_problem`,
as ``check`` reports it; the steps run it all the same), then how to read it: what real
DDP does around the hook, as measured on torch 2.13 / gloo (``docs/ddp-facts.md`` §1 and
§4, ``docs/gloo-facts.md`` §3) — the hook runs inside ``backward()`` with grad mode off,
``p.grad`` (None until ready, then the local gradient, then the result in the same
tensor), what "in flight" means, where callbacks run and in which grad mode, and the
inline-then race the simulation leaves out. Then for each step

1. the layout: which parameters each bucket holds, the rebuild and why, and that the
   buffers are kept from the rebuild on;
2. each rank's input, per bucket;
3. the trace — hook calls, every collective posted, when it completed, where each
   callback ran (a gloo worker thread and its grad mode, inline, …), who blocked, and
   when each future the hook returned completed (DDP reads it at the end of ``backward()``);
4. the collectives across ranks with the bytes each rank sends under the backend's
   algorithm (:mod:`simcluster.teaching.wire`), the ratio against plain ``allreduce_hook`` on the
   same buckets, and an α-β estimate of the communication time;
5. what each rank's future held, against the float64 mean, and whether replicas agree.

A hook that fails gets the trace up to the failure, then the failure in full: the
message, every note simcluster attached (ranks, blocked waits, replay) and the hook's
own frames.

A TARGET is loaded as ``check`` loads it: every simulated rank imports the hook's module
(the state factory's, and the ``--isolate`` modules) for itself
(:class:`~simcluster.usercode.rank_local.RankLocal`), so a hook keeping state in module
globals is explained as it is checked.

>>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
>>> text, ok = explain(allreduce_hook, world_size=2, seed=0)
>>> ok
True
>>> "all_reduce #0 on WORLD completes on ranks [0, 1]" in text
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from simcluster.checking.render import abridged, as_reported
from simcluster.teaching.story import DEFAULT_CAP_MB, DEFAULT_SHAPES, HookCall, StepStory, Story, record
from simcluster.engine.frames import user_frames
from simcluster.engine.trace import Blocked, CallbackRan, Completed, CopiedBack, ReadInFlight, Trace, waits_in
from simcluster.ddp.layout import cap_bytes, rebuild_iteration
from simcluster.errors import exit_meaning
from simcluster.names import callable_name
from simcluster.usercode.output import rank_lines
from simcluster.usercode.targets import format_shapes
from simcluster.teaching.wire import DEFAULT_NETWORK, PRESETS, Network, allreduce_baseline, wire_rows

__all__ = ["explain", "explain_story", "small_gradients", "format_failure"]


def small_gradients(world_size: int, numel: int, seed: int) -> list[torch.Tensor]:
    """Rank ``r``'s float32 gradient: ``numel`` whole numbers in [-8, 8], drawn from
    ``seed`` with a private generator (the global RNG is not touched). Step 0 of
    ``explain --numel N`` feeds exactly these."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-8, 9, (numel,), generator=gen).to(torch.float32) for _ in range(world_size)]


SHOWN_WHOLE = 64
"""Tensors of at most this many elements are printed whole; larger ones as their first 8
and last 4 values and a count (:func:`values`): a 400,000-element bucket printed whole
made one explained step ~11 MB of text."""


def values(t: torch.Tensor) -> str:
    """``t``'s values as an explained step prints them (:func:`~simcluster.checking.render.abridged`,
    up to :data:`SHOWN_WHOLE` whole), e.g. ``[-1.0, -5.0, …, 3.0] (400,000 values)``."""
    return abridged(t, whole=SHOWN_WHOLE, head=8, tail=4)


def _fmt(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        dtype = str(t.dtype).removeprefix("torch.")
        return f"{values(t)}  ({dtype}{list(t.shape)})"
    if isinstance(t, (list, tuple)):
        return f"a {type(t).__name__} of {len(t)}: [{', '.join(_fmt(x) for x in t)}]"
    return f"{type(t).__name__}: {t!r}"


def _result_tensor(value: Any) -> torch.Tensor | None:
    """The result tensor: the value itself, or the one tensor of a legacy ``[tensor]`` result."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _where_words(where: str) -> str:
    """Where a callback ran, as the trace labels it, in words a learner can act on
    (``docs/gloo-facts.md`` §3: gloo runs a pending collective's callbacks on one of the
    group's 2 worker threads, a thread of its own whose grad mode is on)."""
    if where.startswith("gloo-worker "):
        group, _, n = where.removeprefix("gloo-worker ").rpartition("#")
        return f"on {group}'s gloo worker thread #{n} (grad mode on)"
    if where.startswith("rank "):
        return f"on {where}'s own thread"
    if where == "inline":
        return "inline, in the code that attached it, before then() returned (the future was already complete)"
    if where == "completion":
        return "in the code that completed the future"
    return where


def event_line(e: Any, futures: dict[tuple[int, str], int] | None = None) -> str:
    """One trace event in words. ``futures`` maps ``(rank, label)`` of each future the hook
    returned to its bucket: the reducer's wait on it is told as that bucket's. DDP's
    reducer reads a hook's future when it waits for every bucket at the end of
    ``backward()``, on the rank's own thread — not where the future completed."""
    if isinstance(e, HookCall):
        verb = {"call": "calls the hook on", "return": f"hook returns {e.returned} for", "raise": "hook RAISES on"}
        return f"rank {e.rank}: {verb[e.phase]} bucket {e.bucket}"
    if isinstance(e, CopiedBack):
        which = f"the future the hook returned for bucket {e.bucket}"
        if e.failed:  # torch marks it complete too, holding the error: DDP's wait re-raises it
            return (f"rank {e.rank}: {which} completed WITH AN ERROR ({e.future}); "
                    "DDP's wait at the end of backward() raises it")
        return (f"rank {e.rank}: {which} is complete ({e.future}); DDP, waiting on it at the end of backward(), "
                "copies it into the gradients now")
    if isinstance(e, CallbackRan):
        return f"rank {e.rank}: callback {e.callback} of {e.future} runs {_where_words(e.where)}"
    if isinstance(e, Blocked):
        held = ", which it holds while it waits" if e.context.startswith("gloo-worker ") else ""
        where = _where_words(e.context).removesuffix(" (grad mode on)")
        return f"rank {e.rank}: blocks {waits_in(e.future)} ({where}{held})"
    if isinstance(e, ReadInFlight):
        return (f"rank {e.rank}: READS memory {e.op} #{e.seq} on {e.group} still has in flight ({e.how} at {e.site}): "
                "a race on a real cluster — gloo's worker may be writing it (the rank's own value or the reduced one, "
                "depending on timing); here it holds the value from before the collective. Read it after wait(), "
                "or in the future's callback")
    if isinstance(e, Completed) and e.options > 1:
        return (f"         {e.op} #{e.seq} on {e.group} completes on ranks {list(e.ranks)} (the seeded scheduler "
                f"picked it among {e.options} possible next steps — a rank's backward() going on to its next bucket, "
                "collectives ready to complete, results a rank has not seen yet, DDP copy-backs waiting to run; "
                "another --seed may pick another)")
    return Trace([e]).format()


def _returned_futures(events: Sequence[Any]) -> dict[tuple[int, str], int]:
    """``(rank, future label) -> bucket`` for the futures the hook returned in a step."""
    return {(e.rank, e.future): e.bucket for e in events
            if isinstance(e, HookCall) and e.phase == "return" and e.future}


def _section(title: str, lines: list[str]) -> list[str]:
    return [title, *("   " + line for line in lines), ""]


def _bucket_flat(step: StepStory, rank: int, k: int) -> torch.Tensor:
    return torch.cat([step.inputs[rank][i].reshape(-1) for i in step.bucket_params[k]])


_REBUILD_ITERATION = rebuild_iteration()  # explain's DDP: no static_graph, no find_unused_parameters


def _reading_notes(backend: str, api: str = "current") -> list[str]:
    """What real DDP does around the hook, which the trace below does not show by itself
    (measured on torch 2.13 with real DDP over gloo: ``docs/ddp-facts.md`` §1 and §4,
    ``docs/gloo-facts.md`` §3)."""
    if backend == "gloo":
        callbacks = ("a callback attached with then() to a collective still in flight runs on one of the group's "
                     "2 gloo worker threads, not on the rank's own thread, and there grad mode is ON; a callback "
                     "that waits on another collective holds that worker until it returns")
    else:
        callbacks = ("a callback attached with then() to a collective still in flight runs in the code that "
                     "completes the collective (the NCCL model: the rank's own thread here). Real NCCL on CUDA "
                     "differs in timing (not modelled): a collective's future is marked complete when its work is "
                     "queued on the GPU stream, so a then() callback runs at once, inline in the hook with grad mode "
                     "off, and async_op=False does not hold the host thread until the data has arrived; here a "
                     "collective completes only once every rank posted it")
    legacy = ["--api legacy: the bucket is torch 1.7-1.9's (get_index(), get_tensors(), get_tensor() in 1.9) "
              "and the future's value a one-element list, as that era's DDP took it; the rest below was measured on "
              "torch 2.13"] if api == "legacy" else []
    return legacy + [
        "the hook: DDP's reducer calls it inside loss.backward(), on the rank's own thread, as soon as the bucket's "
        "gradients and every lower bucket's are ready; grad mode is OFF there (torch.is_grad_enabled() is False)",
        "bucket.buffer(): the rank's local gradients of the bucket's parameters, flat, in bucket.parameters() order; "
        "p.grad of each of them holds the same local gradient, in a tensor of its own (DDP's default "
        "gradient_as_bucket_view=False: not a view of the buffer, so a collective on p.grad leaves the buffer "
        "local), and p.grad of a parameter whose gradient is not ready yet is None (the loop's "
        "zero_grad(set_to_none=True))",
        "in flight: a collective posted with async_op=True and not completed yet; the hook returns a future at "
        "once and DDP goes on with backward() and the next buckets",
        callbacks,
        "in this simulation a collective completes only once every rank of its group posted it and the ranks wait, "
        "return or poll (work.is_completed(), fut.done()); on a real cluster it may complete sooner — even before "
        "the hook calls then(), and that callback then runs inline in the hook, grad mode off (not modelled)",
        "a rank's first poll of a work or future looks at once (pending) or after the others ran (maybe complete), "
        "as the seeded scheduler picks; on real gloo a poll right after posting answers pending 86-100 % of the "
        "time, complete otherwise — code that branches on the answer takes both branches on a real cluster",
        "DDP's reducer waits for every bucket's future at the end of backward() and copies each result into the "
        "same p.grad tensors the hook saw (each parameter gets its slice of the result)",
        "every rank's parameters start as rank 0's: DDP's constructor broadcasts them",
    ]


def _layout_lines(story: Story, step: StepStory, previous: StepStory | None) -> list[str]:
    lines = [f"bucket {k}: params {ps}, float32[{n}] ({4 * n} B)"
             for k, (ps, n) in enumerate(zip(step.bucket_params, step.bucket_numel))]
    if previous is None:
        lines.insert(0, "before the rebuild: one bucket, parameters in model.parameters() order")
    elif step.iteration == _REBUILD_ITERATION:
        same = " (the same buckets as before here)" if previous.bucket_params == step.bucket_params else ""
        first, cap = cap_bytes(story.bucket_cap_mb)
        caps = (f"the cap: {first} B for the first bucket (DDP's dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB, when "
                f"bucket_cap_mb is left at its default), {cap} B for the others" if first != cap else f"the cap, {cap} B")
        lines[:0] = [f"REBUILT after iteration {previous.iteration}{same}: parameters in gradient-ready order "
                     f"(reverse parameter order here), a bucket closes once it reaches {caps}",
                     f"why: in iteration {previous.iteration} DDP recorded the order in which the gradients became "
                     "ready; buckets filled in that order are ready one after another during backward(), so each "
                     "bucket's communication can start while the rest of backward() runs",
                     "the rebuild gives each bucket a new buffer, and DDP keeps it from now on"]
    elif _REBUILD_ITERATION is not None and step.iteration > _REBUILD_ITERATION:
        lines.insert(0, f"the same buckets as iteration {previous.iteration}, and the same buffers: DDP refills them "
                        "with this step's local gradients (a tensor the hook kept from the last step by reference, "
                        "such as bucket.buffer(), now holds this step's values)")
    if len(step.bucket_params) > 1:
        lines.append(_overlap_line(step))
    return lines


def _overlap_line(step: StepStory) -> str:
    """Whether the step's buckets were in flight together (read from the trace): DDP calls
    the hook for every bucket before any collective completes, unless the hook itself waits
    (a synchronous collective, ``wait()`` on a work) — the buckets then go one at a time —
    or, on the gloo model, the schedule lets a collective complete while a rank's backward
    pass goes on to its next bucket, as on a real cluster."""
    n = len(step.bucket_params)
    last_call = max((i for i, e in enumerate(step.events) if isinstance(e, HookCall) and e.phase == "call"), default=-1)
    first_done = next((i for i, e in enumerate(step.events) if isinstance(e, Completed)), None)
    if first_done is None or first_done > last_call:
        return (f"every rank calls the hook for all {n} buckets before any collective completes: they are in flight "
                "together (in this simulation; on a real cluster an early bucket's collective may finish sooner)")
    done = step.events[first_done]
    bucket = next((e.bucket for e in reversed(step.events[:first_done]) if isinstance(e, HookCall)
                   and e.phase == "call" and e.rank in done.ranks), 0)
    later = next(e for e in step.events[first_done:last_call + 1] if isinstance(e, HookCall) and e.phase == "call")
    if not any(isinstance(e, Blocked) for e in step.events[:first_done]):
        return (f"{done.op} #{done.seq} on {done.group} completed before rank {later.rank}'s hook was called for "
                f"bucket {later.bucket}: as on a real cluster, a collective may finish while a rank's "
                "backward() goes on to its next buckets (the seeded schedule's pick; in order, every rank calls the "
                f"hook for all {n} buckets first)")
    return (f"the hook waits inside for its collectives: bucket {bucket}'s collective completed before rank "
            f"{later.rank}'s hook was called for bucket {later.bucket}, so the {n} buckets went one at a time "
            "(no overlap of their communication)")


def _wire_lines(story: Story, step: StepStory, network: Network) -> list[str]:
    rows = wire_rows(step.events, story.backend, network)
    out = []
    for row in rows:
        sent = ", ".join(f"rank {r}: {b} B" for r, b in zip(row.ranks, row.sent))
        out.append(f"{row.op} #{row.seq} on {row.group}: ranks {list(row.ranks)}, {row.dtype}{list(row.shape)} "
                   f"({row.nbytes} B) per rank; sent on the wire — {sent}; α-β {row.seconds * 1e6:.1f} µs")
    if not rows:
        return ["none: this hook does not communicate"]
    mine = sum(row.sent[row.ranks.index(0)] for row in rows if 0 in row.ranks)
    base = allreduce_baseline(step.bucket_numel, story.world_size)
    ratio = f"{base / mine:.2f}" if mine else "n/a (nothing to send)" if not base else "∞ (nothing sent)"
    total = sum(row.seconds for row in rows)
    payload = sum(row.nbytes for row in rows if 0 in row.ranks)
    why = ""
    if mine and mine != base and payload == 4 * sum(step.bucket_numel) and any(len(r.ranks) < story.world_size
                                                                                for r in rows):
        why = (" (not compression: rank 0 hands its collectives as many bytes as plain allreduce_hook; they run "
               "on smaller groups)")
    out.append(f"rank 0 sends {mine} B this step; plain allreduce_hook on these buckets sends {base} B: "
               f"compression ratio {ratio}{why}; α-β total {total * 1e6:.1f} µs, one collective at a time "
               f"({network.describe()})")
    return out


def _result_lines(story: Story, step: StepStory) -> list[str]:
    assert step.result is not None
    lines = []
    for k in range(len(step.bucket_params)):
        inputs = [_bucket_flat(step, r, k) for r in range(story.world_size)]
        mean = torch.stack([g.to(torch.float64) for g in inputs]).mean(0)
        lines.append(f"bucket {k}: the inputs' float64 mean: {values(mean)}")
        tensors = []
        for r in range(story.world_size):
            value = step.result.outputs[r][k]
            lines.append(f"  rank {r} future held {_fmt(value)}")
            t = _result_tensor(value)
            if t is not None:
                tensors.append(t)
                flat = t.detach().reshape(-1)[: mean.numel()].to(torch.float64)
                err = (flat - mean).abs().max().item() if flat.numel() == mean.numel() else float("nan")
                lines.append(f"  rank {r}: max |result - mean| = {err:g}")
        if len(tensors) == story.world_size:
            agree = all(torch.equal(tensors[0], t) and tensors[0].dtype == t.dtype for t in tensors)
            lines.append("  replicas agree bitwise: " + ("yes" if agree else (
                "NO — DDP broadcasts parameters only in its constructor (and when a join() for uneven inputs "
                "ends), so the model copies drift apart unless something outside the hook averages them (local "
                "SGD's periodic model averager does, by design)")))
    return lines + ["DDP's reducer copies each result into the p.grad tensors the hook saw (each parameter its slice)"
                    + ("" if not step.result.warnings else ", with warnings:"),
                    *("  " + w for w in step.result.warnings)]


def format_failure(exc: BaseException) -> list[str]:
    """The whole diagnostic: type and full message, every note (as a report quotes them: an
    address masked, :func:`~simcluster.checking.render.as_reported`), and the last frames of user
    code it arose at (:func:`~simcluster.engine.frames.user_frames`: the hook's own lines,
    also for an error a failed collective or a callback carried to DDP)."""
    meaning = exit_meaning(exc)  # already names SystemExit
    lines = [meaning] if meaning else [f"{type(exc).__name__}: {line}" if i == 0 else line
                                       for i, line in enumerate(as_reported(str(exc)).strip().splitlines() or [""])]
    lines += [n for note in getattr(exc, "__notes__", []) for n in as_reported(str(note)).splitlines()]
    frames = user_frames(exc, limit=4)
    if frames:
        lines.append("where (innermost last):")
        lines += [f"  {frame}" for frame in frames]
    return lines


def _open_calls(events: Sequence[Any]) -> list[str]:
    """Which hook calls raised, or had not returned when the step failed (from the trace)."""
    state: dict[tuple[int, int], str] = {}
    for e in events:
        if isinstance(e, HookCall):
            state[(e.rank, e.bucket)] = e.phase
    words = {"call": "was still inside the hook (called, never returned)", "raise": "raised from inside the hook"}
    return [f"rank {r}, bucket {b}: {words[phase]}" for (r, b), phase in state.items() if phase in words]


def registration_lines(problem: str | None) -> list[str]:
    """The ``registration:`` line (and a blank one) when real DDP's ``register_comm_hook``
    would refuse the hook — ``problem``, what it raises and why
    (:func:`~simcluster.checking.properties.registration_problem`): on a real cluster the
    hook never runs; here it does. ``explain`` and ``explain --range`` both open with it."""
    if problem is None:
        return []
    return [f"registration: real DDP would refuse this hook — {problem}. "
            "DistributedDataParallel.register_comm_hook raises before any step, so on a real cluster the hook never "
            "runs; below it runs all the same, to show what it does", ""]


def explain_story(story: Story, *, label: str, network: Network | None = None) -> tuple[str, bool]:
    """Render a recorded :class:`Story`; returns ``(text, ran)`` (``ran`` False if a step failed)."""
    network = network or PRESETS[DEFAULT_NETWORK]
    shapes = format_shapes(story.shapes)
    cap = "DDP's default" if story.bucket_cap_mb is None else f"{story.bucket_cap_mb * 2**20:g} B"
    out = [f"simcluster explain: {label} on {story.world_size} simulated rank(s), {story.backend} backend model, "
           f"seed {story.seed}; params {shapes} (float32), bucket cap {cap}, {len(story.steps)} step(s)", "",
           *registration_lines(story.registration),
           *_section("How to read this (what real DDP does around the hook, measured on torch 2.13 / gloo):",
                     _reading_notes(story.backend, story.api))]
    previous = None
    for step in story.steps:
        out.append(f"== step {step.step} (DDP iteration {step.iteration}) ==")
        out += _section("1. The buckets:", _layout_lines(story, step, previous))
        flat = "bucket.buffer()" if story.api == "current" else "bucket.get_tensors()[0], get_tensor() in 1.9"
        out += _section(f"2. What each rank's hook receives ({flat}: its local gradients):", [
            f"rank {r}, bucket {k}: {values(_bucket_flat(step, r, k))}"
            for r in range(story.world_size) for k in range(len(step.bucket_params))])
        title = "3. What happened, in order (the trace" + (", up to the failure):" if step.error else "):")
        futures = _returned_futures(step.events)
        out += _section(title, [event_line(e, futures) for e in step.events] or ["(no events)"])
        if step.printed.strip():
            out += _section(f"What the hook printed during step {step.step} (stdout and stderr, in order, each "
                            "line with the rank whose code wrote it):", rank_lines(step.printed_by))
        if step.error is not None:
            out += _section(f"4. The hook failed at step {step.step}:",
                            format_failure(step.error) + _open_calls(step.events))
            return "\n".join(out).rstrip() + "\n", False
        out += _section("4. The collectives and the bytes on the wire:", _wire_lines(story, step, network))
        out += _section("5. What each future held (what DDP copies into p.grad):", _result_lines(story, step))
        previous = step
    last = story.steps[-1].result
    assert last is not None
    out += _not_reached(story)
    out.append(f"replay: {last.replay}")
    return "\n".join(out) + "\n", True


def _not_reached(story: Story) -> list[str]:
    """A note when the state says the hook changes what it does at an iteration the steps
    never reached: PowerSGD's ``start_powerSGD_iter`` (plain all_reduce before it), which a
    learner explaining torch's ``powerSGD_hook`` at the default 2 steps never saw compress."""
    state = story.states[0] if story.states else None
    start = getattr(state, "start_powerSGD_iter", None)
    last = story.steps[-1].iteration
    if not isinstance(start, int) or last >= start:
        return []
    return [f"note: the state's start_powerSGD_iter is {start}: PowerSGD all-reduces the bucket uncompressed before "
            f"DDP iteration {start}, and these steps ended at iteration {last} — run with --steps {start + 1} to see "
            "it compress", ""]


def explain(
    hook: Callable[[Any, Any], Any] | str,
    *,
    world_size: int = 2,
    backend: str = "gloo",
    seed: int = 0,
    state: Any = None,
    shapes: Sequence[tuple[int, ...]] = DEFAULT_SHAPES,
    bucket_cap_mb: float | None = DEFAULT_CAP_MB,
    steps: int = 2,
    api: str = "current",
    network: Network | None = None,
    name: str | None = None,
    isolate: Sequence[str] | str | None = (),
    launcher: str = "none",
) -> tuple[str, bool]:
    """Run ``hook`` for ``steps`` DDP steps and explain it; returns ``(text, ran)``.

    ``ran`` is False when a step failed: the text then ends with the trace up to the
    failure and the full diagnostic. ``hook``: a callable, or a ``module:name`` /
    ``file.py:name`` spec whose module every simulated rank imports for itself, with the
    ``isolate`` modules (as ``check_hook`` does: :func:`~simcluster.teaching.story.record`).
    ``state``: ``None``, ``"group"`` or a per-rank factory. ``launcher``: ``"torchrun"`` gives
    every rank torchrun's environment variables (:class:`~simcluster.fake.cluster.SimCluster`).
    """
    story = record(hook, world_size=world_size, backend=backend, seed=seed, state=state, shapes=shapes,
                   bucket_cap_mb=bucket_cap_mb, steps=steps, api=api, isolate=isolate, launcher=launcher)
    return explain_story(story, label=name or (hook if isinstance(hook, str) else callable_name(hook)),
                         network=network)


def _again(args: Any) -> str:
    """The command line that prints this explanation again (options at their defaults left out)."""
    parts = [f"simcluster explain {args.target} --world-size {args.world_size} --backend {args.backend} "
             f"--seed {args.seed}"]
    for flag, value, default in (("--state", args.state, "none"), ("--isolate", args.isolate, None),
                                 ("--launcher", args.launcher, "none"),
                                 ("--numel", args.numel, None),
                                 ("--params", args.params, None), ("--bucket-cap-mb", args.bucket_cap_mb, None),
                                 ("--steps", args.steps, 2), ("--api", args.api, "current"),
                                 ("--network", args.network, DEFAULT_NETWORK)):
        if value != default:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


RANGE_DEFAULTS = {"tolerance": "fp16", "world_sizes": "2,3,8"}
"""``explain``'s options that only ``--range`` reads, and their defaults (the parser leaves them None)."""


def _check_range_options(args: Any) -> None:
    """``--range`` reads ``--tolerance`` and ``--world-sizes`` and draws no story (no
    ``--timeline``/``--chrome-trace``); an option the run would not read is exit 2, not
    silently dropped (``explain … --tolerance nonsense`` exited 0), and its value is
    checked either way."""
    from simcluster.checking.tolerances import parse_tolerance
    from simcluster.errors import UsageError
    from simcluster.usercode.targets import parse_world_sizes

    unread = [f"--{name.replace('_', '-')}" for name in RANGE_DEFAULTS if getattr(args, name) is not None]
    for name, default in RANGE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    parse_tolerance(args.tolerance)
    parse_world_sizes(args.world_sizes)
    if args.range:
        drawn = [o for o, v in (("--timeline", args.timeline), ("--chrome-trace", args.chrome_trace)) if v]
        if drawn:
            raise UsageError(f"{', '.join(drawn)}: not with --range (it searches magnitudes; it tells no story to draw)")
        return
    if unread:
        raise UsageError(f"{', '.join(unread)}: only with --range")


def explain_command(args: Any, monitor: Any = None) -> int:
    """``simcluster explain``: load the target (and state), print the explanation, write the
    pictures asked for. Returns 0 when every step ran, 1 when the hook failed. ``monitor``:
    the supervised child's (each step, or each ``--range`` run, is announced to it)."""
    import sys

    from simcluster.errors import UsageError
    from simcluster.limits import SEEDS, STEPS, WORLD_SIZES, check_int, check_output_file
    from simcluster.usercode.rank_local import RankLocal, parse_isolate, rank_local_state
    from simcluster.usercode.targets import parse_shapes
    from simcluster.teaching.wire import parse_network

    if args.numel is not None and args.params is not None:
        raise UsageError("--numel N is short for --params N: give one of them")
    if args.numel is not None and args.numel < 1:
        raise UsageError(f"--numel {args.numel}: must be at least 1")
    check_int("--world-size", args.world_size, *WORLD_SIZES)  # all before loading the target, as record() will
    check_int("--steps", args.steps, *STEPS)
    check_int("--seed", args.seed, *SEEDS)
    network = parse_network(args.network)
    shapes = parse_shapes(str(args.numel), what="--numel") if args.numel is not None else (  # --params' limits
        parse_shapes(args.params) if args.params is not None else DEFAULT_SHAPES)
    cap = args.bucket_cap_mb if args.bucket_cap_mb is not None else (
        DEFAULT_CAP_MB if args.params is None and args.numel is None else None)
    if cap is not None and not 0 < cap < 1e6:
        raise UsageError(f"--bucket-cap-mb {cap}: must be a positive number of MiB")
    if args.timeline and not args.timeline.endswith((".svg", ".html")):
        raise UsageError(f"--timeline {args.timeline}: the file name must end in .svg or .html")
    if args.chrome_trace and not args.chrome_trace.endswith(".json"):
        raise UsageError(f"--chrome-trace {args.chrome_trace}: the file name must end in .json")
    for option, path in (("--timeline", args.timeline), ("--chrome-trace", args.chrome_trace)):
        if path:
            check_output_file(option, path)
    _check_range_options(args)
    isolate = parse_isolate(args.isolate)
    # as check loads a TARGET: every simulated rank imports the hook's module (and the
    # state factory's, and the --isolate modules) for itself, as a process does
    hook = RankLocal(args.target, isolate=isolate)
    state = rank_local_state(args.state, isolate=isolate)
    if args.range:
        from simcluster.teaching.safe_range import range_command

        return range_command(hook, args, state, monitor)
    story = record(hook, world_size=args.world_size, backend=args.backend, seed=args.seed, state=state,
                   shapes=shapes, bucket_cap_mb=cap, steps=args.steps, api=args.api, monitor=monitor,
                   launcher=args.launcher)
    text, ran = explain_story(story, label=args.target, network=network)
    sys.stdout.write(text + f"again:  {_again(args)}\n")
    if args.timeline:
        from simcluster.teaching.timeline import write_timeline

        write_timeline(story, args.timeline, network)
        sys.stdout.write(f"wrote {args.timeline}\n")
    if args.chrome_trace:
        from simcluster.teaching.chrome_trace import write_chrome_trace

        write_chrome_trace(story, args.chrome_trace, network)
        sys.stdout.write(f"wrote {args.chrome_trace} (open it in https://ui.perfetto.dev or chrome://tracing)\n")
    return 0 if ran else 1
