"""``simcluster explain``: run a hook once, on small gradients, and say what it did.

For learning what a communication hook does: each rank gets one bucket holding a few
small whole numbers (exact in every float type, so the mean is readable), the hook runs
once per rank on the simulated cluster, and the explanation shows

1. each rank's input gradient;
2. the trace — every collective posted, when it completed, where each callback ran,
   who blocked (:meth:`simcluster.trace.Trace.format`);
3. the collectives summarised across ranks;
4. what each rank's future held — what DDP would copy into the parameters' ``.grad`` —
   and whether it is the bucket's own storage (an in-place hook) or a new tensor;
5. the float64 mean of the inputs, each rank's distance from it, and whether the replicas
   agree bitwise.

>>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
>>> text, ok = explain(allreduce_hook, world_size=2, seed=0)
>>> ok
True
>>> "all_reduce #0 on WORLD completes on ranks [0, 1]" in text
True
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from simcluster.cluster import SimCluster
from simcluster.errors import UsageError

__all__ = ["explain", "explain_command", "small_gradients"]


def small_gradients(world_size: int, numel: int, seed: int) -> list[torch.Tensor]:
    """Rank ``r``'s float32 gradient: ``numel`` whole numbers in [-8, 8], drawn from
    ``seed`` with a private generator (the global RNG is not touched)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-8, 9, (numel,), generator=gen).to(torch.float32) for _ in range(world_size)]


def _fmt(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        dtype = str(t.dtype).removeprefix("torch.")
        return f"{t.detach().reshape(-1).tolist()}  ({dtype}{list(t.shape)})"
    if isinstance(t, (list, tuple)):
        return f"a {type(t).__name__} of {len(t)}: [{', '.join(_fmt(x) for x in t)}]" + (
            "  — current DDP rejects a list result ('Unable to cast')" if t else ""
        )
    return f"{type(t).__name__}: {t!r}"


def _result_tensor(value: Any) -> torch.Tensor | None:
    """The result tensor: the value itself, or the one tensor of a legacy ``[tensor]`` result."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _trace_lines(text: str) -> list[str]:
    """The trace, with the harness's own wait (DDP's reducer taking the result) said in words."""
    lines = []
    for line in text.splitlines():
        head, sep, rest = line.partition(": callback collect.<locals>.store of ")
        if sep:
            future, _, where = rest.rpartition(" runs ")
            line = f"{head}: DDP's reducer takes the result of {future} ({where})"
        lines.append(line)
    return lines or ["(no events)"]


def _section(title: str, lines: list[str]) -> list[str]:
    return [title, *("   " + line for line in lines), ""]


def explain(
    hook: Callable[[Any, Any], Any],
    *,
    world_size: int = 2,
    backend: str = "gloo",
    seed: int = 0,
    state: Any = None,
    numel: int = 4,
    name: str | None = None,
) -> tuple[str, bool]:
    """Run ``hook`` once on ``world_size`` ranks and explain it; returns ``(text, ran)``.

    ``ran`` is False when the hook (or its future) raised: the text then ends with the
    error and the replay line. ``state`` is a state spec as for
    :meth:`SimCluster.run_hook` (``None``, ``"group"``, or a per-rank factory).
    """
    if numel < 1:
        raise UsageError(f"--numel {numel}: must be at least 1")
    grads = small_gradients(world_size, numel, seed)
    label = name or getattr(hook, "__qualname__", repr(hook))
    cluster = SimCluster(world_size=world_size, seed=seed, backend=backend)
    out = [f"simcluster explain: {label} on {world_size} simulated rank(s), {backend} backend model, seed {seed}", ""]
    out += _section(f"1. What each rank's hook receives (bucket 0, the only bucket, float32[{numel}]):",
                    [f"rank {r}: {g.tolist()}" for r, g in enumerate(grads)])
    try:
        run = cluster.run_hook(hook, grads, state=None if state == "none" else state)
    except Exception as exc:  # noqa: BLE001 - the hook's own error is the lesson here
        notes = [n for n in getattr(exc, "__notes__", [])]
        first = (str(exc).strip().splitlines() or [""])[0]
        out += _section("2. The hook failed:", [f"{type(exc).__name__}: {first}", *notes])
        return "\n".join(out).rstrip() + "\n", False
    out += _section("2. What happened, in order (the trace):", _trace_lines(run.trace.format()))
    summary = [
        f"{c.op} #{c.seq} on {c.group}: ranks {list(c.ranks)}, {c.dtype}{list(c.shape)} per rank, "
        f"{c.nbytes} B in total, " + ("never completed" if c.order is None else f"completion order {c.order}")
        for c in run.trace.collectives()
    ]
    out += _section("3. The collectives, across ranks:", summary or ["none: this hook does not communicate"])
    held = []
    for r, (value, bucket) in enumerate(zip(run.outputs, run.buckets)):
        where = ""
        if isinstance(value, torch.Tensor):
            same = value.untyped_storage().data_ptr() == bucket.buffer().untyped_storage().data_ptr()
            where = "  the bucket's own buffer (in place)" if same else "  a new tensor"
        held.append(f"rank {r}: {_fmt(value)}{where}")
    out += _section("4. What each rank's future held (what DDP copies into .grad):", held)
    mean = torch.stack([g.to(torch.float64) for g in grads]).mean(0)
    verdict = [f"mean: {mean.tolist()}"]
    tensors = [t for t in (_result_tensor(v) for v in run.outputs) if t is not None]
    if any(not isinstance(v, torch.Tensor) for v in run.outputs) and len(tensors) == world_size:
        verdict.append("(comparing the tensor inside each legacy [tensor] result)")
    if len(tensors) == world_size:
        for r, v in enumerate(tensors):
            flat = v.detach().reshape(-1)[:numel].to(torch.float64)
            err = (flat - mean).abs().max().item() if flat.numel() == numel else float("nan")
            verdict.append(f"rank {r}: max |result - mean| = {err:g}")
        agree = all(torch.equal(tensors[0], t) and tensors[0].dtype == t.dtype for t in tensors)
        verdict.append("replicas agree bitwise: " + ("yes" if agree else "NO — the model copies would drift apart"))
    out += _section("5. The float64 mean of the inputs (what an averaging hook should give):", verdict)
    out.append(f"replay: {run.replay}")
    return "\n".join(out) + "\n", True


def explain_command(target: str, *, world_size: int, backend: str, seed: int, state: str, numel: int) -> int:
    """``simcluster explain``: load ``target`` (and ``state``), print the explanation.

    Returns 0 when the hook ran, 1 when it raised (the error is part of the explanation).
    """
    from simcluster.rank_local import RankLocal

    if world_size < 1:
        raise UsageError(f"--world-size {world_size}: must be at least 1")
    hook = RankLocal(target)  # every simulated rank imports the TARGET's module for itself
    state_obj = state if state in ("none", "group") else RankLocal(state, what="--state factory")
    text, ran = explain(hook, world_size=world_size, backend=backend, seed=seed,
                        state=state_obj, numel=numel, name=target)
    again = f"simcluster explain {target} --world-size {world_size} --backend {backend} --seed {seed}"
    again += (f" --state {state}" if state != "none" else "") + (f" --numel {numel}" if numel != 4 else "")
    sys.stdout.write(text + f"again:  {again}\n")
    return 0 if ran else 1
