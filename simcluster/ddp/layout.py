"""Where DDP puts each parameter: the bucket layout of every iteration.

Real DDP (torch 2.13) lays buckets out twice. Figures below were measured with a
recording hook on real DDP over gloo (see ``docs/ddp-facts.md``).

* **Before the rebuild** (iteration 0; iterations 0 and 1 with ``static_graph``):
  one bucket per dtype holding the parameters in ``model.parameters()`` order,
  whatever the cap. Only ``find_unused_parameters=True`` (without
  ``static_graph``) applies the caps here, walking the parameters in
  ``parameters()`` order; the resulting bucket list is then *reversed*, so bucket 0
  holds the last parameters, each bucket keeping ``parameters()`` order inside.
* **The rebuild** (from iteration 1; from iteration 2 with ``static_graph``): the
  parameters are walked in the order their gradients became ready in the recorded
  iteration (iteration 0; iteration 1 with ``static_graph``), each one appended to
  the open bucket of its dtype; a bucket closes as soon as its bytes reach the cap,
  so it may overshoot by one tensor and a tensor is never split. Bucket 0 holds the
  first-ready gradients. With the default cap (``bucket_cap_mb=None``, i.e. 25 MiB)
  the *first* bucket closes at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB); an
  explicit ``bucket_cap_mb`` applies to the first bucket too (even ``25``).
  ``find_unused_parameters=True`` without ``static_graph`` never rebuilds.

The cap in bytes is ``int(bucket_cap_mb * 2**20)``. Hooks are called in bucket-index
order and ``is_last()`` is True only for the highest index — except in the first
``static_graph`` iteration, where DDP reduces every bucket at the end of backward and
each of them reports ``index() == 0`` (see :func:`bucket_calls`).

The grouping itself is done by torch's own ``dist._compute_bucket_assignment_by_size``
(which also decides the order of partly filled buckets of different dtypes); this
module decides which parameters, limits and order go in, and validates them first
(the C++ function does not: a bad index reads garbage or crashes).

>>> import torch
>>> params = [torch.zeros(64), torch.zeros(64), torch.zeros(64)]   # 256 bytes each
>>> bucket_assignment(params, iteration=0, bucket_cap_mb=300 / 2**20)
[[0, 1, 2]]
>>> bucket_assignment(params, iteration=1, bucket_cap_mb=300 / 2**20)
[[2, 1], [0]]

Not modelled: sparse gradients (``nn.Embedding(sparse=True)`` gets a bucket of its
own), ``no_sync()`` iterations, the Python reducer, CUDA devices, rank-dependent ready
orders (real DDP broadcasts rank 0's rebuilt layout).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from simcluster.errors import UsageError

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "BucketCall",
    "bucket_assignment",
    "bucket_calls",
    "cap_bytes",
    "rebuild_iteration",
]

DEFAULT_BUCKET_CAP_MB = 25
"""DDP's cap when ``bucket_cap_mb`` is None (``torch.nn.parallel.distributed``)."""

_UNLIMITED = sys.maxsize


class BucketCall(NamedTuple):
    """One hook call of an iteration, in call order.

    ``index`` and ``is_last`` are what ``bucket.index()`` and ``bucket.is_last()``
    report; ``params`` are the indices (into the ``params`` list) of the bucket's
    parameters in buffer order.
    """

    index: int
    is_last: bool
    params: tuple[int, ...]


def rebuild_iteration(*, static_graph: bool = False, find_unused_parameters: bool = False) -> int | None:
    """The first iteration that uses the rebuilt layout, or None if DDP never rebuilds.

    >>> rebuild_iteration(), rebuild_iteration(static_graph=True)
    (1, 2)
    >>> rebuild_iteration(find_unused_parameters=True) is None
    True
    """
    if static_graph:
        return 2
    return None if find_unused_parameters else 1


def cap_bytes(bucket_cap_mb: float | None) -> tuple[int, int]:
    """``(first_bucket_cap, cap)`` in bytes for a ``bucket_cap_mb`` as DDP computes them.

    >>> cap_bytes(None)          # default: a small first bucket
    (1048576, 26214400)
    >>> cap_bytes(25)            # explicit, even if equal to the default
    (26214400, 26214400)
    """
    if bucket_cap_mb is None:
        return int(dist._DEFAULT_FIRST_BUCKET_BYTES), DEFAULT_BUCKET_CAP_MB * 2**20
    _check_mb("bucket_cap_mb", bucket_cap_mb)
    cap = int(bucket_cap_mb * 2**20)
    return cap, cap


