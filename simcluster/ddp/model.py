"""``SimDDP``: DDP's backward-time bucket reduction, simulated on a :class:`SimCluster`.

One :meth:`SimDDP.step` is what one ``loss.backward()`` under
``DistributedDataParallel`` does with a communication hook, on every rank at once:

1. **Layout.** The buckets of this iteration come from :mod:`simcluster.ddp.layout`:
   iteration 0 has one bucket in ``model.parameters()`` order; from iteration 1
   (``static_graph``: 2) DDP rebuilds them in gradient-ready order under the cap;
   ``find_unused_parameters`` applies the cap from iteration 0 and never rebuilds.
2. **Hook calls.** Each step starts with every ``p.grad`` None (the training loop's
   ``zero_grad(set_to_none=True)``, torch's default); the gradients then become ready in
   the ready order, each setting its ``p.grad`` (with ``gradient_as_bucket_view``, the
   bucket's view, the same object every step after the rebuild). Each rank builds a
   *fresh* bucket per call (its gradients packed without gaps, into the buffer kept from
   the last step) and calls ``hook(state, bucket)`` for every bucket in index order, once
   that bucket and every lower one are ready, ``is_last()`` only on the highest index —
   so a hook sees ``p.grad`` None for a gradient not ready yet, as in real DDP (measured:
   ``benchmarks/measure_gloo_facts.py census``). Under the in-order schedule every rank
   calls *all* its hooks before any collective completes — several buckets in flight, as
   in a backward pass that outruns the network — then the scheduler completes them in its
   (seeded) order. On the gloo model other schedules let a collective complete, and its
   callbacks run, between two hook calls of a rank (its backward pass pauses where
   something else could happen: ``Engine.go_on_later``), as gloo's worker does while the
   autograd thread goes on; the NCCL model never does.
3. **Copy-back.** At the end of ``backward()`` DDP's reducer waits on each bucket's
   future in turn and copies what it holds into ``p.grad`` (:class:`_Finalize`) — at once
   for a future already complete, before any collective completes; for a pending one, once
   it completes, when the scheduler picks — with its own rules and traps (measured on torch
   2.13, gloo; see ``docs/ddp-facts.md``, "Copy-back" and "A collective the hook's future
   does not wait for"):

   * a tensor of any dtype and shape is read as the flat run of its *storage* from
     element 0: parameter ``k`` gets ``result.as_strided((numel_k,), (1,), offset_k)``
     cast to ``p.dtype``. So fp16/bf16/float64/int64 results are cast silently, a
     ``(1, n)`` result or a longer one works — and a **non-contiguous or offset view is
     accepted with wrong gradients** (DDP reads the storage, not the view);
   * a storage too short for the bucket → ``setStorage: ... out of bounds ...``;
   * ``[tensor]`` / ``(tensor,)`` (the PyTorch 1.8 contract; accepted with
     ``api="legacy"``), ``set_exception(e)`` or any other object →
     ``Unable to cast <it> to Tensor``; ``None`` → ``Expected a proper Tensor but got None…``;
   * an exception inside a ``then`` callback → the future's error
     (``Got the following error when running the callback: …``);
   * a hook returning a non-Future fails at once on that rank (a pybind cast error;
     returning ``None`` crashes real DDP with SIGSEGV).

   These raise :class:`CopyBackError` (a :class:`HookContractError` and a
   ``RuntimeError``, like real DDP's) — a ``then`` callback's exception
   :class:`CallbackError` (a ``RuntimeError`` too, but the hook's own failure, not DDP's
   contract) — whose message starts with real DDP's text and names the rank, bucket,
   iteration and replay line; the rules live in :mod:`simcluster.fake.reducer`. A hook
   that raises is re-raised as itself, with those as notes.

Hook state (``state=None | "group" | factory(process_group)``) is made once per rank,
inside the first step, and kept across steps, as DDP keeps it. Like DDP's constructor,
``SimDDP`` gives every rank the parameter values of its group's rank 0.

>>> import torch
>>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
>>> ddp = SimDDP(SimCluster(2, seed=0), allreduce_hook, [(2,), (3,)])
>>> step = ddp.step([[torch.ones(2), torch.ones(3)], [torch.zeros(2), torch.full((3,), 4.0)]])
>>> step.grads[1]
[tensor([0.5000, 0.5000]), tensor([2.5000, 2.5000, 2.5000])]
>>> step.bucket_params, ddp.step(step.grads).bucket_params   # iteration 0, then the rebuild
([[0, 1]], [[1, 0]])

Differs from real DDP: the gradients are inputs (no autograd, no forward); the
ready order is one fixed permutation (``DDPConfig.ready_order``); a failed step leaves
the simulation usable (real DDP's next iteration fails inside the reducer); on the NCCL
model the hooks of a step all run before any collective completes (on a GPU a collective
may finish while later hooks run: timing not measured here); then-callbacks run on the rank's own
thread (gloo's run on its worker threads); not modelled: unused parameters' gradients,
``no_sync``, sparse gradients, the ``set_grads_to_none`` path, a loop that does not zero
its gradients to None between steps, mixed-device models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from simcluster.fake.bucket import SimGradBucket, pack_bucket, packed_buffer, packing
from simcluster.fake.collectives import bits_equal
from simcluster.fake.backends import BackendModel
from simcluster.fake.cluster import SimCluster
from simcluster.fake.reducer import (call_hook, check_future, copy_bucket, expect_future, layout_copy, resolved,
                                     returned_lines)
from simcluster.errors import (
    CallbackError, CopyBackError, DeadlockError, InFlightReadError, SimClusterError, UsageError, add_context_note,
    innermost_error, launcher_environment_note,
)
from simcluster.names import callable_name
from simcluster.ddp.layout import BucketCall, bucket_calls, ready_order_of, rebuild_iteration
from simcluster.fake.process_group import SimProcessGroup
from simcluster.fake.state import LayoutModel, StateSpec
from simcluster.usercode.rank_local import as_rank_local
from simcluster.engine.trace import Completed, CopiedBack, Trace
from simcluster.engine.matching import posted_at_lines, rank_list

__all__ = ["DDPConfig", "StepResult", "SimDDP", "CopyBackError", "subgroups", "gloo_gather_hint", "gather_source"]

@dataclass(frozen=True)
class DDPConfig:
    """The ``DistributedDataParallel`` options that change what a hook sees.

    ``ready_order``: the order in which the parameters' gradients become ready in the
    recorded iteration (iteration 0; 1 with ``static_graph``), as parameter indices;
    default reverse parameter order. ``api``: ``"current"`` (torch >= 1.10: the future
    must hold a tensor) or ``"legacy"`` (torch 1.8 contract: ``[tensor]`` is accepted
    too, and the bucket offers the 1.7–1.9 methods only).
    """

    bucket_cap_mb: float | None = None
    static_graph: bool = False
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    ready_order: tuple[int, ...] | None = None
    api: str = "current"

    def __post_init__(self) -> None:
        if self.api not in ("current", "legacy"):
            raise UsageError(f"DDPConfig(api={self.api!r}): use 'current' or 'legacy'")
        if not isinstance(self.gradient_as_bucket_view, bool):
            raise UsageError(f"DDPConfig(gradient_as_bucket_view={self.gradient_as_bucket_view!r}) must be a bool")


@dataclass
class StepResult:
    """One simulated backward pass.

    ``grads[r][i]``: rank ``r``'s ``p.grad`` of parameter ``i`` after the copy-back (a copy
    where ``p.grad`` views a bucket buffer, which the next step refills, as DDP does).
    ``bucket_params[k]``: parameter indices of bucket ``k`` (buffer order).
    ``outputs[r][k]``: what rank ``r``'s future for bucket ``k`` resolved to (likewise kept
    apart from the buffers, with the same storage layout).
    ``warnings``: results DDP accepted but read differently from what the view shows.
    ``future_labels[r][k]``: the label of the future rank ``r``'s hook returned for bucket ``k``
    (what it derives from: ``"then(aggregate) of all_gather#0 on WORLD"``).
    ``params[r][i]``: rank ``r``'s parameter ``i`` after the step (a copy), recorded only
    when some rank's parameters changed in place during the step — a hook that steps an
    optimizer (``p._version`` moved); ``None`` otherwise, and then every replica still holds
    the parameters DDP broadcast.
    """

    iteration: int
    grads: list[list[torch.Tensor]]
    bucket_params: list[list[int]]
    outputs: list[list[Any]]
    trace: Trace
    schedule: list[int]
    warnings: list[str] = field(default_factory=list)
    params: list[list[torch.Tensor]] | None = None
    future_labels: list[list[str]] = field(default_factory=list)
    replay_fn: Callable[[], str] = field(repr=False, compare=False, default=lambda: "")

    @property
    def replay(self) -> str:
        """A constructor call replaying the cluster up to the end of this step (built on demand:
        it lists every schedule choice the cluster made, so built at every step it made a long
        run quadratic — 1.2 ms a step after 300 steps at world 4)."""
        return self.replay_fn()


def subgroups(*member_lists: Sequence[int]) -> Callable[[int], SimProcessGroup]:
    """A ``process_group_factory`` splitting the world into groups, e.g.
    ``subgroups([0, 1], [2, 3])``: every rank creates every group, in the given order
    (as ``dist.new_group`` requires on a real cluster), and DDP uses its own."""
    groups = [sorted(m) for m in member_lists]

    def factory(rank: int) -> SimProcessGroup:
        mine = None
        for members in groups:
            pg = dist.new_group(members)
            if rank in members:
                mine = pg
        if mine is None:
            raise UsageError(f"subgroups{tuple(groups)}: rank {rank} is in none of the groups")
        return mine

    return factory


def _apart_from(value: Any, buffers: dict[Any, torch.Tensor]) -> Any:
    """``value`` as it is now, for a step's result: a tensor sharing storage with one of
    ``buffers`` (a rank's bucket buffers, which the next step overwrites, as DDP's do) is
    copied with its storage layout (:func:`~simcluster.fake.reducer.layout_copy`), so the
    contract's storage checks read it as they read the original; lists are walked."""
    if isinstance(value, (list, tuple)):
        return type(value)(_apart_from(v, buffers) for v in value)
    if not isinstance(value, torch.Tensor) or not buffers:
        return value
    ptr = value.untyped_storage().data_ptr()
    if all(b.untyped_storage().data_ptr() != ptr for b in buffers.values()):
        return value
    return layout_copy(value)


