"""Differential checks: run one hook in the simulator and on real gloo, compare bit for bit.

The simulator is only worth trusting where it agrees with the real thing. This module
runs the *same* hook on the *same* per-rank gradients twice — once on
``SimCluster(world_size, backend="gloo", schedule="in_order")`` and once on
``world_size`` real gloo processes (:mod:`simcluster.real.gloo_runner`) — and compares what
every rank's future resolved to, step by step, **bitwise** (tensors are viewed as
integers of their element size, so ``-0.0 != 0.0`` and NaN payloads count).

>>> import torch
>>> grads = [[torch.randn(57) for _ in range(2)] for _ in range(3)]   # 3 steps x 2 ranks
>>> report = compare_with_gloo(                                      # doctest: +SKIP
...     "torch.distributed.algorithms.ddp_comm_hooks.default_hooks:allreduce_hook",
...     grads, world_size=2)
>>> report.equal, report.differences                                 # doctest: +SKIP
(True, [])

How a step runs, on both sides alike:

* Each rank gets a fresh bucket (:func:`simcluster.fake.bucket.make_bucket`, index 0,
  ``is_last=True``) holding its gradient, split over parameters shaped
  ``parameters_shapes`` (default: one 1-D parameter). The parameters are created once
  per rank and reused across steps, as DDP hands a hook the model's own parameters.
* The hook's state is built **once per rank** and kept across steps, so stateful hooks
  (PowerSGD's iteration counter and error feedback, top-k residuals) see a training
  loop: ``"none"`` → ``None``; ``"group"`` → the rank's WORLD group; ``"module:factory"``
  (or an importable callable) → ``factory(process_group)``.
* Rank ``r``'s global torch, ``random`` and numpy RNGs start from ``seed + r`` on both
  sides (the simulator's ``rng="per_rank"``; in each gloo process ``torch.manual_seed``,
  ``random.seed`` and ``numpy.random.seed``).
* A hook (and a state factory) given as a ``"file.py:name"`` / ``"module:name"`` string
  gets fresh module state on both sides, as fresh processes would: a per-rank copy in the
  simulator (:class:`~simcluster.usercode.rank_local.RankLocal`), a fresh copy per job in each gloo
  process (a persistent :class:`GlooCluster` would otherwise carry module globals from
  one job into the next).
* The outcome of a rank's step is the future's value, or :class:`Raised` — the
  exception's type name and the first line of its message — when the hook raised, its
  future held an exception (``wait()`` raised), or it returned something other than a
  ``torch.futures.Future``. Exceptions are caught per rank and the loop goes on.

The gloo side needs names, not objects: the hook and a state factory travel to the
children as their spec string, or as ``"module:qualname"`` and are imported there, so they
must be module-level and importable (lambdas and closures are refused with a :class:`UsageError`).

Tensors are compared by dtype, shape, stride and storage offset (a hook returning an
offset or strided view must return the same view on both sides: DDP's copy-back reads
the storage), then bit for bit.

What cannot be compared step by step: the gloo job returns all steps at once, so a job
that fails as a whole (a hang, a process aborted by gloo) yields no values. Two such
outcomes count as agreement, with a note: the simulator's :class:`DeadlockError` against
a gloo timeout, and its :class:`CollectiveMismatchError` against any failed gloo job (gloo
aborts the process on a size mismatch and hangs on others). Anything else is a
:class:`Difference` with ``step=-1``. Same-size collectives issued in swapped order are no
failure on either side: both pair them by issue position (silent wrong data, bit-identical).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from simcluster.fake.bucket import make_bucket
from simcluster.fake.reducer import call_hook, layout_copy
from simcluster.fake.state import LayoutModel, StateSpec
from simcluster.errors import CollectiveMismatchError, DeadlockError, GlooRunError, UsageError, first_line
from simcluster.real.gloo_runner import GlooCluster, first_failed_rank, resolve_target, run_gloo, target_name
from simcluster.usercode.rank_local import RankLocal, own_copies
from simcluster.usercode.rank_state import seed_process_generators

__all__ = ["Raised", "Difference", "DifferentialReport", "compare_with_gloo", "compare_outcomes", "importable_name"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Raised:
    """An exception in place of a value: its type name and the first line of its message."""

    type: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "Raised":
        return cls(type(exc).__name__, first_line(exc))

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


@dataclass
class Difference:
    """The first disagreement on one rank, step and bucket; ``detail`` names the first
    differing element with both values and their bits (sim first, then gloo)."""

    rank: int
    step: int
    bucket: int
    detail: str


@dataclass
class DifferentialReport:
    """Outcome of :func:`compare_with_gloo`.

    ``sim_outputs[step][rank][bucket]`` and ``gloo_outputs[step][rank][bucket]`` hold
    each outcome (a tensor, a list of tensors for legacy hooks, or :class:`Raised`);
    a side that stopped early has fewer steps. ``equal`` is True when nothing differs.
    """

    hook: str
    world_size: int
    steps: int
    equal: bool
    differences: list[Difference]
    sim_outputs: list[list[list[Any]]] = field(repr=False)
    gloo_outputs: list[list[list[Any]]] = field(repr=False)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line per difference (at most ``10``), then the notes."""
        head = f"{self.hook} at world {self.world_size}, {self.steps} steps: "
        if not self.equal:
            head += f"{len(self.differences)} difference(s)"
        else:
            head += "sim and gloo agree bitwise" if self.gloo_outputs else "both fail the same way (no values compared)"
        lines = [head] + [f"  rank {d.rank}, step {d.step}, bucket {d.bucket}: {d.detail}" for d in self.differences[:10]]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