def bucket_assignment(
    params: Sequence[torch.Tensor],
    *,
    iteration: int,
    bucket_cap_mb: float | None = None,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    ready_order: Sequence[int] | None = None,
    bucket_cap_mb_list: Sequence[float] | None = None,
    last_bucket_small: bool = False,
) -> list[list[int]]:
    """The parameter indices in each bucket of ``iteration``, in bucket-index order.

    ``params`` are the parameters DDP manages (``requires_grad=True``, no duplicates)
    in ``model.parameters()`` order; only their numel, dtype and device matter.
    ``ready_order`` is the order in which their gradients became ready in the recorded
    iteration (a permutation of ``range(len(params))``; default: reverse parameter
    order, as backward through a plain stack of layers produces it). It is used only
    from the rebuild on (:func:`rebuild_iteration`).

    ``bucket_cap_mb_list`` (torch 2.13) gives one cap per bucket, the last one
    repeating; it overrides ``bucket_cap_mb`` and, unlike it, applies to the
    pre-rebuild layout as well. ``last_bucket_small`` models the environment variable
    ``DDP_SET_LAST_BUCKET_CAP=1``: the rebuild walks the ready order backwards, so the
    small first cap lands on the last bucket (this module never reads the environment).

    A negative cap is what the C++ reducer turns into an unreachable size: it yields
    one bucket per dtype (measured), except where DDP hands it to the Python binding,
    which rejects it — then a :class:`~simcluster.errors.UsageError` is raised.
    """
    tensors = _check_params(params)
    _check_iteration(iteration)
    _check_flag("static_graph", static_graph)
    _check_flag("find_unused_parameters", find_unused_parameters)
    _check_flag("last_bucket_small", last_bucket_small)
    order = _check_ready_order(ready_order, len(tensors))
    caps = _check_cap_list(bucket_cap_mb_list)
    first, cap = cap_bytes(bucket_cap_mb)
    rebuild_at = rebuild_iteration(static_graph=static_graph, find_unused_parameters=find_unused_parameters)

    if rebuild_at is not None and iteration >= rebuild_at:
        return _rebuilt_buckets(tensors, order, caps, first, cap, last_bucket_small)
    return _constructor_buckets(tensors, caps, first, cap, static_graph=static_graph,
                                find_unused_parameters=find_unused_parameters, bucket_cap_mb=bucket_cap_mb,
                                bucket_cap_mb_list=bucket_cap_mb_list)


def _rebuilt_buckets(tensors: list[torch.Tensor], order: list[int], caps: list[int], first: int, cap: int,
                     last_bucket_small: bool) -> list[list[int]]:
    """The layout DDP rebuilds in gradient-ready order (the C++ reducer's caps: negative wraps)."""
    limits = [_wrap(c) for c in caps] if caps else [_wrap(first), _wrap(cap)]
    if last_bucket_small:
        order = order[::-1]
    groups, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits, [], order)
    groups = [list(g) for g in groups]
    return groups[::-1] if last_bucket_small else groups


def _constructor_buckets(tensors: list[torch.Tensor], caps: list[int], first: int, cap: int, *, static_graph: bool,
                         find_unused_parameters: bool, bucket_cap_mb: float | None,
                         bucket_cap_mb_list: Sequence[float] | None) -> list[list[int]]:
    """The layout DDP's constructor builds in reverse parameter order (one bucket unless a cap applies)."""
    if caps:
        limits = caps
    elif static_graph or not find_unused_parameters:
        limits = [_UNLIMITED]
    else:
        limits = [first, cap] if first < cap else [cap]
    negative = [c for c in limits if c < 0]
    if negative:
        raise UsageError(
            f"bucket cap of {negative[0]} bytes: real DDP passes this cap to "
            "dist._compute_bucket_assignment_by_size at construction, which raises TypeError "
            f"(bucket_cap_mb={bucket_cap_mb!r}, bucket_cap_mb_list={bucket_cap_mb_list!r}, "
            f"find_unused_parameters={find_unused_parameters})"
        )
    groups, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [])
    return [list(g) for g in reversed(groups)]


