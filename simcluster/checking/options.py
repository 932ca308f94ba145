"""What one check runs with: :class:`Options`, validated once from ``check_hook``'s arguments.

:func:`make_options` turns the keyword arguments of
:func:`~simcluster.checking.check.check_hook` (or the CLI's spellings of them) into one
:class:`Options`, raising :class:`~simcluster.errors.UsageError` — one line, naming the
argument — for anything it cannot use. Which properties apply by default is decided here
too (:func:`choose_properties`), from the tolerance and the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from simcluster.fake.launcher import check_launcher
from simcluster.checking.report import PROPERTIES
from simcluster.checking.strategies import fixed_shapes
from simcluster.checking.supervisor import DEFAULT_DEADLINE, Monitor
from simcluster.checking.tolerances import parse_tolerance
from simcluster.errors import UsageError
from simcluster.fake.state import StateSpec
from simcluster.limits import BACKEND_NAMES, EXAMPLES, SEEDS, STEPS, WORLD_SIZES, check_deadline, check_int
from simcluster.usercode.rank_local import rank_local_state
from simcluster.usercode.targets import parse_shapes

__all__ = ["Options", "DRAIN_STEPS", "EF_DRAIN_CAP", "EF_DRAIN_MAX", "make_options", "choose_properties"]

DRAIN_STEPS = 4
"""Zero-gradient steps appended when *error_feedback* is checked, so a kept residual drains."""

EF_DRAIN_CAP = 256
"""The zero steps of the first longer drain, when the short one left a lag (fewer if the model
has fewer entries): a hook sending one entry per bucket per step (top-1%) needs as many as
the model has entries (round 10 of hooks from the wild, docs/hooks.md)."""

EF_DRAIN_MAX = 4096
"""The most zero steps a drain runs while the lag keeps shrinking (a top-0.1% hook on a model
of a few hundred entries needs that many: stop 30); a hook sending one entry per step of a
larger model is beyond it."""


@dataclasses.dataclass
class Options:
    """Everything one example's run and report need besides the example itself."""

    hook: Callable[..., Any]
    target: str
    state: StateSpec  # parsed once; resolved per rank
    state_name: str
    tolerance: str
    api: str
    seed: int
    props: tuple[str, ...]
    ef_drain: int
    ef_forced: bool = False  # error_feedback named in properties=: check it even without a visible residual
    monitor: Monitor = dataclasses.field(default_factory=Monitor)  # announces examples to a supervisor
    deadline: float = DEFAULT_DEADLINE
    replay_target: str = ""  # the TARGET spelling the replay command uses (loadable from the current directory)
    params: tuple[tuple[int, ...], ...] | None = None  # fixed parameter shapes (--params)
    subgroups: bool = False  # draw DDP on equal subgroups of the world (--subgroups; always with state "group")
    rng: str = "per_rank"  # the ranks' RNG policy (SimCluster's rng=)
    launcher: str = "none"  # the launcher environment the ranks see (SimCluster's launcher=, --launcher)
    bucket_view: bool = False  # every layout with DDP's gradient_as_bucket_view=True (--gradient-as-bucket-view)
    posting_lines: bool = False  # record each collective's posting line (a deadlock's reporting re-run, judge.py)


def choose_properties(properties: Sequence[str] | None, tolerance: str, state: StateSpec) -> tuple[str, ...]:
    """The properties checked, in :data:`~simcluster.checking.report.PROPERTIES` order.

    By default every one that applies: *averages* unless the tolerance is ``none``, and
    *error_feedback* for a stateful lossy hook (tolerance ``none`` and a state factory);
    *keeps_nonfinite* always (it judges only steps whose inputs hold an inf or NaN)."""
    if properties is None:
        chosen = ["contract", "liveness", "replicas_agree", "keeps_nonfinite", "schedule_independence"]
        if tolerance != "none":
            chosen.insert(3, "averages")
        if tolerance == "none" and state.kind == "factory":  # a stateful lossy hook: it should keep a residual
            chosen.append("error_feedback")
        return tuple(chosen)
    unknown = [p for p in properties if p not in PROPERTIES]
    if unknown or isinstance(properties, str):
        raise UsageError(f"properties={properties!r}: each must be one of {', '.join(PROPERTIES)}")
    return tuple(p for p in PROPERTIES if p in properties and not (p == "averages" and tolerance == "none"))


def _check_search(backends: Sequence[str], world_sizes: Sequence[int], steps: int, examples: int,
                  seed: int | None) -> None:
    """The search's sizes: backends, world sizes, steps, examples and seed."""
    bad = [b for b in backends if b not in BACKEND_NAMES]
    if bad or not backends or isinstance(backends, str):
        raise UsageError(f"backends={backends!r}: use a list of 'gloo' and/or 'nccl'")
    if not world_sizes or isinstance(world_sizes, (str, int)):
        raise UsageError(f"world_sizes={world_sizes!r} must be a non-empty list of ints")
    for w in world_sizes:
        check_int("world size", w, *WORLD_SIZES)
    check_int("steps", steps, *STEPS)
    check_int("examples", examples, *EXAMPLES)
    if seed is not None:
        check_int("seed", seed, *SEEDS)


def make_options(hook: Callable[..., Any], *, target: str, replay_target: str, state: Any,
                 isolate: tuple[str, ...], tolerance: str, backends: Sequence[str], world_sizes: Sequence[int],
                 steps: int, examples: int, seed: int | None, api: str, properties: Sequence[str] | None,
                 params: Sequence[Sequence[int]] | str | None, subgroups: bool | None, deadline: float,
                 rng: str, bucket_view: bool = False, launcher: str = "none") -> Options:
    """Validate ``check_hook``'s arguments (in the order they are checked) into :class:`Options`."""
    state_spec = rank_local_state(state, isolate=isolate)
    tol = parse_tolerance(tolerance).describe()
    _check_search(backends, world_sizes, steps, examples, seed)
    deadline = check_deadline(deadline, "deadline")
    if api not in ("current", "legacy"):
        raise UsageError(f"api={api!r}: use 'current' or 'legacy'")
    props = choose_properties(properties, tol, state_spec)
    shapes = None if params is None else parse_shapes(params, what="params") if isinstance(params, str) \
        else fixed_shapes(params)
    if subgroups not in (None, True, False):
        raise UsageError(f"subgroups={subgroups!r}: use True, False or None (default: only with state 'group')")
    check_launcher(launcher)
    if bucket_view not in (True, False):
        raise UsageError(f"gradient_as_bucket_view={bucket_view!r}: use True or False")
    return Options(hook, target, state_spec, state_spec.name, tol, api, 0 if seed is None else seed, props, DRAIN_STEPS,
                   ef_forced=properties is not None and "error_feedback" in properties, deadline=deadline,
                   replay_target=replay_target, params=shapes,
                   subgroups=state_spec.kind == "group" if subgroups is None else subgroups, rng=rng,
                   bucket_view=bool(bucket_view), launcher=launcher)