# --------------------------------------------------------------------------- both sides


def _call_hook(hook: Callable[..., Any], state: Any, bucket: Any) -> Any:
    """The hook's future (called as DDP calls it: grad mode off), or :class:`Raised` if it
    raised or returned a non-Future."""
    try:
        fut = call_hook(hook, state, bucket)
    except Exception as exc:  # noqa: BLE001 - the hook's exception is an outcome to compare
        return Raised.of(exc)
    if not isinstance(fut, torch._C.Future):
        return Raised("NotAFuture", f"the hook returned {type(fut).__name__}, not a torch.futures.Future")
    return fut


def _portable(value: Any) -> Any:
    """A copy that outlives the step: tensors keep their layout (:func:`layout_copy`: what
    DDP's copy-back reads), lists are walked."""
    if isinstance(value, torch.Tensor):
        return layout_copy(value)
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    return value


def _parameters(cache: dict[Any, list[torch.Tensor]], shapes: Sequence[tuple[int, ...]] | None,
                grad: torch.Tensor) -> list[torch.Tensor]:
    """The bucket's parameters for ``grad``, created on first use and reused across steps."""
    key = (tuple(tuple(s) for s in shapes) if shapes is not None else ((grad.numel(),),), grad.dtype)
    if key not in cache:
        cache[key] = [torch.nn.Parameter(torch.zeros(s, dtype=grad.dtype)) for s in key[0]]
    return cache[key]


def _state_loader(fresh: bool) -> Callable[[str], Callable[..., Any]]:
    """How a factory spec loads: per simulated rank (a :class:`RankLocal`) or imported once."""
    return (lambda spec: RankLocal(spec, what="state factory")) if fresh else resolve_target


def _states(state: Any, fresh: bool) -> tuple[str, StateSpec]:
    """``state=`` twice: as the gloo processes receive it (``"none"``, ``"group"`` or an
    importable name) and as the simulation uses it (a :class:`StateSpec`).

    A factory spec string is loaded once, here, and the simulation uses that load (a
    per-rank :class:`RankLocal` spelled by its portable name, as the children spell it).
    A factory object travels by its importable name, which the simulation loads as the
    children do (per rank when ``fresh``).
    """
    load = _state_loader(fresh)
    parsed = StateSpec.parse(state, load=load)
    if parsed.kind != "factory":
        return parsed.kind, parsed
    if isinstance(state, str):
        if isinstance(parsed.factory, RankLocal):
            portable = parsed.factory.portable()
            return portable.spec, StateSpec.parse(portable, name=portable.spec)
        return state, parsed
    name = parsed.factory.portable_spec if isinstance(parsed.factory, RankLocal) else importable_name(state)
    return name, StateSpec.parse(name, load=load)


def _fresh_copies(payload: dict[str, Any]) -> tuple[Callable[..., Any], StateSpec]:
    """In a gloo process: the hook and factory from brand-new copies of their modules
    (:func:`~simcluster.usercode.rank_local.own_copies`), as a fresh process imports them."""
    return own_copies(RankLocal(payload["hook"]), StateSpec.parse(payload["state"], load=_state_loader(True)))


# --------------------------------------------------------------------------- gloo side


