"""``SimProcessGroup``: a real ``torch.distributed.ProcessGroup`` whose collectives are simulated.

Each simulated rank holds its own ``SimProcessGroup`` object per group, exactly as each
process holds its own ``ProcessGroupGloo``. ``dist.all_reduce(t, group=pg,
async_op=True)`` and friends call straight into it (torch's Python front end
needs no ``init_process_group`` for that). Each call:

1. validates the arguments as the real front end/back end would;
2. posts the rank's part to the engine, which matches the k-th call of every rank of
   the group and checks that they agree (op, dtype, shape, reduce op, root);
3. returns a :class:`SimWork` whose future is a pending
   :class:`~simcluster.fake.futures.SimFuture`.

When the scheduler completes the collective, every rank's output tensors are written
(with the bits the backend would produce — :mod:`simcluster.fake.collectives`) and each
rank's future is set to the value the backend model says
(:mod:`simcluster.fake.backends`).

Not supported (each raises :class:`~simcluster.errors.UnsupportedError` naming it):
``recv`` from any source, ``dist._coalescing_manager``, ``monitored_barrier``,
``split_group``, functional collectives (``group_name``); CUDA tensors.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from simcluster.fake import collectives
from simcluster.engine.contract import Call, EngineContract
from simcluster.engine.frames import Frame, stack_user_frames
from simcluster.engine.trace import Failed, Trace, Wrapped
from simcluster.errors import BackendError, DeadlockError, UnsupportedError, UsageError, backend_error
from simcluster.fake.futures import DoneFlag, SimFuture, polled_by_user
from simcluster.names import MASKED_ADDRESS, MASKED_STAMP, wear_torchs_name
from simcluster.usercode.rank_state import CURRENT

if TYPE_CHECKING:
    from simcluster.fake.backends import BackendModel

__all__ = ["SimProcessGroup", "SimWork", "GroupSpec", "GLOO_SELF_P2P", "InFlightTensors"]

GLOO_SELF_P2P = ("[enforce fail at third_party/gloo/gloo/transport/tcp/pair.cc:801] state_ >= CONNECTED. 1 vs 4. "
                 "Pair is not connected")
"""What real gloo raises (a RuntimeError, at the call) for an isend/irecv whose peer is the
calling rank itself — measured, see docs/gloo-facts.md."""


@dataclass(frozen=True)
class GroupSpec:
    """A group's identity, shared by every member rank: its name and global ranks."""

    name: str
    ranks: tuple[int, ...]


@runtime_checkable
class Runtime(Protocol):
    """What a process group needs from its cluster: the current run's engine (``None``
    between runs) and the backend model. :class:`~simcluster.fake.cluster.SimCluster` is
    one (its engine: :class:`~simcluster.engine.inline.Engine`); so is the real-reducer
    mode's runtime (:class:`~simcluster.engine.threaded.ThreadedEngine`,
    :mod:`simcluster.ddp.real_ddp`). Either engine serves, through :class:`EngineContract`."""

    engine: EngineContract | None
    backend: "BackendModel"


_grad_enabled = torch.is_grad_enabled  # the issuing thread's grad mode (NCCL's completion callbacks run in it)

_DTYPE_NAMES: dict[torch.dtype, str] = {}
_ReduceOp = dist.ReduceOp
# torch's front end: a collective called with async_op=False waits on its work from here
_C10D_FILE = dist.distributed_c10d.__file__
_REDUCTIONS: dict[tuple[str, int, torch.dtype, str], tuple[str, collectives.Rejection | None, str]] = {}
"""``(op, ReduceOp kind's number, dtype, backend)`` -> ``(reduce-op name, rejection, dtype name)``
(see :meth:`SimProcessGroup._reduce_signature`). The kind is keyed by its number
(``ReduceOp.RedOpType.value``), not by the ``RedOpType`` itself: pybind makes a new enum
object at every ``reduce_op.op``, and hashing and comparing two of them calls pybind's
``__hash__`` and ``__eq__`` (~4.7 k instructions a lookup, 1.3 % of a W=8 tiny step)."""


def _dtype(t: torch.Tensor) -> str:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
    return name


class SimWork(dist.Work):
    """A collective's handle, as ``dist.*(…, async_op=True)`` returns it.

    ``wait()`` blocks the calling rank (simulated: other ranks run) until the collective
    completed *and its future's callbacks finished* (measured on gloo), then returns
    ``True``; it raises the collective's error if it failed. ``get_future()`` returns the
    :class:`SimFuture` — or raises ``Work::getFuture not implemented.`` for the ops
    whose real backend has no future (gloo's ``reduce_scatter`` and point-to-point).
    """

    __slots__ = ("_future", "_finished", "_op", "_get_future_error", "_source",
                 "_seen_pending")  # as SimFuture's: one per call

    def __init__(self, future: SimFuture, finished: DoneFlag, op: str, get_future_error: str | None) -> None:
        super().__init__()
        self._future = future
        self._finished = finished
        self._op = op
        self._get_future_error = get_future_error

    def get_future(self) -> torch.futures.Future:
        if self._get_future_error is not None:
            raise RuntimeError(self._get_future_error)
        return self._future

    def wait(self, timeout: Any = None) -> bool:
        # Measured on gloo: work.wait() returns only after the future's callbacks ran.
        # Called from torch's front end, it is a collective called with async_op=False.
        self._finished.wait(synchronous=sys._getframe(1).f_code.co_filename == _C10D_FILE)
        self._future.wait()
        source = getattr(self, "_source", None)
        if source is not None:  # a recv: its source is known once wait() returned (source_rank)
            self._source = (source[0], True)
        seen = getattr(self, "_seen_pending", None)
        if seen is not None and seen.until_wait:  # gloo point to point: completed from now on (polled)
            self._seen_pending = None
        return True

    def is_completed(self) -> bool:
        return self.polled(sys._getframe(1))

    def polled(self, caller: Any) -> bool:
        """:meth:`is_completed` as ``caller`` (a frame) asked it: a pending work polled by
        the code under test lets the others make progress first (:func:`polled_by_user`)."""
        seen = getattr(self, "_seen_pending", None)
        if seen is not None:  # gloo's point to point until wait() returned; its reduce_scatter, ever
            polled_by_user(self._future.engine, seen, caller)
            return False
        finished = self._finished
        if not finished.done():
            polled_by_user(self._future.engine, finished, caller)
        return finished.done()

    def is_success(self) -> bool:
        if not self._future.done():
            raise RuntimeError(f"is_success() on the pending {self._future.label}")
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - failure is the answer
            return False
        return True

    def exception(self) -> BaseException | None:
        try:
            self._future.value()
        except Exception as exc:  # noqa: BLE001 - returned, not raised
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        if self._get_future_error is not None:
            raise RuntimeError("result() not implemented.")
        return self._future.wait()

    def synchronize(self) -> None:
        return None

    def source_rank(self) -> int:
        """A ``recv``'s source (a group rank) where the backend's recv work knows it
        (:attr:`~simcluster.fake.backends.BackendModel.recv_knows_its_source`: gloo): -1 until
        its ``wait()`` returned, as gloo's ``RecvWork`` learns it there (measured); otherwise
        torch's own answer, the ``RuntimeError`` every other work raises. It raised for every
        work, and a hook asking a batched irecv where its data came from took another path than
        on real gloo (e2e: FIDELITY BUG; an audit of hostile hooks, 2026-12-07)."""
        source = getattr(self, "_source", None)  # (source, waited) for a recv only (SimProcessGroup._p2p)
        if source is None:
            return super().source_rank()
        return source[0] if source[1] else -1

    _source_rank = source_rank  # torch's private alias: a hook calling it got the RuntimeError every other work raises


