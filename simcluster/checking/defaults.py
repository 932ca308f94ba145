"""What ``simcluster check`` checks when given no TARGET: every hook torch ships, and ours.

Every hook in ``torch.distributed.algorithms.ddp_comm_hooks`` (torch 2.13) appears here,
either as a row to check — with the state it needs and the tolerance its arithmetic
earns — or as a *skipped* row that says why a CPU run cannot check it. Nothing is dropped
silently. Then come the reference hooks of :mod:`simcluster.hooks.catalogue` (the buggy ones are the
catalogue's own business and not part of the default run).

Every row is written in the CLI's own words — a ``module:name`` target, a ``--state``
spec, a ``--tolerance`` — so each row is exactly ``simcluster check TARGET --state STATE
--tolerance TOL`` and any failure it finds replays from the command line. Hooks that need
building (torch's compression *wrappers*) and states that need arguments (PowerSGD,
post-local SGD) are module-level functions below, so they have such a name.

Why these tolerances (the derivations live in :mod:`simcluster.checking.properties`):

* ``allreduce_hook`` divides by the world size, then sums in float32: ``fp32``.
* ``fp16_compress_hook`` / ``fp16_compress_wrapper(allreduce_hook)``: one float16 rounding
  of each input and of the sum: ``fp16``; likewise ``bf16`` for the bfloat16 pair.
* Quantization (8-bit, affine, one scale per bucket or per 512-element channel): each
  element within half a quantization step of the mean, i.e. ``scale=R,atol=A`` with R just
  above 1/255 and A = 2^-24 (the observer's smallest step), derived in
  :func:`simcluster.checking.tolerances.quantization_tolerance` for the largest world size drawn (8).
* PowerSGD: lossy by design (low-rank); no bound to promise per step, so ``none`` — the
  contract, replicas, liveness and schedule properties still apply, and error feedback.
* ``noop_hook`` communicates nothing and ``post_localSGD_hook`` averages only inside
  subgroups once local SGD starts: replicas differ *by design* (a model averager re-syncs
  parameters after ``optimizer.step()``), so only the properties that do not assume a
  global average are checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simcluster.checking.tolerances import quantization_tolerance, round_up
from simcluster.limits import BACKEND_NAMES
from simcluster.names import target_spec

__all__ = [
    "DefaultEntry",
    "default_entries",
    "fp16_wrapped_allreduce_hook",
    "bf16_wrapped_allreduce_hook",
    "powersgd_state",
    "post_localsgd_state",
    "TORCH_HOOKS",
    "QUANTIZATION_TOLERANCE",
]

_T = "torch.distributed.algorithms.ddp_comm_hooks."
_NO_AVERAGE = ("contract", "liveness", "schedule_independence")
_TRAINING = ("liveness", "trains_like_reference")

QUANTIZATION_TOLERANCE = round_up(quantization_tolerance(8))
"""``scale=0.003923,atol=5.961e-08``: the bound torch's quantization hooks meet at world sizes up to 8."""


@dataclass(frozen=True)
class DefaultEntry:
    """One row of the default run.

    ``target`` / ``state`` / ``tolerance`` / ``api`` are CLI spellings. ``properties`` is
    ``None`` for "every property that applies" or the subset to check. ``skipped`` holds
    the reason a row cannot be checked on CPU (then nothing is loaded or run).
    """

    name: str
    target: str
    state: str = "none"
    tolerance: str = "fp32"
    api: str = "current"
    properties: tuple[str, ...] | None = None
    backends: tuple[str, ...] = BACKEND_NAMES
    skipped: str | None = None
    note: str = ""
    source: str = "torch"

    def command(self) -> str:
        """The ``simcluster check`` line that checks this row alone."""
        if self.skipped is not None:
            return ""
        parts = ["simcluster check", self.target]
        if self.state != "none":
            parts.append(f"--state {self.state}")
        parts.append(f"--tolerance {self.tolerance}")
        if self.properties is not None:
            parts.append(f"--properties {','.join(self.properties)}")
        if self.api != "current":
            parts.append(f"--api {self.api}")
        return " ".join(parts)


# -- hooks that need building, and states that need arguments -------------------------------


_WRAPPED = {
    "fp16_wrapped_allreduce_hook": "fp16_compress_wrapper",
    "bf16_wrapped_allreduce_hook": "bf16_compress_wrapper",
}


def __getattr__(name: str) -> Any:
    """``fp16_wrapped_allreduce_hook`` / ``bf16_wrapped_allreduce_hook``: torch's own
    ``fp16_compress_wrapper(allreduce_hook)`` / ``bf16_compress_wrapper(allreduce_hook)``,
    built on access (PEP 562), so what is checked — annotations and registration rules
    included — is exactly the function torch's wrapper returns, not a stand-in of ours."""
    wrapper = _WRAPPED.get(name)
    if wrapper is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return getattr(default_hooks, wrapper)(default_hooks.allreduce_hook)


def powersgd_state(process_group: Any) -> Any:
    """A rank's ``PowerSGDState``: rank-1 approximation, error feedback and warm start on,
    compressing from iteration 2 (the earliest torch allows with error feedback), so a
    3-step check covers the plain all-reduce iterations *and* compression after the
    bucket rebuild. ``random_seed`` is the same on every rank, as PowerSGD requires."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    return PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=1,
        start_powerSGD_iter=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )


def post_localsgd_state(process_group: Any) -> Any:
    """A rank's ``PostLocalSGDState``: global all-reduce for iterations 0–1, then all-reduce
    inside subgroups of two consecutive ranks ({0,1}, {2,3}, …; a last rank alone at odd
    world sizes). Every rank creates every subgroup, in the same order, as
    ``dist.new_group`` requires, and keeps its own."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    world, me = process_group.size(), process_group.rank()
    mine = None
    for start in range(0, world, 2):
        members = list(range(start, min(start + 2, world)))
        group = dist.new_group(members)
        if me in members:
            mine = group
    return PostLocalSGDState(process_group=process_group, subgroup=mine, start_localSGD_iter=2)


