"""Which user line read a tensor a collective still had in flight: a torch function mode.

A hook that posts ``all_reduce(scale, op=MAX, async_op=True)`` and quantises with ``scale``
before it waits reads memory gloo is writing on its worker thread: it sees its own value or
the reduced one, depending on timing. The simulator gives the value from before the
collective (the collective writes at its completion), so such a hook fails — ranks disagree,
the mean is off — and the report said no more than that. Reads leave no trace a check at
the completion could find (writes move version counters; reads do not), so the reported
re-run of a wrong value (:func:`simcluster.checking.judge.with_read_cause`) watches every
torch call a user line makes: a :class:`~torch.overrides.TorchFunctionMode` on each thread
that runs rank code, installed through the engine's
:class:`~simcluster.engine.write_watch.WriteWatch` (the engine knows no tensors: it asks
each call's in-flight record whether the tensors overlap its memory).

What counts as a read: any torch function or tensor method called *by a user line* (torch's
own Python wrappers in between are looked through; simcluster's, the standard library's and
``torch.distributed``'s callers are not user lines) with a tensor argument whose memory
overlaps a tensor in flight — except what reads no element: metadata (``size()``,
``shape``, ``dtype``, ``data_ptr()``, …) and views (``view``, slicing, ``detach``, …; a read
*through* the view is seen, it overlaps the same memory), and the tensor an in-place method
writes (``t.add_(…)``'s ``t``: a write, :class:`WriteWatch`'s) or an ``out=`` argument.
Only the first read of each call is recorded. The search never runs this (a torch call
costs ~2x under a mode).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from simcluster.engine.frames import is_internal
from simcluster.engine.write_watch import WriteWatch

__all__ = ["enter_read_watch", "NOT_READS"]

NOT_READS = frozenset({
    # metadata
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
    "data_ptr", "untyped_storage", "storage", "_version", "__len__", "is_complex", "is_floating_point",
    "is_inference", "has_names", "get_device", "__hash__", "dtype", "shape", "device", "requires_grad", "grad",
    "grad_fn", "is_leaf", "layout", "ndim", "names", "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta",
    "_base", "itemsize", "nbytes", "is_conj", "is_neg", "is_set_to", "is_shared", "is_pinned",
    "requires_grad_", "retain_grad", "register_hook", "__torch_function__",
    # views: no element read (a read through one overlaps the same memory)
    "data", "T", "mT", "H", "mH", "view", "view_as", "reshape", "reshape_as", "__getitem__", "narrow", "flatten",
    "unflatten", "chunk", "split", "tensor_split", "unbind", "select", "detach", "detach_", "t", "transpose",
    "permute", "squeeze", "unsqueeze", "expand", "expand_as", "as_strided", "view_as_real", "view_as_complex",
    "movedim", "swapaxes", "diagonal", "unfold",
})
"""Torch functions that read no element of their tensor arguments."""

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DISTRIBUTED_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep


def _name(func: Any) -> str:
    """``abs`` for ``Tensor.abs``, ``shape`` for the ``Tensor.shape`` getter."""
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # a property's getter: name the property
        return getattr(getattr(func, "__self__", None), "__name__", name) or name
    return name


def _user_caller(frame: FrameType | None) -> FrameType | None:
    """The user frame that made this torch call: ``frame`` (the caller of the mode's
    handler) or, past torch's own Python wrappers (``torch/_tensor.py``,
    ``torch/functional.py``), the first frame outside torch; None when that is not user
    code, or the call came through ``torch.distributed``."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH_DIR):
            return None if is_internal(filename) else frame
        if filename.startswith(_DISTRIBUTED_DIR):
            return None
        frame = frame.f_back
    return None


def _tensors(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)


class _ReadWatchMode(TorchFunctionMode):
    """Asks :meth:`WriteWatch.read` about each torch call a user line makes with tensors,
    while the running rank has a call in flight nobody read yet."""

    def __init__(self, watch: WriteWatch) -> None:
        super().__init__()
        self._watch = watch

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self._watch.watching_reads():
            name = _name(func)
            frame = None if name in NOT_READS else _user_caller(sys._getframe(1))
            if frame is not None:
                read: list[torch.Tensor] = []
                written = args[0] if args and (name.endswith("_") or name == "__setitem__") else None
                _tensors([a for a in args if a is not written], read)
                _tensors([v for k, v in kwargs.items() if k != "out"], read)
                if read:
                    self._watch.read(read, f"Tensor.{name}" if args and isinstance(args[0], torch.Tensor)
                                     and hasattr(torch.Tensor, name) else f"torch.{name}", frame)
        return func(*args, **kwargs)


def enter_read_watch(watch: WriteWatch) -> Callable[[], None]:
    """Install the read watch on the calling thread (the engine's ``watch_reads``); returns its undo."""
    mode = _ReadWatchMode(watch)
    mode.__enter__()
    return lambda: mode.__exit__(None, None, None)
