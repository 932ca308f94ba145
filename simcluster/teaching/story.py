"""A recorded DDP run for teaching: K steps of :class:`~simcluster.ddp.model.SimDDP`, every event kept.

``simcluster explain`` and its pictures (:mod:`simcluster.teaching.timeline`,
:mod:`simcluster.teaching.chrome_trace`) and the wire model (:mod:`simcluster.teaching.wire`) all read one
:class:`Story`: per step, the bucket layout DDP used (iteration 0 one bucket in parameter
order, then the rebuild in gradient-ready order), the small whole-number gradients each
rank fed in, the trace of that step with the hook calls added (:class:`HookCall`), what
each future held, and — when the step failed — the exception and the trace *up to the
failure*.

The hook calls are recorded by a thin wrapper around the hook that appends to the running
step's trace (the hook itself sees the same state and bucket). Nothing here reads a
clock: equal arguments give equal stories.

>>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
>>> story = record(allreduce_hook, world_size=2, steps=2)
>>> [s.bucket_params for s in story.steps]    # iteration 0, then the rebuild: three buckets
[[[0, 1, 2]], [[2], [1], [0]]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from simcluster.checking.properties import build_refusal, registration_problem
from simcluster.fake.cluster import SimCluster
from simcluster.ddp.model import DDPConfig, SimDDP, StepResult
from simcluster.engine.guard import is_stop_request
from simcluster.errors import NOT_THE_HOOKS
from simcluster.limits import SEEDS, STEPS, WORLD_SIZES, check_int
from simcluster.usercode.output import captured_output, marking_ranks
from simcluster.usercode.rank_local import as_rank_local, rank_local_state

__all__ = ["HookCall", "StepStory", "Story", "record", "DEFAULT_SHAPES", "DEFAULT_CAP_MB", "step_gradients"]

DEFAULT_SHAPES: tuple[tuple[int, ...], ...] = ((2, 2), (3,), (3,))
"""``explain``'s default model: three small parameters (16, 12 and 12 bytes in float32)."""

DEFAULT_CAP_MB = 12 / 2**20
"""``explain``'s default bucket cap, 12 bytes: after the rebuild each parameter is a bucket of
its own, so the default story has three buckets in flight."""


@dataclass(frozen=True)
class HookCall:
    """Rank ``rank`` entered (``phase="call"``) or left (``"return"``/``"raise"``) the hook for
    bucket ``bucket``. Added to a step's events by :func:`record`; not a :mod:`simcluster.engine.trace` event."""

    rank: int
    bucket: int
    phase: str
    returned: str = "its future"
    """For ``"return"``: what the hook returned, in words (``"None, not a future"``)."""
    future: str = ""
    """For ``"return"`` of a simulated future: its trace label (``"then(f) of all_reduce#0 on
    WORLD"``), so the reducer's wait on it can be told as that bucket's."""


@dataclass
class StepStory:
    """One DDP step. ``inputs[r][i]``: rank ``r``'s gradient of parameter ``i``;
    ``events``: the trace with the :class:`HookCall` events; ``result``: the step's
    :class:`StepResult`, None when it failed with ``error``; ``printed``: what the hook
    (and its callbacks) printed during the step, stdout and stderr in order;
    ``printed_by``: the same text in ``(rank, text)`` pieces — the rank whose code was
    running when it was written (``None``: outside every rank), as each real rank's
    process prints its own."""

    step: int
    iteration: int
    bucket_params: list[list[int]]
    bucket_numel: list[int]
    inputs: list[list[torch.Tensor]]
    events: list[Any]
    result: StepResult | None = None
    error: BaseException | None = None
    printed: str = ""
    printed_by: list[tuple[int | None, str]] = field(default_factory=list)


@dataclass
class Story:
    """A recorded run: the setting and each step (the last one may have failed)."""

    world_size: int
    backend: str
    seed: int
    shapes: tuple[tuple[int, ...], ...]
    bucket_cap_mb: float | None
    steps: list[StepStory] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)  # each rank's hook state after the last step
    api: str = "current"
    """The bucket API the hook met: ``"current"`` (torch >= 1.10) or ``"legacy"`` (1.7-1.9)."""
    registration: str | None = None
    """How real DDP's ``register_comm_hook`` refuses the hook, None when it registers it
    (:func:`~simcluster.checking.properties.registration_problem`); the story runs it anyway."""

    @property
    def failed(self) -> StepStory | None:
        """The step that failed, if any."""
        return next((s for s in self.steps if s.error is not None), None)


def step_gradients(gen: torch.Generator, world_size: int, shapes: Sequence[tuple[int, ...]]) -> list[list[torch.Tensor]]:
    """One step's gradients: per rank, whole numbers in [-8, 8] (exact in every float type, so
    the mean is readable), drawn flat from ``gen`` and split into the parameters."""
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    out = []
    for _ in range(world_size):
        flat = torch.randint(-8, 9, (sum(sizes),), generator=gen).to(torch.float32)
        out.append([g.reshape(s).clone() for g, s in zip(flat.split(sizes), shapes)])
    return out


