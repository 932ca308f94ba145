"""Hooks that step an optimizer, checked by training: ``trains_like_reference``.

Some of torch's hooks are not reductions but *training steps*: ZeRO's
``hook_with_zero_step`` updates each rank's shard of the parameters inside the last
bucket's hook and broadcasts it; ``_hook_then_optimizer`` applies a functional optimizer
in the all-reduce's callback. They need the real DDP object (and a
``ZeroRedundancyOptimizer``), so they run on torch's own ``DistributedDataParallel`` on
simulated groups (:func:`simcluster.real_ddp.run_real_ddp`, one thread per rank), and are
judged by what training must give:

**trains_like_reference** — after every iteration, every rank's parameters equal those of
a plain single-process run of the same optimizer (``torch.optim.SGD``) on the float64 mean
of the ranks' local gradients, within a bound derived from the arithmetic
(:func:`trains_like_reference`).

Hypothesis draws the world size, the model (1–3 independent linear heads of 1–6 inputs,
so gradients are exact functions of the inputs), a bucket cap that splits it, and the
inputs; a failure is shrunk and printed with a replay line (same seed and world size:
the runs are deterministic). A hook is recognised by the torch function that builds it
(:data:`TRAININGS`); :func:`check_training` takes any :class:`Training`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, Verbosity, given, settings, strategies as st
from hypothesis import seed as hypothesis_seed

from simcluster.errors import SimClusterError, UsageError
from simcluster.properties import error_bound
from simcluster.real_ddp import Setup, run_real_ddp
from simcluster.report import CheckReport, PropertyFailure

__all__ = ["Training", "Heads", "TRAININGS", "training_for", "trains_like_reference", "check_training",
           "zero_step_setup", "hook_then_optimizer_setup"]

LR, MOMENTUM = 0.1, 0.9
_U = 2.0**-24


class Heads(torch.nn.Module):
    """Independent linear heads: head ``i`` reads its own ``sizes[i]`` input columns. The
    loss ``out.sum()`` has gradients that do not depend on the parameters (weights: the
    column sums of the inputs; biases: the batch size), so the reference's gradients are
    exactly the ranks' whatever the parameters became."""

    def __init__(self, sizes: Sequence[int]) -> None:
        super().__init__()
        self.sizes = list(sizes)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(n, 2) for n in self.sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([h(part) for h, part in zip(self.heads, x.split(self.sizes, dim=1))], dim=1)


@dataclass(frozen=True)
class Training:
    """How each rank trains: ``setup(ddp, group) -> (hook, state, step)`` (see
    :data:`simcluster.real_ddp.Setup`) with ``torch.optim.SGD(lr=LR, momentum=MOMENTUM)``
    semantics; ``warmup``: iterations in which the recipe updates nothing (ZeRO's overlap
    needs DDP's rebuilt buckets first: 2 with ``static_graph=False``, as torch documents);
    ``backends``: where it may run (torch refuses ZeRO overlap on gloo)."""

    name: str
    setup: Setup
    warmup: int = 0
    backends: tuple[str, ...] = ("gloo", "nccl")
    note: str = ""


def zero_step_setup(ddp: Any, group: Any) -> tuple[Any, Any, None]:
    """``hook_with_zero_step(allreduce_hook, ddp, zero)`` over a ZeroRedundancyOptimizer of SGD."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer(ddp.module.parameters(), optimizer_class=torch.optim.SGD, lr=LR,
                                   momentum=MOMENTUM, overlap_with_ddp=True, process_group=group)
    return hook_with_zero_step(allreduce_hook, ddp, zero), group, None


def hook_then_optimizer_setup(ddp: Any, group: Any) -> tuple[Any, Any, None]:
    """``_hook_then_optimizer(allreduce_hook, _OptimizerHookState(functional SGD))``, as DDP's
    ``_register_fused_optim`` builds it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
        _hook_then_optimizer, _OptimizerHookState,
    )
    from torch.distributed.optim.functional_sgd import _FunctionalSGD

    params = list(ddp.module.parameters())
    optimizer = _FunctionalSGD([], lr=LR, momentum=MOMENTUM, _allow_empty_param_list=True)
    return _hook_then_optimizer(allreduce_hook, _OptimizerHookState(optimizer, params)), group, None


