"""DDP's reducer, as a comm hook meets it: what the hook must return, and what becomes of its future.

The one home of how DDP calls a hook (:func:`call_hook`) and of the hook's result contract, shared by :meth:`SimCluster.run_hook
<simcluster.fake.cluster.SimCluster.run_hook>` (one bucket) and :meth:`SimDDP.step
<simcluster.ddp.model.SimDDP.step>` (every bucket of a backward pass), in the order the
reducer applies it:

1. :func:`check_future` — the hook must return a ``torch.futures.Future`` (real DDP's
   pybind cast error otherwise; ``None`` crashes real DDP);
2. :func:`collect` — wait on it as the reducer does, inside the simulation (and if the
   run deadlocks, :func:`returned_lines` says which ranks' futures completed while a
   peer's for the same bucket never will);
3. :func:`resolved` — the tensor the reducer gets from the completed future, or the error
   real DDP raises from ``backward()`` (:func:`raise_stored`: the future's own error,
   where a bare hook run reports it as itself);
4. :func:`copy_bucket` — the copy-back into ``p.grad``.

Measured on torch 2.13 / gloo (``docs/ddp-facts.md``, "Copy-back (measured)"). For each
bucket the reducer takes the future's value as a tensor and gives parameter ``k``
(offset ``off_k`` in the bucket's buffer order) ``result.as_strided((numel_k,), (1,),
off_k)`` cast into ``p.grad``: the result's *storage* read from element 0. So

>>> import torch
>>> p = torch.nn.Parameter(torch.zeros(2))
>>> copy_bucket(torch.arange(4.0)[::2], [p], False, "example", [])   # a stride-2 view of [0, 1, 2, 3]
>>> p.grad                                                            # ... is read as [0, 1]
tensor([0., 1.])

Anything else raises :class:`CopyBackError`, whose message starts with real DDP's text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from simcluster.engine.matching import MAX_LISTED
from simcluster.fake.bucket import packing
from simcluster.fake.futures import CALLBACK_ERROR, NOT_A_PYOBJECT, SimFuture, holds_cpp_value, in_grad_mode
from simcluster.errors import CallbackError, CopyBackError, HookContractError, add_context_note
from simcluster.names import callable_name, without_addresses

__all__ = ["call_hook", "check_future", "collect", "expect_future", "returned_lines", "raise_stored", "resolved", "cpp_value_why", "copy_bucket",
           "layout_copy"]



def call_hook(hook: Callable[[Any, Any], Any], state: Any, bucket: Any) -> Any:
    """``hook(state, bucket)`` as DDP's reducer calls it: from the autograd engine, during
    ``backward()``, where grad mode is what ``create_graph`` says — off, in a plain
    ``loss.backward()`` (measured on torch 2.13 / gloo: ``torch.is_grad_enabled()`` is
    ``False`` in the hook and in a callback that runs inline, ``True`` in a callback run
    later on a gloo worker thread, ``docs/gloo-facts.md`` §3). So a hook may, say, add a
    parameter-derived term to its bucket in place; with grad mode on the same line raises
    "a leaf Variable that requires grad is being used in an in-place operation".

    The rank's thread gets its grad mode back afterwards, also when the hook raises. A
    hook that waits inside parks on its own thread, whose grad mode stays off meanwhile
    (grad mode is per thread), as on the real autograd thread."""
    return in_grad_mode(False, hook, state, bucket)


def check_future(future: Any, hook: Callable[..., Any], rank: int, where: str, api: str = "current") -> None:
    """Real DDP requires the hook to return a ``torch.futures.Future``: anything else is
    the reducer's pybind cast error from ``backward()`` (and the *next* iteration then
    fails inside the reducer); ``None`` crashes the process (measured on torch 2.13,
    ``docs/ddp-facts.md``, "What the hook itself returns"). ``where`` names the bucket;
    ``api="legacy"`` (a hook written for torch 1.7–1.9) words ``None`` in that contract,
    whose reducer was not measured: the crash is torch 2.13's."""
    # torch.futures.Future subclasses torch._C.Future; a plain future's .then() returns
    # the C++ class itself, which DDP accepts too.
    if future is None:
        if api == "legacy":
            raise CopyBackError(
                f"hook {callable_name(hook)} returned None on rank {rank}, {where}: under the PyTorch 1.7-1.9 "
                "contract (api='legacy') a DDP communication hook must return a torch.futures.Future too "
                "(what a 1.7-1.9 reducer does with None was not measured; on torch 2.13, gloo, real DDP crashes "
                "the process with SIGSEGV in backward())"
            )
        raise CopyBackError(
            f"hook {callable_name(hook)} returned None on rank {rank}, {where}: real DDP (torch 2.13, gloo) crashes "
            "the process with SIGSEGV in backward() (measured); a DDP communication hook must return a "
            "torch.futures.Future"
        )
    if not isinstance(future, torch._C.Future):
        cls = type(future)
        raise CopyBackError(
            f"Unable to cast Python instance of type {cls} to C++ type '?' (#define "
            "PYBIND11_DETAILED_ERROR_MESSAGES or compile in debug mode for details). DDP "
            "communication hook's callback must return a torch.futures.Future object, but got "
            f"{cls.__module__}.{cls.__qualname__}\n  simcluster: hook {callable_name(hook)} on rank {rank}, "
            f"{where}: real DDP raises this from backward() and then fails the next iteration inside the reducer"
        )


