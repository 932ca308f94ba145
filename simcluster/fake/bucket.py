"""``SimGradBucket``: what a DDP communication hook receives as ``bucket``.

``torch.distributed.GradBucket`` has no Python constructor, so this is a duck type
with the semantics of torch 2.13's, measured inside real DDP runs (gloo, recording
hook; see ``docs/ddp-facts.md``):

* ``buffer()`` is a 1-D contiguous tensor, the same object on every call.
* ``gradients()`` builds *new* views of the *current* buffer on every call, one per
  parameter, shaped like it and packed without gaps in ``parameters()`` order:
  parameter ``k`` is ``buffer()[off_k : off_k + numel_k].view(shape_k)``.
* ``parameters()`` is a new list of the model's own Parameter objects.
* ``set_buffer(x)`` rebinds the buffer to ``x`` — nothing is copied, ``buffer() is x``
  afterwards — and ``gradients()`` then slices ``x``: another dtype gives views of that
  dtype, a longer tensor uses its first elements, a non-contiguous or offset tensor
  gives strided or shifted views, and a shorter, empty, 0-d or ``(1, n)`` tensor makes
  ``gradients()`` fail (the real one raises the same torch error).
* ``index()`` is an int, ``is_last()`` a bool; no new attributes, no pickling or copying.

>>> import torch
>>> w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
>>> bucket = make_bucket(0, [w, b], [torch.ones(2, 2), torch.full((2,), 2.0)], is_last=True)
>>> bucket.buffer()
tensor([1., 1., 1., 1., 2., 2.])
>>> bucket.parameters()[0] is w, bucket.gradients()[1]
(True, tensor([2., 2.]))
>>> bucket.set_buffer(bucket.buffer().half())
>>> bucket.gradients()[1].dtype
torch.float16

**The legacy API** (PyTorch 1.7–1.9, removed in 1.10; torch 2.13's GradBucket has none
of it) is modelled after that era's ``comm.hpp``: ``get_index()``, ``get_tensor()``,
``get_tensors()`` (a one-element list ``[buffer]``), ``get_per_parameter_tensors()``
(= ``gradients()``), ``get_model_params_for_bucket()`` (= ``parameters()``),
``set_tensor(x)`` (= ``set_buffer(x)``) and ``is_the_last_bucket_to_allreduce()``,
which returned ``index == 0`` in every release that had it — contrary to its
docstring, bucket 0 is the *first* bucket reduced, so hooks of that era that use it
for end-of-iteration work run that work at the start of the iteration.

``api="current"`` exposes exactly torch 2.13's methods and ``api="legacy"`` exactly
the 1.7–1.9 ones; the others raise an ``AttributeError`` (so ``hasattr`` works as on
the real bucket), and ``api="both"`` (default) exposes all.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, Literal

import torch
import torch.distributed as dist

from simcluster.errors import (
    GradBucketAttributeError, GradBucketMisuse, GradBucketRuntimeError, GradBucketTypeError, UsageError,
)
from simcluster.fake.futures import in_grad_mode
from simcluster.names import wear_torchs_name

__all__ = [
    "SimGradBucket",
    "make_bucket",
    "pack_bucket",
    "packed_buffer",
    "packing",
]

Api = Literal["both", "current", "legacy"]
_CURRENT = ("index", "buffer", "gradients", "parameters", "is_last", "set_buffer")
_LEGACY = (
    "get_index",
    "get_tensor",
    "get_tensors",
    "is_the_last_bucket_to_allreduce",
    "get_per_parameter_tensors",
    "get_model_params_for_bucket",
    "set_tensor",
)
_COUNTERPART = MappingProxyType({
    "get_index": "index()", "get_tensor": "buffer()", "get_tensors": "buffer()",
    "is_the_last_bucket_to_allreduce": "is_last()", "get_per_parameter_tensors": "gradients()",
    "get_model_params_for_bucket": "parameters()", "set_tensor": "set_buffer()",
    "index": "get_index()", "buffer": "get_tensor()", "gradients": "get_per_parameter_tensors()",
    "is_last": "is_the_last_bucket_to_allreduce()", "parameters": "get_model_params_for_bucket()",
    "set_buffer": "set_tensor()",
})
"""Each generation's method and the other generation's that does its job (for the error's advice)."""
_AVAILABLE = MappingProxyType(
    {"both": frozenset(_CURRENT + _LEGACY), "current": frozenset(_CURRENT), "legacy": frozenset(_LEGACY)}
)


def packing(parameters: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``(offset, numel)`` of each parameter's gradient in a bucket buffer (no gaps).

    >>> packing([torch.zeros(2, 3), torch.zeros(3)])
    [(0, 6), (6, 3)]
    """
    out, offset = [], 0
    for p in parameters:
        out.append((offset, p.numel()))
        offset += p.numel()
    return out


_TORCH_BUCKET_TYPE = "torch._C._distributed_c10d.GradBucket"
"""Real DDP's bucket type as Python's errors name it (its pybind ``tp_name``)."""


class SimGradBucket:
    """A duck type of ``torch.distributed.GradBucket`` (current and legacy API).

    ``buffer`` must be a 1-D contiguous tensor of the parameters' dtype holding
    exactly their elements; ``gradients``, if given, must be views into it packed as
    DDP packs them (checked, so a caller's own packing cannot drift from DDP's).
    Use :func:`make_bucket` to pack gradients into a fresh buffer.

    Differs from the real one: ``repr`` describes the bucket (the real one is the
    default ``<…GradBucket object at 0x…>``); errors are :class:`GradBucketMisuse`
    subclasses carrying the method name and bucket index.
    """

    __slots__ = ("_index", "_buffer", "_params", "_packing", "_is_last", "_api")

    def __new__(cls, *args: Any, api: Api = "both", **kwargs: Any) -> "SimGradBucket":
        # api="current"/"legacy" buckets are instances of a gated subclass (see _gated_class)
        return object.__new__(_bucket_class(cls, api))

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        parameters: Sequence[torch.Tensor],
        *,
        is_last: bool,
        gradients: Sequence[torch.Tensor] | None = None,
        api: Api = "both",
    ) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise UsageError(f"bucket index must be an int >= 0, got index={index!r} (type={type(index).__name__})")
        if not isinstance(is_last, bool):
            raise UsageError(f"bucket {index}: is_last must be a bool, got is_last={is_last!r}")
        if api not in _AVAILABLE:
            raise UsageError(f"bucket {index}: api must be 'both', 'current' or 'legacy', got api={api!r}")
        params = _check_parameters(index, parameters)
        layout = packing(params)
        _check_buffer(index, buffer, params, layout)
        if gradients is not None:
            _check_gradients(index, buffer, params, layout, gradients)
        for name, value in (
            ("_index", index),
            ("_buffer", buffer),
            ("_params", params),
            ("_packing", layout),
            ("_is_last", is_last),
            ("_api", api),
        ):
            object.__setattr__(self, name, value)

    # --- the current API (torch >= 1.10) ---------------------------------------
    def index(self) -> int:
        """The bucket's index; bucket 0 is the first reduced (it changes at the rebuild)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat buffer: the same tensor object until ``set_buffer`` rebinds it."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """New views of the current buffer, one per parameter, shaped like it."""
        return self._views("gradients")

    def parameters(self) -> list[torch.Tensor]:
        """A new list of the model's own Parameter objects, in buffer order."""
        return list(self._parameter_tuple())

    def is_last(self) -> bool:
        """True only for the highest bucket index of the iteration."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Rebind the buffer to ``buffer`` (no copy; any dtype, length or shape)."""
        self._rebind("set_buffer", buffer)

    # --- the legacy API (torch 1.7 - 1.9) ---------------------------------------
    def get_index(self) -> int:
        """Legacy ``index()``."""
        return self._index

    def get_tensor(self) -> torch.Tensor:
        """Legacy (1.9) ``buffer()``."""
        return self._buffer

    def get_tensors(self) -> list[torch.Tensor]:
        """Legacy (1.7/1.8): a new one-element list ``[buffer]`` (one replica per process)."""
        return [self._buffer]

    def get_per_parameter_tensors(self) -> list[torch.Tensor]:
        """Legacy ``gradients()``."""
        return self._views("get_per_parameter_tensors")

    def get_model_params_for_bucket(self) -> list[torch.Tensor]:
        """Legacy (1.9) ``parameters()``."""
        return list(self._parameter_tuple())

    def is_the_last_bucket_to_allreduce(self) -> bool:
        """``index == 0``, as torch 1.8/1.9 implemented it (bucket 0 is reduced *first*)."""
        return self._index == 0

    def set_tensor(self, tensor: torch.Tensor) -> None:
        """Legacy (1.9) ``set_buffer(tensor)``."""
        self._rebind("set_tensor", tensor)

    # --- plumbing -------------------------------------------------------------
    def _where(self, method: str) -> str:
        return f"bucket {self._index}: GradBucket.{method}()"

    def _rebind(self, method: str, buffer: Any) -> None:
        if not isinstance(buffer, torch.Tensor):
            raise GradBucketTypeError(
                f"{self._where(method)} got {type(buffer).__name__} {_short(buffer)}; it takes a torch.Tensor "
                "(torch's GradBucket raises TypeError: incompatible function arguments)"
            )
        object.__setattr__(self, "_buffer", buffer)

    def _parameter_tuple(self) -> tuple[torch.Tensor, ...]:
        """The parameters, made on first use for a :func:`fresh_bucket` (whose one zero
        parameter most hooks never ask for: at 1M elements × 8 ranks, making it eagerly
        cost a 32 MB zero fill per step)."""
        params = self._params
        if isinstance(params, _ZerosLike):
            params = (torch.nn.Parameter(torch.zeros(params.shape, dtype=params.dtype)),)
            object.__setattr__(self, "_params", params)
        return params

    def _views(self, method: str) -> list[torch.Tensor]:
        buf = self._buffer
        views = []
        for k, ((offset, numel), p) in enumerate(zip(self._packing, self._parameter_tuple())):
            try:
                views.append(buf[offset : offset + numel].view(p.shape))
            except (RuntimeError, IndexError) as exc:
                raise GradBucketRuntimeError(
                    f"{self._where(method)}: the buffer (shape={tuple(buf.shape)}, dtype={buf.dtype}, "
                    f"stride={buf.stride()}) cannot hold parameter {k} (shape={tuple(p.shape)}) at elements "
                    f"[{offset}, {offset + numel}): {type(exc).__name__}: {exc} — torch's GradBucket fails the "
                    "same way; was set_buffer() given a tensor shorter than the bucket or not 1-D?"
                ) from exc
        return views

    def __dir__(self) -> list[str]:
        return sorted(_AVAILABLE[self._api])

    def __getattr__(self, name: str) -> Any:
        # Only for names normal lookup did not find. A method of the other API generation
        # (an _Unavailable of the gated class) keeps its era advice; any other name fails as
        # a real bucket's does, worded on torch's type (measured: docs/ddp-facts.md §1), so
        # a hook's `bucket.allreduce()` reads as it would under real DDP.
        hidden = type(self).__dict__.get(name)
        if isinstance(hidden, _Unavailable):
            return hidden.__get__(self, type(self))
        raise AttributeError(f"'{_TORCH_BUCKET_TYPE}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        raise GradBucketAttributeError(
            f"bucket {self._index}: cannot set attribute {name!r}; torch's GradBucket accepts no new "
            "attributes (keep per-bucket state in the hook's state, keyed by bucket.index())"
        )

    def __delattr__(self, name: str) -> None:
        raise GradBucketAttributeError(f"bucket {self._index}: cannot delete attribute {name!r} of a GradBucket")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise GradBucketTypeError(
            f"bucket {self._index}: cannot pickle or copy a GradBucket (torch raises TypeError: cannot pickle "
            "'torch._C._distributed_c10d.GradBucket' object); copy bucket.buffer() instead"
        )

    def __repr__(self) -> str:
        buf = self._buffer
        return (
            f"SimGradBucket(index={self._index}, is_last={self._is_last}, parameters={len(self._parameter_tuple())}, "
            f"buffer=<{buf.dtype} shape={tuple(buf.shape)}>, api={self._api!r})"
        )


class _Unavailable:
    """A method the bucket's ``api`` does not have: reading it raises what torch's (or the
    old era's) GradBucket would, an ``AttributeError`` (so ``hasattr`` is ``False``)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, bucket: SimGradBucket | None, owner: type) -> Any:
        if bucket is None:
            return self
        legacy = self.name in _LEGACY
        era = "torch 1.7-1.9 (removed in 1.10)" if legacy else "torch >= 1.10"
        other = _COUNTERPART.get(self.name)
        instead = f"bucket.{other}" if other else "the other generation's methods"
        advice = (f"port the hook to {instead} (current torch), or check a hook kept in the 1.7-1.9 style with "
                  "--api legacy (Python: api='legacy')" if legacy else
                  f"a 1.7-1.9 hook uses {instead}; check a current hook with --api current (Python: api='current')")
        raise GradBucketAttributeError(
            f"bucket {bucket._index}: GradBucket.{self.name}() exists only in {era}; this bucket models "
            f"api={bucket._api!r}: {advice}"
        )


def _gated_class(base: type[SimGradBucket], api: Api) -> type[SimGradBucket]:
    """The subclass of ``base`` a bucket of ``api`` is an instance of: every method of the
    other generation replaced by an :class:`_Unavailable`. Gating by class, not by a
    ``__getattribute__`` override, leaves every attribute read of an ``api="both"``
    bucket (the default, the hot path) at plain slot and method speed."""
    hidden = {name: _Unavailable(name) for name in _AVAILABLE["both"] - _AVAILABLE[api]}
    cls = type(base.__name__, (base,), {"__slots__": (), "__module__": base.__module__, **hidden})
    cls.__qualname__ = base.__qualname__
    if base is SimGradBucket:
        _wear_torchs_name(cls)
    return cls


def _wear_torchs_name(cls: type) -> None:
    """Name ``cls`` as real DDP's bucket type is named (:func:`~simcluster.names.wear_torchs_name`),
    so Python's own errors about a misused bucket read as real DDP's do:
    ``'torch._C._distributed_c10d.GradBucket' object is not subscriptable``, and, the class
    itself named so too, ``… but got <class 'torch._C._distributed_c10d.GradBucket'>
    instead`` (measured, docs/ddp-facts.md). Otherwise they named ``SimGradBucket``, a class
    the user never wrote. Only the simulator's own bucket classes wear it: a user's subclass
    keeps its name."""
    wear_torchs_name(cls, dist.GradBucket)


_GATED_CLASSES: dict[tuple[type[SimGradBucket], str], type[SimGradBucket]] = {}


def _bucket_class(base: type[SimGradBucket], api: Api) -> type[SimGradBucket]:
    """The class of a bucket of ``api`` (``base`` itself for ``"both"``; a gated subclass,
    made once per ``(base, api)``, otherwise). An unknown ``api`` gives ``base``: its
    constructor then raises the ``UsageError``."""
    if api not in _AVAILABLE or (api == "both" and base is not SimGradBucket):
        return base
    found = _GATED_CLASSES.get((base, api))
    if found is None:
        found = _GATED_CLASSES[(base, api)] = _gated_class(base, api)
    return found


def make_bucket(
    index: int,
    parameters: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    is_last: bool,
    gradient_as_bucket_view: bool = False,
    api: Api = "both",
    into: torch.Tensor | None = None,
) -> SimGradBucket:
    """Pack ``grads`` (one per parameter, same shape and dtype) into a fresh flat buffer —
    or into ``into``, the buffer this bucket had the iteration before (DDP keeps each
    bucket's buffer until it rebuilds its buckets: measured, docs/ddp-facts.md).

    The grads are copied; they and the parameters are left alone, except with
    ``gradient_as_bucket_view=True``, where — as in DDP — each ``p.grad`` becomes the
    bucket's view of that parameter, so in-place edits of the buffer show in ``p.grad``
    (``set_buffer`` does not move them: ``p.grad`` keeps viewing the old buffer).
    """
    params = _check_parameters(index, parameters)
    if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence) or len(grads) != len(params):
        n = len(grads) if isinstance(grads, Sequence) else "?"
        raise UsageError(f"bucket {index}: need one gradient per parameter ({len(params)}), got {n} ({type(grads).__name__})")
    for k, (p, g) in enumerate(zip(params, grads)):
        if not isinstance(g, torch.Tensor) or g.shape != p.shape or g.dtype != p.dtype:
            got = f"shape={tuple(g.shape)}, dtype={g.dtype}" if isinstance(g, torch.Tensor) else f"{g!r}"
            raise UsageError(
                f"bucket {index}: grads[{k}] ({got}) must have parameter {k}'s shape={tuple(p.shape)} "
                f"and dtype={p.dtype}"
            )
    if isinstance(index, bool) or not isinstance(index, int) or index < 0 or not isinstance(is_last, bool):
        raise UsageError(f"bucket index must be an int >= 0 and is_last a bool, got index={index!r}, is_last={is_last!r}")
    if api not in _AVAILABLE:
        raise UsageError(f"bucket {index}: api must be 'both', 'current' or 'legacy', got api={api!r}")
    return pack_bucket(index, params, grads, is_last=is_last, gradient_as_bucket_view=gradient_as_bucket_view,
                       api=api, into=into)


def pack_bucket(index: int, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], *, is_last: bool,
                gradient_as_bucket_view: bool = False, api: Api = "both",
                into: torch.Tensor | None = None) -> SimGradBucket:
    """:func:`make_bucket` for arguments already checked (a DDP model's own parameters and
    gradients: validated once, packed at every step — the hot path)."""
    buffer = in_grad_mode(False, _packed, grads, into)
    # Packed here by construction, so the constructor's checks are skipped (hot path).
    bucket = object.__new__(_bucket_class(SimGradBucket, api))
    layout = packing(params)
    for name, value in (("_index", index), ("_buffer", buffer), ("_params", tuple(params)), ("_packing", layout),
                        ("_is_last", is_last), ("_api", api)):
        object.__setattr__(bucket, name, value)
    if gradient_as_bucket_view:
        for p, (off, n) in zip(params, layout):
            p.grad = buffer[off : off + n].view(p.shape)
    return bucket


def _packed(grads: Sequence[torch.Tensor], into: torch.Tensor | None) -> torch.Tensor:
    """``grads`` flattened into one buffer: ``into`` when it fits (DDP's kept buffer), else a new one."""
    if into is not None and into.dtype == grads[0].dtype and into.numel() == sum(g.numel() for g in grads):
        return torch.cat([g.detach().reshape(-1) for g in grads], out=into)
    if len(grads) > 1:
        return torch.cat([g.detach().reshape(-1) for g in grads])
    return grads[0].detach().reshape(-1).clone()


def packed_buffer(bucket: SimGradBucket) -> torch.Tensor:
    """The buffer :func:`make_bucket` packed the gradients into, under either API (a legacy
    bucket has no ``buffer()``); read before the hook runs, so a ``set_buffer`` cannot move it."""
    return object.__getattribute__(bucket, "_buffer")


class _ZerosLike:
    """A :func:`fresh_bucket`'s parameter before anything asked for it: its shape and dtype."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype


def fresh_bucket(index: int, grad: torch.Tensor, *, is_last: bool) -> SimGradBucket:
    """What ``make_bucket(index, [Parameter(zeros_like(grad))], [grad], is_last=is_last)``
    returns, for a flat, detached ``grad`` the caller has already checked
    (:meth:`~simcluster.fake.cluster.SimCluster.run_hook`'s default parameters): the same
    buffer bits and layout without re-validating what was just made, and the zero
    parameter made only when the hook asks for it (hot path, see ``docs/speed.md``)."""
    bucket = object.__new__(SimGradBucket)
    setattr_ = object.__setattr__
    setattr_(bucket, "_index", index)
    setattr_(bucket, "_buffer", grad.clone())
    setattr_(bucket, "_params", _ZerosLike(grad.shape, grad.dtype))
    setattr_(bucket, "_packing", [(0, grad.numel())])
    setattr_(bucket, "_is_last", is_last)
    setattr_(bucket, "_api", "both")
    return bucket


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_parameters(index: int, parameters: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if isinstance(parameters, torch.Tensor) or not isinstance(parameters, Sequence) or not parameters:
        raise UsageError(f"bucket {index}: parameters must be a non-empty sequence of tensors, got {_short(parameters)}")
    params = tuple(parameters)
    for k, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise UsageError(f"bucket {index}: parameters[{k}]={_short(p)} (type={type(p).__name__}) is not a tensor")
        if p.dtype != params[0].dtype or p.device != params[0].device:
            raise UsageError(
                f"bucket {index}: parameters[{k}] is {p.dtype} on {p.device} but parameters[0] is "
                f"{params[0].dtype} on {params[0].device}; DDP puts each dtype and device in its own buckets"
            )
    return params


def _check_buffer(index: int, buffer: Any, params: Sequence[torch.Tensor], layout: list[tuple[int, int]]) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise UsageError(f"bucket {index}: buffer must be a torch.Tensor, got {type(buffer).__name__}")
    total = layout[-1][0] + layout[-1][1]
    if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() != total or buffer.dtype != params[0].dtype:
        raise UsageError(
            f"bucket {index}: buffer (shape={tuple(buffer.shape)}, dtype={buffer.dtype}, contiguous="
            f"{buffer.is_contiguous()}) must be 1-D, contiguous, {params[0].dtype}, with exactly {total} elements "
            "(the parameters' numels added up)"
        )


def _check_gradients(
    index: int,
    buffer: torch.Tensor,
    params: Sequence[torch.Tensor],
    layout: list[tuple[int, int]],
    gradients: Sequence[torch.Tensor],
) -> None:
    if not isinstance(gradients, Sequence) or len(gradients) != len(params):
        raise UsageError(f"bucket {index}: gradients must hold one view per parameter ({len(params)})")
    base = buffer.data_ptr()
    for k, (g, p, (offset, numel)) in enumerate(zip(gradients, params, layout)):
        ok = isinstance(g, torch.Tensor) and g.shape == p.shape and g.dtype == buffer.dtype and g.is_contiguous()
        if ok and numel:
            ok = g.data_ptr() == base + offset * buffer.element_size()
        if not ok:
            raise UsageError(
                f"bucket {index}: gradients[{k}] must be the contiguous view buffer[{offset}:{offset + numel}]"
                f".view({tuple(p.shape)}), as DDP packs gradients without gaps in parameter order"
            )