TRAININGS: dict[str, Training] = {
    "hook_with_zero_step": Training("hook_with_zero_step", zero_step_setup, warmup=2, backends=("nccl",),
                                    note="torch refuses ZeRO overlap on gloo (RuntimeError: 'Gloo backend using "
                                         "Overlapping DDP with ZeRO may meet hangs')"),
    "_hook_then_optimizer": Training("_hook_then_optimizer", hook_then_optimizer_setup),
}
"""The torch wrappers checked by training, by ``__name__``."""


def training_for(obj: Any) -> Training | None:
    """The :class:`Training` of one of torch's optimizer-stepping wrappers (or a Training itself)."""
    if isinstance(obj, Training):
        return obj
    if getattr(obj, "__module__", "").startswith("torch.distributed.algorithms.ddp_comm_hooks"):
        return TRAININGS.get(getattr(obj, "__name__", ""))
    return None


# --------------------------------------------------------------------------- the oracle
def trains_like_reference(params: Sequence[Sequence[Sequence[torch.Tensor]]], initial: Sequence[torch.Tensor],
                          inputs: Sequence[Sequence[torch.Tensor]], model: torch.nn.Module, *, warmup: int = 0,
                          lr: float = LR, momentum: float = MOMENTUM) -> str | None:
    """``None`` if every rank's parameters track the single-process reference; else the first divergence.

    ``params[k][r][i]``: parameter ``i`` on rank ``r`` after iteration ``k``; ``initial``:
    the parameters DDP started from (rank 0's, broadcast); ``inputs[r][k]``; ``model``: a
    module of the same architecture (its parameters are overwritten: the reference).
    The reference computes every rank's local gradient at *its* parameters, takes the
    float64 mean g, and steps ``torch.optim.SGD(lr, momentum)`` on ``fl32(g)`` — nothing
    in iterations ``< warmup``.

    **Bound** (elementwise, carried along the steps; u = 2^-24). The run's gradient is a
    float32 mean within ``e_g = γ_{W+2}(u)·mean|g_r| + W·2^-149 + u·|g|`` of the
    reference's (``properties.error_bound("fp32")``, plus the reference's own rounding to
    float32). Momentum ``b ← μ·b + g`` then errs by ``e_b ← μ·e_b + e_g`` plus two
    roundings on each side, ``2u·(μ|b_prev| + |b|)``; the update ``p ← p − lr·b`` by
    ``e_p ← e_p + lr·e_b`` plus ``2u·(lr|b| + |p|)`` (magnitudes taken with their error
    bars, and 1% slack for the rounding terms' own rounding). Before the first update
    the bound is 0: parameters must equal the initial ones bit for bit.
    """
    world = len(inputs)
    ref = list(model.parameters())
    with torch.no_grad():
        for p, value in zip(ref, initial):
            p.copy_(value)
    e_p = [torch.zeros_like(p, dtype=torch.float64) for p in ref]
    e_b = [torch.zeros_like(p, dtype=torch.float64) for p in ref]
    bufs: list[torch.Tensor | None] = [None] * len(ref)
    for k in range(len(params)):
        local = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            model(inputs[r][k]).sum().backward()
            local.append([p.grad.detach().clone() for p in ref])
        if k >= warmup:
            for i, p in enumerate(ref):
                e_b[i], e_p[i] = _sgd_step(p, bufs, i, [g[i] for g in local], e_b[i], e_p[i], lr, momentum, world)
        for r in range(world):
            for i, p in enumerate(ref):
                got = params[k][r][i].detach().to(torch.float64)
                diff = (got - p.detach().to(torch.float64)).abs()
                bad = ~(diff <= e_p[i])
                if bool(bad.any()):
                    j = int(bad.nonzero()[0, 0]) if bad.dim() else 0
                    flat = lambda t: t.reshape(-1)[j]  # noqa: E731
                    return (f"after iteration {k}: rank {r}, param {i} (shape {tuple(p.shape)}), element {j}: got "
                            f"{float(flat(got))!r}, the single-process reference (SGD lr={lr:g}, momentum={momentum:g} "
                            f"on the mean gradient{f', no update before iteration {warmup}' if warmup else ''}) has "
                            f"{float(flat(p.detach()))!r}; |difference| {float(flat(diff)):.3g} > derived bound "
                            f"{float(flat(e_p[i])):.3g}")
    return None