def _reducer_wait(iteration: int, bucket_index: int) -> str:
    """How a report names DDP's reducer waiting on a hook's future: ``DDP's reducer (iteration 0, bucket 1)``."""
    return f"DDP's reducer (iteration {iteration}, bucket {bucket_index})"


_INDEXED_PAST_ITS_SHAPE = ("out of bounds", "out of range", "too many indices", "invalid index of a 0-dim tensor")
"""What torch says when a tensor (or list) is indexed beyond its shape — what reading rank 0's
part as the gathered whole leads to (torch's quantization hooks: ``too many indices for tensor
of dimension 2``, ``invalid index of a 0-dim tensor``). Other IndexErrors (``tensors used
as indices must be long, int, byte or bool tensors``: a float index tensor, a deep gradient
compression hook from the wild, round 9) have nothing to do with the gather's shape."""


def gloo_gather_hint(future: Any, backend: BackendModel, error: BaseException | None = None) -> str:
    """The one-line hint for a hook result that failed where a gather read as NCCL's may be
    why (``""`` when not): the hook's future derives from an ``all_gather`` /
    ``all_gather_into_tensor`` (its label names the chain's source) on a backend whose gather
    future holds one tensor per rank — gloo: ``[outs[0], …, outs[W-1]]`` at every world size,
    1 included (measured: ``benchmarks/measure_gloo_facts.py gather``, docs/gloo-facts.md §1) —
    so ``value()[0]`` is rank 0's part, not the gathered whole NCCL's ``[flat]`` is.

    ``error``: the future's own error (a ``then`` callback raised): hinted when the innermost
    error it names is an ``IndexError`` past a shape (:data:`_INDEXED_PAST_ITS_SHAPE`) — the
    whole indexed by rank, as torch's quantization hooks index ``fut.wait()[0][rank][0]``. ``None``: DDP could not copy the result (too short).
    """
    said = gather_source(getattr(future, "label", ""), backend)
    if not said:
        return ""
    hint = f"simcluster: hint: {said}"
    if error is None:
        return hint
    first = str(error).strip().partition("\n")[0]
    if innermost_error(first) == "IndexError" and any(words in first for words in _INDEXED_PAST_ITS_SHAPE):
        return (f"{hint} (at every world size, 1 included): indexing it by rank as the whole (value()[0][rank][...], "
                "as torch's quantization hooks do) raises IndexError (docs/gloo-facts.md §1)")
    return ""