def _bucket_index(bucket: Any) -> int:
    """The bucket's index under either API: the recorder must not call ``index()`` on a
    bucket that models torch 1.7-1.9 (it raises there, as torch 1.9's had none)."""
    return bucket.get_index() if hasattr(bucket, "get_index") else bucket.index()


def _recording(hook: Callable[[Any, Any], Any], cluster: SimCluster, seen: list[Any]) -> Callable[[Any, Any], Any]:
    """``hook`` with its calls appended to the running step's trace (``seen[0]`` keeps that trace)."""

    @functools.wraps(hook)
    def recorded(state: Any, bucket: Any) -> Any:
        engine = cluster.engine
        trace = engine.trace if engine is not None else None
        if trace is not None:
            seen[:] = [trace]
        rank, index = dist.get_rank(), _bucket_index(bucket)
        if trace is not None:
            trace.add(HookCall(rank, index, "call"))
        try:
            future = hook(state, bucket)
        except BaseException:
            if trace is not None:
                trace.add(HookCall(rank, index, "raise"))
            raise
        if trace is not None:
            trace.add(HookCall(rank, index, "return", _returned(future), str(getattr(future, "label", ""))))
        return future

    return recorded


def _returned(value: Any) -> str:
    """What a hook returned, in words: ``"its future"``, or e.g. ``"None, not a future"``."""
    if isinstance(value, torch._C.Future):  # every future, a simulated one too (torch.futures.Future is
        # patched to a per-cluster subclass during a run); one that is done already (a hook that waited, or set
        # its result) is said to be: the line telling it complete comes later, where DDP's callback on it runs
        return "its future, already complete," if value.done() else "its future"
    return f"{'None' if value is None else 'a ' + type(value).__name__}, not a future,"


def record(
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
    monitor: Any = None,
    isolate: Sequence[str] | str | None = (),
    launcher: str = "none",
) -> Story:
    """Run ``hook`` under :class:`SimDDP` for ``steps`` steps and keep everything.

    Stops at the first failing step (its ``error`` set, its events up to the failure) —
    also when the hook calls ``sys.exit()``, which ends a real rank's process.
    ``hook``: a callable (its module shared by every rank), or a ``module:name`` /
    ``file.py:name`` spec or :class:`~simcluster.usercode.rank_local.RankLocal` — each
    simulated rank then runs its own copy of the module (and of the ``isolate`` modules),
    as ``check`` does (:func:`~simcluster.usercode.rank_local.as_rank_local`).
    ``state``: ``None``, ``"group"`` or a factory ``factory(process_group)`` (a spec string:
    per rank, :func:`~simcluster.usercode.rank_local.rank_local_state`). ``monitor``
    (a supervised child's :class:`~simcluster.checking.supervisor.Monitor`) hears of each
    step (``begin``: the deadline is per step) and each hook call (``at``: where it stopped).
    ``launcher``: SimCluster's (``"torchrun"``: each rank sees torchrun's variables).
    """
    check_int("--steps", steps, *STEPS)
    check_int("--world-size", world_size, *WORLD_SIZES)
    check_int("--seed", seed, *SEEDS)
    shapes = tuple(tuple(s) for s in shapes)
    hook, state = as_rank_local(hook, isolate=isolate), rank_local_state(state, isolate=isolate)
    # a story is told once, not searched: a deadlock may name the line that posted each unmatched call
    cluster = SimCluster(world_size=world_size, seed=seed, backend=backend, posting_lines=True, launcher=launcher)
    seen: list[Any] = []
    ddp = SimDDP(cluster, _recording(hook, cluster, seen), list(shapes), state=state,
                 config=DDPConfig(bucket_cap_mb=bucket_cap_mb, api=api))
    if monitor is not None:
        ddp.on_hook_call = monitor.at
    story = Story(world_size, backend, seed, shapes, bucket_cap_mb, api=api,
                  registration=registration_problem(hook, api) or build_refusal(hook))
    gen = torch.Generator().manual_seed(seed)
    for k in range(steps):
        if monitor is not None:
            monitor.begin({"phase": "explain", "step": k})
        calls = ddp.layout()
        grads = step_gradients(gen, world_size, shapes)
        numel = [sum(int(torch.Size(shapes[i]).numel()) for i in c.params) for c in calls]
        one = StepStory(k, ddp.iteration, [list(c.params) for c in calls], numel, grads, [])
        story.steps.append(one)
        seen.clear()
        with captured_output(getattr(monitor, "output_fd", None)) as printed, marking_ranks(printed):
            try:
                one.result = ddp.step(grads)
            except NOT_THE_HOOKS:  # not the hook's failure: not modelled, or a bug of ours
                raise
            except BaseException as exc:  # the hook's failure is the lesson; explain prints it whole
                if is_stop_request(exc):
                    raise
                one.error = exc
        one.printed, one.printed_by = printed.text, printed.parts()
        if one.result is None:
            one.events = list(seen[0].events) if seen else []
            break
        one.events = list(one.result.trace.events)
    story.states = list(ddp.states)
    return story
