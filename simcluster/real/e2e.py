"""End to end: the hook inside torch's real ``DistributedDataParallel``, simulated and real.

One :class:`Scenario` (world size, parameter shapes, steps, bucket cap, per-rank
gradients, gradient-ready order) is run twice with the *same* real C++ reducer:

* **sim** — :func:`simcluster.ddp.real_ddp.run_real_ddp`: one thread per rank on
  simulated process groups (the backend model ``gloo`` or ``nccl``);
* **real** — one real process per rank on a real gloo group
  (:mod:`simcluster.real.gloo_runner`, or ``torchrun`` through :mod:`simcluster.real.e2e_torchrun`).

Only the process group differs, so any difference — a gradient bit, a parameter's bit after
a step (a hook may step an optimizer on ``bucket.parameters()``), the sequence of hook calls,
an exception or hang on one side only — is a **fidelity bug of the
simulator**, not a verdict on the hook (:func:`compare`).

The model is built so the gradients are exactly the scenario's: ``forward(x)`` is
``Σ_i (p_i * x_i).sum()`` with ``x`` the flat concatenation of the per-parameter inputs, so
``p_i.grad == x_i`` bit for bit (the backward of ``sum`` is ones, of ``mul`` is
``grad * x``). A check example's gradients therefore reach the hook unchanged. The parts
are added so that backward readies the gradients in the scenario's ready order
(:class:`GradientModel`), which the DDP model is given too.

Every real rank prints one line per event (``simcluster-e2e rank R: step S: ...``: a hook
call, a collective posted, a failure) to its captured output; when a rank hangs or dies,
its last event is what the report names. Real ranks see ``SIMCLUSTER_E2E=real`` in their
environment (the simulated ranks do not), which lets a test hook misbehave on one side only.

One-rank groups: whether gloo's future is already complete when the hook returns is a
load-dependent race at world size 1 (docs/e2e.md, measured), so a disagreement there is
reported as *unconfirmed*, never as a fidelity bug; so is a simulated collective mismatch where
real gloo finished every step (gloo completes many mismatches silently, and callbacks that post
collectives from worker threads post them in an order that is timing); and so is any
difference on a hook whose outcome the DDP model shows to be timing (:attr:`Side.timing`: it
writes to a tensor a collective has in flight, or branches on a first poll). A simulated mismatch
where real gloo aborted a rank (SIGABRT, ``gloo::EnforceNotMet``) is the same failure
(:func:`aborted_on_mismatch`). A hook using what the simulator does not model is
*unsupported*: nothing is compared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from simcluster.errors import (HookExited, InFlightReadError, InFlightWriteError, SimClusterError, first_line,
                               innermost_error)
from simcluster.engine.trace import Polled
from simcluster.usercode.output import captured_output
from simcluster.usercode.rank_state import process_generator_states, seed_process_generators
from simcluster.names import without_addresses
from simcluster.usercode.stand_in import stand_in

if TYPE_CHECKING:
    from simcluster.fake.state import StateSpec

__all__ = ["Scenario", "Side", "SideFailure", "E2EResult", "GradientModel", "run_real", "run_sim", "compare",
           "run_e2e", "judge_sides", "per_process", "same_rank", "race_reached", "EVENT_PREFIX", "RAISED_NOTE",
           "SETUP_PHASE", "noted_step"]

EVENT_PREFIX = "simcluster-e2e"
"""Every event line a real rank prints starts with this, then `` rank R: ``."""

REAL_SIDE_ENV = "SIMCLUSTER_E2E"
"""Set to ``real`` in a real rank's environment (:func:`run_rank`), and taken out of the
simulation's (:func:`run_sim`, :func:`race_reached`: their supervised children), so a test
hook can misbehave on real ranks only — also under torchrun, whose rank 0 simulates in the
process that ran its real rank."""

HookCall = tuple[int, int, bool, tuple[int, ...]]
"""``(step, bucket.index(), bucket.is_last(), parameter indices)`` of one hook call."""


_SIM_HUNG = ("DeadlockError", "StuckError")


# --------------------------------------------------------------------------- scenario


@dataclass(frozen=True)
class Scenario:
    """One end-to-end run's input, plain data (it travels to the real ranks by pickle).

    ``grads[step][rank][param]``: the gradients; ``None`` draws them from ``seed``
    (standard normal, float32 first, then cast to ``dtype``) — every rank and the
    simulation draw the same ones. ``ready_order``: the order in which the parameters'
    gradients become ready in backward (parameter indices, first ready first), which DDP's
    bucket rebuild after iteration 0 follows; both sides use it — the real ranks' and the
    real reducer's :class:`GradientModel`, and the DDP model's ``DDPConfig.ready_order``.
    ``None``: reverse parameter order (``GradientModel``'s own, measured; the DDP model's
    default). ``label`` says where the scenario came from.
    """

    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    steps: int = 3
    bucket_cap_mb: float | None = None
    seed: int = 0
    dtype: str = "float32"
    static_graph: bool = False
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    grads: tuple[tuple[tuple[torch.Tensor, ...], ...], ...] | None = None
    label: str = ""
    ready_order: tuple[int, ...] | None = None
    environs: tuple[tuple[tuple[str, str], ...], ...] | None = None
    """Each rank's launcher variables (``(name, value)`` pairs), as the real ranks had them:
    set under a real torchrun (:mod:`simcluster.real.e2e_torchrun` gathers them), so that the
    simulation's rank r sees real rank r's ``RANK``, ``LOCAL_RANK``, … and not those of the
    process it runs in (rank 0's). ``None``: the simulation's ranks see that process's own."""

    def __post_init__(self) -> None:
        if self.ready_order is not None:  # a bad order: one clear UsageError here, not in a rank
            from simcluster.ddp.layout import ready_order_of

            object.__setattr__(self, "ready_order", tuple(ready_order_of(self.ready_order, len(self.shapes))))

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch dtype (the names are torch's: those of a check's examples)."""
        return getattr(torch, self.dtype)

    def gradients(self) -> list[list[list[torch.Tensor]]]:
        """``[step][rank][param]``, deterministic."""
        if self.grads is not None:
            return [[list(rank) for rank in step] for step in self.grads]
        gen = torch.Generator().manual_seed(self.seed)
        dtype = self.torch_dtype
        return [[[torch.randn(shape, generator=gen).to(dtype) for shape in self.shapes]
                 for _ in range(self.world_size)] for _ in range(self.steps)]

    def inputs(self) -> list[list[torch.Tensor]]:
        """``[rank][step]``: the flat input of :class:`GradientModel` for each rank and step."""
        grads = self.gradients()
        return [[torch.cat([g.reshape(-1) for g in grads[k][r]]) for k in range(self.steps)]
                for r in range(self.world_size)]

    def describe(self) -> str:
        cap = "default cap" if self.bucket_cap_mb is None else f"cap {int(self.bucket_cap_mb * 2**20)} B"
        flags = [n for n in ("static_graph", "find_unused_parameters", "gradient_as_bucket_view") if getattr(self, n)]
        order = "" if self.ready_order is None else f", ready order {list(self.ready_order)}"
        text = (f"world {self.world_size}, params {[tuple(s) for s in self.shapes]} ({self.dtype}), {cap}{order}, "
                f"{self.steps} steps, seed {self.seed}")
        launcher = ", each rank with its launcher variables" if self.environs is not None else ""
        return text + "".join(f", {f}" for f in flags) + launcher + (f" [{self.label}]" if self.label else "")

    def ddp_kwargs(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.bucket_cap_mb, "static_graph": self.static_graph,
                "find_unused_parameters": self.find_unused_parameters,
                "gradient_as_bucket_view": self.gradient_as_bucket_view}


def with_launcher(scenario: Scenario, launcher: str) -> Scenario:
    """``scenario`` with torchrun's variables for each rank (:attr:`Scenario.environs`) when
    ``launcher`` is ``"torchrun"`` (``--launcher``, as ``check`` takes it): the real ranks set
    them for their run and the simulation gives them to its ranks, as
    ``SimCluster(launcher="torchrun")`` does (the single-node model,
    :func:`~simcluster.fake.launcher.rank_environment`). ``"none"``: unchanged."""
    from simcluster.fake.launcher import check_launcher, rank_environment

    if check_launcher(launcher) == "none":
        return scenario
    environs = tuple(tuple(sorted(rank_environment(scenario.world_size, rank).items()))
                     for rank in range(scenario.world_size))
    return dataclasses.replace(scenario, environs=environs)


@contextlib.contextmanager
def _launcher_environment(variables: Mapping[str, str] | None) -> Iterator[None]:
    """A real rank's job with ``variables`` in ``os.environ`` (None: nothing set); the
    process's own values back afterwards (a gloo process runs job after job)."""
    if not variables:
        yield
        return
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class GradientModel(torch.nn.Module):
    """Parameters of the given shapes whose gradients are the input: ``p_i.grad == x_i``,
    becoming ready in ``ready_order`` (parameter indices, first ready first; default ``None``:
    reverse parameter order, as DDP's layout model assumes by default).

    ``forward`` adds the parts ``(p_i * x_i).sum()`` in the *reverse* of the ready order. The
    autograd engine runs, of the nodes ready at once, the one created last first, and a
    parameter's ``AccumulateGrad`` (where DDP's hook fires) as soon as it can; so backward
    reaches the last-added part — the first-ready parameter — first, then the next, every
    iteration. Measured on real DDP over gloo for every order of up to 4 parameters, with
    every DDP flag (``benchmarks/measure_ready_order.py``, docs/ddp-facts.md §3 "Ready order").
    The gradients do not depend on the order (each part's backward is ``ones * x_i``).

    >>> m = GradientModel([(2,), (1, 2)])
    >>> m(torch.tensor([1.0, 2.0, 3.0, -0.0])).backward()
    >>> [p.grad.tolist() for p in m.parameters()]
    [[1.0, 2.0], [[3.0, -0.0]]]
    >>> GradientModel([(2,), (1,), (3,)]).ready_order, GradientModel([(2,), (1,)], ready_order=(0, 1)).ready_order
    ([2, 1, 0], [0, 1])
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32,
                 ready_order: Sequence[int] | None = None) -> None:
        from simcluster.ddp.layout import ready_order_of

        super().__init__()
        self.shapes = [tuple(s) for s in shapes]
        self.ready_order = ready_order_of(ready_order, len(self.shapes))
        for i, shape in enumerate(self.shapes):
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
            p._simcluster_index = i  # type: ignore[attr-defined] - how a hook call names its parameters
            self.register_parameter(f"p{i}", p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = list(self.parameters())
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        total = None
        for i in reversed(self.ready_order):  # the first-ready parameter's part is added last
            p = params[i]
            part = (p * x[offsets[i]:offsets[i + 1]].view(p.shape)).sum()
            total = part if total is None else total + part
        assert total is not None
        return total


def load_hook_and_state(hook: str, state: str) -> tuple[Callable[..., Any], StateSpec]:
    """The hook and its parsed :class:`~simcluster.fake.state.StateSpec`, from CLI specs."""
    from simcluster.usercode.targets import load_state, load_target

    return load_target(hook), load_state(state)


def per_process(hook: str, state: str, isolate: Sequence[str] = ()) -> tuple[Any, StateSpec]:
    """The hook and its state as every rank — a real process or a simulated one — loads them
    for itself (:func:`~simcluster.usercode.rank_local.own_copies`): a
    :class:`~simcluster.usercode.rank_local.RankLocal` hook, and a state factory as one, each
    copying its own module and the ``isolate`` modules (``check``'s ``--isolate``; both sides
    get the same, so module globals are judged alike)."""
    from simcluster.usercode.rank_local import RankLocal, rank_local_state

    return RankLocal(hook, isolate=isolate), rank_local_state(state, isolate=isolate)


# --------------------------------------------------------------------------- recording


def recording(hook: Callable[..., Any], calls: dict[int, list[HookCall]], rank_of: Callable[[], int],
              emit: Callable[[int, str], None] | None = None) -> Callable[..., Any]:
    """``hook`` as registered on both sides: records each call as a :data:`HookCall` of its
    rank (``rank_of()``), announces it through ``emit``, then calls ``hook``.

    The step is the number of the rank's earlier calls on a last bucket. Real DDP's
    registration sees the hook itself through it (:func:`~simcluster.usercode.stand_in.stand_in`):
    its signature, and its ``__name__`` and ``__qualname__`` or their absence.
    """

    def recorded(state: Any, bucket: Any) -> Any:
        rank = rank_of()
        mine = calls.setdefault(rank, [])
        step = sum(1 for c in mine if c[2])
        indices = tuple(getattr(p, "_simcluster_index", -1) for p in bucket.parameters())
        mine.append((step, bucket.index(), bucket.is_last(), indices))
        if emit is not None:
            emit(rank, f"step {step}: hook call on bucket {bucket.index()} (params {list(indices)})")
        return hook(state, bucket)

    return stand_in(hook, recorded)


# --------------------------------------------------------------------------- outcomes


@dataclass
class SideFailure:
    """How one side failed. ``kind``: ``raised`` (an exception), ``hung`` (killed by the
    watchdog, or the simulator's deadlock/stuck report) or ``died`` (a rank's process ended
    without reporting). ``detail``: the traceback or the last events, for the report."""

    kind: str
    rank: int  # -1: not known (the simulation's process died where no rank was recorded)
    error_type: str
    message: str
    step: int | None = None
    detail: str = ""
    unmodelled: str = ""
    """On a simulated side: what the simulator does not model that the hook used (its
    ``UnsupportedError``, with the rank and user line: ``SimProcessGroup does not support
    monitored_barrier (rank 0, at hook.py:6 in hook: dist.monitored_barrier())``)."""

    def line(self) -> str:
        at = "" if self.step is None else f" at step {self.step}"
        typed = "" if self.error_type == self.kind else f"{self.error_type}: "  # no "hung: hung:"
        who = f"rank {self.rank}" if self.rank >= 0 else "a rank"  # -1: which rank is not known
        return f"{who} {self.kind}{at}: {typed}{self.message}"


@dataclass
class Side:
    """One side's outcome: ``grads[step][rank][param]``, ``params[step][rank][param]`` and
    ``calls[rank]`` when it finished, ``failure`` when it did not (``calls`` then holds what was recorded: on
    the real side, what each rank that raised listed in its exception's note —
    :func:`noted_calls`). ``calls_known``: every rank's record is complete up to where it
    stopped; ``False`` after :func:`note_failed_calls`: only the ranks listed in ``calls``
    have one (a real rank that hung or died has none)."""

    name: str
    grads: list[list[list[torch.Tensor | None]]] = field(default_factory=list)
    params: list[list[list[torch.Tensor]]] = field(default_factory=list)
    """Every rank's parameter values after each step (after the hook's work, including an
    optimizer step the hook itself takes: ``_hook_then_optimizer``), copies keeping their
    layout (:func:`~simcluster.fake.reducer.layout_copy`), read from the model DDP trains —
    the real DDP module's parameters on a real rank, the simulated model's the hook was handed
    on the simulated side. Compared bitwise like the gradients (:func:`_param_differences`):
    the gradients of :class:`GradientModel` do not depend on the parameters, so a hook that
    updates parameters wrongly (or a simulator that hands the hook parameters that are not
    the model's) changes nothing else."""
    calls: dict[int, list[HookCall]] = field(default_factory=dict)
    failure: SideFailure | None = None
    seconds: float = 0.0
    calls_known: bool = True
    model_differences: list[str] = field(default_factory=list)
    """On the simulated side: where the DDP model the property search runs
    (:class:`~simcluster.ddp.model.SimDDP`) disagrees with torch's real reducer on the same
    simulated groups (:func:`run_model`)."""
    raised: dict[int, SideFailure] = field(default_factory=dict)
    """On a real side that failed: every rank that raised an error of its own (not a peer's
    consequence, such as a closed connection), by rank — :func:`compare` reads the simulated
    failure's rank here, since which rank reports first is timing on both sides."""
    died: dict[int, SideFailure] = field(default_factory=dict)
    """On a real side that failed: every rank whose process died (a signal, an exit) without
    reporting, by rank — :func:`aborted_rank` reads them: gloo may abort one rank on a
    mismatch while a peer's part of the same collective completes silently and that peer
    raises on what it received (measured, docs/e2e.md)."""
    output: str = ""
    """On the simulated side: what the hook printed on the DDP model's run (captured, shown
    with a failure or a disagreement; the real reducer's run prints the same lines in an
    order that depends on its threads' timing, so they are not kept)."""
    note: str = ""
    """On the simulated side: how its gradients were obtained when not the usual way
    (a hook drawing from torch's global RNG: the DDP model's, see :func:`_simulate`)."""
    unmodelled: str = ""
    """On the simulated side: what the hook used that the simulator does not model (the real
    reducer's run or the DDP model's stopped at an ``UnsupportedError``): the simulation
    predicts nothing, and the verdict is *unsupported* (:func:`compare`)."""
    timing: str = ""
    """On the simulated side: why the hook's outcome on a real cluster is timing, as the DDP
    model's run showed it (:func:`run_model`) — it wrote to a tensor a collective had in
    flight (``InFlightWriteError``), left one in flight that DDP's copy-back read
    (``InFlightReadError``), or branched on a poll's answer: a real run is one draw
    of that race, and a difference from it is no evidence against the simulator (*unconfirmed*,
    :func:`compare`); the property search (``simcluster check``) explores the race itself."""

    polled: str = ""
    """On the DDP model's side: where the hook first polled a pending work or future
    (``rank 0 at hooks.py:12``), or ``""``; :func:`run_sim` then asks whether the outcome
    depends on the polls' answers (:attr:`timing`)."""

    def knows_calls(self, rank: int) -> bool:
        return self.calls_known or rank in self.calls


# --------------------------------------------------------------------------- one real rank


def _drawn_from(before: tuple[Any, ...]) -> list[str]:
    """Which global generators moved since ``before``
    (:func:`~simcluster.usercode.rank_state.process_generator_states`), by name."""
    now = process_generator_states()
    moved = []
    if not torch.equal(now[0], before[0]):
        moved.append("torch's global RNG")
    if now[1] != before[1]:
        moved.append("Python's random")
    if now[2] is not None and (now[2][0] != before[2][0] or (now[2][1] != before[2][1]).any()
                               or now[2][2:] != before[2][2:]):
        moved.append("numpy's global RNG")
    return moved


class _SetsRecorded:
    """``torch.random``'s ``default_generator`` while the real reducer's rank threads run: it
    forwards everything to torch's CPU generator, and notes when a thread other than
    ``caller`` seeds it or sets its state. ``torch.manual_seed``, ``torch.seed`` and
    ``torch.set_rng_state`` (so ``torch.random.fork_rng``'s restore) reach the generator
    through that name. A draw moves the state (seen at the end, :func:`_drawn_from`); a
    draw between a seed and ``fork_rng``'s restore does not, and is seen here — PowerSGD
    seeds inside ``fork_rng`` before its random projections."""

    _SETTERS = frozenset({"manual_seed", "seed", "set_state"})

    def __init__(self, generator: Any, caller: Any) -> None:
        self._generator = generator
        self._caller = caller
        self.set_by_ranks = False

    def __getattr__(self, name: str) -> Any:
        if name in self._SETTERS and threading.current_thread() is not self._caller:
            self.set_by_ranks = True
        return getattr(self._generator, name)


@contextlib.contextmanager
def _recording_sets() -> Iterator[_SetsRecorded]:
    """Watch the global CPU generator's seeding through ``torch.random`` (:class:`_SetsRecorded`)
    while inside; the calling thread's own (``run_real_ddp`` forks the RNG to build its
    models) are not counted."""
    import torch.random

    original = torch.random.default_generator
    recorded = _SetsRecorded(original, threading.current_thread())
    torch.random.default_generator = recorded  # type: ignore[assignment]
    try:
        yield recorded
    finally:
        torch.random.default_generator = original


def run_rank(rank: int, world_size: int, payload: dict[str, Any], group: Any = None,
             device: torch.device | None = None, emit: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """One real rank: real DDP over ``group`` (default: WORLD), the hook registered, every step.

    Shared by the gloo children (:func:`run_real`) and torchrun ranks. Returns
    ``{"grads": [step][param], "params": [step][param], "calls": [...]}`` (tensors on the CPU;
    ``params``: the DDP module's parameters after each step, :attr:`Side.params`). An exception
    propagates with a note naming the rank, type and step (the runner reports it).
    ``emit(rank, text)`` announces each event (default: a line on stdout).
    """
    from simcluster.usercode.rank_local import own_copies

    os.environ[REAL_SIDE_ENV] = "real"
    scenario: Scenario = payload["scenario"]
    # every generator a rank owns, as a simulated rank's (seed + rank): a gloo child reseeds
    # random and numpy from OS entropy after it forks, and a hook drawing from them could never
    # be compared (a false FIDELITY BUG on every run, an e2e audit)
    seed_process_generators(scenario.seed, rank)
    emit = emit or _print_event
    with _announce_collectives(rank, emit):
        # fresh copies of the hook's module (and a state factory's, and the isolate modules): a
        # persistent gloo process runs job after job, and module globals must start clean each
        # time, as in the simulation; loaded while the announcers are in place (what a module
        # captures from torch.distributed at import is what it finds there when it runs)
        hook, state_spec = own_copies(*per_process(payload["hook"], payload["state"], payload.get("isolate", ())))
        inputs = scenario.inputs()[rank]
        model = GradientModel(scenario.shapes, scenario.torch_dtype, scenario.ready_order)
        if device is not None:
            model, inputs = model.to(device), [x.to(device) for x in inputs]
        for i, p in enumerate(model.parameters()):
            p._simcluster_index = i  # type: ignore[attr-defined] - .to(device) may make new Parameters
        with _launcher_environment(dict(scenario.environs[rank]) if scenario.environs is not None else None):
            return _train_rank(rank, scenario, model, inputs, hook, state_spec, group, emit)


def _train_rank(rank: int, scenario: Scenario, model: GradientModel, inputs: list[torch.Tensor],
                hook: Callable[..., Any], state_spec: StateSpec, group: Any,
                emit: Callable[[int, str], None]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from simcluster.fake.reducer import layout_copy

    calls: dict[int, list[HookCall]] = {}
    grads: list[list[torch.Tensor | None]] = []
    params: list[list[torch.Tensor]] = []
    step: int | None = None  # None: constructing DDP or registering the hook, before step 0
    try:
        emit(rank, "constructing DistributedDataParallel")
        ddp = DistributedDataParallel(model, process_group=group, **scenario.ddp_kwargs())
        ddp.register_comm_hook(state_spec.resolve(group or _world(), model),
                               recording(hook, calls, lambda: rank, emit))
        for step in range(scenario.steps):
            emit(rank, f"step {step}: forward and backward")
            ddp(inputs[step]).sum().backward()
            grads.append([None if p.grad is None else layout_copy(p.grad) for p in model.parameters()])
            # what DDP trains: its module's parameters, once backward() has waited on every
            # hook future (an optimizer step the hook takes in a callback is done by then)
            params.append([layout_copy(p) for p in ddp.module.parameters()])
            ddp.zero_grad(set_to_none=True)
        emit(rank, "finished every step")
    except BaseException as exc:
        last = calls.get(rank, [])
        at = last[-1][0] if last else step
        when = f"at step {at}" if at is not None else SETUP_PHASE
        exc.add_note(f"{EVENT_PREFIX}: rank {rank} raised {type(exc).__name__} {when}")
        exc.add_note(f"{EVENT_PREFIX}: rank {rank} hook calls {json.dumps(last)}")
        emit(rank, f"{'before step 0' if at is None else f'step {at}'}: raised {type(exc).__name__}: {first_line(exc)}")
        raise
    return {"grads": grads, "params": params, "calls": calls.get(rank, [])}


def _world() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


def _print_event(rank: int, text: str) -> None:
    print(f"{EVENT_PREFIX} rank {rank}: {text}", flush=True)


ANNOUNCED = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
             "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
             "monitored_barrier", "send", "recv", "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced",
             "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
             "send_object_list", "recv_object_list")
"""The ``torch.distributed`` entry points a real rank announces (``posting NAME``) when the
hook calls them. Not ``isend``/``irecv``: torch checks *their identity* — ``dist.P2POp(op, …)``
raises ``ValueError: Invalid ``op``…`` unless ``op`` is torch's own ``isend`` or ``irecv``
(``_check_op``, torch 2.13), and ``batch_isend_irecv`` picks the peer argument by ``op is
isend`` — so a wrapper in their place failed every hook using ``P2POp`` on the real side only
(a false FIDELITY BUG). Point-to-point ops batched through ``P2POp`` are announced as
``posting batch_isend_irecv``; a direct ``dist.isend``/``dist.irecv`` is not announced (a rank
that hangs there is named by its last hook call or earlier collective)."""


_ANNOUNCING: list[Any] = [None]
"""``(rank, emit)`` while a real rank runs under :func:`_announce_collectives`, else None."""

_ANNOUNCERS: dict[str, tuple[Any, Any]] = {}
"""``(wrapper, torch's own function)`` of each of :data:`ANNOUNCED`: the wrapper is made once
per process and put in place for every job: code that captured one (``q_gather = auto_quantize(dist.all_gather, …)`` at module
level, ``from torch.distributed import all_gather``) and compares it with ``dist.all_gather``
later (``func is dist.all_gather``, as torch's ``auto_quantize`` does) finds the same object
in every job, as in a process that never patched anything."""


def _announcer(name: str, original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        announcing = _ANNOUNCING[0]
        if announcing is not None:
            announcing[1](announcing[0], f"posting {name}")
        return original(*args, **kwargs)

    return functools.wraps(original)(call)


@contextlib.contextmanager
def _announce_collectives(rank: int, emit: Callable[[int, str], None]) -> Iterator[None]:
    """While the rank runs: each of :data:`ANNOUNCED`, called through ``torch.distributed``,
    prints an event first (calls torch makes inside them are not announced again).
    Restored afterwards (rank 0 of a torchrun then simulates in the same process). The
    rank's own copies of the hook's modules are loaded inside, so what they capture at
    import time is what ``torch.distributed`` holds while they run."""
    import torch.distributed as dist

    names = [name for name in ANNOUNCED if hasattr(dist, name)]
    for name in names:
        if name not in _ANNOUNCERS:
            original = getattr(dist, name)
            _ANNOUNCERS[name] = (_announcer(name, original), original)
    _ANNOUNCING[0] = (rank, emit)
    try:
        for name in names:
            setattr(dist, name, _ANNOUNCERS[name][0])
        yield
    finally:
        _ANNOUNCING[0] = None
        for name in names:
            setattr(dist, name, _ANNOUNCERS[name][1])


# --------------------------------------------------------------------------- real side (gloo processes)


def _gloo_job(rank: int, world_size: int, payload: dict[str, Any]) -> dict[str, Any]:
    """What each gloo child runs (:mod:`simcluster.real.gloo_runner` calls it by name)."""
    return run_rank(rank, world_size, payload)


def run_real(scenario: Scenario, hook: str, state: str = "none", *, timeout: float = 60.0,
             cluster: Any = None, start_method: str = "subprocess", isolate: Sequence[str] = ()) -> Side:
    """The scenario on ``world_size`` fresh real gloo processes; never raises for a hook's failure.

    The runner's watchdog bounds the whole run by ``timeout`` seconds; every child is
    killed and reaped and its temp dir removed on every path (Ctrl-C included).
    ``cluster``: a :class:`~simcluster.real.gloo_runner.GlooCluster` of ``world_size``
    ranks to reuse (no process start-up; a failed run restarts its world).
    ``start_method``: the runner's (``"forkserver"`` starts a world in ~0.5 s instead of
    seconds, but re-runs the caller's ``__main__``, which then needs the
    ``if __name__ == "__main__":`` guard; the CLI uses it). ``isolate``: modules each job
    loads fresh with the hook's (:func:`per_process`).
    """
    import time

    from simcluster.errors import GlooRunError
    from simcluster.real.gloo_runner import run_gloo

    payload = {"scenario": scenario, "hook": hook, "state": state, "isolate": tuple(isolate)}
    started = time.monotonic()
    side = Side("real gloo")
    try:
        if cluster is None:
            per_rank = run_gloo(_gloo_job, scenario.world_size, [payload] * scenario.world_size, timeout=timeout,
                                start_method=start_method)
        else:
            per_rank = cluster.run(_gloo_job, [payload] * scenario.world_size, timeout=timeout)
    except GlooRunError as err:
        side.failure = real_failure(err, timeout)
        side.raised = raised_ranks(err)
        side.died = died_ranks(err)
        note_failed_calls(side, err.failures)
    else:
        side.grads = [[per_rank[r]["grads"][k] for r in range(scenario.world_size)] for k in range(scenario.steps)]
        side.params = [[per_rank[r]["params"][k] for r in range(scenario.world_size)] for k in range(scenario.steps)]
        side.calls = {r: [tuple(c) for c in per_rank[r]["calls"]] for r in range(scenario.world_size)}
    side.seconds = time.monotonic() - started
    return side


SETUP_PHASE = "before step 0 (constructing DDP, registering the hook)"
"""Where a real rank that raised before its first step (e.g. ``register_comm_hook`` refusing
the hook) failed: its note and report name no step (they said "at step 0")."""
RAISED_NOTE = re.compile(rf"{EVENT_PREFIX}: rank (\d+) raised (\w+) (?:at step (\d+)|{re.escape(SETUP_PHASE)})")
"""The note a failing real rank adds to its exception (:func:`run_rank`): rank, error type,
step (group 3; ``None`` when it raised before step 0)."""
_CALLS_NOTE = re.compile(rf"^{EVENT_PREFIX}: rank \d+ hook calls (\[.*\])$", re.MULTILINE)


def noted_step(note: re.Match[str] | None) -> int | None:
    """The step a :data:`RAISED_NOTE` match names (``None``: no note, or raised before step 0)."""
    return int(note.group(3)) if note is not None and note.group(3) is not None else None


def noted_calls(traceback_text: str) -> list[HookCall] | None:
    """The hook calls a real rank that raised recorded before it raised, from the note
    :func:`run_rank` adds to its exception (``None`` if the text has no such note: the rank
    hung, died, or failed outside the run).

    >>> noted_calls("IndexError: x\\nsimcluster-e2e: rank 1 hook calls [[0, 0, true, [0, 1]]]")
    [(0, 0, True, (0, 1))]
    """
    match = _CALLS_NOTE.search(traceback_text)
    if match is None:
        return None
    return [(int(s), int(b), bool(last), tuple(int(p) for p in params)) for s, b, last, params in json.loads(match.group(1))]


def note_failed_calls(side: Side, tracebacks: Mapping[int, str]) -> None:
    """On a real side that failed: record the hook calls each rank that raised listed in
    its exception's note (:func:`noted_calls`; ``tracebacks``: rank -> its traceback text),
    and mark the record partial — only the ranks in ``side.calls`` are compared, since a
    rank that hung or died left no note (:attr:`Side.calls_known`)."""
    for rank, text in tracebacks.items():
        if (calls := noted_calls(text)) is not None:
            side.calls[rank] = calls
    side.calls_known = False


def last_events(text: str, rank: int) -> list[str]:
    """The event lines of ``rank`` found in ``text`` (a runner error's captured output)."""
    prefix = f"{EVENT_PREFIX} rank {rank}: "
    return [line.strip()[len(prefix):] for line in text.splitlines() if line.strip().startswith(prefix)]


def real_failure(err: Any, timeout: float) -> SideFailure:
    """A :class:`~simcluster.real.gloo_runner.GlooRunError` as a :class:`SideFailure`."""
    from simcluster.real.gloo_runner import first_failed_rank

    text = str(err)
    if err.failures:
        rank = first_failed_rank(err)
        own = err.failures[rank]
        return _died_on(rank, own, text) if _died(own) else _raised_on(rank, own)
    hung = err.unfinished or [0]
    parts = []
    for rank in hung:
        events = last_events(text, rank)
        parts.append(f"rank {rank}: last event {events[-1]!r}" if events else f"rank {rank}: no event recorded")
    return SideFailure("hung", hung[0], "hung",
                       f"ranks {hung} did not finish within {timeout:g} s and were killed ({'; '.join(parts)})",
                       None, text)


def raised_ranks(err: Any) -> dict[int, SideFailure]:
    """Every rank of a :class:`~simcluster.real.gloo_runner.GlooRunError` that raised an error
    of its own (:func:`~simcluster.real.gloo_runner.primary_ranks`), by rank (:attr:`Side.raised`)."""
    from simcluster.real.gloo_runner import primary_ranks

    return {r: _raised_on(r, err.failures[r]) for r in sorted(primary_ranks(err.failures))
            if not _died(err.failures[r])}


def died_ranks(err: Any) -> dict[int, SideFailure]:
    """Every rank of a :class:`~simcluster.real.gloo_runner.GlooRunError` whose process died
    without reporting (:attr:`Side.died`), by rank (:func:`_died_on`)."""
    text = str(err)
    return {rank: _died_on(rank, own, text) for rank, own in sorted(err.failures.items()) if _died(own)}


def _died_on(rank: int, own: str, text: str) -> SideFailure:
    """Rank ``rank``'s death, from its failure text ``own`` (gloo_runner's last line: killed by a
    signal, or exited) and the last event it announced in the runner's whole ``text``."""
    events = last_events(text, rank)
    last = f"its last event: {events[-1]}" if events else "no event recorded"
    return SideFailure("died", rank, "died", f"{own.strip().splitlines()[-1]}; {last}", None, text)


def _died(own: str) -> bool:
    """A rank's failure text says its process ended without reporting (killed by a signal, or
    exited): gloo_runner's wording."""
    return "without reporting an error" in own


def _raised_on(rank: int, own: str) -> SideFailure:
    """Rank ``rank``'s exception, from its traceback text ``own`` (with :func:`run_rank`'s note)."""
    note = RAISED_NOTE.search(own)
    error_type = note.group(2) if note else _error_type(own)
    # the notes run_rank adds come after the exception's own line: never its message (an
    # exception without one, a bare ``assert``, ends its traceback with "AssertionError" alone)
    body = [ln for ln in own.strip().splitlines() if not ln.startswith(EVENT_PREFIX)]
    own_line = re.compile(rf"^(?:[\w.]+\.)?{re.escape(error_type)}(?::(.*))?$")
    matches = [m for ln in body if (m := own_line.match(ln))]
    if matches:
        message = (matches[-1].group(1) or "").strip()
    else:
        message = body[-1] if body else ""
    return SideFailure("raised", rank, error_type, message, noted_step(note), own)


def _error_type(traceback_text: str) -> str:
    for line in reversed(traceback_text.strip().splitlines()):
        match = re.match(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning))\b", line)
        if match:
            return match.group(1).rpartition(".")[2]
    return "Exception"


# --------------------------------------------------------------------------- sim side


def run_sim(scenario: Scenario, hook: str, state: str = "none", *, backend: str = "gloo",
            timeout: float = 60.0, isolate: Sequence[str] = ()) -> Side:
    """The scenario under :func:`~simcluster.ddp.real_ddp.run_real_ddp` (real reducer, simulated
    groups), and under the DDP model (:func:`run_model`), in a supervised child
    (:func:`~simcluster.checking.supervisor.run_supervised`): a hook that spins, blocks, calls
    ``sys.exit`` or ends its process makes this side ``hung`` (after ``timeout`` seconds),
    ``raised SystemExit`` or ``died`` — as a real rank reports it — and never ends or hangs
    the caller. ``isolate``: modules every simulated rank copies with the hook's (:func:`per_process`)."""
    import importlib

    from simcluster.checking.supervisor import format_stack, run_supervised, stuck_in

    # DDP's constructor imports torch._dynamo on first use (2-5 s cold, under load): here, before
    # the fork, so the deadline bounds the scenario, not a one-off import (the forked child has it)
    importlib.import_module("torch._dynamo.utils")
    outcome = run_supervised(lambda monitor: _simulate(scenario, hook, state, backend, timeout, isolate, monitor),
                             deadline=timeout)
    if outcome.value is not None:
        return outcome.value
    side = Side(f"sim ({backend} model)", seconds=outcome.seconds, calls_known=False)
    if outcome.death is not None:
        death = outcome.death
        if death.kind == "deadline":
            # which rank's code spins or blocks is thread timing under the real reducer: not named;
            # where the code was is (the function, stable run to run; the stack sampled at the deadline)
            function = stuck_in(death.stacks)
            if function:
                side.failure = SideFailure("hung", -1, "hung", f"the simulation {death.detail}, stuck in {function}",
                                           None, format_stack(death.stacks) or death.stacks)
            else:  # every thread waited in DDP, torch or simcluster: the sampled frames are not the hook's
                side.failure = SideFailure(
                    "hung", -1, "hung", f"the simulation {death.detail}, with no hook code running: every rank "
                    "waited in DDP or simcluster — on a future the hook returned that never completes, or a "
                    "collective some rank never posted", None,
                    _located_hang(scenario, hook, state, backend, timeout, isolate)
                    + "no hook code was on any thread's stack at the deadline; the threads' stacks:\n"
                    + (format_stack(death.stacks) or death.stacks))
        else:
            side.failure = _located_death(scenario, hook, state, backend, timeout, isolate, death.detail)
    else:
        error = outcome.error
        assert error is not None
        if not isinstance(error, SystemExit):
            raise error  # not the hook's: a bug of ours, or a usage error
        side.failure = _sim_failure(error, {})  # as a real rank reports it: raised SystemExit
    return side


def _located_death(scenario: Scenario, hook: str, state: str, backend: str, timeout: float,
                   isolate: Sequence[str], detail: str) -> SideFailure:
    """The simulation's process died (a signal, a crash) while the real reducer's rank
    threads ran: which rank's code ended it is thread timing, not recorded. So the
    scenario runs again on the DDP model alone (one baton, ranks in a fixed order), in a
    supervised child that announces every hook call and rank switch: the death there names
    the rank, DDP step and bucket, the same on every run. If the model's run does not die,
    the rank stays unknown and the line says so (``rank`` is then -1)."""
    from simcluster.checking.supervisor import run_supervised

    def located(monitor: Any) -> Side:
        monitor.begin({"scenario": scenario.describe(), "locating": "the process death"})
        hook_local, state_local = per_process(hook, state, isolate)
        with captured_output(monitor.output_fd):  # read back from the file if the process dies
            side = run_model(scenario, hook_local, state_local, backend=backend, on_hook_call=monitor.at)
        monitor.end()
        return side

    again = run_supervised(located, deadline=timeout)
    death = again.death
    if death is None or death.kind == "deadline" or (death.position is None and death.running is None):
        return SideFailure("died", -1, "died", f"the simulation's process {detail} (on a rank the real reducer's "
                           "threads do not record; the DDP model did not die on this scenario)")
    rank = death.running if death.running is not None else death.position[0]  # type: ignore[index]
    step = death.position[1] if death.position is not None and death.position[0] == rank else None
    printed = f"\n--- what the hook printed on the DDP model's run (last lines) ---\n{death.output}" if death.output else ""
    return SideFailure("died", rank, "died", f"the simulation's process {detail}; where: {death.where()}; located "
                       "by re-running the scenario on the DDP model", step, death.stacks + printed)


def _located_hang(scenario: Scenario, hook: str, state: str, backend: str, timeout: float,
                  isolate: Sequence[str]) -> str:
    """The real reducer's rank threads hung with no hook code running: which future or
    collective they waited on is in no stack. The DDP model (one baton, a deadlock seen as
    soon as nothing can run) runs the scenario again in a supervised child; its deadlock
    report — each rank's wait, each collective some rank never posted — is returned with a
    heading, or ``''`` when the model finished, failed otherwise, or hung too."""
    from simcluster.checking.supervisor import run_supervised

    def located(monitor: Any) -> str:
        monitor.begin({"scenario": scenario.describe(), "locating": "the hang"})
        hook_local, state_local = per_process(hook, state, isolate)
        with captured_output(monitor.output_fd):
            side = run_model(scenario, hook_local, state_local, backend=backend, on_hook_call=monitor.at)
        monitor.end()
        failure = side.failure
        if failure is None or failure.error_type != "DeadlockError" or failure.detail is None:
            return ""
        story = failure.detail.rpartition("DeadlockError: ")[2]  # the error's whole text, after its traceback
        kept = [line for line in story.splitlines() if not line.lstrip().startswith(("replay:", "simcluster:"))]
        return "\n".join(kept)

    again = run_supervised(located, deadline=timeout)
    if not again.value:
        return ""
    return f"what the ranks waited on, from the DDP model's run of the scenario (a deadlock there):\n{again.value}\n"


def _simulate(scenario: Scenario, hook: str, state: str, backend: str, timeout: float, isolate: Sequence[str],
              monitor: Any) -> Side:
    """:func:`run_sim`'s work, in the supervised child; ``monitor`` announces it as one
    example, so the supervisor's deadline (``timeout``) bounds it from the start."""
    import time

    import torch.distributed as dist

    from simcluster.checking.supervisor import watchdog_under
    from simcluster.ddp.real_ddp import run_real_ddp
    from simcluster.usercode.rank_local import own_copies

    os.environ.pop(REAL_SIDE_ENV, None)  # this child is a simulation, even in torchrun's rank 0
    monitor.begin({"scenario": scenario.describe()})
    hook_fn, _ = load_hook_and_state(hook, state)  # load errors first, and the signature real DDP checks
    calls: dict[int, list[HookCall]] = {}
    side = Side(f"sim ({backend} model)")
    started = time.monotonic()
    dtype = scenario.torch_dtype
    torch.manual_seed(scenario.seed)
    seeded = process_generator_states()
    hook_local, state_local = per_process(hook, state, isolate)

    def own_process(ddp: Any, group: Any) -> tuple[Callable[..., Any], Any, None]:
        # Each rank imports the hook's module (and the state factory's) afresh, as a process
        # does: module globals are the rank's own, and start clean for this run.
        rank_hook, spec = own_copies(hook_local, state_local)
        return recording(rank_hook, calls, dist.get_rank), spec.resolve(group, ddp.module), None

    output_fd = getattr(monitor, "output_fd", None)
    # What the hook prints is captured, as the search captures it: under the real reducer its
    # rank threads interleave their lines by timing (dropped); on the DDP model, one baton and
    # a fixed order, the text is the same on every run (kept, shown with a failure).
    with captured_output(output_fd), _recording_reads(scenario) as environ, _recording_sets() as seeds:
        try:
            run = run_real_ddp(lambda: GradientModel(scenario.shapes, dtype, scenario.ready_order), scenario.inputs(),
                               world_size=scenario.world_size, hook=None, setup=own_process,
                               iterations=scenario.steps, backend=backend, timeout=watchdog_under(timeout),
                               **scenario.ddp_kwargs())
        except Exception as exc:  # noqa: BLE001 - the hook's (or the simulator's) failure is the outcome
            side.failure = _sim_failure(exc, calls)
        else:
            side.grads, side.params = run.grads, run.params
    side.calls = calls
    drew = _drawn_from(seeded)
    if seeds.set_by_ranks and "torch's global RNG" not in drew:
        drew.insert(0, "torch's global RNG")
    with captured_output(output_fd) as printed:
        model = run_model(scenario, hook_local, state_local, backend=backend, inspect=hook_fn)
    side.output = printed.text
    if model.polled and not model.timing:
        # The hook polled. A loop that polls until done ends alike whatever a poll answered:
        # its outcome is no race. So the model runs once more with every first poll looking
        # after the others ran (and completions in reverse): if that differs, the outcome is timing.
        from simcluster.engine.scheduler import Reverse

        with captured_output(output_fd):
            late = run_model(scenario, hook_local, state_local, backend=backend, inspect=hook_fn, schedule=Reverse())
        if side_differences(scenario, model, late, exact_errors=False):
            model.timing = (f"the hook branches on a poll ({model.polled}): its outcome when every first poll looks at "
                            "once differs from when every first poll looks after the others ran, and whether a poll "
                            "sees its work complete is timing on a real cluster (docs/gloo-facts.md §12)")
    if drew and side.failure is None and model.failure is None:
        # The hook drew from a global RNG (torch's, Python's random, numpy's). Real ranks each
        # own their generators (seed + rank), as the DDP model's simulated ranks do; the real
        # reducer's rank threads share the process's, so their draws cannot match. The
        # simulator's gradients are the model's; hook calls and failures are still the real
        # reducer's, compared as ever.
        side.grads, side.params = model.grads, model.params
        side.note = (f"the hook draws from {' and '.join(drew)}: gradients and parameters from the DDP model, whose "
                     "simulated ranks own generators seeded like the real ranks (seed + rank); the real reducer's "
                     "rank threads share the process's (docs/e2e.md)")
    if environ is not None and environ.read:
        # The hook read a launcher variable whose value differs between the real ranks. The
        # real reducer's rank threads share this process's one environment (rank 0's, under
        # torchrun); the DDP model gives each simulated rank the real rank's own: this side is the model's.
        names = ", ".join(sorted(os.environ.decodekey(k) for k in environ.read))  # type: ignore[attr-defined]
        side.grads, side.params, side.calls, side.failure = model.grads, model.params, model.calls, model.failure
        side.note = (f"the hook reads {names}, which differ between the real ranks: this side is the DDP model's, "
                     "whose simulated ranks each see their real rank's launcher variables; the real reducer's "
                     "rank threads share one process environment (docs/e2e.md)")
    else:
        side.model_differences = _model_differences(scenario, model, side)
    side.unmodelled = next((f.unmodelled for f in (side.failure, model.failure) if f is not None and f.unmodelled), "")
    side.timing = model.timing
    side.seconds = time.monotonic() - started
    monitor.end()
    return side


def run_model(scenario: Scenario, hook: Callable[..., Any], state: Any, *, backend: str = "gloo",
              inspect: Callable[..., Any] | None = None, schedule: Any = None,
              on_hook_call: Callable[[int, int, int], None] | None = None) -> Side:
    """The scenario under :class:`~simcluster.ddp.model.SimDDP` — the DDP model the property
    search runs (simulated reducer, bucketing and copy-back, inline engine, in-order schedule).
    ``hook`` and ``state`` as SimDDP takes them (a :class:`~simcluster.usercode.rank_local.RankLocal`
    gives each simulated rank its own module, as a process has); ``inspect``: the hook whose
    signature real DDP's registration checks (default ``hook``); ``schedule``: the order
    collectives complete in (default in order: :class:`~simcluster.engine.scheduler.InOrder`);
    ``on_hook_call(rank, step, bucket)``: told before every hook call (a supervisor's
    :meth:`~simcluster.checking.supervisor.Monitor.at`)."""
    import torch.distributed as dist

    from simcluster.ddp.model import DDPConfig, SimDDP
    from simcluster.engine.scheduler import InOrder
    from simcluster.fake.cluster import SimCluster
    from simcluster.fake.reducer import layout_copy

    calls: dict[int, list[HookCall]] = {}
    side = Side("sim DDP model")
    refused = _registration_refused(inspect or hook)
    if refused is not None:  # real DDP's register_comm_hook raises: the hook never runs
        side.failure = refused
        return side
    cluster = SimCluster(scenario.world_size, seed=scenario.seed, backend=backend,
                         schedule=InOrder() if schedule is None else schedule, launcher=rank_launcher(scenario))
    config = DDPConfig(bucket_cap_mb=scenario.bucket_cap_mb, static_graph=scenario.static_graph,
                       find_unused_parameters=scenario.find_unused_parameters,
                       gradient_as_bucket_view=scenario.gradient_as_bucket_view, ready_order=scenario.ready_order)
    ddp = SimDDP(cluster, recording(hook, calls, dist.get_rank), list(scenario.shapes), state=state, config=config,
                 dtype=scenario.torch_dtype)
    if on_hook_call is not None:
        ddp.on_hook_call = on_hook_call
    for params in ddp.params:
        for i, p in enumerate(params):
            p._simcluster_index = i  # type: ignore[attr-defined] - as GradientModel's, for the call records
    for step_grads in scenario.gradients():
        try:
            result = ddp.step(step_grads)
        except Exception as exc:  # noqa: BLE001 - the hook's (or the model's) failure is the outcome
            side.failure = _sim_failure(exc, calls)
            if isinstance(exc, InFlightWriteError):
                side.timing = f"the hook writes to a tensor a collective has in flight ({exc.race}): a race on a real " \
                              "cluster (docs/gloo-facts.md §14)"
            elif isinstance(exc, InFlightReadError):  # read before the collective wrote, or left in flight past backward()
                side.timing = (f"{exc.race}: a race on a real cluster (docs/ddp-facts.md, \"A collective the hook's "
                               "future does not wait for\")")
            break
        poll = next(iter(result.trace.of(Polled)), None)
        if poll is not None and not side.polled:
            side.polled = f"rank {poll.rank} at {poll.at}"
        # a step's grads as SimDDP keeps them: with gradient_as_bucket_view, copies that keep
        # their bucket views' storage layout, as the other two sides record p.grad
        side.grads.append([list(rank) for rank in result.grads])
        # every step, not only when SimDDP saw a version counter move (StepResult.params):
        # a hook updating ``p.data`` in place leaves ``p._version`` where it was
        side.params.append([[layout_copy(p) for p in rank] for rank in ddp.params])
    side.calls = calls
    return side


def rank_launcher(scenario: Scenario) -> Any:
    """What the DDP model's cluster takes as ``launcher``: each rank's real launcher
    variables (:attr:`Scenario.environs`, a :class:`~simcluster.fake.launcher.LauncherEnvironment`),
    or ``"none"``."""
    from simcluster.fake.launcher import LauncherEnvironment

    if scenario.environs is None:
        return "none"
    return LauncherEnvironment(scenario.world_size, [dict(env) for env in scenario.environs])


class _ReadsRecorded(dict):  # type: ignore[type-arg]
    """``os.environ``'s store while the real reducer's rank threads run: notes which of
    ``watched`` (encoded names) were read — ``os.environ[...]``, ``.get``, ``os.getenv``,
    ``in``, a copy all read through it."""

    def __init__(self, data: dict[Any, Any], watched: set[bytes]) -> None:
        super().__init__(data)
        self.watched = watched
        self.read: set[bytes] = set()

    def __getitem__(self, key: Any) -> Any:
        if key in self.watched:
            self.read.add(key)
        return super().__getitem__(key)


@contextlib.contextmanager
def _recording_reads(scenario: Scenario) -> Iterator[_ReadsRecorded | None]:
    """The real reducer's run with :attr:`Scenario.environs`: its rank threads share one
    process environment, so it holds the launcher variables alike on every rank (as each
    real rank's does) and reads of the others — which cannot be each thread's own — are
    recorded: ``os.environ`` (and ``os.environb``, which shares its store) reads through a
    :class:`_ReadsRecorded` copy while inside. What was written meanwhile is kept, and the
    variables are put back as they were. Yields None (nothing changed) without environs."""
    launcher = rank_launcher(scenario)
    if launcher == "none":
        yield None
        return
    launcher.begin()
    original = os.environ._data  # type: ignore[attr-defined]
    recorded = _ReadsRecorded(original, {os.environ.encodekey(name) for name in launcher.varying})  # type: ignore[attr-defined]
    shares = getattr(os, "environb", None) is not None and os.environb._data is original  # type: ignore[attr-defined]
    os.environ._data = recorded  # type: ignore[attr-defined]
    if shares:
        os.environb._data = recorded  # type: ignore[attr-defined]
    try:
        yield recorded
    finally:
        os.environ._data = original  # type: ignore[attr-defined]
        if shares:
            os.environb._data = original  # type: ignore[attr-defined]
        if dict(recorded) != original:
            original.clear()
            original.update(recorded)
        launcher.end()


def _registration_refused(hook: Callable[..., Any]) -> SideFailure | None:
    """How real DDP's ``register_comm_hook`` refuses ``hook`` (its parameter name or its
    annotations, :func:`~simcluster.checking.properties.registration_problem`; or its name on
    this torch build, :func:`~simcluster.checking.properties.build_refusal`), as a failure
    on rank 0 before any step; ``None`` when it registers. SimDDP does not check this itself:
    the search reports it once and still runs the hook for its other bugs."""
    from simcluster.checking.properties import build_refusal, registration_problem

    problem = registration_problem(hook) or build_refusal(hook)
    if problem is None:
        return None
    raised = re.search(r"raises (\w+Error)", problem)
    return SideFailure("raised", 0, raised.group(1) if raised else "TypeError", problem, None)


def _model_differences(scenario: Scenario, model: Side, reducer: Side) -> list[str]:
    """Where the DDP model disagrees with the real reducer on the same simulated groups:
    :func:`side_differences` without comparing error types and messages (the model words
    DDP's errors itself, e.g. as ``CopyBackError``).

    One run meeting mismatched collectives where the other finished is no difference: the
    two engines interleave a racy hook's ranks (callbacks posting collectives while the next
    bucket's hook posts its own) each in their own order, as two real runs would."""
    if _mismatch_where_other_finished(model, reducer) or _mismatch_where_other_finished(reducer, model):
        return []
    if model.timing and reducer.failure is None:  # the reducer's rank threads ran the race as threads do: not checked
        return []
    return [f"the DDP model (SimDDP, what the property search runs) vs the real reducer on simulated groups: {d}"
            for d in side_differences(scenario, model, reducer, exact_errors=False)]


def _mismatch_where_other_finished(mismatched: Side, other: Side) -> bool:
    """``mismatched`` met a ``CollectiveMismatchError`` and ``other`` finished every step."""
    return (other.failure is None and mismatched.failure is not None
            and mismatched.failure.error_type == "CollectiveMismatchError")


def _sim_failure(exc: BaseException, calls: dict[int, list[HookCall]]) -> SideFailure:
    import traceback

    notes = "\n".join(getattr(exc, "__notes__", ()))
    match = re.search(r"raised on rank (\d+) of", notes)
    rank = int(match.group(1)) if match else 0
    mine = calls.get(rank, [])
    step = mine[-1][0] if mine else None
    detail = "".join(traceback.format_exception(exc))
    if isinstance(exc, HookExited):  # os._exit(n) in the hook: a real rank's process ends without reporting
        return SideFailure("died", rank, "died", first_line(exc), step, detail)
    kind = "hung" if type(exc).__name__ in _SIM_HUNG else "raised"
    return SideFailure(kind, rank, _as_real_type(exc), first_line(exc), step, detail, _unmodelled(exc))


def _unmodelled(exc: BaseException) -> str:
    """``what (rank r, at file:line in fn: code)`` when ``exc`` is (or was caused by) the
    simulator's :class:`~simcluster.errors.UnsupportedError`; else ``""``. The rank is the
    one simcluster noted, the line the innermost of user code (as ``simcluster check`` says it)."""
    from simcluster.checking.supervisor import raise_site
    from simcluster.errors import UnsupportedError

    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, UnsupportedError):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return ""
    site = raise_site(exc) if seen is exc else raise_site(seen) or raise_site(exc)
    return f"{first_line(seen)}{site}"


def _as_real_type(exc: BaseException) -> str:
    """The name of the exception type real torch would raise in ``exc``'s place: simcluster's
    own errors stand for a built-in one they derive from (``BackendError`` and
    ``CopyBackError`` are ``RuntimeError``\\s, as real gloo's and real DDP's are); the
    simulator's hang and deadlock reports keep their own names."""
    if not isinstance(exc, SimClusterError):
        return type(exc).__name__
    real = next((c for c in type(exc).__mro__ if c.__module__ == "builtins" and c not in (Exception, BaseException,
                                                                                          object)), None)
    return real.__name__ if real is not None else type(exc).__name__


# --------------------------------------------------------------------------- comparing


@dataclass
class E2EResult:
    """The comparison of one scenario. ``verdict``: ``agree``; ``fidelity bug`` (the
    simulator differs from real gloo); ``unconfirmed`` (it differs where real gloo's outcome
    is itself timing — a one-rank group, or a simulated mismatch where real gloo finished —
    ``why`` says which; docs/e2e.md); ``unsupported`` (the hook used what the simulator does
    not model, ``why`` names it and the user line: nothing was predicted, nothing compared)."""

    scenario: Scenario
    hook: str
    sim: Side
    real: Side
    differences: list[str]
    verdict: str
    why: str = ""  # "unconfirmed": why the disagreement is no evidence against the simulator; "unsupported":
    # what is not modelled; "agree": what made two different-looking failures one (e.g. an abort on a mismatch)
    isolate: tuple[str, ...] = ()  # the modules both sides loaded per rank with the hook's (--isolate)

    @property
    def agree(self) -> bool:
        return self.verdict == "agree"

    @property
    def hook_failed(self) -> bool:
        """Both sides failed alike: the hook's own failure, confirmed on real gloo."""
        return self.agree and self.sim.failure is not None

    def format(self, *, per_step: bool = True) -> str:
        """The report: the scenario, per-step per-rank summaries, failures side by side, the verdict."""
        isolated = f" --isolate {','.join(self.isolate)}" if self.isolate else ""
        lines = [f"e2e {self.hook}{isolated}: {self.scenario.describe()}",
                 f"  {self.sim.name} {self.sim.seconds:.1f}s | {self.real.name} {self.real.seconds:.1f}s"]
        if self.sim.note:
            lines.append(f"  note: {self.sim.note}")
        if per_step and self.verdict != "unsupported":  # nothing was compared
            lines += _step_lines(self)
        for side in (self.sim, self.real):
            if side.failure is not None:
                lines.append(f"  {side.name:<17} FAILED: {side.failure.line()}")
        if self.sim.failure is not None or self.real.failure is not None:
            for side in (self.sim, self.real):
                if side.failure is None:
                    lines.append(f"  {side.name:<17} finished every step")
        if self.verdict == "unsupported":
            lines.append(f"  verdict: UNSUPPORTED by the simulator (no comparison): not modelled: {self.why}")
            return "\n".join(lines)
        if self.verdict == "agree":
            both = "both sides failed alike (the hook's failure, confirmed)" if self.hook_failed else \
                "gradients, parameters, hook calls and outcomes agree bitwise"
            both += f": {self.why}" if self.why else ""
            lines.append(f"  verdict: agree — {both}")
            if self.hook_failed and self.sim.failure is not None and self.sim.failure.kind == "hung" \
                    and self.sim.failure.detail:  # where the hook's code was when it was stopped
                lines += _detail_block(f"{self.sim.name}: where the hook's code was at the deadline",
                                       self.sim.failure.detail)
        else:
            head = "FIDELITY BUG of the simulator" if self.verdict == "fidelity bug" else f"UNCONFIRMED ({self.why})"
            lines.append(f"  verdict: {head}:")
            lines += [f"    - {d}" for d in self.differences[:10]]
            if len(self.differences) > 10:
                lines.append(f"    … and {len(self.differences) - 10} more")
            for side in (self.real, self.sim):
                if side.failure is not None and side.failure.detail:
                    lines += _detail_block(f"{side.name}: {side.failure.line()}", side.failure.detail)
        if (self.hook_failed or self.verdict != "agree") and self.sim.output.strip():
            printed = self.sim.output.strip().splitlines()
            lines.append(f"  output: what the hook printed on the DDP model's run ({len(printed)} lines"
                         f"{', the last 12' if len(printed) > 12 else ''}):")
            lines += [f"    {t}" for t in printed[-12:]]
        return "\n".join(lines)


def _detail_block(title: str, detail: str) -> list[str]:
    """A failure's detail under the verdict: a ``--- title ---`` line, then its last 12 lines, indented."""
    return [f"  --- {title} ---", *(f"    {t}" for t in detail.strip().splitlines()[-12:])]


def _digest(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha1(raw).hexdigest()[:8]


def _step_lines(result: E2EResult) -> list[str]:
    """Per step and rank, each side's hook calls, gradient and parameter digests, marked ``=`` (the same),
    ``≠`` (different) or ``?`` (a side's record of that rank is unknown: it hung or died)."""
    lines = []
    for k in range(result.scenario.steps):
        for r in range(result.scenario.world_size):
            cells = []
            for side in (result.sim, result.real):
                calls = [c for c in side.calls.get(r, []) if c[0] == k]
                buckets = ",".join(f"b{c[1]}{list(c[3])}" for c in calls) or "-" if side.knows_calls(r) else "?"
                grads = side.grads[k][r] if k < len(side.grads) else None
                digest = "/".join(_digest(g) for g in grads) if grads is not None else "no grads"
                params = _params_at(side, k, r)  # not recorded (a side that failed): left out
                values = "" if params is None else " params " + "/".join(_digest(p) for p in params)
                cells.append(f"hooks {buckets} grads {digest}{values}")
            known = result.sim.knows_calls(r) and result.real.knows_calls(r)
            same = "?" if not known else "=" if cells[0] == cells[1] else "≠"
            lines.append(f"  step {k} rank {r}: sim {cells[0]} {same} real {cells[1]}")
    return lines


def compare(scenario: Scenario, hook: str, sim: Side, real: Side) -> E2EResult:
    """Compare the two sides (:func:`side_differences`), and the simulated side's DDP model
    with the real reducer (:attr:`Side.model_differences`); any difference is a fidelity bug
    (unconfirmed on a one-rank group). A simulation that stopped at what it does not model
    (:attr:`Side.unmodelled`) predicted nothing: the verdict is ``unsupported``."""
    if sim.unmodelled:
        return E2EResult(scenario, hook, sim, real, [], "unsupported", sim.unmodelled)
    real = aborted_rank(sim, same_rank(sim, real))
    diffs = side_differences(scenario, sim, real) + sim.model_differences
    why = _unconfirmed(scenario, sim, real) if diffs else _agreed_because(sim, real)
    verdict = "agree" if not diffs else "unconfirmed" if why else "fidelity bug"
    return E2EResult(scenario, hook, sim, real, diffs, verdict, why)


def aborted_rank(sim: Side, real: Side) -> Side:
    """``real`` with its failure replaced by a rank gloo aborted (:attr:`Side.died`,
    :func:`aborted_on_mismatch`) when the simulation met mismatched collectives and the failure
    real gloo reported first is another rank's; else ``real`` as it is. On a mismatch gloo
    aborts the rank whose buffer is the smaller and completes the peer's part with what it
    got; that peer may then raise first on the mixed-up data (a deep gradient compression
    hook from the wild, round 9: all_gather of (2, 4) on rank 0 and (2, 2) on rank 1 — rank 0
    raised an IndexError in its callback, rank 1 was killed by SIGABRT, 3 runs in 3), and
    comparing only that error called the mismatch a FIDELITY BUG."""
    s, g = sim.failure, real.failure
    if s is None or g is None or aborted_on_mismatch(s, g) or hung_where_gloo_aborted(s, g):
        return real
    if s.error_type != "CollectiveMismatchError" and s.kind != "hung":
        return real
    abort = next((d for d in real.died.values() if aborted_on_mismatch(s, d) or hung_where_gloo_aborted(s, d)), None)
    return real if abort is None else dataclasses.replace(real, failure=abort)


def same_rank(sim: Side, real: Side) -> Side:
    """``real`` with its failure on the rank the simulated failure names, when both sides raised
    on different ranks and that rank raised its own error on real gloo too (:attr:`Side.raised`);
    else ``real`` as it is. Which rank's error a side reports is timing — on real gloo the first
    process to report, in the simulation the first rank thread to raise — and ranks may raise
    different errors: torch's quantization hook at world 3 indexes out of bounds on rank 2 and a
    0-dim tensor on ranks 0 and 1 (measured), so comparing whichever each side reported first
    called one run in three a FIDELITY BUG."""
    s, g = sim.failure, real.failure
    if s is None or g is None or s.kind != "raised" or g.kind != "raised" or s.rank == g.rank:
        return real
    mine = real.raised.get(s.rank)
    return real if mine is None else dataclasses.replace(real, failure=mine)


ONE_RANK = "one-rank group: real gloo itself is not deterministic here, see docs/e2e.md"
MISMATCH_FINISHED = ("the simulation met mismatched collectives where real gloo finished: gloo completes many "
                     "mismatches silently (docs/gloo-facts.md §6), and collectives posted from callbacks on worker "
                     "threads come in an order that is timing — the hook's liveness failure, not confirmed this run")


HUNG_WHERE_ABORTED = (
    "the simulation hung where real gloo aborted rank {rank} on mismatched collectives (SIGABRT, gloo::EnforceNotMet: "
    "a received size differs from the posted one, docs/gloo-facts.md §6): whether a racy hook first meets a deadlock "
    "or a mismatch is timing, in real processes as in the simulator's rank threads")
ABORTED = ("the simulation's collective mismatch is what aborted real gloo's rank {rank} (SIGABRT, gloo::EnforceNotMet: "
           "a received size differs from the posted one, docs/gloo-facts.md §6)")


def _agreed_because(sim: Side, real: Side) -> str:
    """For an agreement that is not the same failure word for word, what made it one (``""``
    otherwise): the simulation's mismatch where real gloo aborted a rank (:func:`aborted_on_mismatch`)."""
    if sim.failure is not None and real.failure is not None and aborted_on_mismatch(sim.failure, real.failure):
        return ABORTED.format(rank=real.failure.rank)
    if sim.failure is not None and real.failure is not None and hung_where_gloo_aborted(sim.failure, real.failure):
        return HUNG_WHERE_ABORTED.format(rank=real.failure.rank)
    return ""


def _unconfirmed(scenario: Scenario, sim: Side, real: Side) -> str:
    """Why a disagreement is no evidence against the simulator (``""``: it is): on a one-rank
    group real gloo's own timing decides; a simulated ``CollectiveMismatchError`` where
    real gloo finished every step is not contradicted by it (a real mismatch may complete
    silently, and a racy hook may post alike on one run and not on the next); and a hook whose
    outcome the DDP model showed to be timing (:attr:`Side.timing`) is one draw of its race."""
    if scenario.world_size == 1:
        return ONE_RANK
    if _mismatch_where_other_finished(sim, real) and not sim.model_differences:
        return MISMATCH_FINISHED
    if sim.timing:
        return (f"{sim.timing}; one real run is one draw of it, not comparable bit for bit — `simcluster check` "
                "explores it")
    return ""


def side_differences(scenario: Scenario, sim: Side, real: Side, *, exact_errors: bool = True) -> list[str]:
    """Bitwise: every step's and rank's gradients and parameter values, each rank's hook calls,
    and the failures
    (same kind and innermost error; with ``exact_errors`` also the same exception type and,
    for exceptions, the same first line of the message, byte for byte).

    When both sides raised, the hook calls are compared too, as far as both ran
    (:func:`_call_differences`)."""
    diffs: list[str] = []
    if sim.failure is None and real.failure is None:
        diffs += _call_differences(sim, real, scenario.world_size)
        diffs += _grad_differences(sim, real, scenario)
        diffs += _param_differences(sim, real, scenario)
    elif sim.failure is None or real.failure is None:
        failed, other = (sim, real) if sim.failure is not None else (real, sim)
        assert failed.failure is not None
        diffs.append(f"only {failed.name} failed: {failed.failure.line()}; {other.name} finished every step")
    else:
        s, g = sim.failure, real.failure
        if (_liveness(s) and _liveness(g)) or aborted_on_mismatch(s, g) or hung_where_gloo_aborted(s, g):
            pass
        elif s.kind != g.kind or (exact_errors and s.error_type != g.error_type) or root_error(s) != root_error(g):
            diffs.append(f"the failures differ: {sim.name} {s.line()} vs {real.name} {g.line()}")
        elif exact_errors and s.kind == "raised" and without_addresses(s.message) != without_addresses(g.message):
            # an object's address in torch's words ('Unable to cast <torch.Future object at 0x…>') is no difference
            diffs.append(f"the failure messages differ: {sim.name} {s.message!r} vs {real.name} {g.message!r}")
        if s.kind == "raised" and g.kind == "raised":
            steps = [f.step for f in (s, g) if f.step is not None]
            diffs += _call_differences(sim, real, scenario.world_size, min(steps) if steps else 0)
    return diffs


def _liveness(failure: SideFailure) -> bool:
    """A hang, or the simulator's report of mismatched collectives: both are the hook's
    *liveness* failure. Real gloo hangs, aborts or mixes data on a mismatch (docs/gloo-facts.md
    §6), and whether a racy hook (callbacks on worker threads posting collectives while the
    hook posts others) first meets a deadlock or a mismatch is timing, in real processes as
    in the simulator's threads — so the two agree with each other."""
    return failure.kind == "hung" or failure.error_type == "CollectiveMismatchError"


GLOO_ENFORCE = "gloo::EnforceNotMet"
"""What a gloo process that aborted on a mismatch printed (``terminate called after throwing
an instance of 'gloo::EnforceNotMet'``, docs/gloo-facts.md §6)."""


def aborted_on_mismatch(sim: SideFailure, real: SideFailure) -> bool:
    """The simulation reported mismatched collectives and real gloo aborted a rank's process
    on it: the same failure of the hook. Real gloo aborts (SIGABRT, ``gloo::EnforceNotMet``:
    ``Received data size doesn't match expected size``) where the ranks' buffers differ in
    bytes (docs/gloo-facts.md §6, measured). Narrow on purpose: the real rank *died* killed
    by SIGABRT or with gloo's enforce message in its output; any other death, or any other
    simulated failure, is still compared as ever.

    >>> mismatch = SideFailure("raised", 0, "CollectiveMismatchError", "mismatched collectives on WORLD")
    >>> aborted_on_mismatch(mismatch, SideFailure("died", 0, "died", "rank 0 was killed by SIGABRT while in …"))
    True
    >>> aborted_on_mismatch(mismatch, SideFailure("died", 0, "died", "rank 0 was killed by SIGKILL while in …"))
    False
    """
    if sim.error_type != "CollectiveMismatchError" or real.kind != "died":
        return False
    return "killed by SIGABRT" in real.message or GLOO_ENFORCE in real.detail


def hung_where_gloo_aborted(sim: SideFailure, real: SideFailure) -> bool:
    """The simulation hung and real gloo aborted a rank on mismatched collectives (its output
    holds gloo's enforce message: SIGABRT alone is not enough here): the same liveness failure
    of a racy hook, met as a deadlock on one side and a mismatch on the other (:func:`_liveness`
    says why those agree). An EF21 PowerSGD hook from the wild (round 13) went either way from
    run to run under load, and each hang was called a FIDELITY BUG.

    >>> hang = SideFailure("hung", -1, "hung", "a rank hung: the simulation did not return within 60 s")
    >>> hung_where_gloo_aborted(hang, SideFailure("died", 1, "died", "rank 1 was killed by SIGABRT", detail=GLOO_ENFORCE))
    True
    >>> hung_where_gloo_aborted(hang, SideFailure("died", 1, "died", "rank 1 was killed by SIGABRT"))
    False
    """
    return sim.kind == "hung" and real.kind == "died" and GLOO_ENFORCE in real.detail


def root_error(failure: SideFailure) -> str:
    """The innermost exception type a failure's message names (DDP wraps a callback's
    ``IndexError`` as ``RuntimeError: Got the following error when running the callback:
    IndexError: ...``), else its own type."""
    return innermost_error(failure.message) or failure.error_type


def _call_differences(sim: Side, real: Side, world_size: int, failed_at: float = math.inf) -> list[str]:
    """Each rank's hook calls on both sides, for the ranks whose record both have.

    Sides that finished (``failed_at`` infinite) must have made the same calls. For two
    sides that both raised, ``failed_at`` is the earliest failing step: every call of a
    step before it must match exactly (both sides finished those steps). From that step
    on, where each side stopped is a matter of timing (a peer's failure reaches a rank
    sooner or later, in the simulation's threads as between real processes), so one record
    may be shorter — but the calls both made must be the same: the first call that differs
    is a disagreement.
    """
    out = []
    for r in range(world_size):
        if not (sim.knows_calls(r) and real.knows_calls(r)):
            continue
        a, b = sim.calls.get(r, []), real.calls.get(r, [])
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None and len(a) != len(b):
            shorter = a if len(a) < len(b) else b
            longer = b if shorter is a else a
            k = len(shorter) if longer[len(shorter)][0] < failed_at else None
        if k is not None:
            out.append(f"rank {r} hook call #{k}: sim {_call(a, k)} vs real {_call(b, k)}")
    return out


def _call(calls: list[HookCall], k: int) -> str:
    if k >= len(calls):
        return "no call"
    step, index, last, params = calls[k]
    return f"step {step} bucket {index}{' (last)' if last else ''} params {list(params)}"


def _grad_differences(sim: Side, real: Side, scenario: Scenario) -> list[str]:
    from simcluster.real.differential import compare_outcomes

    out = []
    for k in range(scenario.steps):
        for r in range(scenario.world_size):
            for i, (a, b) in enumerate(zip(sim.grads[k][r], real.grads[k][r])):
                if a is None or b is None:
                    detail = None if a is None and b is None else f"sim {'None' if a is None else 'a tensor'} " \
                                                                 f"vs real {'None' if b is None else 'a tensor'}"
                else:
                    detail = compare_outcomes(a, b)
                if detail is not None:
                    out.append(f"step {k} rank {r} param {i} grad: {detail.replace(' vs gloo ', ' vs real ')}")
    return out


def _param_differences(sim: Side, real: Side, scenario: Scenario) -> list[str]:
    """Every step's and rank's parameter values (:attr:`Side.params`), bitwise, as
    :func:`_grad_differences` compares the gradients: ``step K rank R param I value: element
    … sim … (bits) vs real … (bits)``. A side that finished without a record of a step's
    parameters differs (no silent pass on a record that was never made)."""
    from simcluster.real.differential import compare_outcomes

    out = []
    for k in range(scenario.steps):
        for r in range(scenario.world_size):
            a, b = _params_at(sim, k, r), _params_at(real, k, r)
            if a is None or b is None:
                if a is not None or b is not None:
                    out.append(f"step {k} rank {r} params: sim {'not recorded' if a is None else 'recorded'} "
                               f"vs real {'not recorded' if b is None else 'recorded'}")
                else:
                    out.append(f"step {k} rank {r} params: recorded on neither side")
                continue
            for i, (x, y) in enumerate(zip(a, b)):
                detail = compare_outcomes(x, y)
                if detail is not None:
                    out.append(f"step {k} rank {r} param {i} value: {detail.replace(' vs gloo ', ' vs real ')}")
            if len(a) != len(b):
                out.append(f"step {k} rank {r} params: sim {len(a)} parameters vs real {len(b)}")
    return out


def _params_at(side: Side, step: int, rank: int) -> list[torch.Tensor] | None:
    """``side``'s parameter values of ``rank`` after ``step``, or ``None`` if not recorded."""
    if step >= len(side.params) or rank >= len(side.params[step]):
        return None
    return side.params[step][rank]


def run_e2e(scenario: Scenario, hook: str, state: str = "none", *, backend: str = "gloo",
            timeout: float = 60.0, cluster: Any = None, start_method: str = "subprocess",
            isolate: Sequence[str] = ()) -> E2EResult:
    """Run ``scenario`` on real gloo processes (:func:`run_real`), then judge the simulator
    against them (:func:`judge_sides`). ``isolate``: modules both sides load per rank with
    the hook's (``--isolate``, :func:`per_process`)."""
    real = run_real(scenario, hook, state, timeout=timeout, cluster=cluster, start_method=start_method,
                    isolate=isolate)
    return judge_sides(scenario, hook, state, real, backend=backend, timeout=timeout, isolate=isolate)


def judge_sides(scenario: Scenario, hook: str, state: str, real: Side, *, backend: str = "gloo",
                timeout: float = 60.0, isolate: Sequence[str] = ()) -> E2EResult:
    """The verdict on a real run: simulate the same scenario (:func:`run_sim`) and compare
    (:func:`compare`); where only the real side hung or died, the simulator is first asked
    whether another order of completions meets the same trouble (:func:`race_reached`) before
    it is blamed. The one judge of both real runners — gloo processes here (:func:`run_e2e`)
    and torchrun's rank 0 (:mod:`simcluster.real.e2e_torchrun`)."""
    isolate = tuple(isolate)
    sim = run_sim(scenario, hook, state, backend=backend, timeout=timeout, isolate=isolate)
    result = compare(scenario, hook, sim, real)
    result.isolate = isolate
    if result.verdict == "fidelity bug" and _only_real_stalled(sim, real):
        reached = race_reached(scenario, hook, state, backend=backend, timeout=timeout, isolate=isolate)
        if reached is not None:
            seed, failure = reached
            why = RACE_REACHED.format(real=real.name, kind=real.failure.kind,  # type: ignore[union-attr]
                                      error=failure.error_type, seed=seed, line=failure.line())
            return E2EResult(scenario, hook, sim, result.real, result.differences, "unconfirmed", why, isolate)
    return result


RACE_TRIES = 32
"""How many seeded random orders of completions :func:`race_reached` tries."""
RACE_REACHED = ("{real} {kind} where this simulation finished every step, and the DDP model meets {error} on the "
                "same scenario under another order of completions (schedule random(seed={seed}): {line}): the "
                "hook's race, decided by timing on the real backend too — not confirmed this run")
_STALLS = ("CollectiveMismatchError", "DeadlockError")


def _only_real_stalled(sim: Side, real: Side) -> bool:
    """Real gloo hung or a rank died (a mismatch aborts gloo) where the simulation finished."""
    return sim.failure is None and real.failure is not None and real.failure.kind in ("hung", "died")


def race_reached(scenario: Scenario, hook: str, state: str = "none", *, backend: str = "gloo",
                 timeout: float = 60.0, isolate: Sequence[str] = ()) -> tuple[int, SideFailure] | None:
    """The first of :data:`RACE_TRIES` seeded random orders of completions under which the
    DDP model (SimDDP) meets a collective mismatch or a deadlock on ``scenario``: ``(seed,
    failure)``, or ``None``. A hook posting collectives from callbacks on gloo's worker threads
    races (docs/e2e.md): real gloo can hang on one run where the simulation's one order
    finished, which is no evidence against the simulator when another order meets it too.
    Supervised: a hook that hangs here gives ``None``."""
    from simcluster.checking.supervisor import run_supervised

    outcome = run_supervised(lambda monitor: _search_orders(scenario, hook, state, backend, isolate, monitor),
                             deadline=timeout)
    return outcome.value if outcome.death is None and outcome.error is None else None


def _search_orders(scenario: Scenario, hook: str, state: str, backend: str, isolate: Sequence[str],
                   monitor: Any) -> tuple[int, SideFailure] | None:
    from simcluster.engine.scheduler import SeededRandom

    os.environ.pop(REAL_SIDE_ENV, None)  # this child is a simulation, even in torchrun's rank 0
    monitor.begin({"scenario": scenario.describe(), "search": "orders of completions"})
    hook_fn, _ = load_hook_and_state(hook, state)
    found = None
    for seed in range(RACE_TRIES):
        side = run_model(scenario, *per_process(hook, state, isolate), backend=backend, inspect=hook_fn,
                         schedule=SeededRandom(seed))
        if side.failure is not None and side.failure.error_type in _STALLS:
            found = (seed, side.failure)
            break
    monitor.end()
    return found


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `simcluster e2e TARGET` (simcluster.real.e2e_cli)")