def gather_source(label: str, backend: BackendModel) -> str:
    """What a hook's future labelled ``label`` holds when it derives from a gather on a backend
    whose gather future holds one tensor per rank (``""`` when it does not):
    ``"the hook's future comes from all_gather#0 on WORLD; on gloo that future holds … —
    value()[0] is rank 0's part, not the gathered whole"`` (:func:`gloo_gather_hint`'s words;
    the checker adds them to a *contract* failure of such a result)."""
    if backend.gather_as_flat or not label:
        return ""
    source = label.rsplit(" of ", 1)[-1]
    if source.startswith("all_gather_into_tensor#"):
        held = "[v0, …, v(W-1)], one view of the output tensor per rank, not [output] as on NCCL"
    elif source.startswith("all_gather#"):
        held = "the W output tensors themselves, [outs[0], …, outs[W-1]], not [flat output] as on NCCL"
    else:
        return ""
    return (f"the hook's future comes from {source}; on {backend.name} that future holds {held} "
            "— value()[0] is rank 0's part, not the gathered whole")


class SimDDP:
    """DDP over ``cluster`` with ``hook`` registered, one :meth:`step` per backward.

    ``param_shapes`` (every rank gets zero Parameters of ``dtype`` with these shapes)
    or ``parameters[r]`` (rank ``r``'s own Parameters, same shapes and dtypes on every
    rank). ``state``: ``None``, ``"group"`` (the rank's DDP process group) or a factory
    ``factory(process_group)`` or ``factory(process_group, model)`` (``model``: a
    :class:`~simcluster.fake.state.LayoutModel` of the rank's parameters; see
    :mod:`simcluster.fake.state`), called once per rank inside the first step.
    ``process_group_factory(rank)``: DDP on a subgroup (see :func:`subgroups`), called
    once per rank inside the first step; default the whole world. With ``state=None``
    torch's hooks then fall back to ``dist.group.WORLD`` — as on a real cluster.

    ``hook`` (and a state factory) given as a callable share their module with every
    simulated rank: module globals — counters, residual dicts, module-level RNG objects —
    are then *not* per rank. Give a ``"file.py:name"`` / ``"module:name"`` spec (or a
    :class:`~simcluster.usercode.rank_local.RankLocal`) for full isolation: each rank calls its own
    copy of the module, fresh for every :class:`SimCluster`.
    """

    def __init__(
        self,
        cluster: SimCluster,
        hook: Callable[[Any, Any], Any],
        param_shapes: Sequence[tuple[int, ...]] | None = None,
        *,
        parameters: Sequence[Sequence[torch.nn.Parameter]] | None = None,
        state: Any = None,
        config: DDPConfig = DDPConfig(),
        dtype: torch.dtype = torch.float32,
        process_group_factory: Callable[[int], Any] | None = None,
    ) -> None:
        if not isinstance(cluster, SimCluster):
            raise UsageError(f"cluster={cluster!r} must be a SimCluster")
        hook = as_rank_local(hook)
        if not callable(hook):
            raise UsageError(f"hook={hook!r} is not callable")
        if not isinstance(config, DDPConfig):
            raise UsageError(f"config={config!r} must be a DDPConfig")
        self.cluster, self.hook, self.config = cluster, hook, config
        self.state_spec = StateSpec.parse(state)
        self.process_group_factory = process_group_factory
        self.on_hook_call: Callable[[int, int, int], None] | None = None
        """Called as ``(rank, iteration, bucket index)`` before every hook call (the
        supervisor uses it to say where a hook that never returns was)."""
        self.params = _make_params(cluster.world_size, param_shapes, parameters, dtype)
        self.iteration = 0
        self.groups: list[Any] = [None] * cluster.world_size
        self.states: list[Any] = [None] * cluster.world_size
        self._buffers: list[dict[tuple[int, tuple[int, ...]], torch.Tensor]] = [{} for _ in range(cluster.world_size)]
        """Each rank's bucket buffers, kept from one iteration to the next as DDP keeps them
        (a hook holding last step's ``bucket.buffer()`` sees this step's gradients in it);
        new ones from the rebuild on (:meth:`_buffer_generation`)."""
        self._views: list[dict[int, torch.Tensor]] = [{} for _ in range(cluster.world_size)]
        """With ``gradient_as_bucket_view``: each rank's ``p.grad`` view of its bucket buffer, by
        parameter index, kept with the buffers — real DDP gives ``p.grad`` the same view object
        every iteration after the rebuild (measured)."""
        self._initial = _sync_module_states(self.params, process_group_factory)
        self._versions: list[list[int]] = [[p._version for p in ps] for ps in self.params]
        """Each rank's parameters' in-place version counters after its last step (or its
        set-up): a hook that updates a parameter moves one (:attr:`StepResult.params`)."""
        for it in range(3):  # validates caps and ready_order now, not mid-run
            self.layout(it)

    # -- layout -----------------------------------------------------------------
    def layout(self, iteration: int | None = None) -> list[BucketCall]:
        """The hook calls of ``iteration`` (default: the next one), in call order."""
        c = self.config
        return bucket_calls(
            self.params[0], iteration=self.iteration if iteration is None else iteration,
            bucket_cap_mb=c.bucket_cap_mb, static_graph=c.static_graph,
            find_unused_parameters=c.find_unused_parameters,
            ready_order=None if c.ready_order is None else list(c.ready_order),
        )

    # -- stepping ---------------------------------------------------------------
    def run(self, grads_per_step: Sequence[Sequence[Sequence[torch.Tensor]]]) -> list[StepResult]:
        """:meth:`step` once per entry of ``grads_per_step``."""
        return [self.step(grads) for grads in grads_per_step]

    def step(self, grads: Sequence[Sequence[torch.Tensor]]) -> StepResult:
        """One backward pass: ``grads[r][i]`` is rank ``r``'s local gradient of parameter ``i``.

        Raises what real DDP's ``backward()`` would (see the module docstring). The
        iteration counter advances even when the step fails, as DDP's does.
        """
        local = self._check_grads(grads)
        it, calls = self.iteration, self.layout()
        world = self.cluster.world_size
        futures: list[list[Any]] = [[] for _ in range(world)]
        finals: list[_Finalize | None] = [None] * world
        bucket_api = "legacy" if self.config.api == "legacy" else "current"

        def rank_fn(rank: int) -> None:
            self._backward_on_rank(rank, it, calls, local[rank], futures[rank], finals, bucket_api=bucket_api)

        try:
            result = self.cluster.run(rank_fn)
        except BaseException as exc:
            if isinstance(exc, DeadlockError) and (
                    lines := returned_lines(futures, lambda k: _reducer_wait(it, calls[k].index))):
                add_context_note(exc, "\n".join(lines))
            add_context_note(exc, f"simcluster: in SimDDP.step, DDP iteration {it}")
            raise
        finally:
            self.iteration += 1
        grads_out, outputs, warnings = self._copy_back(finals, result.replay_fn)
        return StepResult(
            iteration=it, grads=grads_out, bucket_params=[list(c.params) for c in calls], outputs=outputs,
            trace=result.trace, schedule=result.schedule, replay_fn=result.replay_fn, warnings=warnings,
            params=self._moved_params(),
            future_labels=[[getattr(f, "label", "") for f in rank_futures] for rank_futures in futures],
        )

    def _moved_params(self) -> list[list[torch.Tensor]] | None:
        """A copy of every rank's parameters if any changed in place since the last step, else ``None``."""
        versions = [[p._version for p in ps] for ps in self.params]
        if versions == self._versions:
            return None
        self._versions = versions
        return [[p.detach().clone() for p in ps] for ps in self.params]

    def _backward_on_rank(self, rank: int, it: int, calls: list[BucketCall], local: list[torch.Tensor],
                          futures: list[Any], finals: "list[_Finalize | None]", *, bucket_api: str) -> None:
        """Rank ``rank``'s part of one backward pass: set up its state on first use, let the
        gradients become ready in the ready order and call the hook for each bucket once it
        is ready (``futures`` gets what each call returned), then start DDP's
        ``finalize_backward`` on them (:class:`_Finalize`, put in ``finals[rank]``), which
        copies each bucket's result back once its future completes. ``bucket_api`` (the
        buckets' API) is the same for every rank: :meth:`step` works it out once per backward.

        Between two hook calls the rank pauses where completions may come first
        (:meth:`~simcluster.engine.inline.Engine.go_on_later`): on a real rank the autograd
        thread launches bucket k+1 while gloo's worker may already have completed bucket k's
        collective and run its callbacks — state those callbacks change is then seen by the
        next hook call on some ranks and not on others (round 24 of hooks from the wild: a
        counter advanced in callbacks picked each bucket's dtype, and real gloo aborted on
        the mismatched sizes; the model, calling every hook before any completion, missed it)."""
        if self.groups[rank] is None:
            self._init_rank(rank)
        state, params = self.states[rank], self.params[rank]
        if it == self._buffer_generation():
            self._buffers[rank].clear()  # the rebuild allocates new buffers, whatever the new layout
            self._views[rank].clear()
        for p in params:  # the training loop's zero_grad(set_to_none=True), torch's default
            p.grad = None
        ready = _ReadyGradients(self, rank, calls, local, bucket_api)

        def launch(start: int) -> None:
            """The hook calls from bucket position ``start`` on, then the finalize."""
            for pos in range(start, len(calls)):
                engine = self.cluster.engine
                if pos > start and engine is not None and engine.go_on_later(
                        rank, lambda pos=pos: launch(pos), f"rank {rank}'s code"):
                    return
                futures.append(self._call_hook(rank, it, calls, pos, ready.launch(pos), state))
            finalize = _Finalize(self, rank, it, calls, futures)
            finals[rank] = finalize
            finalize.run()

        launch(0)

    def _call_hook(self, rank: int, it: int, calls: list[BucketCall], pos: int, bucket: SimGradBucket,
                   state: Any) -> Any:
        """Call the hook for bucket position ``pos`` on ``rank`` and check what it returned."""
        call = calls[pos]
        where = f"DDP iteration {it}, bucket {call.index} (hook call {pos + 1} of {len(calls)})"
        if self.on_hook_call is not None:
            self.on_hook_call(rank, it, call.index)
        engine = self.cluster.engine
        if engine is not None and engine.posting_lines:  # a reported run: posts say which hook call made them
            engine.doing[rank] = f"in DDP iteration {it}, bucket {call.index}'s hook call"
        try:
            future = call_hook(self.hook, state, bucket)
        except Exception as exc:
            add_context_note(exc, f"simcluster: raised by hook {callable_name(self.hook)} on rank {rank}, {where}")
            if (launcher := launcher_environment_note(exc)) is not None:
                add_context_note(exc, launcher)
            raise
        if engine is not None and engine.posting_lines:
            engine.doing.pop(rank, None)
        check_future(future, self.hook, rank, where, self.config.api)
        return future

    def _buffer_generation(self) -> int | None:
        """The first iteration whose buckets get new buffers: the rebuild's (measured: the
        buffers of iteration 0 are replaced at iteration 1 even when the layout is the same,
        and kept from then on, ``docs/ddp-facts.md``); None when DDP never rebuilds."""
        c = self.config
        return rebuild_iteration(static_graph=c.static_graph, find_unused_parameters=c.find_unused_parameters)

    # -- per-rank set-up ----------------------------------------------------------
    def _init_rank(self, rank: int) -> None:
        if self.process_group_factory is None:
            group = self.cluster.process_group(rank)
        else:
            group = self.process_group_factory(rank)
            if not isinstance(group, SimProcessGroup) or rank not in group.spec.ranks:
                raise UsageError(
                    f"process_group_factory({rank}) returned {group!r}; it must return a simulated process "
                    "group this rank belongs to (create it with dist.new_group inside the factory)"
                )
        self.groups[rank] = group
        if self._initial is not None:  # DDP's constructor broadcasts group rank 0's parameters
            with torch.no_grad():
                for p, source in zip(self.params[rank], self._initial[group.spec.ranks[0]]):
                    p.copy_(source)
            self._versions[rank] = [p._version for p in self.params[rank]]  # the broadcast is DDP's, not the hook's
        self.states[rank] = self.state_spec.resolve(group, lambda: LayoutModel(self.params[rank]))

    # -- copy-back ----------------------------------------------------------------
    def _copy_back(self, finals: "list[_Finalize | None]",
                   replay: Callable[[], str]) -> tuple[list[list[torch.Tensor]], list[list[Any]], list[str]]:
        """Every rank's gradients, futures' values and warnings as its :class:`_Finalize` left
        them; raises the lowest failing rank's error (the others' as notes)."""
        grads: list[list[torch.Tensor]] = []
        outputs: list[list[Any]] = []
        warnings: list[str] = []
        errors: list[tuple[int, BaseException]] = []
        for rank, final in enumerate(finals):
            assert final is not None and final.grads is not None, "a run that ended had every rank finalize"
            grads.append(final.grads)
            outputs.append(final.outputs)
            warnings.extend(final.warnings)
            error = final.error or final.read_too_early()
            if error is not None:
                errors.append((rank, error))
        if errors:
            rank, exc = errors[0]
            for other, other_exc in errors[1:]:
                add_context_note(exc, f"simcluster: rank {other} also failed: {other_exc}")
            raised = [r for r, _ in errors]
            went_on = [r for r in range(len(finals)) if r not in raised]
            if went_on and isinstance(exc, CallbackError):
                failed = f"rank {raised[0]}'s" if len(raised) == 1 else f"ranks {rank_list(raised)}'"
                done = f"rank {went_on[0]}" if len(went_on) == 1 else f"ranks {rank_list(went_on)}"
                add_context_note(exc, f"simcluster: {done} "
                                      f"completed this step: on a real cluster {failed} backward() raises this "
                                      "while the others go on to their next collective and wait there")
            if isinstance(exc, SimClusterError):
                exc.with_replay(replay())
            raise exc
        return grads, outputs, warnings

    # -- validation ---------------------------------------------------------------
    def _check_grads(self, grads: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        if len(grads) != self.cluster.world_size:
            raise UsageError(f"grads has {len(grads)} entries; the cluster has {self.cluster.world_size} ranks")
        out = []
        for rank, (rank_grads, params) in enumerate(zip(grads, self.params)):
            if isinstance(rank_grads, torch.Tensor) or len(rank_grads) != len(params):
                raise UsageError(f"grads[{rank}] must hold one tensor per parameter ({len(params)})")
            for i, (g, p) in enumerate(zip(rank_grads, params)):
                if not isinstance(g, torch.Tensor) or g.shape != p.shape or g.dtype != p.dtype:
                    got = f"shape={tuple(g.shape)}, dtype={g.dtype}" if isinstance(g, torch.Tensor) else repr(g)
                    raise UsageError(
                        f"grads[{rank}][{i}] ({got}) must match parameter {i}: shape={tuple(p.shape)}, dtype={p.dtype}"
                    )
            out.append([g.detach() for g in rank_grads])
        return out


def _hinted(exc: BaseException, hint: str) -> None:
    """Add ``hint`` (a one-line note) to ``exc`` unless it is empty."""
    if hint:
        add_context_note(exc, hint)


def _sync_module_states(params: list[list[torch.nn.Parameter]],
                        process_group_factory: Callable[[int], Any] | None) -> list[list[torch.Tensor]] | None:
    """DDP's constructor broadcasts the parameters of its group's rank 0 to every rank
    (measured: rank 1's parameters hold rank 0's values from the first hook call on,
    ``benchmarks/measure_gloo_facts.py census``). On the whole world that is done here, at
    once; with ``process_group_factory`` the groups exist only inside the first step, so the
    values are kept (returned) and copied as each rank learns its group."""
    if process_group_factory is not None:
        return [[p.detach().clone() for p in ps] for ps in params]
    with torch.no_grad():
        for ps in params[1:]:
            for p, source in zip(ps, params[0]):
                p.copy_(source)
    return None


class _Finalize:
    """DDP's ``finalize_backward`` on one rank, as the reducer runs it at the end of
    ``backward()``: for each bucket in order, wait on the future the hook returned, then copy
    what it holds into the parameters' ``.grad`` (:func:`~simcluster.fake.reducer.copy_bucket`);
    once the last bucket is copied, the gradients are what the optimizer reads.

    Nothing blocks: a future already complete is copied at once, in the rank's code right
    after its last hook call — before any collective the hook posted but did not tie to that
    future completes, as on real gloo, where DDP does not wait for those (a hook that returns a
    completed future of its bucket while the all_reduce writing into it is still in flight
    hands DDP the values from before the reduction: measured, docs/ddp-facts.md; until round
    22 of hooks from the wild the copy-back ran only after every collective had completed and
    such a hook passed). A pending future is waited on as the engine's ``expect`` (one that
    never completes is a deadlock); once it completes, the copy runs when the scheduler picks
    it (:meth:`~simcluster.engine.inline.Engine.run_later`): after every other completion under
    the in-order schedule, earlier — while later buckets' collectives and callbacks are still to
    come — under others, as the reducer's thread and gloo's interleave on a real rank.

    ``grads``, ``outputs`` (each future's value, kept apart from the buffers DDP reuses),
    ``warnings`` and ``error`` (the first copy-back failure: the rank stops there) are filled
    in as it goes; ``grads`` is None until it is done."""

    def __init__(self, ddp: "SimDDP", rank: int, it: int, calls: list[BucketCall], futures: list[Any]) -> None:
        self.ddp, self.rank, self.it, self.calls, self.futures = ddp, rank, it, calls, futures
        self.outputs: list[Any] = []
        self.warnings: list[str] = []
        self.error: BaseException | None = None
        self.grads: list[torch.Tensor] | None = None
        self._next = 0  # the bucket to copy next
        self._left: Any = None
        """A collective still holding a bucket buffer in flight when ``backward()`` returned (or None)."""
        self._early: list[tuple[int, torch.Tensor, torch.Tensor, Any, Completed | None]] = []
        """(bucket, the tensor DDP read, its values then, the collective that had it in flight, a
        collective on its group posted after it that had completed by then, or None)."""
        engine = ddp.cluster.engine
        assert engine is not None, "finalize runs inside the step's run"
        self._engine = engine
        for call, future in zip(calls, futures):  # the reducer waits on every one: a pending one must complete
            expect_future(future, rank, _reducer_wait(it, call.index))

    def run(self) -> None:
        """Copy back every bucket whose future has completed, in order, up to the first pending
        one, which is then waited on (this runs again, as the rank's task, once it completes)."""
        ddp, rank = self.ddp, self.rank
        while self._next < len(self.futures) and self.error is None:
            future, call = self.futures[self._next], self.calls[self._next]
            if not future.done():
                future.on_done(lambda: self._engine.run_later(rank, self.run, "DDP's finalize_backward"))
                return
            self._next += 1
            where = f"rank {rank}, DDP iteration {self.it}, bucket {call.index}"
            label = str(getattr(future, "label", "") or "a torch Future simcluster did not make")
            try:
                try:
                    value = resolved(future, self.outputs, where, ddp.config.api)
                except (CopyBackError, CallbackError) as exc:  # a then-callback raised, or the future errored
                    self._engine.trace.log((CopiedBack, (rank, call.index, label, True)))
                    _hinted(exc, gloo_gather_hint(future, ddp.cluster.backend, exc))
                    raise
                except SimClusterError:
                    self._engine.trace.log((CopiedBack, (rank, call.index, label, True)))
                    raise
                self._engine.trace.log((CopiedBack, (rank, call.index, label, False)))
                self._note_if_in_flight(value, call.index)
                params = [ddp.params[rank][i] for i in call.params]
                self._note_writes_in_flight(value, params, call.index)
                try:
                    copy_bucket(value, params, ddp.config.gradient_as_bucket_view, where, self.warnings)
                except CopyBackError as exc:
                    _hinted(exc, gloo_gather_hint(future, ddp.cluster.backend))
                    raise
                finally:
                    self.outputs[-1] = _apart_from(self.outputs[-1], ddp._buffers[rank])
            except (CopyBackError, SimClusterError) as exc:
                self.error = exc
        kept = ddp._buffers[rank] if ddp.config.gradient_as_bucket_view else {}  # p.grad views them
        self.grads = [_apart_from(p.grad, kept) for p in ddp.params[rank]]
        if self.error is None:
            self._note_left_in_flight()

    def _note_left_in_flight(self) -> None:
        """``backward()`` returns on this rank now: a collective it posted that is still in flight
        and holds one of DDP's bucket buffers — which DDP fills with the next iteration's
        gradients while the collective still reads and writes it — is remembered for
        :meth:`read_too_early` (a group of one rank moves no data: no race)."""
        self._left = next((call for call in self._holding(self.ddp._buffers[self.rank].values())
                           if len(call.ranks) > 1), None)

    def _holding(self, tensors: Iterable[torch.Tensor]) -> Iterator[Any]:
        """This rank's calls not completed yet (oldest first) that hold one of ``tensors``' memory in flight."""
        tensors = list(tensors)
        for call in self._engine.open_calls(self.rank):
            if call.in_flight is not None and any(call.in_flight.holds(t) for t in tensors):
                yield call

    def _note_if_in_flight(self, value: torch.Tensor, bucket: int) -> None:
        """If a collective this rank posted, not completed yet, holds ``value``'s memory in
        flight, DDP copies it back now, before the collective writes its result: remember
        what DDP read, for :meth:`read_too_early` to compare once the step has run."""
        call = next(self._holding([value]), None)
        if call is not None:
            later = next((e for e in self._engine.trace.events if isinstance(e, Completed)
                          and e.group == call.channel and e.seq > call.seq), None)
            self._early.append((bucket, value, value.clone(), call, later))

    def _note_writes_in_flight(self, value: torch.Tensor, params: list[torch.nn.Parameter], bucket: int) -> None:
        """With ``gradient_as_bucket_view`` each ``p.grad`` is a view of the bucket's buffer, and
        the copy-back writes a result that is another tensor into it: a collective of this rank
        still holding that buffer in flight then sees a write that no line of the hook made.
        Say who made it (``Call.written_by``), for the race's report."""
        if not self.ddp.config.gradient_as_bucket_view:
            return
        storage = value.untyped_storage().data_ptr()
        targets = [p.grad for p in params if p.grad is not None and p.grad.untyped_storage().data_ptr() != storage]
        for call in self._holding(targets):
            if not call.written_by:
                call.written_by = (f"DDP's copy-back wrote bucket {bucket}'s result into p.grad at DDP iteration "
                                   f"{self.it} — with gradient_as_bucket_view p.grad is a view of the bucket's "
                                   "buffer, which this collective still had in flight: the future the hook returned "
                                   "completed before it did")

    def read_too_early(self) -> InFlightReadError | None:
        """Once the step has run: the error for the first bucket DDP read while a collective of
        this rank still had its memory in flight, if that memory changed after the read (the
        collective wrote other values into it: DDP copied the ones from before) — a collective
        that leaves the values as they were (a broadcast from this rank, an all_reduce over
        one rank) did no harm in this step; else, for a collective still holding a bucket
        buffer when ``backward()`` returned (it mixes into the next step's gradients, whatever
        values it carries: round 23 of hooks from the wild); else None."""
        for bucket, value, read, call, later in self._early:
            if not bits_equal(value, read):
                order = ("" if later is None else
                         f" ({later.op}#{later.seq} on {later.group}, posted after it, had completed: gloo runs a "
                         "group's collectives on 2 worker threads, and one posted later may complete first — waiting "
                         "on it does not wait for the one before)")
                read_at = (f"DDP's copy-back on rank {self.rank} read bucket {bucket}'s result "
                           f"({str(value.dtype).removeprefix('torch.')}{list(value.shape)}) at DDP iteration {self.it} "
                           f"while {call.op}#{call.seq} on {call.channel}")
                return InFlightReadError(
                    f"{read_at}, which the rank posted, still had that memory in flight, "
                    f"and the collective then wrote other values into it: the future the hook returned completed "
                    f"before that collective did{order}. Real DDP waits on the hook's future only and copies its "
                    "tensor at once, so the gradients get the values from before the collective, different on each "
                    "rank (how often, measured on gloo for an all_reduce the hook did not wait for: 193-200 of 200 "
                    "gradients, docs/ddp-facts.md). Return the collective's future (work.get_future()), a then() of "
                    "it, or a future of all of them (torch.futures.collect_all)\n"
                    + "\n".join(posted_at_lines({self.rank: call})), f"{read_at} still had it in flight")
        call = self._left
        if call is not None:
            read = next((bucket for bucket, _, _, early, _ in self._early if early is call), None)
            also = ("" if read is None else
                    f"; DDP's copy-back had read bucket {read} from that memory before the collective wrote it (the "
                    "values from before it: here the same, which is chance)")
            left = (f"{call.op}#{call.seq} on {call.channel}, which rank {self.rank} posted, was still in flight when "
                    f"backward() returned on that rank at DDP iteration {self.it}")
            return InFlightReadError(
                f"{left} (every future the hook returned had "
                f"completed and been copied back{also}): it holds one of DDP's bucket buffers, which DDP fills with the "
                "next iteration's gradients while the collective still reads and writes it, so the next steps' "
                "gradients and this collective's data mix (measured on gloo, a broadcast of values every rank "
                "already held, not waited for: 60-184 of 200 gradients wrong over the following steps, docs/ddp-facts.md). Wait for "
                "every collective the hook posts on the bucket before the future it returns completes\n"
                + "\n".join(posted_at_lines({self.rank: call})), left)
        return None


class _ReadyGradients:
    """One rank's gradients becoming ready during one backward pass, as DDP's reducer sees them.

    A parameter's gradient is ready at its place in the ready order; a bucket is launched (its
    hook called) once its own gradients and every lower bucket's are ready. Measured with
    real DDP (``benchmarks/measure_gloo_facts.py census``, after ``zero_grad(set_to_none=True)``):
    while a hook runs, ``p.grad`` is ``None`` for a parameter whose gradient is not ready yet
    — not last step's value — and holds its local gradient once ready (the bucket's view of it
    with ``gradient_as_bucket_view``, the same view object every iteration after the rebuild).
    A bucket's buffer is filled when its first gradient is ready.
    """

    def __init__(self, ddp: "SimDDP", rank: int, calls: list[BucketCall], local: list[torch.Tensor],
                 api: str) -> None:
        self.ddp, self.rank, self.calls, self.local, self.api = ddp, rank, calls, local, api
        self.order = ready_order_of(ddp.config.ready_order, len(local))
        self.position = {i: n for n, i in enumerate(self.order)}
        self.owner = {i: pos for pos, call in enumerate(calls) for i in call.params}
        self.buckets: dict[int, SimGradBucket] = {}
        self.slots: dict[int, tuple[int, int]] = {}  # parameter -> (offset, numel) in its bucket's buffer
        self.ready = 0  # how many gradients of self.order are ready

    def launch(self, pos: int) -> SimGradBucket:
        """Bucket ``pos`` (call order), after every gradient up to its launch became ready."""
        last = max(self.position[i] for call in self.calls[: pos + 1] for i in call.params)
        while self.ready <= last:
            self._make_ready(self.order[self.ready])
            self.ready += 1
        return self.buckets[pos]

    def _make_ready(self, i: int) -> None:
        pos = self.owner[i]
        call, params = self.calls[pos], self.ddp.params[self.rank]
        buffers, key = self.ddp._buffers[self.rank], (pos, self.calls[pos].params)
        if pos not in self.buckets:
            members = [params[j] for j in call.params]
            self.buckets[pos] = pack_bucket(  # parameters bucketed by dtype, gradients checked by step()
                call.index, members, [self.local[j] for j in call.params],
                is_last=call.is_last, api=self.api, into=buffers.get(key),  # type: ignore[arg-type]
            )
            buffers[key] = packed_buffer(self.buckets[pos])
            if self.ddp.config.gradient_as_bucket_view:
                self.slots.update(zip(call.params, packing(members)))
        p = params[i]
        if not self.ddp.config.gradient_as_bucket_view:  # autograd left it in p.grad; DDP copies it in
            p.grad = self.local[i].detach().clone()
            return
        views, buffer = self.ddp._views[self.rank], buffers[key]
        view = views.get(i)
        if view is None or view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            off, n = self.slots[i]
            view = views[i] = buffer[off : off + n].view(p.shape)
        p.grad = view


def _make_params(
    world: int, shapes: Sequence[tuple[int, ...]] | None, parameters: Sequence[Sequence[Any]] | None,
    dtype: torch.dtype,
) -> list[list[torch.nn.Parameter]]:
    if (shapes is None) == (parameters is None):
        raise UsageError("pass exactly one of param_shapes and parameters")
    if shapes is not None:
        if isinstance(shapes, torch.Tensor) or not shapes:
            raise UsageError(f"param_shapes={shapes!r} must be a non-empty sequence of shapes")
        return [[torch.nn.Parameter(torch.zeros(tuple(s), dtype=dtype)) for s in shapes] for _ in range(world)]
    assert parameters is not None
    if len(parameters) != world:
        raise UsageError(f"parameters has {len(parameters)} entries; the cluster has {world} ranks (one list per rank)")
    out = [list(ps) for ps in parameters]
    for rank, ps in enumerate(out):
        if [(tuple(p.shape), p.dtype) for p in ps] != [(tuple(p.shape), p.dtype) for p in out[0]]:
            raise UsageError(f"parameters[{rank}] differ from parameters[0] in shapes or dtypes; DDP replicas match")
        if len({id(p) for p in ps} & {id(p) for q in out[:rank] for p in q}):
            raise UsageError(f"parameters[{rank}] shares Parameter objects with a lower rank; give each rank its own")
    return out