def _gloo_job(rank: int, world_size: int, payload: dict[str, Any]) -> list[Any]:
    """One real gloo rank: every step of the comparison, state kept across steps."""
    import torch.distributed as dist

    seed_process_generators(payload["seed"], rank)
    if payload.get("fresh"):
        hook, state_spec = _fresh_copies(payload)
    else:
        hook, state_spec = resolve_target(payload["hook"]), StateSpec.parse(payload["state"], load=resolve_target)
    params: dict[Any, list[torch.Tensor]] = {}
    state = state_spec.resolve(dist.group.WORLD, lambda: LayoutModel(_parameters(params, payload["shapes"],
                                                                                 payload["grads"][0])))
    outcomes = []
    for grad in payload["grads"]:
        ps = _parameters(params, payload["shapes"], grad)
        bucket = make_bucket(0, ps, [g.view(p.shape) for g, p in zip(grad.split([p.numel() for p in ps]), ps)],
                             is_last=True)
        got = _call_hook(hook, state, bucket)
        if not isinstance(got, Raised):
            try:
                got = _portable(got.wait())
            except Exception as exc:  # noqa: BLE001 - what DDP's backward() would raise
                got = Raised.of(exc)
        outcomes.append(got)
    return outcomes


# --------------------------------------------------------------------------- sim side


def _settle(fut: torch.futures.Future) -> Any:
    """``.then`` callback: the value, or :class:`Raised` for the exception it holds."""
    try:
        return fut.value()
    except Exception as exc:  # noqa: BLE001
        return Raised.of(exc)


def _run_sim(hook: Callable[..., Any], steps: list[list[torch.Tensor]], state_spec: StateSpec, world_size: int,
             shapes: Sequence[tuple[int, ...]] | None, seed: int) -> tuple[list[list[list[Any]]], BaseException | None]:
    """Every step on ``SimCluster(backend="gloo", schedule="in_order")``; stops at an engine error."""
    from simcluster.fake.cluster import SimCluster

    cluster = SimCluster(world_size, seed=seed, backend="gloo", schedule="in_order")
    kept: list[Any] = [None] * world_size

    def first_state(pg: Any, model: Any) -> Any:
        kept[pg.rank()] = state_spec.resolve(pg, model)
        return kept[pg.rank()]

    def sim_hook(state: Any, bucket: Any) -> Any:
        got = _call_hook(hook, state, bucket)
        if isinstance(got, Raised):
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(got)
            return done
        return got.then(_settle)

    params: dict[Any, list[torch.Tensor]] = {}
    outputs: list[list[list[Any]]] = []
    for step, grads in enumerate(steps):
        if state_spec.kind == "group":
            state: Any = state_spec
        elif step == 0:
            state = first_state
        else:
            state = lambda pg: kept[pg.rank()]  # noqa: E731 - the states built at step 0
        try:
            run = cluster.run_hook(sim_hook, grads, state, parameters=_parameters(params, shapes, grads[0]))
        except Exception as exc:  # noqa: BLE001 - an engine-level outcome (deadlock, mismatch…)
            outputs.append([[Raised.of(exc)] for _ in range(world_size)])
            return outputs, exc
        outputs.append([[_portable(o)] for o in run.outputs])
    return outputs, None


# --------------------------------------------------------------------------- comparing


def _bits(t: torch.Tensor, i: int) -> str:
    size = t.element_size()
    raw = int(t.reshape(-1)[i : i + 1].contiguous().view(_INT_OF_SIZE[size]).item()) & ((1 << (8 * size)) - 1)
    return f"0x{raw:0{2 * size}x}"


def compare_outcomes(sim: Any, gloo: Any) -> str | None:
    """``None`` if the two outcomes agree bitwise; else what differs first (sim, then gloo).

    >>> compare_outcomes(torch.tensor([1.0, 0.0]), torch.tensor([1.0, -0.0]))
    'element 1 of 2 (float32): sim 0.0 (0x00000000) vs gloo -0.0 (0x80000000)'
    """
    if isinstance(sim, torch.Tensor) and isinstance(gloo, torch.Tensor):
        if sim.dtype != gloo.dtype or sim.shape != gloo.shape:
            return f"sim {sim.dtype}{list(sim.shape)} vs gloo {gloo.dtype}{list(gloo.shape)}"
        if (sim.stride(), sim.storage_offset()) != (gloo.stride(), gloo.storage_offset()):
            return (f"layout: sim stride {sim.stride()} offset {sim.storage_offset()} vs gloo stride "
                    f"{gloo.stride()} offset {gloo.storage_offset()}")
        if sim.element_size() not in _INT_OF_SIZE:
            return None if torch.equal(sim, gloo) else f"values differ ({sim.dtype}, no integer view)"
        a = sim.contiguous().reshape(-1).view(_INT_OF_SIZE[sim.element_size()])
        b = gloo.contiguous().reshape(-1).view(_INT_OF_SIZE[sim.element_size()])
        where = (a != b).nonzero()
        if where.numel() == 0:
            return None
        i = int(where[0, 0])
        fa, fb = sim.reshape(-1)[i].item(), gloo.reshape(-1)[i].item()
        return (f"element {i} of {a.numel()} ({str(sim.dtype).removeprefix('torch.')}): "
                f"sim {fa!r} ({_bits(sim, i)}) vs gloo {fb!r} ({_bits(gloo, i)})")
    if isinstance(sim, list) and isinstance(gloo, list):
        if len(sim) != len(gloo):
            return f"sim a list of {len(sim)} vs gloo a list of {len(gloo)}"
        for k, (x, y) in enumerate(zip(sim, gloo)):
            detail = compare_outcomes(x, y)
            if detail is not None:
                return f"item {k}: {detail}"
        return None
    if type(sim) is type(gloo) and sim == gloo:
        return None
    return f"sim {_describe(sim)} vs gloo {_describe(gloo)}"


