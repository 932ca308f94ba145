"""``SimCluster``: N simulated ranks in one process, and running a hook on them.

    >>> import torch
    >>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    >>> from simcluster import SimCluster
    >>> cluster = SimCluster(world_size=2, seed=0)
    >>> result = cluster.run_hook(allreduce_hook, [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    >>> result.outputs[0]
    tensor([2., 3.])

What happens in ``run_hook``: each rank gets a fresh bucket holding its gradient;
the hook is called once per rank (rank 0 first); every collective it issues is
matched across ranks and completed when the scheduler says; callbacks run where the
backend model says; each rank then waits on the future its hook returned, as DDP's
reducer does. ``outputs[r]`` is what rank ``r``'s future resolved to.

Same ``seed`` and ``schedule`` → bitwise-identical outputs and an equal trace. Every
error raised from a run ends with a replay line naming both.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import torch

from simcluster.fake.backends import backend_model
from simcluster.fake.bucket import SimGradBucket, fresh_bucket, make_bucket
from simcluster.fake.launcher import LauncherEnvironment
from simcluster.engine.inline import Engine
from simcluster.errors import DeadlockError, ThreadedRankCodeError, UsageError, add_context_note
from simcluster.limits import SEEDS, WORLD_SIZES, check_int, check_memory
from simcluster.fake.process_group import Runtime, SimProcessGroup
from simcluster.fake.read_watch import enter_read_watch
from simcluster.fake.rank_context import RankContexts, install_torch_patches, restore_torch_patches
from simcluster.fake.reducer import call_hook, check_future, collect, raise_stored, returned_lines
from simcluster.usercode.rank_local import as_rank_local
from simcluster.usercode.rank_state import CURRENT
from simcluster.engine.scheduler import Scheduler, make_scheduler
from simcluster.fake.state import LayoutModel, StateSpec
from simcluster.engine.trace import Trace

__all__ = ["SimCluster", "RunResult", "HookRun"]


@dataclass
class RunResult:
    """What :meth:`SimCluster.run` returns: each rank's return value and the trace."""

    values: list[Any]
    trace: Trace
    schedule: list[int]
    replay_fn: Callable[[], str] = field(repr=False, compare=False, default=lambda: "")

    @property
    def replay(self) -> str:
        """A constructor call replaying the cluster up to the end of this run (built on demand)."""
        return self.replay_fn()


@dataclass
class HookRun(RunResult):
    """What :meth:`SimCluster.run_hook` returns.

    ``outputs[r]``: the value rank ``r``'s future resolved to (normally a tensor);
    ``buckets[r]``: the bucket rank ``r``'s hook saw; ``states[r]``: its state.
    """

    outputs: list[Any] = field(default_factory=list)
    buckets: list[SimGradBucket] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)


