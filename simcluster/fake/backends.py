"""Backend models: what a hook observes that differs between gloo and NCCL.

A hook's result can depend on the backend in five ways, and each model states all five:

1. **The shape of a future's value.** ``all_reduce`` resolves to ``[t]`` (the input
   tensor itself) on both. ``all_gather`` resolves to the flat list of the output
   tensors themselves on gloo, but to ``[flat]`` — *one* tensor of shape ``(W, …)`` — on
   NCCL. A hook that indexes ``fut.value()[0]`` gets rank 0's tensor on one and the
   whole gathered batch on the other.
2. **Which futures exist.** gloo's ``reduce_scatter``, ``reduce_scatter_tensor`` and
   point-to-point works raise ``RuntimeError: Work::getFuture not implemented.``.
3. **Where callbacks run.** On gloo, a collective runs on one of the group's worker
   threads (2 per group by default) and its future's ``then`` callbacks run on that
   worker; a callback that blocks on another collective holds the worker, so enough
   blocking callbacks starve the group — a real deadlock the model reproduces. On
   NCCL the future is marked complete as soon as the work is enqueued on the device
   stream, so callbacks run at once in the issuing thread. **Difference from the real
   thing:** a CPU simulation cannot hand out a result before every rank has posted the
   collective, so the NCCL model completes a collective once all ranks posted it (in
   the scheduler's order) and runs callbacks then, with no worker limit. The thread
   also sets the **grad mode** callbacks see (it is per thread): on gloo a callback run
   at completion sees the worker thread's, grad enabled (measured), while the hook
   itself runs with grad off, inside ``backward()``; on NCCL callbacks see the issuing
   thread's (read from the code path, not run). **Not modelled:** on gloo a collective
   whose ranks all posted may finish before the hook calls ``then`` on its future; the
   callback then runs inline, in the hook's thread (grad off, no worker held). The
   simulator completes collectives only when rank code waits or returns, so a ``then``
   in straight-line hook code always meets a pending future.
4. **Completion order.** On gloo each rank's workers finish collectives on their own,
   so rank 0 may see collective B complete before A while rank 1 sees A first (measured:
   PowerSGD with two buckets posts its inner all_reduces in different orders on the two
   ranks and gloo aborts on the size mismatch); the gloo model lets the scheduler deliver
   each rank's completion separately — except ``barrier``, which on gloo starts on a rank
   only after that rank's earlier collectives of the group finished, callbacks included
   (measured), so nothing posted before a barrier can complete after it. On NCCL a group's
   collectives run on one stream, in issue order, on every rank; the NCCL model completes
   them in that order.
5. **Which ops and dtypes are accepted, and when the error comes.** gloo raises for
   ``PREMUL_SUM`` and for bitwise ops on floating dtypes at ``wait()``, leaving the
   group usable; NCCL rejects unsupported ops when the call is made. gloo also refuses,
   at the call, gather outputs not shaped as the input and a send or recv to the rank
   itself, which NCCL accepts. The messages and the floating-point summation order come
   from :mod:`simcluster.fake.collectives`. The arguments each backend refuses at the call
   itself — a root outside the group, a negative tag, a list of the wrong length, … — and
   its words for each are :attr:`BackendModel.call_refusals`.

The facts behind each line are in ``docs/gloo-facts.md`` (measured on torch 2.13 with
real gloo) and ``docs/collectives.md``; NCCL's are read from its code paths, not run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from simcluster.errors import UsageError, backend_error
from simcluster.limits import BACKEND_NAMES

__all__ = ["BackendModel", "GLOO", "NCCL", "backend_model"]

_GET_FUTURE_NOT_IMPLEMENTED = "Work::getFuture not implemented."


@dataclass(frozen=True)
class BackendModel:
    """The observable behaviour of one backend (see the module docstring)."""

    name: str
    workers_per_group: int | None
    """gloo: 2 worker threads per group, FIFO; ``None``: no limit (NCCL)."""
    errors_at_call: bool
    """True: an unsupported op raises when called (NCCL); False: at ``wait()`` (gloo)."""
    no_future_ops: frozenset[str]
    """Ops whose ``Work.get_future()`` raises ``Work::getFuture not implemented.``."""
    gather_as_flat: bool
    """True: ``all_gather``'s future holds ``[flat]`` of shape ``(W, …)`` (NCCL)."""
    fifo_per_group: bool
    """True: a group's collectives complete in issue order (NCCL: one stream per communicator)."""
    per_rank_delivery: bool
    """True: each rank sees a collective complete at its own moment (gloo: each rank's own
    worker threads), so two ranks may see two collectives complete in different orders."""
    completion_grad_mode: bool | None
    """The grad mode of the thread that runs a collective's completion callbacks: gloo's
    worker threads have grad enabled (a new thread's default; measured); ``None``: the
    issuing code's, read when the collective is posted (NCCL: callbacks run at once in
    the issuing thread)."""
    barrier_after_prior_work: bool
    """True: ``barrier`` starts on a rank only once every collective that rank posted
    earlier on the group has finished, its ``then`` callbacks included (gloo, measured:
    docs/gloo-facts.md §8); False: no such wait is modelled (NCCL: a group's collectives
    complete in issue order anyway)."""
    alltoall_bytes: bool
    """True: ``all_to_all_single`` without split sizes cuts the flat *bytes* in equal parts
    and enforces its sizes at ``wait()`` (gloo's own ``alltoall``, measured:
    docs/gloo-facts.md §8); False: dim 0's rows (NCCL)."""
    strict_gather_shapes: bool
    """True: ``all_gather`` and ``all_gather_into_tensor`` check their outputs at the call,
    in the backend's own words: one output per rank (the tensor output cut as
    ``output.chunk(W)``), each shaped exactly as the input (gloo's
    ``ProcessGroupGloo::allgather``, measured with ``benchmarks/measure_gather_sizes.py``:
    docs/gloo-facts.md §8); False: only the element count is checked, in simcluster's own
    words (NCCL: its checks are not measured)."""
    refuses_self_p2p: bool
    """True: a ``send``/``recv`` whose peer is the calling rank raises at the call (gloo
    never connects a rank to itself, measured: docs/gloo-facts.md §6, "Point to point");
    False: it is accepted and completes only with the matching half from itself (NCCL, read
    from ``ProcessGroupNCCL::pointToPoint``, same section)."""
    coalesces_p2p: bool
    """True: ``dist.batch_isend_irecv`` returns *one* work for the whole batch (torch 2.13 takes
    its coalescing path when the group's backend ``supports_coalescing``, which
    ``ProcessGroupNCCL`` does — read from its header — and returns ``cm.works``: one work),
    so ``send_req, recv_req = dist.batch_isend_irecv(ops)`` raises ``ValueError`` on NCCL;
    False: one work per op (gloo: ``supports_coalescing`` is False, measured: a list as long
    as the batch). A simulated group is a subclass, which torch's exact-type test sends down
    the per-op path: a run under a coalescing model wraps the works into one
    (:func:`simcluster.fake.rank_context.install_torch_patches`)."""
    new_group_waits: bool
    """True: ``dist.new_group`` returns on a member only once every member made the group
    (gloo connects them all when it is made: a member alone waits until its timeout,
    measured: docs/gloo-facts.md §7); False: it returns at once (NCCL, read from torch's
    ``ProcessGroupNCCL``: without a bound ``device_id`` its communicator is made at the
    group's first collective, where a missing member then hangs it)."""
    knows_nccl_version: bool
    """True: ``torch.cuda.nccl.version()`` answers during a run, as on a real NCCL cluster
    whose CUDA build knows its NCCL (this CPU build does not, so a run installs
    :func:`simcluster.fake.rank_context.nccl_version_stand_in`; only torch's collective
    error logger reads it, for a log field); False: left as torch has it (gloo)."""
    recv_knows_its_source: bool
    """True: a ``recv``'s work answers ``source_rank()`` with its source, the group rank it
    receives from, once its ``wait()`` returned, -1 before (gloo's ``RecvWork``, measured
    2026-12-07); False: it raises, as every other work does (NCCL's work has no
    ``sourceRank``, from torch's source; not measured: no GPU here)."""
    p2p_completed_at_wait: bool
    """True: a ``send``'s or ``recv``'s work says ``is_completed()`` False until its ``wait()``
    returned, however long ago the data moved (gloo, measured 2026-12-07: a recv polled for
    2 s after its peer's send, and the send itself, both False until waited): a hook that
    polls one before it waits spins for ever on a real cluster. False: it says True once the
    operation finished (NCCL: the work queries its CUDA event; from torch's source)."""

    never_completed_ops: frozenset[str] = frozenset()
    """Ops whose work never says ``is_completed()`` True, not even after its ``wait()`` returned
    (gloo's ``reduce_scatter`` and ``reduce_scatter_tensor``, measured 2026-12-07: False right
    after the wait and 0.3 s later, where every other collective's says True; docs/gloo-facts.md
    §18): a hook that polls one spins for ever on a real cluster."""

    call_refusals: Mapping[str, tuple[type[Exception], str]] = field(default_factory=dict)
    """The arguments the backend refuses at the call, by check, with its exception class and
    words (a ``str.format`` template): ``root`` (a root outside the group), ``p2p_contiguous``
    (a non-contiguous send or recv), ``tag`` (a negative one), ``alltoall_sizes`` (all_to_all
    tensors of different sizes), ``"<op> <list>"`` (a list of tensors not one per rank). A
    check the backend does not make is absent. gloo's are measured
    (``benchmarks/measure_gloo_argument_checks.py``, docs/gloo-facts.md §17); NCCL's from its
    source, not run."""

    def refusal(self, check: str, **words: object) -> Exception | None:
        """The error the backend raises at the call for ``check`` (:attr:`call_refusals`, its
        template filled with ``words``), or None when it makes no such check."""
        found = self.call_refusals.get(check)
        return None if found is None else backend_error(found[0], found[1].format(**words))

    def get_future_error(self, op: str) -> str | None:
        return _GET_FUTURE_NOT_IMPLEMENTED if op in self.no_future_ops else None

    def all_gather_value(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What ``all_gather(outputs, t).get_future()`` resolves to, given the filled outputs."""
        if self.gather_as_flat:
            return [torch.stack(list(outputs))]
        return list(outputs)

    def all_gather_into_tensor_value(
        self, output: torch.Tensor, input_shape: Sequence[int], world_size: int
    ) -> list[torch.Tensor]:
        """What ``all_gather_into_tensor(output, t)``'s future resolves to.

        gloo: ``world_size`` *new* view tensors of ``output`` (one per rank's chunk,
        each shaped like the input), measured; NCCL: ``[output]``.
        """
        if self.gather_as_flat:
            return [output]
        return list(output.view(world_size, *input_shape).unbind(0))

    def worker_name(self, group: str, index: int) -> str:
        return f"gloo-worker {group}#{index}" if self.name == "gloo" else f"{self.name} {group}"


GLOO = BackendModel(
    name="gloo",
    workers_per_group=2,
    errors_at_call=False,
    no_future_ops=frozenset({"reduce_scatter", "reduce_scatter_tensor", "send", "recv"}),
    gather_as_flat=False,
    fifo_per_group=False,
    per_rank_delivery=True,
    completion_grad_mode=True,
    barrier_after_prior_work=True,
    alltoall_bytes=True,
    strict_gather_shapes=True,
    refuses_self_p2p=True,
    coalesces_p2p=False,
    new_group_waits=True,
    knows_nccl_version=False,
    recv_knows_its_source=True,
    p2p_completed_at_wait=True,
    never_completed_ops=frozenset({"reduce_scatter", "reduce_scatter_tensor"}),
    call_refusals={
        "root": (RuntimeError, "ProcessGroupGloo::{op}: invalid root rank: {root}"),
        "p2p_contiguous": (RuntimeError, "input tensor has to be contiguous"),  # checked before the tag
        "tag": (RuntimeError, "Tag must be nonnegative"),
        "alltoall_sizes": (RuntimeError, "ProcessGroupGloo::alltoall: input and output tensors must have the same size"),
        "reduce_scatter input_list": (RuntimeError, "invalid input tensor list size, must be world size"),
        "all_to_all input_tensor_list": (RuntimeError, "ProcessGroupGloo::alltoall: input tensor list size {n} does "
                                                       "not match world size {size}"),
        # by analogy with the input list's (measured), as is gather's with scatter's
        "all_to_all output_tensor_list": (RuntimeError, "ProcessGroupGloo::alltoall: output tensor list size {n} does "
                                                        "not match world size {size}"),
        "scatter scatter_list": (RuntimeError, "ProcessGroupGloo::scatter: Incorrect input list size {n}. Input list "
                                               "size should be {size}, same as size of the process group."),
        "gather gather_list": (RuntimeError, "ProcessGroupGloo::gather: Incorrect output list size {n}. Output list "
                                             "size should be {size}, same as size of the process group."),
    },
)

NCCL = BackendModel(
    name="nccl",
    workers_per_group=None,
    errors_at_call=True,
    no_future_ops=frozenset({"send", "recv"}),
    gather_as_flat=True,
    fifo_per_group=True,
    per_rank_delivery=False,
    completion_grad_mode=None,
    barrier_after_prior_work=False,
    alltoall_bytes=False,
    strict_gather_shapes=False,
    refuses_self_p2p=False,
    coalesces_p2p=True,
    new_group_waits=False,
    knows_nccl_version=True,
    recv_knows_its_source=False,
    p2p_completed_at_wait=False,
    call_refusals={
        "root": (RuntimeError, "ProcessGroupNCCL::{op}: invalid root rank: {root}"),  # gloo's form: not measured
        "p2p_contiguous": (ValueError, "Tensors must be contiguous"),
    },
)

_MODELS = {model.name: model for model in (GLOO, NCCL)}
assert tuple(_MODELS) == BACKEND_NAMES, "every backend named in simcluster.limits has a model here"


def backend_model(name: str) -> BackendModel:
    """``"gloo"`` or ``"nccl"`` → its model."""
    if name not in _MODELS:
        raise UsageError(f"backend={name!r} is not modelled; choose one of {list(_MODELS)}")
    return _MODELS[name]