TORCH_HOOKS: tuple[DefaultEntry, ...] = (
    DefaultEntry("allreduce_hook", _T + "default_hooks:allreduce_hook", tolerance="fp32"),
    DefaultEntry("fp16_compress_hook", _T + "default_hooks:fp16_compress_hook", tolerance="fp16"),
    DefaultEntry(
        "bf16_compress_hook", _T + "default_hooks:bf16_compress_hook", tolerance="bf16",
        note="real DDP refuses to register it on gloo/CPU (needs CUDA 11+ and NCCL 2.10+); the hook itself runs",
    ),
    DefaultEntry("fp16_compress_wrapper(allreduce_hook)", "simcluster.checking.defaults:fp16_wrapped_allreduce_hook",
                 tolerance="fp16"),
    DefaultEntry("bf16_compress_wrapper(allreduce_hook)", "simcluster.checking.defaults:bf16_wrapped_allreduce_hook",
                 tolerance="bf16"),
    DefaultEntry("powerSGD_hook", _T + "powerSGD_hook:powerSGD_hook",
                 state="simcluster.checking.defaults:powersgd_state", tolerance="none",
                 note="low-rank compression: lossy by design; torch's defaults otherwise (orthogonalization_epsilon=0)"),
    DefaultEntry("batched_powerSGD_hook", _T + "powerSGD_hook:batched_powerSGD_hook",
                 state="simcluster.checking.defaults:powersgd_state", tolerance="none",
                 note="low-rank compression of the whole bucket: lossy by design"),
    DefaultEntry("quantization_pertensor_hook", _T + "quantization_hooks:quantization_pertensor_hook",
                 state="group", tolerance=QUANTIZATION_TOLERANCE,
                 note="8-bit quantization: within half a step of the grid (derived bound, world sizes up to 8)"),
    DefaultEntry("quantization_perchannel_hook", _T + "quantization_hooks:quantization_perchannel_hook",
                 state="group", tolerance=QUANTIZATION_TOLERANCE,
                 note="8-bit quantization per 512-element channel: same bound as per tensor"),
    DefaultEntry("post_localSGD_hook", _T + "post_localSGD_hook:post_localSGD_hook",
                 state="simcluster.checking.defaults:post_localsgd_state", tolerance="none", properties=_NO_AVERAGE,
                 note="after iteration 2 averages inside subgroups only: replicas differ by design"),
    DefaultEntry("noop_hook", _T + "debugging_hooks:noop_hook", tolerance="none", properties=_NO_AVERAGE,
                 note="debugging hook: communicates nothing, replicas differ by design"),
    DefaultEntry("hook_with_zero_step", _T + "ddp_zero_hook:hook_with_zero_step", tolerance="none",
                 backends=("nccl",), properties=_TRAINING,
                 note="trained on real DDP + ZeroRedundancyOptimizer(SGD); torch refuses ZeRO overlap on gloo"),
    DefaultEntry("hook_with_zero_step_interleaved", _T + "ddp_zero_hook:hook_with_zero_step_interleaved",
                 skipped="posts ZeRO's broadcasts from the all-reduce futures' callbacks: real NCCL runs those at "
                         "enqueue time, in hook order; the NCCL model completes a collective only once every rank "
                         "posted it, so ranks race (CollectiveMismatchError, measured) - a model limit, not a "
                         "finding; torch refuses gloo"),
    DefaultEntry("_hook_then_optimizer", _T + "optimizer_overlap_hooks:_hook_then_optimizer", tolerance="none",
                 properties=_TRAINING, note="allreduce_hook then functional SGD in the callback, on real DDP"),
    DefaultEntry("_apply_optim_in_backward_hook", _T + "optimizer_overlap_hooks:_apply_optim_in_backward_hook",
                 skipped="needs an accelerator: its end-of-backward callback calls torch.accelerator.current_stream() "
                         "(real DDP on CPU raises RuntimeError: 'Cannot access accelerator device when none is "
                         "available', measured)"),
    DefaultEntry("_reducer_allreduce_and_upcast_hook",
                 _T + "mixed_precision_hooks:_reducer_allreduce_and_upcast_hook",
                 skipped="needs an accelerator: DDP mixed precision's upcast stream, and its end-of-backward callback "
                         "calls torch.accelerator.current_stream() (RuntimeError on CPU)"),
)
"""Every hook in ``torch.distributed.algorithms.ddp_comm_hooks`` of torch 2.13, in module order."""


def reference_entries() -> list[DefaultEntry]:
    """The ``REFERENCE`` entries of :mod:`simcluster.hooks.catalogue`, as rows (imported on call)."""
    from simcluster.hooks import catalogue

    return [
        DefaultEntry(
            name=e.name, target=target_spec(e.hook) or repr(e.hook), state=e.state, tolerance=e.tolerance, api=e.api,
            backends=tuple(e.backends), note=e.note, source="hooks",
        )
        for e in catalogue.REFERENCE
    ]


def default_entries() -> list[DefaultEntry]:
    """Torch's hooks (checked and skipped rows), then the reference hooks of ``hooks/``."""
    return [*TORCH_HOOKS, *reference_entries()]