def collect(future: torch._C.Future, into: list[Any], rank: int, context: str) -> None:
    """Wait on a hook's future as DDP's reducer does: ``into[rank]`` gets its value, or
    the exception it holds, once it completes; the run cannot end before that.

    Nothing blocks (the reducer's wait has no side effect a hook could observe), so a
    hook that never blocks runs without a single thread hand-over.
    """
    def store(fut: torch.futures.Future) -> None:
        try:
            into[rank] = fut.value()
        except Exception as exc:  # noqa: BLE001 - DDP raises it from backward(); so do we, later
            into[rank] = _Raised(exc)

    expect_future(future, rank, context)
    if isinstance(future, SimFuture):
        future.add_done_callback(store)
    else:
        store(future)


def expect_future(future: torch._C.Future, rank: int, context: str) -> None:
    """``future`` (a hook's, on ``rank``) must complete before the run may end, as DDP's
    reducer waits on it (``context`` names that wait in a deadlock report); a plain torch
    future simcluster did not make must have completed already: it cannot complete in the run."""
    if isinstance(future, SimFuture):
        future.engine.expect(rank, future, context)
    elif not future.done():
        raise HookContractError(
            f"rank {rank}, {context}: the hook returned a pending plain torch Future that simcluster did not "
            "create; it cannot complete inside the simulation (real DDP would hang in backward())"
        )


def returned_lines(returned: list[list[Any]], waits: Callable[[int], str]) -> list[str]:
    """For a deadlock report: what the hook returned on the ranks that are not stuck where
    their peers are. ``returned[r][k]`` is the future rank ``r``'s hook returned for the
    ``k``-th bucket it was called on; ``waits(k)`` names the reducer's wait on it, as
    :func:`collect` was told. For each ``k`` where some rank's future never completes,
    one line per rank whose future has completed, naming that future by its label::

        rank 1: DDP's reducer (iteration 0, bucket 0) waits on nothing: the hook returned torch.futures.Future() #0 made by rank 1 at hooks.py:12, which has completed

    A future the hook made carries its rank's count and the user line that made it
    (:func:`~simcluster.fake.rank_context.user_future_class`), a ``then`` child the label
    of its parent — so a rank that skipped a collective its peers posted is named with
    the line of the future it returned instead. Read only once a run has deadlocked (no
    cost while it runs); at most :data:`~simcluster.engine.matching.MAX_LISTED` lines, then a count."""
    lines: list[str] = []
    for k in range(max(map(len, returned), default=0)):
        futures = [(rank, fs[k]) for rank, fs in enumerate(returned) if len(fs) > k]
        if all(future.done() for _, future in futures):
            continue
        for rank, future in futures:
            if future.done():
                label = getattr(future, "label", "") or "a torch Future simcluster did not make"
                lines.append(f"  rank {rank}: {waits(k)} waits on nothing: the hook returned {label}, which has completed")
    if len(lines) > MAX_LISTED:
        lines = lines[:MAX_LISTED] + [f"  … and {len(lines) - MAX_LISTED} more ranks' completed futures"]
    return lines


