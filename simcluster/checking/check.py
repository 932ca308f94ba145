"""The checking engine: Hypothesis drives simulated DDP runs of a hook, the oracles judge them.

    >>> from simcluster.hooks.reference import mean_allreduce_hook
    >>> report = check_hook(mean_allreduce_hook, examples=5, world_sizes=(2, 3))
    >>> report.passed, report.properties
    (True, ['contract', 'liveness', 'replicas_agree', 'averages', 'schedule_independence'])

For each backend model, one Hypothesis test draws an :class:`~simcluster.checking.strategies.Example`
(world size, layout, ``steps`` steps of per-rank gradients, a completion schedule), runs
:class:`~simcluster.ddp.model.SimDDP` on it, and applies the oracles of
:mod:`simcluster.checking.properties` in a fixed order — liveness, contract, replicas_agree,
averages, schedule_independence, error_feedback — raising on the first violation. Each
*distinct bug* — property, exception type, the user-code line it arose at — raises its
own exception class, so Hypothesis keeps searching after the first failure, shrinks each
separately, and the report lists every one (at most :data:`MAX_BUGS` per backend), each
with its **shrunk** counterexample. Rendering is :mod:`simcluster.checking.render`.

What a hook's own exception counts as: the step cannot complete, so *liveness* — except
when ``error_feedback`` is checked and the exception comes after step 0 (the memory kept
across steps broke it), then *error_feedback*. ``error_feedback`` is a candidate by
default for a stateful lossy hook (tolerance ``none``, a state factory) and is checked
when its state :func:`keeps_residual`, or always when named in ``properties``. Errors of simcluster's contract model
(``CopyBackError``, bucket misuse, a backend rejecting an op) count as *contract*.

**Replay.** Every failure carries a token ``sc1.<base64url(zlib(JSON of the Example,
plus the backend))>``: the concrete counterexample, not Hypothesis' internal choice
sequence, so it survives Hypothesis upgrades; the example includes the seed of the ranks'
torch, ``random`` and numpy generators (``Example.rng_seed``; a token made before that field
existed replays with ``--seed``, as it did then). ``check_hook(..., replay=token)`` (CLI:
``--replay TOKEN``) runs exactly that example once, bit for bit. With ``database=DIR``
Hypothesis also keeps failing examples there and tries them first on later runs.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import inspect
import json
import os
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from simcluster.checking import properties as P
from simcluster.fake.cluster import SimCluster
from simcluster.ddp.model import DDPConfig, SimDDP, subgroups
from simcluster.engine.inline import is_stop_request
from simcluster.errors import (
    BackendError, GradBucketMisuse, HookContractError, HookExited, UnsupportedError, UsageError, Violation, first_line,
)
from simcluster.fake.state import StateSpec
from simcluster.names import loadable_spec, target_spec
from simcluster.limits import BACKEND_NAMES, EXAMPLES, SEEDS, STEPS, WORLD_SIZES, check_deadline, check_int
from simcluster.checking.render import (
    bucket_steps, describe_layout, describe_steps, error_frames, error_text, rebuild_hint,
    render_gradients, user_line,
)
from simcluster.checking.report import PROPERTIES, CheckReport, PropertyFailure
from simcluster.checking.tolerances import parse_tolerance
from simcluster.checking.strategies import (
    DTYPES, Example, Layout, RankSpec, ScheduleChoices, StepSpec, examples as example_strategy, fixed_shapes,
)
from simcluster.checking.supervisor import (
    DEFAULT_DEADLINE, ChildDeath, Monitor, format_stack, raise_site, run_supervised, stuck_in,
)
from simcluster.usercode.targets import parse_shapes
from simcluster.usercode.rank_local import RankLocal, parse_isolate, rank_local_state

__all__ = ["check_hook", "assert_hook", "encode_example", "decode_example", "run_example", "keeps_residual", "Violation"]

TOKEN_PREFIX = "sc1."
_ORDER = ("liveness", "contract", "replicas_agree", "averages", "schedule_independence", "error_feedback")
DRAIN_STEPS = 4
MAX_BUGS = 5  # distinct failures reported per backend
SHRINK_BUDGET = 3  # × examples: simulated examples allowed for shrinking after the first failure


# One subclass per property, so Hypothesis tells the failures apart and shrinks each.
_VIOLATIONS: dict[str, type[Violation]] = {
    name: type(f"{''.join(w.title() for w in name.split('_'))}Violation", (Violation,), {"prop": name})
    for name in PROPERTIES
}
_KEYED: dict[tuple[str, str, str], type[Violation]] = {}


def _violation_class(prop: str, error_type: str, line: str) -> type[Violation]:
    """The class raised for a distinct bug — (property, exception type, user-code line).

    Hypothesis tells bugs apart by exception type and origin; every Violation is raised
    from one place, so the key must be in the type: one subclass per key (cached, so a
    key always gets the same class) lets Hypothesis shrink each distinct bug separately.
    """
    if not error_type:
        return _VIOLATIONS[prop]
    key = (prop, error_type, line)
    if key not in _KEYED:
        base = _VIOLATIONS[prop]
        _KEYED[key] = type(f"{base.__name__}[{error_type} at {line or '?'}]", (base,), {"key": key})
    return _KEYED[key]


# --------------------------------------------------------------------------- replay tokens
def encode_example(example: Example, backend: str) -> str:
    """The replay token of ``example`` on ``backend`` (see the module docstring)."""
    data = {"backend": backend, "example": dataclasses.asdict(example)}
    if example.rng_seed is None:  # tokens of examples without drawn RNG seeds read as before
        del data["example"]["rng_seed"]
    raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    return TOKEN_PREFIX + base64.urlsafe_b64encode(zlib.compress(raw, 9)).decode().rstrip("=")


def decode_example(token: str) -> tuple[Example, str]:
    """``(example, backend)`` from a replay token; UsageError if it is not one."""
    try:
        if not token.startswith(TOKEN_PREFIX):
            raise ValueError("no sc1. prefix")
        body = token[len(TOKEN_PREFIX):]
        data = json.loads(zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))
        ex = data["example"]
        layout = Layout(**{**ex["layout"], "shapes": tuple(tuple(s) for s in ex["layout"]["shapes"]),
                           "ready_order": tuple(ex["layout"]["ready_order"])})
        b = ex["base"]
        base = StepSpec(ranks=tuple(RankSpec(r["fill"], r["exp"], r["seed"], r["value"],
                                             tuple((p, v) for p, v in r["specials"]), r["zero"]) for r in b["ranks"]),
                        shared=tuple((p, v) for p, v in b["shared"]), exp=b["exp"], shift=b["shift"])
        example = Example(ex["world_size"], layout, base, tuple(ex["shifts"]), tuple(ex["schedule"]), ex["dtype"],
                          ex["values"], ex["exact"], ex["subgroups"], ex.get("rng_seed"))
        return example, data["backend"]
    except Exception as exc:  # noqa: BLE001 - any malformation is the caller's
        raise UsageError(f"--replay {token[:40]!r}…: not a simcluster replay token ({exc})") from None


# --------------------------------------------------------------------------- one example
@dataclasses.dataclass
class _Options:
    hook: Callable[..., Any]
    target: str
    state: StateSpec
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


def _groups(example: Example) -> list[list[int]]:
    size = example.world_size // example.subgroups
    return [list(range(i * size, (i + 1) * size)) for i in range(example.subgroups)]


def _simulate(opts: _Options, example: Example, backend: str, schedule: Any,
              grads: list[list[list[torch.Tensor]]]) -> tuple[list[Any], BaseException | None, int, list[Any]]:
    """Run every step; (step results, the error that stopped the run or None, its step, the states)."""
    seed = opts.seed if example.rng_seed is None else example.rng_seed
    cluster = SimCluster(example.world_size, seed=seed, backend=backend, schedule=schedule, rng=opts.rng)
    lay = example.layout
    config = DDPConfig(bucket_cap_mb=lay.bucket_cap_mb, static_graph=lay.static_graph,
                       find_unused_parameters=lay.find_unused_parameters,
                       gradient_as_bucket_view=lay.gradient_as_bucket_view, ready_order=lay.ready_order, api=opts.api)
    factory = subgroups(*_groups(example)) if example.subgroups > 1 else None
    ddp = SimDDP(cluster, opts.hook, list(lay.shapes), state=opts.state, config=config,
                 dtype=DTYPES[example.dtype], process_group_factory=factory)
    if opts.monitor.enabled:
        ddp.on_hook_call = opts.monitor.at
    results: list[Any] = []
    for t, step_grads in enumerate(grads):
        try:
            results.append(ddp.step(step_grads))
        except (UsageError, UnsupportedError):
            raise
        except (Exception, SystemExit, GeneratorExit) as exc:  # noqa: BLE001 - the hook's failure is the finding
            return results, exc, t, ddp.states
    return results, None, len(grads), ddp.states


def keeps_residual(states: Sequence[Any]) -> bool:
    """Whether a hook state looks like error-feedback memory: an attribute whose name
    contains ``residual`` or ``error`` holding tensors (``TopKState.residuals``,
    PowerSGD's ``error_dict``). A heuristic; name the property to force the check."""
    for state in states:
        names = list(getattr(state, "__dict__", {})) + list(getattr(type(state), "__slots__", ()))
        for name in names:
            if "residual" not in name.lower() and "error" not in name.lower():
                continue
            value = getattr(state, name, None)
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, torch.Tensor) for v in items):
                return True
    return False