class SimCluster(Runtime):
    """``world_size`` simulated ranks sharing this process.

    ``backend``: ``"gloo"`` or ``"nccl"`` model (:mod:`simcluster.fake.backends`).
    ``schedule``: completion order — ``"random"`` (seeded by ``seed``, default),
    ``"in_order"``, ``"reverse"``, a list of choices to replay, or a
    :class:`~simcluster.engine.scheduler.Scheduler`. The scheduler lives as long as the
    cluster, so a multi-step run replays from one list of choices.
    ``rng``: ``"per_rank"`` (rank r starts from ``manual_seed(seed + r)``) or ``"same"``.
    ``stuck_timeout``: seconds before code blocked outside the simulator is reported.
    ``posting_lines``: record the user line that posted each collective, so a deadlock
    report names it beside each call a rank never matched (``rank 0 posted it at
    hooks.py:12 in hook: …``). It walks the stack at every collective, so it is off by
    default; ``simcluster check`` turns it on when it re-runs a deadlocked example for its report.
    ``launcher``: ``"none"`` (default: ``os.environ`` is the caller's, as for a script run
    by ``python``) or ``"torchrun"``: while rank r's code runs, ``os.environ`` holds the
    variables ``torchrun --standalone --nproc-per-node world_size`` gives rank r
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, …; the run-dependent ones
    fixed, see :mod:`simcluster.fake.launcher`), and the caller's environment is back
    exactly when the run ends, also on an error. The replay line names it. A
    :class:`~simcluster.fake.launcher.LauncherEnvironment` made with each rank's variables
    gives rank r exactly those (``simcluster e2e`` under a real torchrun: the real ranks'
    own); the replay line then says ``launcher='torchrun'``, the single-node model.
    """

    def __init__(
        self,
        world_size: int,
        seed: int = 0,
        backend: str = "gloo",
        schedule: object = "random",
        *,
        rng: str = "per_rank",
        stuck_timeout: float = 60.0,
        posting_lines: bool = False,
        launcher: str | LauncherEnvironment = "none",
    ) -> None:
        check_int("world_size", world_size, *WORLD_SIZES)
        check_int("seed", seed, *SEEDS)
        check_memory(world_size)
        self.world_size = world_size
        self.seed = seed
        self.backend = backend_model(backend)
        self.scheduler: Scheduler = make_scheduler(schedule, seed)
        self._schedule_arg = schedule
        self.rng = rng
        self.stuck_timeout = stuck_timeout
        self.posting_lines = posting_lines
        self.engine: Engine | None = None
        self.choices: list[int] = []
        self.launcher = "torchrun" if isinstance(launcher, LauncherEnvironment) else launcher
        self.contexts = RankContexts(world_size, self, seed=seed, rng=rng, launcher=launcher)

    # -- introspection --------------------------------------------------------
    def process_group(self, rank: int) -> SimProcessGroup:
        """Rank ``rank``'s handle on the simulated WORLD group."""
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank={rank} is not in 0..{self.world_size - 1}")
        return self.contexts.world_groups[rank]

    def replay_line(self, pending: Sequence[int] = (), *, upto: int | None = None) -> str:
        """A constructor call that replays every run of this cluster so far, bit for bit
        (making the same calls on it in the same order); ``pending``: choices of the run
        in progress; ``upto``: only the first ``upto`` choices made (a past run's end)."""
        choices = self.choices if upto is None else self.choices[:upto]
        lines = ", posting_lines=True" if self.posting_lines else ""
        if self.launcher != "none":
            lines = f", launcher={self.launcher!r}{lines}"
        return (
            f"SimCluster(world_size={self.world_size}, seed={self.seed}, backend={self.backend.name!r}, "
            f"schedule={[*choices, *pending]!r}, rng={self.rng!r}{lines})"
        )

    # -- running --------------------------------------------------------------
    def run(self, rank_fn: Callable[[int], Any]) -> RunResult:
        """Run ``rank_fn(rank)`` as each rank's code (rank 0 first) until everything settles.

        Inside ``rank_fn``, ``dist.*`` collectives, ``dist.group.WORLD``,
        ``dist.get_rank()`` and ``dist.new_group`` act on that rank's simulated world.
        An exception escaping ``rank_fn`` on any rank is re-raised as itself with the
        rank and the replay line attached as notes (failures on several ranks are
        listed in the notes of the lowest rank's).
        """
        values, trace, start, replay = self._run(rank_fn)
        return RunResult(values=values, trace=trace, schedule=self.choices[start:], replay_fn=replay)

    def _run(self, rank_fn: Callable[[int], Any]) -> tuple[list[Any], Trace, int, Callable[[], str]]:
        """:meth:`run` without its result object: the values, the trace, where the run's
        choices start in :attr:`choices` and its replay function (``run_hook`` builds its
        own result from these, so a hook step makes one result object, not two)."""
        if self.engine is not None:
            raise UsageError("SimCluster.run is not re-entrant: a run is already in progress on this cluster")
        trace = Trace()
        values: list[Any] = [None] * self.world_size
        start = len(self.choices)
        engine = Engine(
            scheduler=self.scheduler,
            trace=trace,
            switch=self.contexts.switch,
            workers_per_channel=self.backend.workers_per_group,
            fifo_per_channel=self.backend.fifo_per_group,
            per_rank_delivery=self.backend.per_rank_delivery,
            worker_name=self.backend.worker_name,
            stuck_timeout=self.stuck_timeout,
            replay=self.replay_line,
            posting_lines=self.posting_lines,
            watch_reads=enter_read_watch,
        )

        for rank in range(self.world_size):
            def body(rank: int = rank) -> None:  # bound per rank by the default (no factory call per rank)
                values[rank] = rank_fn(rank)

            engine.spawn(rank, body, f"rank {rank}'s code")
        self.engine = engine
        CURRENT.exits.clear()
        CURRENT.unmodelled.clear()
        try:
            patches = install_torch_patches(self.contexts, engine)
            try:
                engine.run()
            except DeadlockError as exc:
                if engine.started_threads:  # whether such a thread would have unblocked the ranks is not known
                    raise _threaded_rank_code(engine, self.replay_line, deadlocked=True) from exc
                raise
            finally:
                try:
                    self.choices.extend(map(itemgetter(1), engine.choices))
                finally:
                    restore_torch_patches(patches)
        finally:
            self.engine = None
            # a rank that changed a process-wide setting invalidates the run: that story first
            self.contexts.audit.raise_if_changed(self.replay_line)
            # then a call the simulator does not model: what followed it is no real cluster's
            if _caught_unmodelled(engine) and isinstance(sys.exc_info()[1], (Exception, type(None))):
                raise _unmodelled(CURRENT.unmodelled, self.replay_line())
        upto = len(self.choices)

        def replay() -> str:
            return self.replay_line(upto=upto)

        if engine.started_threads and engine.deadlock is not None:  # a hook's failure, then a deadlock
            raise _threaded_rank_code(engine, replay, deadlocked=True)
        if engine.foreign_calls:
            raise _threaded_rank_code(engine, replay, deadlocked=False)
        if engine.failures:
            self._raise_failures(engine, replay())
        if CURRENT.exits:  # caught by the code under test: the process would have ended all the same
            raise _exit_caught(CURRENT.exits, replay())
        return values, trace, start, replay

    def _raise_failures(self, engine: Engine, replay: str) -> None:
        failures = sorted(engine.failures, key=lambda f: f[0])
        rank, label, exc = failures[0]
        if isinstance(exc, ValueError) and "not initialized in the world group map" in str(exc):
            add_context_note(
                exc, "simcluster: a rank used a process group that belongs to another simulated rank: state built "
                "once is shared by every simulated rank; pass a factory called once per rank with its process group"
            )
        add_context_note(exc, f"simcluster: raised on rank {rank} of {self.world_size} ({label}, backend {self.backend.name})")
        for other_rank, other_label, other in failures[1:]:
            add_context_note(exc, f"simcluster: rank {other_rank} also raised ({other_label}): {type(other).__name__}: {other}")
        if engine.deadlock is not None:
            add_context_note(exc, "simcluster: the other ranks were then left blocked:\n" + str(engine.deadlock.args[0]))
        add_context_note(exc, f"simcluster: replay with {replay}")
        raise exc

    def run_hook(
        self,
        hook: Callable[[Any, Any], Any],
        grads: Sequence[torch.Tensor],
        state: Any = None,  # a StateSpec, or what StateSpec.parse takes, or this cluster's WORLD group
        *,
        parameters: Sequence[torch.Tensor] | None = None,
        bucket_index: int = 0,
        is_last: bool = True,
    ) -> HookRun:
        """Call ``hook(state, bucket)`` on every rank for one bucket and wait on its future.

        ``hook``: a callable — its module is then shared by every simulated rank (module
        globals, caches, module-level RNG objects are *not* per rank) — or a
        ``"file.py:name"`` / ``"module:name"`` spec or :class:`~simcluster.usercode.rank_local.RankLocal`:
        each rank then calls its own copy of the module, as each process imports it.

        ``grads[r]``: rank ``r``'s flat 1-D gradient (copied into a fresh bucket buffer).
        ``state``: ``None``; ``"group"`` (each rank's WORLD process group); one of this
        cluster's :class:`SimProcessGroup` (each rank gets its own handle on that group);
        or a factory called once per rank, inside the run, as ``factory(process_group)``
        (or ``factory(process_group, model)``, the model holding the bucket's parameters; a
        :class:`~simcluster.usercode.rank_local.RankLocal` factory comes from the rank's own module copy).
        ``parameters``: the bucket's parameters (default: one parameter per rank shaped
        like the gradient).
        """
        hook = as_rank_local(hook)
        grads = self._check_grads(grads)
        # issubclass of the type: torch's ProcessGroup has a metaclass whose Python
        # __instancecheck__ makes isinstance cost ~0.6 µs (once per step)
        if not issubclass(type(state), SimProcessGroup):
            state = StateSpec.parse(state)  # once: each rank then resolves it
        buckets: list[SimGradBucket] = []
        states: list[Any] = [None] * self.world_size
        outputs: list[Any] = [None] * self.world_size
        returned: list[Any] = [None] * self.world_size  # each rank's future, for a deadlock report
        waits = f"DDP (bucket {bucket_index})"
        if parameters is None:  # one fresh parameter per rank: nothing left to validate
            if isinstance(bucket_index, bool) or not isinstance(bucket_index, int) or bucket_index < 0 \
                    or not isinstance(is_last, bool):
                make_bucket(bucket_index, [grads[0]], [grads[0]], is_last=is_last)  # raises its UsageError
            buckets = [fresh_bucket(bucket_index, grad, is_last=is_last) for grad in grads]
        else:
            for grad in grads:
                params = list(parameters)
                buckets.append(make_bucket(bucket_index, params, _split_like(grad, params), is_last=is_last))

        def rank_fn(rank: int) -> Any:
            if isinstance(state, StateSpec):
                if state.kind != "none":  # "none" resolves to the None already there (hot: no call)
                    # the bucket's parameters only if the factory takes a model
                    states[rank] = state.resolve(self.contexts.world_groups[rank],
                                                 lambda: LayoutModel(buckets[rank].parameters()))
            else:
                states[rank] = self.state_for(rank, state)
            future = call_hook(hook, states[rank], buckets[rank])
            check_future(future, hook, rank, f"bucket {bucket_index}")
            returned[rank] = future
            collect(future, outputs, rank, waits)

        try:
            values, trace, start, replay = self._run(rank_fn)
        except DeadlockError as exc:
            if lines := returned_lines([[f] if f is not None else [] for f in returned], lambda _: waits):
                add_context_note(exc, "\n".join(lines))
            raise
        raise_stored(outputs, self.world_size, bucket_index, replay)
        return HookRun(
            values=values, trace=trace, schedule=self.choices[start:], replay_fn=replay,
            outputs=outputs, buckets=buckets, states=states,
        )

    def state_for(self, rank: int, state: Any, parameters: Sequence[torch.nn.Parameter] | None = None) -> Any:
        """Rank ``rank``'s hook state from a state spec (see :meth:`run_hook`); ``parameters``
        make the model of a ``factory(process_group, model)`` (:mod:`simcluster.fake.state`)."""
        if isinstance(state, SimProcessGroup):
            if state.global_rank not in state.spec.ranks or state.runtime is not self:
                raise UsageError(f"state={state!r} is not a process group of this cluster")
            if state.spec.name == "WORLD":
                return self.contexts.world_groups[rank]
            raise UsageError(
                f"state={state!r}: pass a factory for subgroups, e.g. lambda pg: dist.new_group([...]), "
                "so every rank creates its own handle"
            )
        spec = state if isinstance(state, StateSpec) else StateSpec.parse(state)  # run_hook parsed it already
        return spec.resolve(self.contexts.world_groups[rank], lambda: LayoutModel(parameters or []))

    def _check_grads(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(grads) != self.world_size:
            raise UsageError(f"grads has {len(grads)} tensors; the cluster has {self.world_size} ranks (one per rank)")
        out = []
        for rank, g in enumerate(grads):
            if not isinstance(g, torch.Tensor):
                raise UsageError(f"grads[{rank}] is a {type(g).__name__}, not a tensor")
            out.append(g if g.dim() == 1 and not g.requires_grad else g.detach().reshape(-1))  # flat already: as is
        shape, dtype = out[0].shape, out[0].dtype  # every rank's against rank 0's (a plain loop, no sets: per step)
        for g in out:
            if g.shape != shape or g.dtype != dtype:
                raise UsageError(
                    "every rank's gradient must have the same shape and dtype (DDP's buckets match across ranks), got "
                    + ", ".join(f"rank {r}: {str(g.dtype).removeprefix('torch.')}{list(g.shape)}" for r, g in enumerate(out))
                )
        return out


def _split_like(grad: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    sizes = [p.numel() for p in params]
    if sum(sizes) != grad.numel():
        raise UsageError(f"the parameters hold {sum(sizes)} elements but the gradient has {grad.numel()}")
    return [g.view(p.shape) for g, p in zip(grad.split(sizes), params)]


CAUGHT_UNMODELLED = "the code under test caught this error and went on"
"""What a report says of a call the simulator does not model when the code under test caught its error."""


def _caught_unmodelled(engine: Engine) -> bool:
    """Whether the code under test caught every error of a call the simulator does not model
    that it got in this run (``process_group.not_modelled``): one it did not catch is a rank's
    failure, told the usual way (:meth:`SimCluster._raise_failures`, which names its rank)."""
    failed = {id(exc) for _, _, exc in engine.failures}
    return bool(CURRENT.unmodelled) and all(id(exc) not in failed for exc in CURRENT.unmodelled)


def _unmodelled(unmodelled: list[BaseException], replay: str) -> BaseException:
    """The first call of the run the simulator does not model, whose error the code under
    test caught and went on (:func:`_caught_unmodelled`), raised whatever the run did after it:
    the deadlock or failure that followed is the simulator's gap, not a finding."""
    first = unmodelled[0]
    first.add_note(f"simcluster: {CAUGHT_UNMODELLED}; what followed is not what a real cluster would do, so this run "
                   "has no verdict")
    first.add_note(f"simcluster: replay with {replay}")
    unmodelled.clear()
    return first


def _exit_caught(exits: list[BaseException], replay: str) -> BaseException:
    """The first ``os._exit`` of a run whose code caught what simcluster raised in its place
    (``except Exception``, a ``__del__`` or finalizer, whose errors Python only prints, a
    thread the hook started): on a real cluster that rank's process ended there, whatever
    its code would have done next (an audit of hostile hooks, 2026-12-07: four such hooks
    passed)."""
    first = exits[0]
    first.add_note("simcluster: the code under test caught the error raised in place of os._exit and went on; "
                   "on a real cluster the process had ended")
    if len(exits) > 1:
        first.add_note(f"simcluster: os._exit was called {len(exits)} times in this run")
    first.add_note(f"simcluster: replay with {replay}")
    exits.clear()
    return first


def _threaded_rank_code(engine: Engine, replay: Callable[[], str], *, deadlocked: bool) -> ThreadedRankCodeError:
    """The run's story when a thread rank code started touched the simulation, or may have
    been what the deadlocked ranks waited for: no verdict (the simulator does not model a
    rank's own threads), worded from what rank code did under the baton, so the same run
    always tells it the same way. A rejected call's words (with its user line) are used only
    when the run did not deadlock: then rank code waited for that thread, so it is always seen."""
    ranks = sorted({rank for rank, _ in engine.started_threads})
    if not deadlocked:
        what = sorted(engine.foreign_calls)[0]
        more = f" ({len(engine.foreign_calls) - 1} more such call(s))" if len(engine.foreign_calls) > 1 else ""
        story = f"{what}{more}; the call was rejected in that thread (ForeignThreadError)"
    else:
        rank, thread = min(engine.started_threads)
        story = (f"the ranks deadlocked after rank {rank}'s code started {thread}" if rank >= 0 else
                 f"the ranks deadlocked after rank code started {thread}")
        if len(engine.started_threads) > 1:
            story += f" ({len(engine.started_threads) - 1} more thread(s) started by ranks {ranks})"
        story += (": simcluster rejects such a thread's collectives, waits and future completions "
                  "(ForeignThreadError in that thread), so whether it would have unblocked them is not known")
    return ThreadedRankCodeError(
        f"{story}. A thread a rank starts belongs to that rank's process on a real cluster, where its "
        "collectives would run on the rank's group; the simulator does not model a rank's own threads, so it "
        f"cannot check this hook faithfully — do that work on the rank's own code path. Replay: {replay()}")