@dataclass
class _Raised:
    """A future's stored exception, kept until the run ends."""

    exception: BaseException


def raise_stored(outputs: list[Any], world_size: int, bucket_index: int, replay: Callable[[], str]) -> None:
    """Raise the exception a hook's future held (lowest rank first), with the rank,
    bucket and replay line attached: what a bare hook run (``run_hook``) reports.
    :func:`resolved` is what DDP's reducer makes of the same future."""
    raised = [(r, o.exception) for r, o in enumerate(outputs) if isinstance(o, _Raised)]
    if not raised:
        return
    rank, exc = raised[0]
    add_context_note(exc, f"simcluster: the future returned by the hook on rank {rank} of {world_size}, "
                          f"bucket {bucket_index}, completed with this error")
    if len(raised) > 1:
        add_context_note(exc, f"simcluster: ranks {[r for r, _ in raised]} all failed this way or similarly")
    add_context_note(exc, f"simcluster: replay with {replay()}")
    raise exc


def resolved(future: torch.futures.Future, outputs: list[Any], where: str, api: str) -> torch.Tensor:
    """The tensor DDP's reducer gets from a completed future, or its error."""
    try:
        value = future.value()
    except Exception as exc:  # noqa: BLE001 - classified below, as the reducer sees it
        outputs.append(exc)
        if isinstance(exc, RuntimeError) and str(exc).startswith(CALLBACK_ERROR):
            raise CallbackError(f"{exc}\n  simcluster: {where}: a then-callback of the hook raised; "
                                "real DDP raises this error from backward()") from exc
        if isinstance(future, SimFuture) and future.errored:  # e.g. gloo rejecting the op at wait()
            add_context_note(exc, f"simcluster: {where}: the hook's future is that of a collective that failed; "
                                  "real DDP raises the collective's error from backward()")
            raise
        raise CopyBackError(
            f"Unable to cast {exc} to Tensor\n  simcluster: {where}: the future was completed with "
            f"set_exception({type(exc).__name__}(...)); real DDP treats the exception as the result and fails "
            "to cast it"
        ) from exc
    outputs.append(value)
    if api != "legacy" and holds_cpp_value(future):
        raise CopyBackError(f"{NOT_A_PYOBJECT}\n  simcluster: {where}: {cpp_value_why(future)}")
    if isinstance(value, torch.Tensor):
        return value
    if api == "legacy" and isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    if api == "legacy":  # worded in the contract the hook was written for
        got = "None" if value is None else f"a {type(value).__name__}"
        raise CopyBackError(
            f"the hook's future resolved to {got}: under the PyTorch 1.7-1.9 contract (api='legacy') it must "
            f"resolve to a one-element list [tensor] holding the bucket's result\n  simcluster: {where}"
        )
    if value is None:
        raise CopyBackError(
            "Expected a proper Tensor but got None (or an undefined Tensor in C++) for argument #0 'self'\n"
            f"  simcluster: {where}: the hook's future resolved to None"
        )
    hint, kind = "", type(value).__name__
    if isinstance(value, (list, tuple)):
        hint = (" — the PyTorch 1.7-1.9 contract ([tensor]); since 1.10 the future must hold the tensor itself "
                "(a hook written for 1.7-1.9 is checked with --api legacy; Python: DDPConfig(api='legacy'))")
    elif isinstance(value, torch._C.Future):
        kind = "Future"
        made_by = f" ({future.label})" if isinstance(future, SimFuture) and future.label.startswith("then(") else ""
        hint = (f": a then-callback{made_by} returned a future, and torch does not unwrap it; return its tensor "
                "(e.g. f.value()[0]) instead")
    raise CopyBackError(
        f"Unable to cast {without_addresses(str(value))} to Tensor\n  simcluster: {where}: the hook's future "
        f"resolved to a {kind}{hint}"
    )