def run_example(opts: _Options, example: Example, backend: str) -> None:
    """Run ``example`` and apply the oracles; raise the :class:`Violation` of the first that fails.

    Under a supervisor the example is announced first (its replay token), so an example
    that never ends is reported as itself."""
    if opts.monitor.enabled:
        opts.monitor.begin({"backend": backend, "token": encode_example(example, backend)})
    try:
        _judge_example(opts, example, backend)
    finally:
        opts.monitor.end()


def _exit_head(error: BaseException, at: int) -> str | None:
    """How a hook that tried to end its process is described (None for other errors)."""
    if isinstance(error, SystemExit):
        return (f"step {at}: the hook called sys.exit({error.code!r}) (SystemExit): on a real cluster this rank's "
                "process ends here and its peers hang or crash")
    if isinstance(error, HookExited):
        return f"step {at}: HookExited: {first_line(error)}"
    return None


def _judge_example(opts: _Options, example: Example, backend: str) -> None:
    grads = example.grads()
    drain_from = len(grads)
    if "error_feedback" in opts.props:
        zero = [[[torch.zeros_like(t) for t in rank] for rank in grads[0]]]
        grads = grads + zero * opts.ef_drain
    chooser = ScheduleChoices(example.schedule)
    results, error, at, states = _simulate(opts, example, backend, chooser, grads)
    check_ef = "error_feedback" in opts.props and (opts.ef_forced or keeps_residual(states))
    taken = [pick for _, pick in chooser.taken]
    while taken and taken[-1] == 0:
        taken.pop()
    info: dict[str, Any] = {"example": example, "backend": backend, "schedule": taken, "step": at}

    def fail(prop: str, message: str, error: BaseException | None = None, **extra: Any) -> None:
        etype = type(error).__name__ if error is not None else ""
        line = user_line(error)
        cls = _violation_class(prop, etype, line)
        raise cls(message, {**info, **extra, "error": error, "error_type": etype, "line": line})

    if error is not None:
        _judge_error(opts, error, at, check_ef, fail)
        return
    groups = _groups(example)
    for t, res in enumerate(results):
        info["step"] = t
        sizes = [sum(int(torch.Size(example.layout.shapes[i]).numel()) for i in b) for b in res.bucket_params]
        if "contract" in opts.props:
            for r, outs in enumerate(res.outputs):
                for k, value in enumerate(outs):
                    problem = P.result_problem(value, sizes[k], opts.api)
                    if problem:
                        fail("contract", f"step {t}, rank {r}, bucket {k}: {problem}")
        if "replicas_agree" in opts.props and (msg := P.replicas_agree(res.grads, groups)):
            fail("replicas_agree", f"step {t}: {msg}")
        if "averages" in opts.props and t < drain_from and (msg := P.averages(res.grads, grads[t], opts.tolerance,
                                                                              groups, res.bucket_params)):
            fail("averages", f"step {t}: {msg}")
    if "schedule_independence" in opts.props and taken:
        info["step"] = 0
        in_order, error_b, at_b, _ = _simulate(opts, example, backend, "in_order", grads)
        if error_b is not None:
            fail("schedule_independence", f"in-order completion fails at step {at_b} where the drawn schedule "
                 f"completes:\n{error_text(error_b)}", error_b)
        msg = P.schedule_independence([r.grads for r in results], [r.grads for r in in_order],
                                      f"the schedule {taken}")
        if msg:
            fail("schedule_independence", msg)
    if check_ef:
        msg = P.error_feedback([res.grads[0] for res in results], grads, drain_from=drain_from, ranks=groups[0])
        if msg:
            fail("error_feedback", msg)