wear_torchs_name(SimWork, dist.Work)  # as a real gloo work is named (docs/gloo-facts.md §8)


class _NeverCompleted:
    """What a poll of a work that gloo never says is completed finds: pending, for good — a
    waitable that is never done, named so that a deadlock of a rank polling it says why. A
    gloo point-to-point work before its ``wait()``
    (:attr:`~simcluster.fake.backends.BackendModel.p2p_completed_at_wait`: a hook that polled a
    recv until it completed passed here, where on real gloo it spins for ever — an audit of
    hostile hooks, 2026-12-07), a gloo reduce_scatter's at any time
    (:attr:`~simcluster.fake.backends.BackendModel.never_completed_ops`, stop 42)."""

    __slots__ = ("label", "until_wait")

    def __init__(self, finished: DoneFlag, why: str, *, until_wait: bool = False) -> None:
        self.label = f"{finished.label}, {why}"
        self.until_wait = until_wait  # True: only until the work's wait() returned (point to point); False: for good

    def done(self) -> bool:
        return False

    def on_done(self, resume: Callable[[], None]) -> None:
        return None


class CoalescedWork(dist.Work):
    """The one work ``dist.batch_isend_irecv`` returns for a whole batch on a backend that
    coalesces it (the NCCL model): ``wait()`` waits for every op of the batch, in order.
    What its ``get_future()`` holds is not known here (NCCL cannot run on this machine): it
    raises :class:`~simcluster.errors.UnsupportedError` rather than guess."""

    __slots__ = ("_works",)

    def __init__(self, works: Sequence[dist.Work]) -> None:
        super().__init__()
        self._works = list(works)

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        caller = sys._getframe(1)
        return all(work.polled(caller) if isinstance(work, SimWork) else work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)

    def exception(self) -> BaseException | None:
        return next((e for e in (work.exception() for work in self._works) if e is not None), None)

    def get_future(self) -> torch.futures.Future:
        raise not_modelled("get_future() of the one work dist.batch_isend_irecv returns for a batch under the "
                               "NCCL model (what it holds is not modelled)")

    def result(self) -> list[torch.Tensor]:
        raise not_modelled("result() of the one work dist.batch_isend_irecv returns for a batch under the "
                               "NCCL model (not modelled)")

    def synchronize(self) -> None:
        return None


wear_torchs_name(CoalescedWork, dist.Work)


RECENTLY_HELD = 3
"""How many of a rank's latest collectives on a group a gloo barrier may find still held by a
worker thread after they failed: the failed one and up to two after it. Measured on real gloo
(``benchmarks/measure_barrier_reraise.py --between K``, 2 processes, a BAND all_reduce waited on
and caught, K successful synchronous all_reduces, then ``barrier()``): the barrier re-raised the
BAND error with K = 0 (about 1 trial in 3-75), K = 1 (3 of 4 runs of 200 trials) and K = 2 (3 of 4
runs of 300 trials), never with K = 3 (0 of 1,200 trials): gloo's two worker threads, one of
which may still be letting go of the failed work while the other runs the later ones
(docs/gloo-facts.md, "A barrier re-raises an earlier collective's error")."""
_NO_RECENT_FLAGS: tuple[None, ...] = (None,) * RECENTLY_HELD


