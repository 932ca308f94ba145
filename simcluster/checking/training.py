"""Hooks that step an optimizer, checked by training: ``trains_like_reference``.

Some of torch's hooks are not reductions but *training steps*: ZeRO's
``hook_with_zero_step`` updates each rank's shard of the parameters inside the last
bucket's hook and broadcasts it; ``_hook_then_optimizer`` applies a functional optimizer
in the all-reduce's callback. They need the real DDP object (and a
``ZeroRedundancyOptimizer``), so they run on torch's own ``DistributedDataParallel`` on
simulated groups (:func:`simcluster.ddp.real_ddp.run_real_ddp`, one thread per rank), and are
judged by what training must give:

**trains_like_reference** — after every iteration, every rank's parameters equal those of
a plain single-process run of the same optimizer (``torch.optim.SGD``) on the float64 mean
of the ranks' local gradients, within a bound derived from the arithmetic
(:func:`trains_like_reference`).

Hypothesis draws the world size, the model (1–3 independent linear heads of 1–6 inputs,
so gradients are exact functions of the inputs), a bucket cap that splits it, and the
inputs (:mod:`simcluster.checking.train_check`); a failure is shrunk and printed with a replay
token. A hook is recognised by the torch function that builds it (:data:`TRAININGS`);
:func:`simcluster.checking.train_check.check_training` takes any :class:`Training`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from simcluster.checking.properties import error_bound
from simcluster.ddp.real_ddp import Setup
from simcluster.limits import BACKEND_NAMES

__all__ = ["Training", "Heads", "TRAININGS", "training_for", "trains_like_reference", "zero_step_setup",
           "hook_then_optimizer_setup"]

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
    :data:`simcluster.ddp.real_ddp.Setup`) with ``torch.optim.SGD(lr=LR, momentum=MOMENTUM)``
    semantics; ``warmup``: iterations in which the recipe updates nothing (ZeRO's overlap
    needs DDP's rebuilt buckets first: 2 with ``static_graph=False``, as torch documents);
    ``backends``: where it may run (torch refuses ZeRO overlap on gloo)."""

    name: str
    setup: Setup
    warmup: int = 0
    backends: tuple[str, ...] = BACKEND_NAMES
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
