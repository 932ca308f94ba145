"""DDP's copy-back: what the reducer makes of the value of a hook's future.

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

from typing import Any

import torch

from simcluster.fake.bucket import packing
from simcluster.errors import CopyBackError, SimClusterError, add_context_note

__all__ = ["resolved", "copy_bucket"]

_CALLBACK_ERROR = "Got the following error when running the callback"


def resolved(future: torch.futures.Future, outputs: list[Any], where: str, api: str) -> torch.Tensor:
    """The tensor DDP's reducer gets from a completed future, or its error."""
    try:
        value = future.value()
    except Exception as exc:  # noqa: BLE001 - classified below, as the reducer sees it
        outputs.append(exc)
        if isinstance(exc, SimClusterError):  # a modelled backend failure of the collective
            add_context_note(exc, f"simcluster: the hook's future failed ({where})")
            raise
        if isinstance(exc, RuntimeError) and str(exc).startswith(_CALLBACK_ERROR):
            raise CopyBackError(f"{exc}\n  simcluster: {where}: a then-callback of the hook raised; "
                                "real DDP raises this error from backward()") from exc
        raise CopyBackError(
            f"Unable to cast {exc} to Tensor\n  simcluster: {where}: the future was completed with "
            f"set_exception({type(exc).__name__}(...)); real DDP treats the exception as the result and fails "
            "to cast it"
        ) from exc
    outputs.append(value)
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
    hint = ""
    if isinstance(value, (list, tuple)):
        hint = (" — the PyTorch 1.7-1.9 contract ([tensor]); since 1.10 the future must hold the tensor itself "
                "(DDPConfig(api='legacy') accepts it)")
    raise CopyBackError(
        f"Unable to cast {value} to Tensor\n  simcluster: {where}: the hook's future resolved to a "
        f"{type(value).__name__}{hint}"
    )


def copy_bucket(
    result: torch.Tensor, params: list[torch.nn.Parameter], as_view: bool, where: str, warnings: list[str]
) -> None:
    """Copy ``result`` into the bucket's parameters' ``.grad`` (buffer order) as the reducer does."""
    try:  # views of the result's storage from element 0, whatever the result's own view
        views = [result.as_strided((n,), (1,), off).view(p.shape) for (off, n), p in zip(packing(params), params)]
    except RuntimeError as exc:
        need = sum(p.numel() for p in params)
        raise CopyBackError(
            f"{exc}\n  simcluster: {where}: the hook's result (shape={tuple(result.shape)}, dtype={result.dtype}) "
            f"has a storage of {result.untyped_storage().nbytes() // result.element_size()} elements; the bucket "
            f"needs {need}"
        ) from exc
    if result.storage_offset() != 0 or not result.is_contiguous():
        warnings.append(
            f"{where}: result has storage_offset={result.storage_offset()}, stride={result.stride()}; DDP read "
            "its storage from element 0 as contiguous, not the values the view shows"
        )
    for p, view in zip(params, views):
        if as_view and p.grad is not None:
            if p.grad.untyped_storage().data_ptr() != result.untyped_storage().data_ptr():
                with torch.no_grad():
                    p.grad.copy_(view)
        else:
            p.grad = torch.empty(p.shape, dtype=p.dtype).copy_(view)