def _from_state_factory(error: BaseException) -> bool:
    """Whether ``error`` escaped the hook's state factory (called in DDP's per-rank set-up)."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is SimDDP._init_rank.__code__:
            return tb.tb_next is not None
        tb = tb.tb_next
    return False


def _judge_error(opts: _Options, error: BaseException, at: int, check_ef: bool,
                 fail: Callable[..., None]) -> None:
    """The property an exception that stopped the run breaks, and its full diagnostic."""
    text = error_text(error)
    head = f"step {at}: {text}"
    if (exit_head := _exit_head(error, at)) is not None:
        fail("liveness", f"{exit_head}{raise_site(error)}", error)
    if "liveness" in opts.props and P.liveness(error):
        fail("liveness", head, error)
    if isinstance(error, (HookContractError, GradBucketMisuse, BackendError)):
        if "contract" in opts.props:
            fail("contract", head, error)
    elif _from_state_factory(error) and "liveness" in opts.props:
        fail("liveness", f"the state factory {opts.state_name} raised while DDP set up rank state at step {at} "
             f"(before any hook call; called once per rank with its process group):\n{text}", error)
    elif check_ef and at >= 1:
        fail("error_feedback", f"{head}\n(the hook's memory from earlier steps broke step {at})", error)
    # Whatever properties were chosen, a step that cannot complete was not checked: never a pass.
    fail("liveness", f"{head}\n(the hook raised: the step cannot complete on every rank)", error)


# --------------------------------------------------------------------------- rendering
def _replay_command(opts: _Options, backend: str, world: int, token: str, steps: int) -> str:
    parts = ["simcluster check", opts.replay_target or opts.target]
    if opts.state_name != "none":
        parts.append(f"--state {opts.state_name}")
    parts += [f"--tolerance {opts.tolerance}"]
    if opts.params is not None:
        parts.append("--params " + ",".join("x".join(map(str, shape)) for shape in opts.params))
    if opts.subgroups and opts.state.kind != "group":
        parts.append("--subgroups")
    if opts.api != "current":
        parts.append(f"--api {opts.api}")
    if opts.rng != "per_rank":
        parts.append(f"--rng {opts.rng}")
    if isinstance(opts.hook, RankLocal) and opts.hook.isolate:
        parts.append(f"--isolate {','.join(opts.hook.isolate)}")
    parts += [f"--backend {backend}", f"--world-sizes {world}", f"--steps {steps}", f"--seed {opts.seed}"]
    if opts.deadline != DEFAULT_DEADLINE:
        parts.append(f"--deadline {opts.deadline:g}")
    parts.append(f"--replay {token}")
    return " ".join(parts)


def _failure(opts: _Options, v: Violation, steps: int) -> PropertyFailure:
    example: Example = v.info["example"]
    backend: str = v.info["backend"]
    at = v.info.get("step", 0)
    token = encode_example(example, backend)
    ddp_steps = bucket_steps(example, at)
    hint = rebuild_hint(ddp_steps, at)
    error = v.info.get("error")
    frames = error_frames(error) if error is not None else []
    return PropertyFailure(
        property=v.prop, backend=backend, message=str(v), world_size=example.world_size,
        layout=describe_layout(example, steps), gradients=render_gradients(example, at),
        schedule=list(v.info.get("schedule", [])),
        replay=_replay_command(opts, backend, example.world_size, token, steps),
        error_type=v.info.get("error_type", ""), frames=[str(f) for f in frames], buckets=describe_steps(ddp_steps),
        hint=hint or "",
        details={"step": at, "token": token, "line": v.info.get("line", ""), "ddp_steps": ddp_steps,
                 "frames": [{"file": f.file, "line": f.line, "function": f.function, "source": f.source}
                            for f in frames]},
    )


def _violations(exc: BaseException) -> list[Violation]:
    if isinstance(exc, Violation):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        return [v for sub in exc.exceptions for v in _violations(sub)]
    return []


# --------------------------------------------------------------------------- the API
def _choose_properties(properties: Sequence[str] | None, tolerance: str, state: StateSpec) -> tuple[str, ...]:
    if properties is None:
        chosen = ["contract", "liveness", "replicas_agree", "schedule_independence"]
        if tolerance != "none":
            chosen.insert(3, "averages")
        if tolerance == "none" and state.kind == "factory":  # a stateful lossy hook: it should keep a residual
            chosen.append("error_feedback")
        return tuple(chosen)
    unknown = [p for p in properties if p not in PROPERTIES]
    if unknown or isinstance(properties, str):
        raise UsageError(f"properties={properties!r}: each must be one of {', '.join(PROPERTIES)}")
    return tuple(p for p in PROPERTIES if p in properties and not (p == "averages" and tolerance == "none"))


def check_hook(hook: Callable[..., Any] | str, *, target: str | None = None, state: Any = "none",
               tolerance: str = "fp32", backends: Sequence[str] = BACKEND_NAMES,
               world_sizes: Sequence[int] = (1, 2, 3, 4, 8), steps: int = 3, examples: int = 50,
               seed: int | None = 0, api: str = "current",
               database: str | os.PathLike[str] | ExampleDatabase | None = None,
               properties: Sequence[str] | None = None, progress: Callable[[str], None] | None = None,
               replay: str | None = None, params: Sequence[Sequence[int]] | str | None = None,
               subgroups: bool | None = None, deadline: float = DEFAULT_DEADLINE,
               supervise: bool = True, rng: str = "per_rank",
               isolate: str | Sequence[str] | None = None) -> CheckReport:
    """Check ``hook`` and return a :class:`~simcluster.checking.report.CheckReport` (never raises for findings).

    ``hook``: a ``module:name`` / ``file.py:name`` string — every simulated rank then gets its
    own copy of its module, as every process imports it (:class:`~simcluster.usercode.rank_local.RankLocal`;
    ``isolate``: more modules to copy per rank, e.g. ``"mypkg.helpers"``) — or a callable
    (its module is then shared by every rank: module globals are not per rank). ``target``: the
    name used in the report and the replay line (default: the string, or
    ``module:qualname``). ``state``: ``"none"`` (hook state ``None``, i.e.
    ``dist.group.WORLD``), ``"group"`` (each rank's process group; also draws DDP on
    equal subgroups of the world), ``"module:factory"`` or a callable
    ``factory(process_group)``. ``tolerance``: ``exact`` | ``fp32`` | ``fp16`` | ``bf16`` |
    ``rtol=R,atol=A`` | ``none`` (skip *averages*); it also picks the inputs (fp16:
    float16 values up to ±65504; exact: exactly averageable values). ``steps`` >= 1
    (default 3: iteration 0, the rebuild, one more). ``examples`` per backend; ``seed``
    fixes generation (``None``: random); every example draws the seed of the ranks' torch,
    ``random`` and numpy generators (carried by its replay token), which ``rng``
    (``"per_rank"``: seed + rank, ``"same"``: seed) turns into each rank's. ``api``: ``"current"`` or
    ``"legacy"``. ``database``: a directory (or an ExampleDatabase) keeping failing
    examples, replayed first next time. ``params``: fixed parameter shapes, e.g.
    ``[(4, 5), (5,)]`` or ``"4x5,5"`` (values, world sizes, caps, ready orders and
    schedules are still drawn). ``subgroups``: draw DDP on equal subgroups of the world
    whatever the state (default: only with ``state="group"``); a factory then receives
    the rank's subgroup. ``properties``: a subset of
    :data:`~simcluster.checking.report.PROPERTIES` (default: all that apply). ``progress``: called
    with a line per backend. ``replay``: a token from a failure: run just that example.
    Usage errors raise :class:`~simcluster.errors.UsageError`.

    **Supervision.** Each backend's search runs in a forked child process
    (:mod:`simcluster.checking.supervisor`): an example that runs longer than ``deadline``
    seconds (spinning, blocked in C, sleeping) or that kills or ends its process is a
    *liveness* failure of the hook, reported with the rank, step and bucket of the last
    hook call, the stuck code's stack and the example's replay command; the other
    backend is still checked. ``KeyboardInterrupt`` and pytest's outcome exceptions
    (``pytest.fail``, pytest-timeout's) end the whole check at once and propagate.
    ``supervise=False`` runs in this process (no deadline: a hook that never returns
    hangs the caller).
    """
    start = time.monotonic()
    isolated = parse_isolate(isolate)
    if rng not in ("per_rank", "same"):
        raise UsageError(f"rng={rng!r}: use 'per_rank' or 'same'")
    if isinstance(hook, str):
        target = target or hook
        hook = RankLocal(hook, isolate=isolated)
    replay_target = target or (hook if isinstance(hook, str) else "")
    from simcluster.checking.train_check import check_training  # hooks that train rather than reduce: real DDP
    from simcluster.checking.training import TRAININGS, training_for

    if (training := training_for(hook)) is not None:
        return check_training(training, target=target or target_spec(hook) or training.name, backends=backends,
                              world_sizes=world_sizes, steps=steps, examples=examples, seed=seed, replay=replay)
    if properties is not None and "trains_like_reference" in properties and not isinstance(properties, str):
        raise UsageError("properties: trains_like_reference applies to hooks that step an optimizer "
                         f"({', '.join(sorted(TRAININGS))}), checked by training on real DDP")
    if not callable(hook):
        raise UsageError(f"hook={hook!r} is not callable")
    replay_target = replay_target or loadable_spec(hook) or ""
    target = target or target_spec(hook) or repr(hook)
    state_spec = rank_local_state(state, isolate=isolated)
    tol = parse_tolerance(tolerance).describe()
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
    deadline = check_deadline(deadline, "deadline")
    if api not in ("current", "legacy"):
        raise UsageError(f"api={api!r}: use 'current' or 'legacy'")
    props = _choose_properties(properties, tol, state_spec)
    shapes = None if params is None else parse_shapes(params, what="params") if isinstance(params, str) \
        else fixed_shapes(params)
    if subgroups not in (None, True, False):
        raise UsageError(f"subgroups={subgroups!r}: use True, False or None (default: only with state 'group')")
    opts = _Options(hook, target, state_spec, state_spec.name, tol, api, 0 if seed is None else seed, props, DRAIN_STEPS,
                    ef_forced=properties is not None and "error_feedback" in properties, deadline=deadline,
                    replay_target=replay_target, params=shapes,
                    subgroups=state_spec.kind == "group" if subgroups is None else subgroups, rng=rng)
    report = CheckReport(target=target, passed=True, properties=list(props), backends=list(backends))
    if getattr(hook, "__name__", "") in ("bf16_compress_hook", "bf16_compress_wrapper_hook"):
        report.notes.append("real DDP refuses to register a hook of this name without CUDA 11+/NCCL 2.10+ or XPU "
                            "(TypeError on CPU/gloo); the hook itself is checked")
    if "contract" in props and (problem := P.registration_problem(hook, api)):
        report.failures.append(PropertyFailure("contract", "any", f"registration: {problem}", 0, "-", "-", [],
                                               f"simcluster check {target} --api {api}", "registration"))
    if replay is not None:
        example, backend = decode_example(replay)

        def replay_job(monitor: Monitor) -> tuple[list[PropertyFailure], int]:
            part = _partial(opts, monitor)
            _run_one(part.opts, example, backend, part.report, steps=example.steps)
            return part.report.failures, part.report.examples

        _supervised(replay_job, opts, backend, report, example.steps, deadline, supervise)
    else:
        for backend in backends:
            if progress is not None:
                progress(f"{target}: {backend}, {examples} examples, world sizes {list(world_sizes)}")

            def backend_job(monitor: Monitor, backend: str = backend) -> tuple[list[PropertyFailure], int]:
                part = _partial(opts, monitor)
                _run_hypothesis(part.opts, backend, part.report, world_sizes, steps, examples, seed, database)
                if not part.report.failures:
                    for explicit in _explicit_examples(opts, world_sizes, steps):
                        _run_one(part.opts, explicit, backend, part.report, steps)
                return part.report.failures, part.report.examples

            _supervised(backend_job, opts, backend, report, steps, deadline, supervise)
    report.passed = not report.failures
    report.seconds = time.monotonic() - start
    return report


@dataclasses.dataclass
class _Partial:
    opts: _Options
    report: CheckReport


def _partial(opts: _Options, monitor: Monitor) -> _Partial:
    """What one supervised job fills in: options bound to its monitor, an empty report."""
    return _Partial(dataclasses.replace(opts, monitor=monitor),
                    CheckReport(target=opts.target, passed=True, properties=[], backends=[]))


def _supervised(job: Callable[[Monitor], tuple[list[PropertyFailure], int]], opts: _Options, backend: str,
                report: CheckReport, steps: int, deadline: float, supervise: bool) -> None:
    """Run one backend's search (or one replay) as ``job``, supervised unless told not to,
    and add what it found to ``report``. A child that died or overran its deadline is a
    liveness failure of the hook; stop requests and usage errors propagate."""
    if not supervise:
        failures, count = job(Monitor())
        report.failures += failures
        report.examples += count
        return
    outcome = run_supervised(job, deadline=deadline)
    if outcome.value is not None:
        failures, count = outcome.value
        report.failures += failures
        report.examples += count
    elif outcome.death is not None:
        report.examples += 1
        report.failures.append(_death_failure(opts, backend, outcome.death, steps))
    elif outcome.error is not None:
        error = outcome.error
        if isinstance(error, (SystemExit, HookExited)):  # user code ended the child outside any example
            report.failures.append(PropertyFailure(
                "liveness", backend, f"{_exit_head(error, 0) or error!r}", 0, "-", "-", [],
                f"simcluster check {opts.replay_target or opts.target}", error_type=type(error).__name__))
            return
        raise error


def _death_failure(opts: _Options, backend: str, death: ChildDeath, steps: int) -> PropertyFailure:
    """The liveness failure of an example whose process never answered."""
    stack, function = format_stack(death.stacks), stuck_in(death.stacks)
    inside = f", in {function}" if function else ""
    if death.kind == "deadline":
        message = f"the example {death.detail} (hook code spinning or blocked); stuck at {death.where()}{inside}"
    else:
        message = f"the example's process ended: {death.detail}; it was at {death.where()}{inside}"
    if stack:  # a sample: a spinning loop's line varies run to run; the line above does not
        message += "\n  stack sampled when it was stopped (outermost call first):\n" + stack
    token = (death.payload or {}).get("token")
    if token is None:
        return PropertyFailure("liveness", backend, message, 0, "-", "-", [],
                               f"simcluster check {opts.replay_target or opts.target}",
                               error_type="Stuck" if death.kind == "deadline" else "ProcessDied",
                               details={"stack": death.stacks})
    example, _ = decode_example(token)
    step = death.position[1] if death.position else 0
    violation = _VIOLATIONS["liveness"](message, {"example": example, "backend": backend, "schedule": [],
                                                   "step": step, "error_type": "Stuck" if death.kind == "deadline"
                                                   else "ProcessDied"})
    failure = _failure(opts, violation, steps)
    failure.details["stack"] = death.stacks
    return failure


def _run_one(opts: _Options, example: Example, backend: str, report: CheckReport, steps: int) -> None:
    report.examples += 1
    try:
        run_example(opts, example, backend)
    except Violation as v:
        report.failures.append(_failure(opts, v, steps))


def _domain(tolerance: str, props: Sequence[str]) -> dict[str, Any]:
    """The inputs a tolerance promises to handle (see docs/properties.md, "Inputs").

    With error feedback checked and no accuracy promised, values stay within float16's
    range (stored as float32): a residual accumulates up to a few steps' gradients, and
    overflow near float32's maximum is the *averages* property's business, not this one's.
    So do they under ``scale=``/``norm=``: a lossy compressor's accuracy is judged
    relative to the bucket's scale, not its arithmetic at float32's edge.
    """
    if tolerance == "exact":
        return {"exact": True}
    if (tolerance == "none" and "error_feedback" in props) or parse_tolerance(tolerance).lossy:
        return {"values": torch.float16}
    return {"values": {"fp16": torch.float16, "bf16": torch.bfloat16}.get(tolerance)}


def _explicit_examples(opts: _Options, world_sizes: Sequence[int], steps: int) -> list[Example]:
    """Known-dangerous inputs tried after the drawn ones pass: every rank at the value dtype's
    largest finite value (sums of W such values overflow a hook that divides late, and at
    W = 3 even a float16 sum of the divided values rounds to inf)."""
    values = {"fp16": "float16", "bf16": "bfloat16"}.get(opts.tolerance)
    if opts.tolerance not in ("fp32", "fp16", "bf16") or max(world_sizes) < 2:
        return []
    world = 3 if 3 in world_sizes else max(world_sizes)
    top = torch.finfo(DTYPES[values or "float32"]).max
    base = StepSpec((RankSpec("const", value=top),) * world)
    shapes = opts.params or ((4,),)
    layout = Layout(shapes, None, tuple(range(len(shapes))))
    return [Example(world, layout, base, (0,) * (steps - 1), (), "float32", values or "float32")]


_PHASES = tuple(p for p in Phase if p is not Phase.explain)
"""Hypothesis's explain phase only annotates its own failure printout (unused here) and
re-runs the shrunk example's neighbours: a third of a failing PowerSGD row (docs/speed.md)."""


def _run_hypothesis(opts: _Options, backend: str, report: CheckReport, world_sizes: Sequence[int], steps: int,
                    examples: int, seed: int | None, database: Any) -> None:
    count = [0]
    # Shrink budget: once a failure is found, at most max(30, 3 × examples) more examples are
    # simulated; after that only examples that already failed are run again (the
    # shrinker's other candidates are declared passing, so it stops improving and
    # keeps its best). Count-based, so as deterministic as the rest.
    failing: set[Example] = set()
    spent = [0]
    strategy = example_strategy(world_size_choices=tuple(world_sizes), steps=steps, subgroups=opts.subgroups,
                                params=opts.params, **_domain(opts.tolerance, opts.props))

    def test(example: Example) -> None:
        if failing:
            spent[0] += 1
            if spent[0] > max(30, SHRINK_BUDGET * examples) and example not in failing:
                return
        count[0] += 1
        try:
            run_example(opts, example, backend)
        except Violation:
            failing.add(example)
            raise

    test._hypothesis_internal_add_digest = (  # type: ignore[attr-defined]
        f"simcluster check|{opts.target}|{backend}|{opts.tolerance}|{opts.state_name}|{opts.api}|{steps}"
        + ("" if opts.params is None else f"|params={opts.params}")
        + ("|subgroups" if opts.subgroups and opts.state.kind != "group" else "")
        + ("" if opts.rng == "per_rank" else f"|rng={opts.rng}")
        + (f"|isolate={','.join(opts.hook.isolate)}" if isinstance(opts.hook, RankLocal) and opts.hook.isolate else "")
    ).encode()
    wrapped = given(strategy)(test)
    if seed is not None:
        wrapped = hypothesis_seed(seed)(wrapped)
    db = DirectoryBasedExampleDatabase(os.fspath(database)) if isinstance(database, (str, os.PathLike)) else database
    wrapped = settings(max_examples=examples, deadline=None, database=db, verbosity=Verbosity.quiet,
                       derandomize=False, print_blob=False, report_multiple_bugs=True,
                       phases=_PHASES, suppress_health_check=list(HealthCheck))(wrapped)
    try:
        with _count_budgeted_search():
            wrapped()
    except Exception as exc:  # noqa: BLE001 - sorted below
        found = _violations(exc)
        if not found:
            raise
        seen: set[tuple[str, str, str]] = set()
        for v in sorted(found, key=_bug_key):
            key = _bug_key(v)[1:]
            if key not in seen and len(seen) < MAX_BUGS:
                seen.add(key)
                report.failures.append(_failure(opts, v, steps))
        if len({_bug_key(v)[1:] for v in found}) > MAX_BUGS:
            report.notes.append(f"{backend}: more than {MAX_BUGS} distinct failures; the first {MAX_BUGS} are shown")
    finally:
        report.examples += count[0]


class _FrozenClock:
    """``time`` as Hypothesis's engine sees it during a check: the clock never moves.

    Hypothesis stops generating 10 s after the first bug and stops shrinking after
    300 s of wall time, so on a slower machine it would report a different (less
    shrunk) counterexample. With the clock frozen those limits never fire; the search is
    bounded by counts alone (``max_examples``, Hypothesis' shrink-call limits and
    :data:`SHRINK_BUDGET`), so the same seed gives the same report on any machine."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._now = real.monotonic()

    def monotonic(self) -> float:
        return self._now

    perf_counter = monotonic

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def _count_budgeted_search() -> Iterator[None]:
    from hypothesis.internal.conjecture import engine as conjecture_engine

    real = getattr(conjecture_engine, "time", None)
    if real is None:  # a Hypothesis that reads time differently: its limits apply (documented)
        yield
        return
    conjecture_engine.time = _FrozenClock(real)  # type: ignore[assignment]
    try:
        yield
    finally:
        conjecture_engine.time = real  # type: ignore[assignment]


def _bug_key(v: Violation) -> tuple[int, str, str, str]:
    """Sort key and identity of a distinct bug: property (in checking order), exception type, user line."""
    return _ORDER.index(v.prop), v.prop, v.info.get("error_type", ""), v.info.get("line", "")


def assert_hook(hook: Callable[..., Any] | str, **options: Any) -> None:
    """:func:`check_hook`, raising ``AssertionError(report.format())`` unless every property held."""
    check_hook(hook, **options).assert_passed()