class SimProcessGroup(dist.ProcessGroup):
    """One rank's handle on one simulated group (see the module docstring)."""

    def __init__(self, runtime: Runtime, spec: GroupSpec, global_rank: int) -> None:
        super().__init__(spec.ranks.index(global_rank), len(spec.ranks))
        self._runtime = runtime
        self.spec = spec
        self.global_rank = global_rank
        self._rank_in_group = spec.ranks.index(global_rank)
        self._size = len(spec.ranks)
        # this rank's collectives on the group that have not finished yet (their "callbacks ran"
        # flags, which leave it when set), for gloo's barrier; a new one for each run (engine)
        self._in_flight: dict[DoneFlag, None] = {}
        self._in_flight_engine: object = None
        # the flags of this rank's last RECENTLY_HELD collectives on the group, oldest first: a gloo
        # barrier posted soon after one failed may still find its worker holding it (docs/gloo-facts.md)
        self._recent_flags: tuple[DoneFlag | None, ...] = _NO_RECENT_FLAGS

    # The values given to torch's constructor above, read without its binding: on a Python
    # subclass, ProcessGroup.size()/rank() cost ~0.8 us each (measured; 0.1 on a plain
    # ProcessGroup), and a hook calls size() every step (allreduce_hook's div_).
    def rank(self) -> int:
        return self._rank_in_group

    def size(self) -> int:
        return self._size

    @property
    def runtime(self) -> Runtime:
        """The cluster (or real-reducer run) this group belongs to."""
        return self._runtime

    # -- identity -------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self._runtime.backend.name

    @property
    def model_backend(self) -> str:
        """The modelled backend's name, ``"gloo"`` or ``"nccl"``: what ``dist.get_backend`` says
        for this group, as on a real cluster (a subclass may answer ``getBackendName`` otherwise)."""
        return self._runtime.backend.name

    def name(self) -> str:
        return self._runtime.backend.name

    def __repr__(self) -> str:
        # As torch's default repr words a group (measured on torch 2.13: a real gloo group is
        # '<torch.distributed.distributed_c10d.ProcessGroup object at 0x7f…>'), the address
        # masked: torch's own errors quote it ('Global rank 0 is not part of group <…>'), and a
        # hook's error must read as on a real run. simcluster's words name groups by spec.name.
        return f"<torch.distributed.distributed_c10d.ProcessGroup object at {MASKED_ADDRESS}>"

    # -- plumbing -------------------------------------------------------------
    def _engine(self, op: str) -> EngineContract:
        engine = self._runtime.engine
        if engine is None or not engine.running:
            raise UsageError(
                f"{op} on {self.spec.name} (global rank {self.global_rank}) outside a simulated run: "
                "simulated collectives only run inside SimCluster.run/run_hook"
            )
        return engine

    def _check_tensors(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: expected a Tensor, got {type(t).__name__} on rank {self.global_rank}")
            if not t.is_cpu:
                raise not_modelled(f"SimProcessGroup does not support {t.device.type} tensors ({op})")
            if t.is_sparse:
                raise not_modelled(f"SimProcessGroup does not support sparse tensors ({op})")

    def _post(
        self,
        op: str,
        tensor: torch.Tensor | None,
        signature: tuple[Any, ...],
        compute: Callable[[dict[int, Call]], dict[int, Any]],
        payload: Any,
        *,
        nbytes: int | None = None,
        detail: str = "",
        channel: str | None = None,
        ranks: tuple[int, ...] | None = None,
        error: collectives.Rejection | None = None,
        watched: tuple[torch.Tensor, ...] | None = None,
    ) -> SimWork:
        """Post this rank's part; ``compute`` maps every rank's call (in group order) to
        each rank's ``(value, exception)`` for its future. ``watched``: the tensors the
        collective reads or writes in flight (default: ``tensor``), which the rank's code must
        not write to until it completes (:class:`InFlightTensors`)."""
        engine = self._runtime.engine
        if engine is None or not engine.running:
            engine = self._engine(op)  # raises its UsageError
        backend = self._runtime.backend
        if error is not None:
            if backend.errors_at_call:  # of the real backend's class: NCCL's BAND is a ValueError
                raise backend_error(error.exc_type, error.message)
            # the collective runs, and fails at wait() on every rank; its error names this call's line
            compute = _rejected(error.message, stack_user_frames(sys._getframe(1)), engine.trace)
        future = SimFuture(engine, self.global_rank, "")
        after: tuple[DoneFlag, ...] = ()
        grad_mode = backend.completion_grad_mode
        if grad_mode is None:
            grad_mode = _grad_enabled()
        if channel is not None:  # point to point: not on the group's worker queue
            finished = DoneFlag(future, None, grad_mode)
        else:
            if self._in_flight_engine is not engine:
                self._in_flight, self._in_flight_engine, self._recent_flags = {}, engine, _NO_RECENT_FLAGS
            recent = self._recent_flags
            if op == "barrier" and backend.barrier_after_prior_work:
                after = tuple(self._in_flight)  # gloo: the barrier waits for these first
                # failed shortly before: its worker thread may not have let go of it yet
                after += tuple(f for f in recent if f is not None and f.done() and f.failure() is not None)
            finished = DoneFlag(future, self._in_flight, grad_mode)
            self._recent_flags = (*recent[1:], finished)
        shape = tuple(tensor.shape) if tensor is not None else ()

        call = Call(  # positional, in field order: keywords to a class call cost a dict (hot path)
            self.global_rank,  # rank
            channel or self.spec.name,  # channel
            ranks or self.spec.ranks,  # ranks
            op,
            ("p2p" if channel else op, *signature),  # signature
            compute,
            finished.deliver,  # deliver
            (_DTYPE_NAMES.get(tensor.dtype) or _dtype(tensor)) if tensor is not None else "",  # dtype
            shape,
            nbytes if nbytes is not None else (tensor.numel() * tensor.element_size() if tensor is not None else 0),
            detail,
            channel is None,  # uses_worker
            payload,
            after,
        )
        if watched is None:
            watched = (tensor,) if tensor is not None else ()
        if watched:  # a write to one before the completion is the hook's race (matching.written_in_flight)
            call.in_flight = InFlightTensors(watched)
        engine.post(call)
        future.label = f"{op}#{call.seq} on {call.channel}"
        work = SimWork(future, finished, op, backend.get_future_error(op))
        if op in backend.never_completed_ops:
            work._seen_pending = _NeverCompleted(finished, "whose work gloo never says is completed: is_completed() "
                                                 "stays False even after its wait() returned (docs/gloo-facts.md §18)")
        return work

    def _reduce_signature(self, op: str, tensor: torch.Tensor, opts: Any) -> tuple[tuple[Any, ...], str, Any, str | None]:
        """``(signature, reduce-op name, premul factor, backend rejection or None)`` of a
        reduction called with ``opts`` (its ``reduceOp``; ``SUM`` without one: :func:`_reduce_op`).

        The name, the rejection and the dtype's name depend only on ``(op, reduce-op kind,
        dtype, backend)``: cached per kind (every reduction call is hot); a ``PREMUL_SUM``
        carries its own factor and is never cached."""
        reduce_op = _reduce_op(opts)
        dtype = tensor.dtype
        backend = self._runtime.backend.name
        key = (op, reduce_op.op.value, dtype, backend) if type(reduce_op) is _ReduceOp else None
        known = _REDUCTIONS.get(key) if key is not None else None
        if known is None:
            name, factor = collectives.reduce_op_name(reduce_op)
            known = (name, collectives.rejection(op, name, dtype, backend), _dtype(tensor))
            if key is not None and factor is None and name != "PREMUL_SUM":
                _REDUCTIONS[key] = known
        else:
            factor = None
        name, error, dtype_name = known
        return (dtype_name, tuple(tensor.shape), name), name, factor, error

    # -- reductions -----------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None, timeout: Any = None, *,
                  op: Any = None) -> SimWork:
        if type(opts) is not _ALLREDUCE_OPTIONS or type(tensors) is not list:  # torch's other overloads (not hot)
            tensors, opts = _tensor_list(tensors), _reduce_options(opts if op is None else op, dist.AllreduceOptions)
        self._one_tensor("all_reduce", tensors)
        (t,) = tensors
        sig, name, factor, error = self._reduce_signature("all_reduce", t, opts)
        backend = self._runtime.backend.name

        integers = name == "SUM" and not (t.dtype.is_floating_point or t.dtype.is_complex)
        runtime = self._runtime

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            result = collectives.reduce([calls[r].payload for r in ranks], name, backend, premul_factor=factor)
            if integers:  # before the copies below overwrite the addends
                _note_wrap(runtime.engine.trace, calls[ranks[0]], [calls[r].payload for r in ranks], result)
            out = {}
            for r in ranks:
                mine = calls[r].payload
                collectives.copy_bits_(mine, result)
                if name == "AVG":
                    increment_version(mine)  # gloo divides the sum in place: the version moves once (measured)
                out[r] = ([mine], None)
            return out

        return self._post("all_reduce", t, sig, compute, t, detail=_op_words(name, factor), error=error)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        self._check_tensors("all_reduce_coalesced", tensors)
        if not tensors:
            raise ValueError(f"all_reduce_coalesced on rank {self.global_rank}: no tensors")
        first = tensors[0]
        name, factor = collectives.reduce_op_name(_reduce_op(opts))
        error = collectives.rejection("all_reduce_coalesced", name, first.dtype, self._runtime.backend.name)
        backend = self._runtime.backend.name
        shapes = tuple((_dtype(t), tuple(t.shape)) for t in tensors)

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            parts = collectives.all_reduce_coalesced([calls[r].payload for r in ranks], name, backend,
                                                     premul_factor=factor)
            for r in ranks:
                for mine, part in zip(calls[r].payload, parts):
                    collectives.copy_bits_(mine, part)
                    increment_version(mine)  # copied back from the flat buffer: each tensor's version moves once (measured)
            return {r: (list(calls[r].payload), None) for r in ranks}

        return self._post("all_reduce_coalesced", first, (shapes, name), compute, list(tensors),
                          nbytes=sum(t.numel() * t.element_size() for t in tensors), watched=tuple(tensors),
                          detail=_op_words(name, factor),
                          error=error)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None, op: Any = None, timeout: Any = None, *,
               root: Any = None) -> SimWork:
        if not hasattr(opts, "rootRank"):  # torch's reduce(tensor, root, op=SUM) overload
            opts = _rooted(dist.ReduceOptions, root if root is not None else opts,
                           _reduce_options(op if op is not None else dist.ReduceOp.SUM, dist.ReduceOptions))
        tensors = _tensor_list(tensors)
        self._one_tensor("reduce", tensors)
        (t,) = tensors
        root = opts.rootRank
        sig, name, factor, error = self._reduce_signature("reduce", t, opts)
        backend = self._runtime.backend.name
        root_global = self._root("reduce", root)

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            buffers = collectives.reduce_to_root(
                [calls[r].payload for r in ranks], name, backend, root, premul_factor=factor
            )
            for r, buffer in zip(ranks, buffers):
                collectives.copy_bits_(calls[r].payload, buffer)
                if name == "AVG":
                    increment_version(calls[r].payload)  # the in-place division, on every rank (measured)
            return {r: ([calls[r].payload], None) for r in ranks}

        return self._post("reduce", t, (*sig, f"root={root}"), compute, t,
                          detail=f"{_op_words(name, factor)}, root {root}", error=error)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None,
                       timeout: Any = None, *, op: Any = None) -> SimWork:
        if isinstance(outputs, torch.Tensor):  # torch's reduce_scatter(output, input_list, op=SUM) overload
            outputs, inputs = [outputs], [list(inputs)]
        opts = _reduce_options(opts if op is None else op, dist.ReduceScatterOptions)
        self._one_tensor("reduce_scatter", outputs)
        out, ins = outputs[0], inputs[0]
        self._check_tensors("reduce_scatter", ins)
        self._list_len("reduce_scatter", "input_list", ins)
        sig, name, factor, error = self._reduce_signature("reduce_scatter", out, opts)
        return self._reduce_scatter_post("reduce_scatter", out, list(ins), sig, name, factor, error)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        self._check_tensors("reduce_scatter_tensor", [output, input])
        if self._runtime.backend.strict_gather_shapes and output.dim() and input.dim() \
                and output.shape[0] * self.size() != input.shape[0]:
            # gloo checks the first dimensions, at the call (measured, docs/gloo-facts.md §8); its glog
            # line's time stamp is masked (names.without_addresses), the rest word for word
            raise BackendError(f"[rank{self.global_rank}]:[F{MASKED_STAMP} ProcessGroupGloo.cpp:1537] Check failed: "
                               f"outputShape[0] * worldSize == inputShape[0] ({output.shape[0] * self.size()} vs. "
                               f"{input.shape[0]}). \n")
        if input.numel() != output.numel() * self.size():
            raise ValueError(
                f"reduce_scatter_tensor on rank {self.global_rank}: input has {input.numel()} elements, expected "
                f"output.numel() * world_size = {output.numel() * self.size()}"
            )
        sig, name, factor, error = self._reduce_signature("reduce_scatter_tensor", output, opts)
        chunks = list(input.reshape(self.size(), *output.shape).unbind(0))
        return self._reduce_scatter_post("reduce_scatter_tensor", output, chunks, sig, name, factor, error, input)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_post(
        self, op: str, out: torch.Tensor, chunks: list[torch.Tensor], sig: tuple[Any, ...], name: str, factor: Any,
        error: collectives.Rejection | None, whole: torch.Tensor | None = None,
    ) -> SimWork:
        backend = self._runtime.backend.name
        group = self.spec.ranks
        whole_tensor = op == "reduce_scatter_tensor"
        if not whole_tensor:
            increment_version(out)  # gloo's reduce_scatter moves the output's version once, in the call

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            inputs = [calls[s].payload[1] for s in ranks]
            if op == "reduce_scatter_tensor":
                whole = [calls[s].payload[2] for s in ranks]
                parts = collectives.reduce_scatter_tensor(whole, name, backend, premul_factor=factor)
            else:
                parts = collectives.reduce_scatter(inputs, name, backend, premul_factor=factor)
            results = {}
            for r, part in zip(ranks, parts):
                mine = calls[r].payload[0]
                collectives.copy_bits_(mine, part.view(mine.shape))
                if whole_tensor or name == "AVG":  # reduce_scatter_tensor's completion; the list form's AVG division
                    increment_version(mine)  # (measured: docs/gloo-facts.md §13)
                results[r] = ([mine], None)
            return results

        return self._post(op, out, sig, compute, (out, chunks, whole), detail=_op_words(name, factor), error=error)

    # -- gathers and scatters -------------------------------------------------
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> SimWork:
        if isinstance(inputs, torch.Tensor):  # torch's allgather(output_tensors, input_tensor) overload
            outputs, inputs = [list(outputs)], [inputs]
        self._one_tensor("all_gather", inputs)
        (t,) = inputs
        outs = outputs[0]
        self._check_tensors("all_gather", outs)
        if self._runtime.backend.strict_gather_shapes:
            _raise_gloo_gather_error(outs, t, self.size())
        self._list_len("all_gather", "tensor_list", outs)
        uneven = len({o.numel() for o in outs}) > 1  # NCCL (gloo raised above): one broadcast per rank
        signature = self._uneven_all_gather(outs, t) if uneven else (_dtype(t), tuple(t.shape))
        for o in outs:
            if (o.numel() != t.numel() and not uneven) or o.dtype != t.dtype:
                raise ValueError(
                    f"all_gather on rank {self.global_rank}: output {_dtype(o)}{list(o.shape)} does not match "
                    f"input {_dtype(t)}{list(t.shape)}"
                )
        backend = self._runtime.backend

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            sources = [calls[r].payload[1].clone() for r in ranks]
            results = {}
            for r in ranks:
                mine = calls[r].payload[0]
                for o, s in zip(mine, sources):
                    collectives.copy_bits_(o, s.view(o.shape))
                    increment_version(o)  # gloo's all_gather moves each output's version once, by its completion
                # uneven: the value of NCCL's coalesced broadcasts' work is not known (unverified): the outputs
                results[r] = (list(mine) if uneven else backend.all_gather_value(mine), None)
            return results

        return self._post("all_gather", t, signature, compute, (list(outs), t), watched=(t, *outs),
                          nbytes=t.numel() * t.element_size(), error=self._dtype_rejection("all_gather", t))

    def _uneven_all_gather(self, outs: list[torch.Tensor], t: torch.Tensor) -> tuple[Any, ...]:
        """An ``all_gather`` whose outputs differ in size, under the NCCL model: ProcessGroupNCCL
        then broadcasts each rank's input into that rank's output on every rank, one
        ``_broadcast_oop`` per rank in a coalesced group (read from torch's sources; no GPU
        here to measure). Rank ``i``'s input must have output ``i``'s size (else the call
        raises ``ValueError``); every rank must pass the same sizes — the signature the ranks'
        calls are matched on — where a rank with equal sizes takes NCCL's allgather and the
        ranks' calls do not fit together."""
        if outs[self.rank()].numel() != t.numel():
            raise backend_error(ValueError, f"Tensor input and output of _broadcast_oop must have the same number "
                                            f"of elements (all_gather on rank {self.global_rank}: input "
                                            f"{_dtype(t)}{list(t.shape)}, output {self.rank()} "
                                            f"{_dtype(outs[self.rank()])}{list(outs[self.rank()].shape)})")
        return (_dtype(t), "uneven outputs", tuple(o.numel() for o in outs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        self._check_tensors("all_gather_into_tensor", [output, input])
        if self._runtime.backend.strict_gather_shapes:
            _raise_gloo_gather_error(list(output.chunk(self.size())), input, self.size())
        if output.numel() != input.numel() * self.size():
            raise ValueError(
                f"all_gather_into_tensor on rank {self.global_rank}: output has {output.numel()} elements, "
                f"expected input.numel() * world_size = {input.numel() * self.size()}"
            )
        backend, size = self._runtime.backend, self.size()

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            flat = torch.cat([calls[r].payload[1].reshape(-1) for r in ranks])
            results = {}
            for r in ranks:
                out, inp = calls[r].payload
                collectives.copy_bits_(out, flat.view(out.shape))
                increment_version(out)  # gloo's all_gather_into_tensor moves its output's version twice, by its
                increment_version(out)  # completion
                results[r] = (backend.all_gather_into_tensor_value(out, tuple(inp.shape), size), None)
            return results

        return self._post("all_gather_into_tensor", input, (_dtype(input), tuple(input.shape)), compute,
                          (output, input), watched=(input, output),
                          error=self._dtype_rejection("all_gather_into_tensor", input))

    _allgather_base = all_gather_single

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> SimWork:
        raise not_modelled("SimProcessGroup does not support all_gather_coalesced yet; use all_gather per tensor")

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None, timeout: Any = None, *,
                  root: Any = None) -> SimWork:
        if not hasattr(opts, "rootRank"):  # torch's broadcast(tensor, root) overload, or no options (root 0)
            opts = _rooted(dist.BroadcastOptions, root if root is not None else opts)
        tensors = _tensor_list(tensors)
        self._one_tensor("broadcast", tensors)
        (t,) = tensors
        root = opts.rootRank
        root_global = self._root("broadcast", root)
        if self._runtime.backend.name == "gloo" and not t.is_contiguous() and not collectives.is_dense(t):
            raise not_modelled(  # measured: broadcast(x[:, ::2], 1) on real gloo wrote 100..105 into x[0, :] and x[1, :2]
                f"a broadcast into a {list(t.shape)} view with gaps (strides {t.stride()}): real gloo sends and writes "
                f"the {t.numel()} elements of memory from each rank's data pointer, not the view's elements")

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            source = calls[root_global].payload.clone()
            results = {}
            for r, call in calls.items():
                collectives.copy_bits_(call.payload, source)
                results[r] = ([call.payload], None)
            return results

        return self._post("broadcast", t, (_dtype(t), tuple(t.shape), f"root={root}"), compute, t, detail=f"root {root}",
                          error=self._dtype_rejection("broadcast", t))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None,
               timeout: Any = None, *, root: Any = None) -> SimWork:
        if isinstance(inputs, torch.Tensor):  # torch's gather(output_tensors, input_tensor, root) overload
            outputs, inputs = [list(outputs)], [inputs]
        if not hasattr(opts, "rootRank"):
            opts = _rooted(dist.GatherOptions, root if root is not None else opts)
        self._one_tensor("gather", inputs)
        (t,) = inputs
        root = opts.rootRank
        root_global = self._root("gather", root)
        gather_list = outputs[0] if outputs else []
        if self.global_rank == root_global:
            self._list_len("gather", "gather_list", gather_list)

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            dest = calls[root_global].payload[0]
            for o, r in zip(dest, ranks):
                collectives.copy_bits_(o, calls[r].payload[1])
                increment_version(o)  # gloo's gather moves each output's version once, by its completion
            return {r: (list(dest) if r == root_global else [], None) for r in ranks}

        return self._post("gather", t, (_dtype(t), tuple(t.shape), f"root={root}"), compute, (list(gather_list), t),
                          detail=f"root {root}", error=self._dtype_rejection("gather", t))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None,
                timeout: Any = None, *, root: Any = None) -> SimWork:
        if isinstance(outputs, torch.Tensor):  # torch's scatter(output_tensor, input_tensors, root) overload
            outputs, inputs = [outputs], [list(inputs)]
        if not hasattr(opts, "rootRank"):
            opts = _rooted(dist.ScatterOptions, root if root is not None else opts)
        self._one_tensor("scatter", outputs)
        (out,) = outputs
        root = opts.rootRank
        root_global = self._root("scatter", root)
        scatter_list = inputs[0] if inputs else []
        if self.global_rank == root_global:
            self._list_len("scatter", "scatter_list", scatter_list)

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            sources = [s.clone() for s in calls[root_global].payload[1]]
            results = {}
            for r, s in zip(ranks, sources):
                mine = calls[r].payload[0]
                collectives.copy_bits_(mine, s)
                results[r] = ([mine], None)
            return results

        return self._post("scatter", out, (_dtype(out), tuple(out.shape), f"root={root}"), compute,
                          (out, list(scatter_list)), detail=f"root {root}", error=self._dtype_rejection("scatter", out))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> SimWork:
        self._check_tensors("all_to_all", [*outputs, *inputs])
        self._list_len("all_to_all", "input_tensor_list", inputs)
        self._list_len("all_to_all", "output_tensor_list", outputs)
        if any(o.numel() != i.numel() for o, i in zip(outputs, inputs)):  # it passed here until stop 42
            self._refuse("alltoall_sizes")

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            sent = {r: [t.clone() for t in calls[r].payload[1]] for r in ranks}
            results = {}
            for j, r in enumerate(ranks):
                outs = calls[r].payload[0]
                for i, s in enumerate(ranks):
                    collectives.copy_bits_(outs[i], sent[s][j])
                    increment_version(outs[i])  # all_to_all moves each output's version once (measured)
                results[r] = (list(outs), None)
            return results

        first = inputs[0]
        return self._post("all_to_all", first, (_dtype(first),), compute, (list(outputs), list(inputs)),
                          nbytes=sum(t.numel() * t.element_size() for t in inputs),
                          error=self._dtype_rejection("all_to_all", first))

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
        input_split_sizes: list[int], opts: Any = None,
    ) -> SimWork:
        self._check_tensors("all_to_all_single", [output, input])
        if not input.is_contiguous():  # at the call on gloo (measured; its output may be a transposed view)
            raise backend_error(ValueError, "Tensors must be contiguous")
        size = self.size()
        error, ins, outs = _alltoall_parts(self._runtime.backend.alltoall_bytes, output, input,
                                           output_split_sizes, input_split_sizes, size)

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            ranks = list(calls)
            sent = {r: [t.clone() for t in calls[r].payload[1]] for r in ranks}
            results = {}
            for j, r in enumerate(ranks):
                out_full, out_parts = calls[r].payload[0]
                for i, s in enumerate(ranks):
                    if out_parts[i].numel() != sent[s][j].numel():
                        raise ValueError(
                            f"all_to_all_single: rank {s} sends {sent[s][j].numel()} elements to rank {r}, "
                            f"which expects {out_parts[i].numel()}"
                        )
                    collectives.copy_bits_(out_parts[i], sent[s][j].view(out_parts[i].shape))
                results[r] = ([out_full], None)
            return results

        return self._post("all_to_all_single", input, (_dtype(input),), compute, ((output, outs), ins),
                          error=self._dtype_rejection("all_to_all_single", input) or (
                              None if error is None else collectives.Rejection(RuntimeError, error, "wait", "measured")))

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> SimWork:
        runtime = self._runtime

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            return _barrier_outcomes(calls, runtime.engine.trace, runtime.engine.choose)

        return self._post("barrier", None, (), compute, None)

    # -- point to point -------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SimWork:
        self._one_tensor("send", tensors)
        (t,) = tensors
        return self._p2p("send", t, self.rank(), dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SimWork:
        self._one_tensor("recv", tensors)
        (t,) = tensors
        return self._p2p("recv", t, src, self.rank(), tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> SimWork:
        raise not_modelled("SimProcessGroup does not support recv from any source (src=None): name the source rank")

    def _p2p(self, op: str, t: torch.Tensor, src: int, dst: int, tag: int) -> SimWork:
        if not t.is_contiguous():  # checked before the tag (gloo, measured)
            self._refuse("p2p_contiguous")
        if tag < 0:
            self._refuse("tag")
        for peer in (src, dst):
            if not 0 <= peer < self.size():
                raise ValueError(f"{op} on rank {self.global_rank}: peer {peer} is not a rank of {self.spec.name}")
        if src == dst and self._runtime.backend.refuses_self_p2p:
            raise BackendError(GLOO_SELF_P2P.format(rank=self.global_rank) + f"\n  simcluster: rank "
                               f"{self.global_rank}'s {op} {'to' if op == 'send' else 'from'} itself on {self.spec.name}: "
                               "gloo has no connection from a rank to itself and raises at the call "
                               "(docs/gloo-facts.md, 'Point to point')")
        src_g, dst_g = self.spec.ranks[src], self.spec.ranks[dst]
        channel = f"{self.spec.name} p2p {src}->{dst} tag {tag}"
        if src == dst and any(o != op for o in self._engine(op).pending_ops(channel)):
            raise not_modelled(
                f"rank {self.global_rank} posted both a send to itself and a recv from itself on {self.spec.name}: "
                "NCCL pairs them (docs/gloo-facts.md, 'Point to point'), the NCCL model does not"
            )

        def compute(calls: dict[int, Call]) -> dict[int, Any]:
            received = calls[dst_g].payload
            collectives.copy_bits_(received, calls[src_g].payload.reshape(received.shape))
            return {r: ([calls[r].payload], None) for r in calls}

        work = self._post(op, t, (_dtype(t), _Elements(tuple(t.shape)), f"{src}->{dst}", f"tag={tag}"), compute, t,
                          channel=channel, ranks=(src_g, dst_g), detail=f"{src}->{dst} tag {tag}")
        backend = self._runtime.backend
        if op == "recv" and backend.recv_knows_its_source:
            work._source = (src, False)
        if backend.p2p_completed_at_wait:
            work._seen_pending = _NeverCompleted(work._finished, "which gloo says is completed only once its wait() "
                                                 "returned (is_completed() stays False until then, however long ago "
                                                 "the data moved; docs/gloo-facts.md, 'Point to point')",
                                                 until_wait=True)
        return work

    # -- not modelled ---------------------------------------------------------
    def _start_coalescing(self, *args: Any) -> None:
        raise not_modelled("SimProcessGroup does not support dist._coalescing_manager")

    def _end_coalescing(self, *args: Any) -> None:
        raise not_modelled("SimProcessGroup does not support dist._coalescing_manager")

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> None:
        raise not_modelled("SimProcessGroup does not support monitored_barrier")

    @property
    def group_name(self) -> str:
        """Not modelled: torch resolves a group by this name in its C++ registry and runs the
        collective through the group's C++ backend (``torch.distributed._functional_collectives``,
        ``torch.ops._c10d_functional``), which a simulated group does not have. On torch's own
        type the read raises ``RuntimeError: ProcessGroup name not set`` for a group without a
        backend — which the simulation would report as the hook's failure, a false alarm on a
        hook that works on a real cluster."""
        raise UnsupportedError(
            f"a group's group_name ({self.spec.name}): functional collectives "
            "(torch.distributed._functional_collectives, torch.ops._c10d_functional), which look a group up by "
            "its name and run in torch's C++ backend, are not modelled by the simulator")

    # -- validation helpers ---------------------------------------------------
    def _one_tensor(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != 1:
            raise not_modelled(f"SimProcessGroup supports one tensor per rank in {op}, got {len(tensors)}")
        t = tensors[0]
        if type(t) is not torch.Tensor or not t.is_cpu or t.is_sparse:  # the common case decided here (hot)
            self._check_tensors(op, tensors)

    def _refuse(self, check: str, **words: object) -> None:
        """Raise what the backend raises at the call for ``check``
        (:attr:`~simcluster.fake.backends.BackendModel.call_refusals`); nothing when it makes
        no such check."""
        error = self._runtime.backend.refusal(check, **words)
        if error is not None:
            raise error

    def _root(self, op: str, root: int) -> int:
        """The global rank of ``root``, a group rank, refused at the call when it is not one,
        in gloo's words (``ProcessGroupGloo::gather: invalid root rank: 2``, also for -1:
        ``benchmarks/measure_gloo_argument_checks.py``). Until stop 42 a root past the group
        raised ``IndexError`` from inside simcluster and -1 passed as the last rank. NCCL's own
        message was not measured: the NCCL model says the same in its name."""
        if not 0 <= root < self.size():
            self._refuse("root", op=op, root=root)
            raise ValueError(f"{op} on rank {self.global_rank}: root {root} is not a rank of {self.spec.name}")
        return self.spec.ranks[root]

    def _dtype_rejection(self, op: str, tensor: torch.Tensor) -> collectives.Rejection | None:
        """The backend's refusal of ``tensor``'s dtype in a collective that does not reduce
        (None: accepted): gloo's ``Invalid scalar type`` at ``wait()`` for int16, uint16,
        uint32, float8, … in every collective — ``gather`` for complex too, which torch
        does not pass as real — and none for send/recv, which move bytes (measured:
        ``benchmarks/measure_gloo_argument_checks.py``; until stop 42 only the reductions were
        refused, and an int16 all_gather passed here and failed on real gloo)."""
        return collectives.rejection(op, None, tensor.dtype, self._runtime.backend.name)

    def _list_len(self, op: str, what: str, items: Sequence[Any]) -> None:
        """Refuse a list of tensors that is not one per rank of the group, at the call: in the
        backend's words where it makes the check itself (its ``call_refusals``), else in
        simcluster's."""
        size = self.size()
        if len(items) == size:
            return
        self._refuse(f"{op} {what}", n=len(items), size=size)
        raise ValueError(
            f"{op} on rank {self.global_rank}: {what} has {len(items)} tensors, the group "
            f"{self.spec.name} has {size} ranks"
        )


wear_torchs_name(SimProcessGroup, dist.ProcessGroup)  # as a real group is named


def _op_words(name: str, factor: Any) -> str:
    """A reduce op as the trace words it: ``SUM``; a ``PREMUL_SUM`` with the factor this rank
    passed (``PREMUL_SUM(factor 0.25)``): what it multiplies by is the whole point of it."""
    if factor is None:
        return name
    if isinstance(factor, torch.Tensor):
        factor = factor.item() if factor.numel() == 1 else factor.reshape(-1).tolist()
    return f"{name}(factor {factor!r})"


def _note_wrap(trace: Trace, call: Call, inputs: list[torch.Tensor], result: torch.Tensor) -> None:
    """Log a :class:`~simcluster.engine.trace.Wrapped` when an integer SUM's ``result`` is not
    the exact sum of ``inputs`` (:func:`~simcluster.fake.collectives.integer_wrap`): a report
    can then say why a quantizing hook's average is off."""
    wrapped = collectives.integer_wrap(inputs, result)
    if wrapped is not None:
        trace.log((Wrapped, (call.op, call.channel, call.seq, call.dtype, *wrapped)))


def _barrier_outcomes(calls: dict[int, Call], trace: Trace, choose: Callable[[int], int]) -> dict[int, Any]:
    """Each rank's ``(value, exception)`` of a barrier: ``([], None)``, except behind a failed
    work. A gloo barrier first waits for the work its rank posted before it (``Call.after``:
    unfinished then, or one of its :data:`RECENTLY_HELD` latest collectives that failed — a
    worker lets go of a failed work only a moment after its ``wait()`` raised) and may re-raise the error
    of one that failed — *without taking part in the barrier* —
    or find the worker already let go of it and go into the exchange: timing, so a pick per
    such rank (``choose``: 0, the exchange; 1, the re-raise). Measured on real gloo
    (docs/gloo-facts.md, "A barrier re-raises"): every rank re-raised, none did, or one did
    while its peer's barrier broke or waited. So: every rank of the group re-raising gets the
    error (the trace's :class:`~simcluster.engine.trace.Failed` names them); none, the barrier
    passes; some, the others wait for them until the group's timeout — a
    :class:`~simcluster.errors.DeadlockError` that says why."""
    held: dict[int, tuple[str, BaseException]] = {}
    for r, call in calls.items():
        failure = next((f for f in map(DoneFlag.failure, call.after) if f is not None), None)
        if failure is not None:
            held[r] = failure
    raising = [r for r in held if choose(2) == 1]  # in group order: one pick per rank, replayed alike
    first = next(iter(calls.values()))
    if not raising:
        return {r: ([], None) for r in calls}
    label, error = held[raising[0]]
    waiting = [r for r in calls if r not in raising]
    if waiting:
        raise DeadlockError(
            f"{first.op} #{first.seq} on {first.channel}: rank{'s' if len(raising) > 1 else ''} "
            f"{', '.join(map(str, raising))} re-raised the error of {label} ({error}), posted before the barrier — "
            f"unfinished then, or failed shortly before: gloo's worker lets go of a failed work only a moment after its "
            f"wait() raises, and its other worker may run later collectives meanwhile — without taking part in the "
            f"barrier: gloo's barrier first waits for its rank's earlier work and "
            f"re-raises its error. Ranks {waiting} went into the barrier's exchange and wait for "
            f"{'them' if len(raising) > 1 else 'it'} until the group's timeout (or fail once a peer's process ends). "
            "Whether a barrier re-raises is timing (real gloo: one rank re-raised and its peer's barrier broke in 4 of "
            "the 5 runs of benchmarks/measure_barrier_reraise.py --no-wait where one did); wait() on a collective "
            "before a barrier, and do not call one after a collective failed")
    trace.log((Failed, (first.op, first.channel, first.seq,
                        f"{error} (the error of {label}, which the barrier waited for)", tuple(raising))))
    out: dict[int, Any] = {}
    for r in calls:
        error = held[r][1]
        again = BackendError(str(error))  # a RuntimeError with the same message, as gloo re-raises it
        again.simcluster_frames = getattr(error, "simcluster_frames", None)  # type: ignore[attr-defined] - the posting line
        out[r] = (None, again)
    return out


class _Elements:
    """A point-to-point tensor's shape in a call's signature, equal to another of the same
    element count: a backend moves the elements, so a (6,) send received into a (2, 3) tensor
    arrives in order (measured on gloo: ``tests/test_process_group.py``, arguments; it was
    reported as a mismatch until stop 42). Shown as the shape."""

    __slots__ = ("shape", "numel")

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.numel = math.prod(shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Elements) and other.numel == self.numel

    def __hash__(self) -> int:
        return hash(self.numel)

    def __str__(self) -> str:
        return str(self.shape)

    __repr__ = __str__


def _rejected(error: str, frames: list[Frame], trace: Trace) -> Callable[[dict[int, Call]], dict[int, Any]]:
    """A collective the backend rejects at ``wait()`` (gloo: ``PREMUL_SUM``, bitwise ops on
    floats): it completes, leaves the data alone, and every rank's future holds the error
    (one per rank), carrying ``frames`` — the user code that posted the call — for reports.
    ``trace`` gets a :class:`~simcluster.engine.trace.Failed` right after its completion."""

    def compute(calls: dict[int, Call]) -> dict[int, Any]:
        first = next(iter(calls.values()))
        trace.log((Failed, (first.op, first.channel, first.seq, error)))
        out = {}
        for r in calls:
            exc = BackendError(error)  # a RuntimeError, as real gloo's is
            exc.simcluster_frames = frames  # type: ignore[attr-defined] - see engine.frames.user_frames
            out[r] = (None, exc)
        return out

    return compute


_ALLREDUCE_OPTIONS = dist.AllreduceOptions


def _tensor_list(tensors: Any) -> Any:
    """A bare tensor (torch's single-tensor overloads: ``pg.allreduce(t)``, ``pg.broadcast(t, 0)``)
    as the one-tensor list the list overloads take; torch reduces it in place and the work's
    future holds ``[t]`` (measured, docs/gloo-facts.md §8). Never iterated as a list of rows."""
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


def _reduce_options(value: Any, make: Callable[[], Any]) -> Any:
    """Options carrying a reduce op: ``value`` itself when it is options already (or None),
    else options made with ``value`` (a ``ReduceOp``, or its ``RedOpType`` such as
    ``dist.ReduceOp.MAX``) as their op — what torch's ``pg.allreduce(tensors, op)``
    overloads do. Read as options, such an op was lost: every one reduced as SUM."""
    if value is None or hasattr(value, "reduceOp"):
        return value
    if not isinstance(value, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        raise TypeError(f"incompatible function arguments: expected a ReduceOp or options, got {type(value).__name__}")
    opts = make()
    opts.reduceOp = value if isinstance(value, dist.ReduceOp) else dist.ReduceOp(value)
    return opts


def _rooted(make: Callable[[], Any], root: Any, base: Any = None) -> Any:
    """Options with ``rootRank`` = ``root`` (torch's ``(tensor, root)`` overloads; None: rank 0,
    as default options), made anew or set on ``base``."""
    opts = base if base is not None else make()
    opts.rootRank = 0 if root is None else int(root)
    return opts


def _reduce_op(opts: Any) -> Any:
    return getattr(opts, "reduceOp", dist.ReduceOp.SUM) if opts is not None else dist.ReduceOp.SUM


def not_modelled(message: str) -> UnsupportedError:
    """The ``UnsupportedError`` for a call of the code under test the simulator does not model,
    remembered for the run in progress (``CURRENT.unmodelled``): a hook that catches it and
    goes on (``except Exception``) does what no real rank would, so the run ends with this
    error whatever follows — until stop 42 a hook that caught a ``recv`` from any source went
    on into a deadlock, reported as its finding, where real gloo runs it."""
    exc = UnsupportedError(message)
    CURRENT.unmodelled.append(exc)
    return exc


def _raise_gloo_gather_error(outs: Sequence[torch.Tensor], t: torch.Tensor, size: int) -> None:
    """Raise what gloo's allgather raises at the call when the outputs do not fit ``t``
    (measured on torch 2.13, docs/gloo-facts.md §8): ``all_gather``'s list, or
    ``all_gather_into_tensor``'s output cut as ``output.chunk(W)`` — one output per rank,
    each shaped exactly as the input (a flat output of the right size for a 2-D input is
    refused; one ``(W·d0, …)`` is not)."""
    if len(outs) != size:
        raise BackendError(f"ProcessGroupGloo::allgather: invalid output tensor list at index 0 "
                           f"(expected length {size}, got {len(outs)})")
    for i, o in enumerate(outs):
        if o.dtype != t.dtype:  # checked before the size (an output of another dtype passed here until stop 42)
            raise BackendError(f"ProcessGroupGloo::allgather: invalid tensor type at index {i} "
                               f"(expected {_tensor_options(t.dtype)}, got {_tensor_options(o.dtype)})")
        if o.shape != t.shape:
            raise BackendError(f"ProcessGroupGloo::allgather: invalid tensor size at index {i} "
                               f"(expected {_sizes(t)}, got {_sizes(o)})")


_CPP_TYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                   torch.bfloat16: "c10::BFloat16", torch.int32: "int", torch.int64: "long int",
                   torch.uint8: "unsigned char", torch.int8: "signed char", torch.bool: "bool"}
"""How a C++ error of torch's names each dtype gloo moves (its ``TensorOptions`` printout;
measured for each: ``benchmarks/measure_gloo_argument_checks.py``)."""


def _tensor_options(dtype: torch.dtype) -> str:
    """A CPU tensor's ``TensorOptions`` as torch's C++ prints them in gloo's type errors."""
    name = _CPP_TYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    return (f"TensorOptions(dtype={name}, device=cpu, layout=Strided, requires_grad=false (default), "
            "pinned_memory=false (default), memory_format=(nullopt))")


SNAPSHOT_ELEMENTS = 4096
"""Up to how many elements a posted tensor that is no view gets a copy of its values at the
post (:class:`InFlightTensors`); a view always does."""


class InFlightTensors:
    """The tensors a posted call reads or writes in flight (an all_reduce's, a gather's input
    and outputs, a coalesced call's every one), as they were at the post: the
    :class:`~simcluster.engine.contract.InFlight` the engine asks at the completion.

    A write shows as a tensor's version counter moved since the post: the fake's collectives
    write results without moving it, as gloo does (``docs/gloo-facts.md`` §13) — except the
    gathers' and reduce_scatter's outputs, whose moves gloo makes too, so a gather writing
    into memory an all_reduce has in flight counts, as the race it is on gloo. Where the
    counter alone cannot tell, a copy of the values taken at the post is compared: a view
    (its counter is its base's, moved by writes anywhere in the base); an inference tensor
    (it has none: version -1); any tensor of at most :data:`SNAPSHOT_ELEMENTS` — in-place
    calls that move the counter without changing a value (``t.copy_(t)``, ``zero_()`` of an
    empty slice, ``squeeze_()``) are no race. A larger tensor that is no view is judged by
    its counter (a copy per post would cost the 1M-element step ~15 %: docs/gloo-facts.md §14)."""

    __slots__ = ("_tensors", "_versions", "_copies")

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        versions, copies = [], []
        for t in tensors:
            inference = t.is_inference()
            versions.append(-1 if inference else t._version)
            keep = inference or t._base is not None or t.numel() <= SNAPSHOT_ELEMENTS
            copies.append(t.clone() if keep else None)
        self._tensors, self._versions, self._copies = tensors, versions, copies

    def written(self) -> tuple[str, str] | None:
        """Which tensor the rank wrote since the post, in words, and how sure (see the class);
        None if none. The copies are let go: they are the size of what was posted."""
        tensors, copies = self._tensors, self._copies
        i = self._first_written()
        self._copies = [None] * len(copies)
        if i is not None:
            t, copy = tensors[i], copies[i]
            which = f"its tensor {i + 1} of {len(tensors)}, " if len(tensors) > 1 else ""
            caveat = "" if copy is not None else (
                " (seen by its version counter, which in-place calls that change no value — t.copy_(t), zero_() of an "
                f"empty slice — move too: for a tensor above {SNAPSHOT_ELEMENTS:,} elements that is no view simcluster "
                "keeps no copy of the values to tell them apart)")
            return f"{which}{_dtype(t)}{list(t.shape)}", caveat
        return None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory overlaps one of these tensors' (same storage, bytes in common)."""
        span = _bytes_spanned(tensor)
        return span is not None and any(
            (mine := _bytes_spanned(t)) is not None and mine[0] == span[0] and mine[1] < span[2] and span[1] < mine[2]
            for t in self._tensors)

    def changed(self) -> bool:
        """Whether :meth:`written` would name a tensor now (nothing let go): asked after each
        user line of a reported re-run (:class:`~simcluster.engine.write_watch.WriteWatch`)."""
        return self._first_written() is not None

    def _first_written(self) -> int | None:
        """The index of the first tensor written since the post (see the class), or None."""
        for i, (t, version, copy) in enumerate(zip(self._tensors, self._versions, self._copies)):
            if version >= 0 and t._version == version:
                continue  # not written (the common case: no copy compared)
            if copy is not None and collectives.bits_equal(t, copy):
                continue  # the counter moved, the values did not: no race
            return i
        return None


def _bytes_spanned(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(storage address, first byte, end byte)`` of the memory ``t``'s elements lie in (from
    its first to its last element, gaps of a strided view included); None when empty."""
    if t.numel() == 0:
        return None
    size = t.element_size()
    first = t.storage_offset()
    last = first + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    return t.untyped_storage().data_ptr(), first * size, (last + 1) * size


def _sizes(t: torch.Tensor) -> str:
    """A shape as c10 prints it in gloo's messages: ``(2, 3)``, ``(4)``."""
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


ALLTOALL_SPLITS = "Number of tensor splits not equal to group size"
ALLTOALL_SPLIT_SUM = "Split sizes doesn't match total dim 0 size"
ALLTOALL_ROWS = "Tensor's dim 0 does not divide equally across group size"
"""c10d's ``checkSplitSizes`` (torch 2.13, measured on gloo: docs/gloo-facts.md §8)."""

GLOO_ALLTOALL_UNEVEN = ("[enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/alltoall.cc:29] "
                        "in->size % context->size == 0. ")
GLOO_ALLTOALL_SIZES = ("[enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/alltoall.cc:30] "
                       "in->size == out->size. ")
"""What gloo's own ``alltoall`` enforces for an ``all_to_all_single`` without split sizes,
byte for byte as the torch 2.13 wheel words it (measured, docs/gloo-facts.md §8)."""


def _alltoall_parts(
    as_bytes: bool, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
    input_split_sizes: list[int], size: int,
) -> tuple[str | None, list[torch.Tensor], list[torch.Tensor]]:
    """``(error, input parts, output parts)`` of an ``all_to_all_single`` on a group of
    ``size`` ranks, part ``i`` going to (coming from) group rank ``i``; ``error`` is what
    the backend raises instead (``None``: it runs).

    With split sizes (either side), both backends run c10d's ``checkSplitSizes`` on the
    input, then the output: a side without sizes must split its dim 0 evenly. Without any,
    gloo (``as_bytes``) runs its own ``alltoall`` on the *bytes*: it enforces ``in->size %
    W == 0`` and ``in->size == out->size`` and cuts the flat bytes in ``W`` equal parts —
    rows that do not split evenly are cut mid-row, and a float32[5] on two ranks sends
    10 bytes each: two and a half floats (measured). NCCL splits dim 0 (read from its
    code, not run)."""
    if as_bytes and not output_split_sizes and not input_split_sizes:
        in_bytes = input.numel() * input.element_size()
        if in_bytes % size:
            return GLOO_ALLTOALL_UNEVEN, [], []
        if in_bytes != output.numel() * output.element_size():
            return GLOO_ALLTOALL_SIZES, [], []
        if input.is_contiguous() and output.is_contiguous():
            return None, list(input.reshape(-1).view(torch.uint8).chunk(size)), \
                list(output.view(-1).view(torch.uint8).chunk(size))
    parts = []
    for t, sizes in ((input, input_split_sizes), (output, output_split_sizes)):
        if not sizes:
            if t.shape[0] % size:
                return ALLTOALL_ROWS, [], []
            parts.append(list(t.split(t.shape[0] // size)))
        elif len(sizes) != size:
            return ALLTOALL_SPLITS, [], []
        elif sum(sizes) != t.shape[0]:
            return ALLTOALL_SPLIT_SUM, [], []
        else:
            parts.append(list(t.split(list(sizes))))
    return None, parts[0], parts[1]