def bucket_calls(
    params: Sequence[torch.Tensor],
    *,
    iteration: int,
    bucket_cap_mb: float | None = None,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    ready_order: Sequence[int] | None = None,
    bucket_cap_mb_list: Sequence[float] | None = None,
    last_bucket_small: bool = False,
) -> list[BucketCall]:
    """The hook calls of ``iteration`` in call order, with what each bucket reports.

    Same arguments as :func:`bucket_assignment`. Normally call ``k`` reports
    ``index() == k`` and ``is_last()`` only for the last call. In iteration 0 with
    ``static_graph=True`` DDP runs no hook during backward and reduces every bucket at
    its end; measured on torch 2.13, each of those buckets reports ``index() == 0``
    and, when there are several (mixed dtypes, ``bucket_cap_mb_list``), ``is_last()``
    is False for all of them.
    """
    layout = bucket_assignment(
        params,
        iteration=iteration,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
        ready_order=ready_order,
        bucket_cap_mb_list=bucket_cap_mb_list,
        last_bucket_small=last_bucket_small,
    )
    last = len(layout) - 1
    if static_graph and iteration == 0:
        return [BucketCall(0, last == 0, tuple(group)) for group in layout]
    return [BucketCall(k, k == last, tuple(group)) for k, group in enumerate(layout)]


def _wrap(limit: int) -> int:
    """The reducer stores caps as size_t: a negative one becomes unreachable."""
    return _UNLIMITED if limit < 0 else limit


def _check_params(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor) or not isinstance(params, Sequence):
        raise UsageError(f"params must be a sequence of tensors, got params={params!r} (type={type(params).__name__})")
    tensors = list(params)
    if not tensors:
        raise UsageError("params=[]: real DDP refuses a module without parameters that require a gradient")
    seen: dict[int, int] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"params[{i}]={t!r} (type={type(t).__name__}) is not a torch.Tensor")
        if t.layout != torch.strided:
            raise UsageError(f"params[{i}] has layout={t.layout}; DDP parameters are dense (strided) tensors")
        if id(t) in seen:
            raise UsageError(
                f"params[{i}] is the same tensor as params[{seen[id(t)]}]; "
                "DDP buckets each parameter once (model.parameters() deduplicates shared ones)"
            )
        seen[id(t)] = i
    return tensors


def _check_iteration(iteration: int) -> None:
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise UsageError(f"iteration must be an int >= 0, got iteration={iteration!r} (type={type(iteration).__name__})")


def _check_flag(name: str, value: bool) -> None:
    if not isinstance(value, bool):
        raise UsageError(f"{name} must be a bool, got {name}={value!r} (type={type(value).__name__})")


def _check_mb(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(
            f"{name} must be a finite number of MiB, got {name}={value!r} (type={type(value).__name__}); "
            "real DDP fails converting it to bytes"
        )


def _check_cap_list(caps: Sequence[float] | None) -> list[int]:
    if caps is None:
        return []
    if isinstance(caps, (str, bytes)) or not isinstance(caps, Sequence):
        raise UsageError(f"bucket_cap_mb_list must be a sequence of numbers, got {caps!r} (type={type(caps).__name__})")
    for i, mb in enumerate(caps):
        _check_mb(f"bucket_cap_mb_list[{i}]", mb)
    return [int(mb * 2**20) for mb in caps]  # an empty list is ignored, as DDP does


def ready_order_of(ready_order: Sequence[int] | None, n: int) -> list[int]:
    """The order in which ``n`` parameters' gradients become ready: ``ready_order`` checked,
    or reverse parameter order (measured for a plain stack, docs/ddp-facts.md §3)."""
    return _check_ready_order(ready_order, n)


def _check_ready_order(ready_order: Sequence[int] | None, n: int) -> list[int]:
    if ready_order is None:
        return list(range(n - 1, -1, -1))
    if isinstance(ready_order, (str, bytes)) or not isinstance(ready_order, Sequence):
        raise UsageError(
            f"ready_order must be a sequence of parameter indices, got ready_order={ready_order!r} "
            f"(type={type(ready_order).__name__})"
        )
    order = list(ready_order)
    for pos, i in enumerate(order):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise UsageError(f"ready_order[{pos}]={i!r} is not a parameter index in range({n})")
    if len(order) != n or len(set(order)) != n:
        missing = sorted(set(range(n)) - set(order))
        dups = sorted({i for i in order if order.count(i) > 1})
        raise UsageError(
            f"ready_order={order!r} is not a permutation of range({n}): "
            f"missing {missing}, repeated {dups}; every parameter's gradient becomes ready exactly once"
        )
    return order