def cpp_value_why(future: SimFuture) -> str:
    """Why real DDP refused ``future`` (:func:`~simcluster.fake.futures.holds_cpp_value`), in one line."""
    if future.label.startswith("collect_all"):
        what = "torch.futures.collect_all's future, whose value is a C++ list of futures"
        fix = "a then() of it that returns the tensor"
    else:
        what = f"the future of {future.label} itself, whose value is a C++ list of the collective's tensors"
        fix = "fut.then(lambda f: f.value()[0])"
    return (f"the hook returned {what}; DDP's Python-hook path accepts only a future whose value Python set "
            f"(torch.futures.Future().set_result, a then() callback's return) and raises this before any cast — "
            f"return {fix} (docs/ddp-facts.md; a hook written for PyTorch 1.7-1.9 is checked "
            "with --api legacy, Python: DDPConfig(api='legacy'))")


def copy_bucket(
    result: torch.Tensor, params: list[torch.nn.Parameter], as_view: bool, where: str, warnings: list[str]
) -> None:
    """Copy ``result`` into the bucket's parameters' ``.grad`` (buffer order) as the reducer does:
    into the ``p.grad`` tensor the hook saw (same object before and after, measured), or
    a new one where there is none."""
    layout = packing(params)
    try:  # views of the result's storage from element 0, whatever the result's own view
        views = [result.as_strided(p.shape, _contiguous_strides(p.shape), off) for (off, _), p in zip(layout, params)]
    except RuntimeError:
        try:  # DDP's own form — a flat view, then .view(shape) — for DDP's message, naming the flat view
            [result.as_strided((n,), (1,), off).view(p.shape) for (off, n), p in zip(layout, params)]
        except RuntimeError as exc:
            need = sum(p.numel() for p in params)
            raise CopyBackError(
                f"{exc}\n  simcluster: {where}: the hook's result (shape={tuple(result.shape)}, dtype={result.dtype}) "
                f"has a storage of {result.untyped_storage().nbytes() // result.element_size()} elements; the bucket "
                f"needs {need}"
            ) from exc
        raise  # pragma: no cover - the two forms need the same storage: one fails only if the other does
    if result.storage_offset() != 0 or not result.is_contiguous():
        warnings.append(
            f"{where}: result has storage_offset={result.storage_offset()}, stride={result.stride()}; DDP read "
            "its storage from element 0 as contiguous, not the values the view shows"
        )
    in_grad_mode(False, _into_grads, params, views, as_view, result)


def _into_grads(params: list[torch.nn.Parameter], views: list[torch.Tensor], as_view: bool,
                result: torch.Tensor) -> None:
    """:func:`copy_bucket`'s copies, with grad mode off (the caller's job)."""
    for p, view in zip(params, views):
        if p.grad is None:
            p.grad = torch.empty(p.shape, dtype=p.dtype).copy_(view)
        elif not as_view or p.grad.untyped_storage().data_ptr() != result.untyped_storage().data_ptr():
            p.grad.copy_(view)  # into p.grad itself: a reference the hook kept sees the result (measured)


@functools.lru_cache(maxsize=4096)  # a model has few shapes; the copy-back is hot
def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what ``.view(shape)`` of a flat view gives)."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


def layout_copy(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` copied to the CPU with its layout — the whole storage, viewed with the same
    offset, size and stride, so what the copy-back reads from storage element 0 and the
    contract's storage checks see the same as in the original. With
    ``gradient_as_bucket_view=True`` DDP's ``p.grad`` views its bucket's buffer at the
    parameter's offset (measured: iteration 0 of a (4, 5), (5,) model gives offsets 0 and 20,
    after the rebuild 5 and 0; docs/ddp-facts.md), and the model's results keep it — a plain
    ``clone()`` said offset 0, and e2e called every view-mode run a FIDELITY BUG of the model."""
    t = grad.detach()
    if t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t.clone()  # the whole storage, contiguous from element 0 (the common case: a bucket buffer)
    storage = t.untyped_storage().clone().cpu()  # the whole storage: the offset and stride stay meaningful
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