def _describe(x: Any) -> str:
    if isinstance(x, Raised):
        return f"raised {x}"
    if isinstance(x, torch.Tensor):
        return f"a tensor {x.dtype}{list(x.shape)}"
    return f"{type(x).__name__} {x!r}"


# --------------------------------------------------------------------------- front door


def compare_with_gloo(
    hook: Callable[..., Any] | str,
    grads_per_step: Sequence[Sequence[torch.Tensor]],
    *,
    state: str | Callable[..., Any] = "none",
    world_size: int,
    cluster: GlooCluster | None = None,
    parameters_shapes: Sequence[tuple[int, ...]] | None = None,
    seed: int = 0,
    timeout: float = 60.0,
) -> DifferentialReport:
    """Run ``hook`` on the simulator and on real gloo; report every rank/step that differs.

    ``grads_per_step[s][r]`` is rank ``r``'s gradient at step ``s`` (one bucket per step).
    ``cluster``: a :class:`GlooCluster` of ``world_size`` ranks to reuse (~1 ms a job);
    ``None`` starts a fresh world for this call (seconds). ``timeout`` bounds the gloo job.
    The hook and a state factory must be importable (see the module docstring).
    """
    fresh = isinstance(hook, str)
    if fresh:
        hook_fn: Callable[..., Any] = RankLocal(hook)  # type: ignore[arg-type]
        name = hook_fn.portable_spec  # type: ignore[attr-defined]
    else:
        name = importable_name(hook)
        hook_fn = hook  # type: ignore[assignment]
    spec, state_spec = _states(state, fresh)
    steps = _check_steps(grads_per_step, world_size)
    if cluster is not None and cluster.world_size != world_size:
        raise UsageError(f"cluster has world_size={cluster.world_size}, but world_size={world_size} was asked for")
    notes = [f"sim: SimCluster(world_size={world_size}, seed={seed}, backend='gloo', schedule='in_order')"]

    sim_outputs, sim_error = _run_sim(hook_fn, steps, state_spec, world_size, parameters_shapes, seed)
    payloads = [{"hook": name, "state": spec, "shapes": parameters_shapes, "seed": seed, "fresh": fresh,
                 "grads": [step[r] for step in steps]} for r in range(world_size)]
    gloo_outputs: list[list[list[Any]]] = []
    differences: list[Difference] = []
    try:
        if cluster is None:
            per_rank = run_gloo(_gloo_job, world_size, payloads, timeout=timeout)
        else:
            per_rank = cluster.run(_gloo_job, payloads, timeout=timeout)
    except GlooRunError as err:
        kwargs = {"hook": name, "grads_per_step": steps, "state": spec, "world_size": world_size,
                  "parameters_shapes": parameters_shapes, "seed": seed, "timeout": timeout}
        differences += _gloo_failed(err, sim_outputs, sim_error, kwargs, notes)
        return DifferentialReport(name, world_size, len(steps), not differences, differences,
                                  sim_outputs, gloo_outputs, notes)

    gloo_outputs = [[[per_rank[r][s]] for r in range(world_size)] for s in range(len(steps))]
    if sim_error is not None:
        notes.append(f"sim stopped at step {len(sim_outputs) - 1}: {Raised.of(sim_error)}")
    differences += _differences(sim_outputs, gloo_outputs, len(steps), world_size)
    return DifferentialReport(name, world_size, len(steps), not differences, differences,
                              sim_outputs, gloo_outputs, notes)