def _sgd_step(p: torch.nn.Parameter, bufs: list[torch.Tensor | None], i: int, grads: list[torch.Tensor],
              e_b: torch.Tensor, e_p: torch.Tensor, lr: float, momentum: float,
              world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One reference SGD step of parameter ``i`` on the mean of ``grads``; the new error bars."""
    stack = torch.stack([g.to(torch.float64) for g in grads])
    mean, abs_mean = stack.mean(0), stack.abs().mean(0)
    e_g = error_bound("fp32", world, mean, abs_mean, torch.float32) + _U * mean.abs()
    grad = mean.to(p.dtype)
    with torch.no_grad():
        prev = bufs[i]
        if prev is None:
            bufs[i] = buf = grad.clone()
            e_b = e_g
        else:
            prev64 = prev.to(torch.float64).abs()
            buf = prev.mul_(momentum).add_(grad)
            e_b = momentum * e_b + e_g
            e_b = e_b + 2.02 * _U * (momentum * (prev64 + e_b) + buf.to(torch.float64).abs() + e_b)
        before = p.detach().to(torch.float64).abs()
        p.add_(buf, alpha=-lr)
        step = lr * (buf.to(torch.float64).abs() + e_b)
        e_p = e_p + lr * e_b + 2.02 * _U * (step + before + p.detach().to(torch.float64).abs() + e_p + step)
    return e_b, e_p


# --------------------------------------------------------------------------- the checker
@dataclass(frozen=True)
class TrainExample:
    """One drawn training job: world size, head sizes, bucket cap (bytes), batch, input seed."""

    world_size: int
    sizes: tuple[int, ...]
    cap_bytes: int
    batch: int
    seed: int

    def describe(self, iterations: int) -> str:
        return (f"model Heads({list(self.sizes)}) (Linear(n, 2) per head), cap {self.cap_bytes} B, batch {self.batch}, "
                f"{iterations} iterations")

    def inputs(self, iterations: int) -> list[list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        return [[torch.rand(self.batch, sum(self.sizes), generator=gen) * 2 - 1 for _ in range(iterations)]
                for _ in range(self.world_size)]

    def model(self) -> Heads:
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            return Heads(self.sizes)


TOKEN_PREFIX = "sct1."


def _token(example: TrainExample, backend: str) -> str:
    import base64
    import json

    raw = json.dumps({"backend": backend, **example.__dict__, "sizes": list(example.sizes)}, sort_keys=True)
    return TOKEN_PREFIX + base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode(token: str) -> tuple[TrainExample, str]:
    import base64
    import json

    try:
        body = token[len(TOKEN_PREFIX):]
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        backend = data.pop("backend")
        return TrainExample(**{**data, "sizes": tuple(data["sizes"])}), backend
    except Exception as exc:  # noqa: BLE001 - any malformation is the caller's
        raise UsageError(f"--replay {token[:40]!r}…: not a simcluster training replay token ({exc})") from None


class _Failed(AssertionError):
    prop = ""


_FAILS = {name: type(f"Training_{name}", (_Failed,), {"prop": name}) for name in ("liveness", "trains_like_reference")}


def run_training(training: Training, example: TrainExample, backend: str, steps: int) -> None:
    """Train ``example`` with ``training`` and judge it; raises a ``_Failed`` subclass on a violation."""
    iterations = training.warmup + steps
    inputs = example.inputs(iterations)
    try:
        run = run_real_ddp(example.model, inputs, world_size=example.world_size, hook=None, setup=training.setup,
                           iterations=iterations, bucket_cap_mb=example.cap_bytes / 2**20, backend=backend)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - the hook's (or the run's) failure is the finding
        kind = "" if isinstance(exc, SimClusterError) else " (the hook raised: the step cannot complete)"
        raise _FAILS["liveness"](f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{kind}") from None
    msg = trains_like_reference(run.params, run.initial[0], inputs, example.model(), warmup=training.warmup)
    if msg is not None:
        raise _FAILS["trains_like_reference"](msg)


def _examples(world_sizes: Sequence[int]) -> st.SearchStrategy[TrainExample]:
    @st.composite
    def build(draw: st.DrawFn) -> TrainExample:
        world = draw(st.sampled_from(sorted(set(world_sizes))))
        sizes = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        total = 4 * sum(3 * n + 2 for n in sizes)  # float32 bytes of the model: (n weights + 1 bias) x 2 outputs
        cap = max(8, total * draw(st.integers(1, 8)) // 8)
        return TrainExample(world, sizes, cap, draw(st.integers(1, 3)), draw(st.integers(0, 2**16)))

    return build()


def check_training(training: Training, *, target: str, backends: Sequence[str] = ("gloo", "nccl"),
                   world_sizes: Sequence[int] = (1, 2, 3, 4, 8), steps: int = 3, examples: int = 50,
                   seed: int | None = 0, replay: str | None = None, **_ignored: Any) -> CheckReport:
    """Check a :class:`Training` on real DDP (threads) under each backend model it supports.

    ``examples`` is capped at 10 per backend (a real-DDP run costs ~0.1-1 s). Options of
    :func:`simcluster.check.check_hook` that do not apply (state, tolerance, …) are ignored.
    """
    start = time.monotonic()
    chosen = [b for b in backends if b in training.backends]
    report = CheckReport(target=target, passed=True, properties=["liveness", "trains_like_reference"],
                         backends=chosen)
    if training.note:
        report.notes.append(training.note)
    if not chosen and replay is None:  # never a silent pass: say nothing was checked, and why
        report.skipped = f"runs under {', '.join(training.backends)} only" + (f": {training.note}" if training.note
                                                                              else "")
        return report
    with warnings.catch_warnings():  # torch's functional optimizers warn on every construction
        warnings.filterwarnings("ignore", message=".*TorchScript. support for functional optimizers",
                                category=DeprecationWarning)
        if replay is not None:
            example, backend = _decode(replay)
            _run_one(training, example, backend, steps, report, target, seed)
        else:
            for backend in chosen:
                _search(training, backend, world_sizes, steps, min(examples, 10), seed, report, target)
    report.passed = not report.failures
    report.seconds = time.monotonic() - start
    return report


def _run_one(training: Training, example: TrainExample, backend: str, steps: int, report: CheckReport, target: str,
             seed: int | None) -> None:
    report.examples += 1
    try:
        run_training(training, example, backend, steps)
    except _Failed as failure:
        report.failures.append(_failure(failure, example, backend, steps, training.warmup, target, seed))


def _search(training: Training, backend: str, world_sizes: Sequence[int], steps: int, examples: int,
            seed: int | None, report: CheckReport, target: str) -> None:
    found: list[tuple[_Failed, TrainExample]] = []

    def test(example: TrainExample) -> None:
        report.examples += 1
        try:
            run_training(training, example, backend, steps)
        except _Failed as failure:
            found.append((failure, example))
            raise

    wrapped = given(_examples(world_sizes))(test)
    if seed is not None:
        wrapped = hypothesis_seed(seed)(wrapped)
    wrapped = settings(max_examples=examples, deadline=None, database=None, verbosity=Verbosity.quiet,
                       print_blob=False, report_multiple_bugs=False, suppress_health_check=list(HealthCheck))(wrapped)
    try:
        wrapped()
    except _Failed as failure:
        example = next(ex for f, ex in reversed(found) if str(f) == str(failure) and f.prop == failure.prop)
        report.failures.append(_failure(failure, example, backend, steps, training.warmup, target, seed))


def _failure(failure: _Failed, example: TrainExample, backend: str, steps: int, warmup: int, target: str,
             seed: int | None) -> PropertyFailure:
    iterations = steps + warmup
    token = _token(example, backend)
    replay = (f"simcluster check {target} --backend {backend} --world-sizes {example.world_size} "
              f"--steps {steps} --seed {0 if seed is None else seed} --replay {token}")
    return PropertyFailure(failure.prop, backend, str(failure), example.world_size, example.describe(iterations),
                           f"inputs: uniform(-1, 1) from seed {example.seed}", [], replay,
                           details={"token": token})