def _gloo_failed(err: GlooRunError, sim_outputs: list[Any], sim_error: BaseException | None,
                 kwargs: dict[str, Any], notes: list[str]) -> list[Difference]:
    """A gloo job that failed as a whole: agreement if the sim failed the same way (a note),
    else one difference, with gloo's error and the command reproducing it in ``notes``."""
    first = first_line(err)
    hung = bool(err.unfinished) and not err.failures
    if (hung and isinstance(sim_error, DeadlockError)) or isinstance(sim_error, CollectiveMismatchError):
        notes.append(f"both fail: sim raised {type(sim_error).__name__} at step {len(sim_outputs) - 1}; "
                     f"gloo: {first}; no values compared (the gloo job returns all steps at once)")
        return []
    text = "\n".join(line for line in str(err).splitlines() if not line.startswith("reproduce: "))
    notes.append(f"gloo: {text}")
    notes.append(f"reproduce: {reproduce_command(kwargs)}")
    return [Difference(first_failed_rank(err), -1, 0, f"the gloo job failed as a whole: {first}")]


def _differences(sim_outputs: list[Any], gloo_outputs: list[Any], steps: int, world_size: int) -> list[Difference]:
    """Every (rank, step) whose sim outcome differs from gloo's, in step then rank order."""
    differences: list[Difference] = []
    for s in range(steps):
        for r in range(world_size):
            if s >= len(sim_outputs):
                differences.append(Difference(r, s, 0, "no sim outcome: the simulation stopped at an earlier step"))
                continue
            detail = compare_outcomes(sim_outputs[s][r][0], gloo_outputs[s][r][0])
            if detail is not None:
                differences.append(Difference(r, s, 0, detail))
    return differences


REPRODUCE_DIR = ".simcluster/differential"
"""Where a failed comparison's inputs are saved (relative to the current directory)."""


def reproduce_command(kwargs: dict[str, Any]) -> str:
    """A shell command, runnable from the current directory, that repeats the comparison.

    Its inputs (the arguments of :func:`compare_with_gloo` and the caller's ``sys.path``,
    so the hook imports as it did here) are saved with ``torch.save`` under
    :data:`REPRODUCE_DIR`, named by their digest; ``python -m simcluster.real.differential FILE``
    loads them, compares again and prints the summary (exit 1 if anything differs).
    """
    import hashlib
    import io
    import os
    import shlex

    buffer = io.BytesIO()
    torch.save({"kwargs": kwargs, "sys_path": [p for p in sys.path if p]}, buffer)
    path = os.path.join(REPRODUCE_DIR, hashlib.sha1(buffer.getvalue()).hexdigest()[:12] + ".pt")
    os.makedirs(REPRODUCE_DIR, exist_ok=True)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
    return f"{shlex.quote(sys.executable)} -m simcluster.real.differential {shlex.quote(path)}"


def _main(argv: list[str]) -> int:
    """``python -m simcluster.real.differential FILE``: repeat a saved comparison (see :func:`reproduce_command`)."""
    if len(argv) != 1:
        print("usage: python -m simcluster.real.differential FILE", file=sys.stderr)
        return 2
    saved = torch.load(argv[0])
    sys.path[:0] = [p for p in saved["sys_path"] if p not in sys.path]
    from simcluster.real.differential import compare_with_gloo as compare  # not __main__'s copy: the children import it

    report = compare(**saved["kwargs"])
    print(report.summary())
    return 0 if report.equal else 1


def importable_name(obj: Callable[..., Any] | str) -> str:
    """``"module:name"`` under which the gloo children can import ``obj``.

    Module-level functions and classes go by their qualified name; an object *built* at
    module level (e.g. ``simcluster.hooks.legacy.fp16_wrapped_allreduce_hook = wrapper(inner)``,
    whose ``__qualname__`` names a closure) is found by identity among its module's
    globals, first in definition order. Anything else raises :class:`UsageError`.
    """
    try:
        return target_name(obj)
    except UsageError:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        for key, value in vars(module).items() if module is not None else ():
            if value is obj:
                return f"{module.__name__}:{key}"
        raise


def _check_steps(grads_per_step: Sequence[Sequence[torch.Tensor]], world_size: int) -> list[list[torch.Tensor]]:
    if not grads_per_step:
        raise UsageError("grads_per_step is empty: give at least one step of per-rank gradients")
    steps = []
    for s, grads in enumerate(grads_per_step):
        if len(grads) != world_size or not all(isinstance(g, torch.Tensor) for g in grads):
            raise UsageError(f"grads_per_step[{s}] must hold {world_size} tensors (one per rank), got {len(grads)}")
        steps.append([g.detach().reshape(-1).clone() for g in grads])
    return steps


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
