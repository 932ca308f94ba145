"""The oracles: pure functions that judge the results of a simulated DDP run.

Each oracle takes plain tensors (what the ranks fed in, what they got back) and returns
``None`` when the property holds, or a sentence explaining the first violation — which
rank, which parameter, which element, which values, and the bound. They need no cluster,
no Hypothesis and no pytest, so they can be used alone::

    >>> import torch
    >>> inputs = [[torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 6.0])]]   # [rank][param]
    >>> good = [[torch.tensor([2.0, 4.0])], [torch.tensor([2.0, 4.0])]]
    >>> averages(good, inputs, "fp32") is None
    True
    >>> print(averages([[torch.tensor([4.0, 8.0])]] * 2, inputs, "fp32"))   # forgot to divide
    rank 0, param 0 (shape (2,)), element 0: got 4.0, the float64 mean of the ranks' gradients is 2.0; |error| 2 > bound 5.96e-07 (tolerance fp32: γ_4(u=2^-24)·mean|x| + 2·2^-149); inputs there, rank by rank: ['1.0', '3.0']; 1 more of its 2 elements out of bound
    (the result is the sum over ranks: the hook did not divide by the world size)

The tolerance of :func:`averages` is **derived from the arithmetic** a hook of that
class performs; the derivation is in :func:`error_bound` and ``docs/properties.md``.

* :func:`averages` — each rank's result is the mean over its group, within the bound.
* :func:`replicas_agree` — every rank of a group holds bitwise-identical results.
* :func:`keeps_nonfinite` — an overflow (``inf``/``NaN``) in one rank's gradient stays
  visible in every rank's result for that bucket, as ``torch.amp.GradScaler`` needs.
* :func:`registration_problem` / :func:`result_problem` — the *contract*: what current
  (or legacy) DDP accepts at ``register_comm_hook`` and from the hook's future.
* :func:`liveness` — the run ended in no deadlock and no mismatched collectives.
* :func:`schedule_independence` — two runs under different completion orders agree bitwise.
* :func:`error_feedback` — for hooks with a residual memory, the accumulated output
  tracks the accumulated mean with a lag that stays bounded and drains.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from simcluster.errors import CollectiveMismatchError, DeadlockError, StuckError, UsageError
from simcluster.fake.collectives import bits_equal
from simcluster.checking.tolerances import (Tolerance, bucket_position, bucket_values, lossy_averages,
                                            parse_tolerance)

__all__ = [
    "Tolerance",
    "error_bound",
    "group_mean",
    "group_means",
    "averages",
    "overflow_threshold",
    "overflow_cause",
    "replicas_agree",
    "keeps_nonfinite",
    "registration_problem",
    "build_refusal",
    "result_problem",
    "liveness",
    "schedule_independence",
    "first_parting",
    "error_feedback",
    "NOT_DRAINED",
    "bits_equal",
]

Grads = Sequence[Sequence[torch.Tensor]]  # [rank][param]

# unit roundoff u = 2**-p and smallest positive subnormal eta of each arithmetic
_ARITH = {
    "fp32": (2.0**-24, 2.0**-149, "u=2^-24", "2^-149"),
    "fp16": (2.0**-11, 2.0**-24, "u=2^-11", "2^-24"),
    "bf16": (2.0**-8, 2.0**-133, "u=2^-8", "2^-133"),
}


def _gamma(k: int, u: float) -> float:
    """γ_k = k·u / (1 − k·u): the relative error bound of k roundings in a row."""
    return k * u / (1.0 - k * u)


def error_bound(tolerance: str | Tolerance, world_size: int, mean: torch.Tensor, abs_mean: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound on ``|result − mean|`` for a hook in the tolerance's arithmetic class.

    ``mean`` = (1/W)·Σ_r x_r (float64), ``abs_mean`` = S = (1/W)·Σ_r |x_r|.

    **Derivation** (standard model: a rounding to nearest with unit roundoff u gives
    fl(a ∘ b) = (a ∘ b)(1 + δ), |δ| ≤ u, plus an absolute error ≤ η/2 when the result is
    subnormal, η the smallest positive subnormal; additions of subnormals are exact).
    A mean-computing hook does, on each rank's value, at most two roundings before the
    sum — the division by W and the cast to the communication dtype (fp16/bf16), in
    either order — then the W − 1 additions of the backend's sum (a ring fold or a tree;
    the order doesn't matter for the bound), then an exact cast back. So each summand is
    y_r = (x_r / W)(1 + θ_2) + e_r, |θ_2| ≤ γ_2, |e_r| ≤ η, and a sum of W terms in any
    order has error ≤ γ_{W−1} · Σ|y_r|. Altogether

        |result − mean| ≤ γ_{W+2}(u) · S + W·η  (+ u_out·|mean| + η_out for the result's dtype)

    with γ_k = k·u/(1 − k·u), and (u, η) = (2^-24, 2^-149) for ``fp32``, (2^-11, 2^-24)
    for ``fp16``, (2^-8, 2^-133) for ``bf16``. The bound is relative to S, not to
    |mean|: with cancellation (mixed signs) the error of a correct hook is relative to
    the magnitudes summed, not to their mean. It assumes no overflow: a result that is
    not finite where the mean is finite fails regardless. Under ``fp16`` every input is a
    float16 value, up to ±65504, and still a hook that divides first can overflow: a share
    ``x/W`` rounded to float16 can round *up*, and W of them can sum past 65504 — at W = 3
    ``65504/3`` rounds to 21840 and ``3 × 21840 = 65520`` rounds to ``inf`` (at W = 5,
    13104 × 5 likewise). Rounding each share toward zero and clamping it keeps every sum
    finite (``simcluster.hooks.reference.compress_share``); :func:`overflow_cause` says
    which step overflowed in a report.
    ``exact``: 0. Explicit: ``atol + rtol·|mean|`` (``numpy.allclose``'s form).
    """
    tol = parse_tolerance(tolerance)
    if tol.kind == "exact":
        return torch.zeros_like(mean)
    if tol.kind == "explicit":
        return tol.atol + tol.rtol * mean.abs()
    if tol.kind not in _ARITH:
        raise UsageError(f"tolerance {tol.describe()!r} has no per-element bound here: none checks nothing, "
                         "scale=/norm= are judged per bucket (simcluster.checking.tolerances.lossy_averages)")
    u, eta, _, _ = _ARITH[tol.kind]
    # in place where the operands are this function's own: the same operations in the same
    # order (the same bits), fewer tensors of the gradients' size (the large explicit example)
    bound = (_gamma(world_size + 2, u) * abs_mean).add_(world_size * eta)
    if out_dtype.is_floating_point:
        fi = torch.finfo(out_dtype)
        bound.add_(mean.abs().mul_(fi.eps / 2)).add_(fi.smallest_normal * fi.eps)
    return bound


def _bound_text(tol: Tolerance, world_size: int) -> str:
    if tol.kind in _ARITH:
        _, _, u, eta = _ARITH[tol.kind]
        return f"tolerance {tol.kind}: γ_{world_size + 2}({u})·mean|x| + {world_size}·{eta}"
    return f"tolerance {tol.describe()}"


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` flattened and concatenated, in order, in float64 (exact for every float dtype)."""
    return _rows([tensors], [0])[0]


def _rows(per_rank: Grads, ranks: Sequence[int]) -> torch.Tensor:
    """``[len(ranks), N]``, float64: row ``j`` is rank ``ranks[j]``'s tensors flattened and
    concatenated in order (each parameter's tensors stacked across ranks first: a few large
    operations, not one per rank and parameter — this runs for every checked step)."""
    first = per_rank[ranks[0]]
    if not first:
        return torch.zeros(len(ranks), 0, dtype=torch.float64)
    n = len(ranks)
    if all(t.is_floating_point() for r in ranks for t in per_rank[r]):  # promotions between floats are exact
        columns = [torch.stack([per_rank[r][k].detach() for r in ranks]).reshape(n, -1) for k in range(len(first))]
        return (columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)).to(torch.float64)
    return torch.stack([torch.cat([t.detach().reshape(-1).to(torch.float64) for t in per_rank[r]]) for r in ranks])


def _param_slices(tensors: Sequence[torch.Tensor]) -> list[slice]:
    """Where each of ``tensors`` lies in :func:`_flat` of them."""
    ends = list(itertools.accumulate(t.numel() for t in tensors))
    return [slice(end - t.numel(), end) for t, end in zip(tensors, ends)]


def group_means(inputs: Grads, ranks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, mean of absolute values) over ``ranks`` of every parameter at once, in float64,
    flattened in parameter order (:func:`_flat`; :func:`_param_slices` says where each is).
    Each element's mean depends on that element alone: one parameter's slice is the same
    whatever the others are, so a verdict and its hints agree to the bit."""
    stack = _rows(inputs, ranks)  # a new tensor: its absolute values may take its place
    return stack.mean(0), stack.abs_().mean(0)


def group_mean(inputs: Grads, ranks: Sequence[int], param: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, mean of absolute values) over ``ranks`` of parameter ``param``, in float64, flat
    (the parameter's slice of :func:`group_means`)."""
    mean, abs_mean = group_means(inputs, ranks)
    where = _param_slices(inputs[ranks[0]])[param]
    return mean[where], abs_mean[where]


def _groups_of(world: int, groups: Sequence[Sequence[int]] | None) -> list[list[int]]:
    return [list(g) for g in groups] if groups is not None else [list(range(world))]


def _fmt(x: float) -> str:
    return repr(float(x)) if abs(x) >= 1e-3 or x == 0 else f"{float(x):.6g}"


Dtypes = Sequence[str] | Callable[[], Sequence[str]]
"""The dtypes the hook's collectives carried (``"float16"``, …; :meth:`Trace.dtypes
<simcluster.engine.trace.Trace.dtypes>`), or a callable giving them, called only to
explain a failure (reading a trace builds its events)."""


def averages(results: Grads, inputs: Grads, tolerance: str | Tolerance,
             groups: Sequence[Sequence[int]] | None = None,
             buckets: Sequence[Sequence[int]] | None = None,
             dtypes: Dtypes | None = None,
             wrapped: Callable[[], Sequence[str]] | None = None) -> str | None:
    """Each rank's result equals the float64 mean of its group's gradients, within :func:`error_bound`.

    ``results[rank][param]``: the gradients after DDP's copy-back; ``inputs[rank][param]``
    what each rank fed in. ``groups``: the rank lists DDP ran on (default: one group of
    every rank). A non-finite result where the mean is finite always fails. A group whose
    inputs hold a non-finite value (``inf``, ``NaN``: an overflow) is not judged: its mean
    is not finite, lossy hooks rightly spread an ``inf`` over the bucket as ``NaN``, and
    ``torch.amp.GradScaler`` discards every gradient of such a step — what must hold there
    is :func:`keeps_nonfinite`. ``scale=``/``norm=`` tolerances judge each DDP bucket (``buckets``: the parameter
    indices of each; default one bucket of all) — see :func:`simcluster.checking.tolerances.lossy_averages`.

    A failure's sentence may end in hints, each on a line of its own: why a result is not
    finite, from the ``dtypes`` the hook's collectives carried (:func:`overflow_cause`;
    without ``dtypes``, the result's dtype is assumed to be the one summed); that every
    result is the ranks' *sum* (the hook did not divide); that every result is within a
    half-precision tolerance; that an integer sum of the hook's wrapped around (``wrapped``:
    a callable giving each such collective in words, :meth:`Trace.wrapped
    <simcluster.engine.trace.Trace.wrapped>`, called only to explain a failure).
    """
    tol = parse_tolerance(tolerance)
    if tol.kind == "none":
        return None
    found = _violation(results, inputs, tol, groups, buckets)
    if found is None:
        return None
    message, spot = found
    carried = dtypes() if callable(dtypes) else dtypes
    wraps = _wrap_hint(wrapped() if wrapped is not None else ())
    summed = _sum_hint(tol, results, inputs, groups, buckets, carried)
    if summed:  # it says where the sum overflowed, too
        return message + summed + wraps
    if spot is not None:
        got, mean, xs, result_dtype = spot
        message += _overflow_hint(got, mean, xs, result_dtype, carried)
    return (message + wraps + _world_hint(tol, results, inputs, groups, buckets)
            + _other_param_hint(tol, results, inputs, groups, buckets) + _looser_hint(tol, results, inputs, groups))


def _world_hint(tol: Tolerance, results: Grads, inputs: Grads, groups: Sequence[Sequence[int]] | None,
                buckets: Sequence[Sequence[int]] | None) -> str:
    """When DDP ran on subgroups (more than one group) and every rank's result is, within
    ``tol``, what the *whole world* would give — the mean over every rank, or its group's
    sum divided by the world's size — say so in one line: the hook communicated on, or
    divided by, the default group (``group=None``, ``dist.group.WORLD``,
    ``dist.get_world_size()``) instead of the process group DDP gave it. Judged as
    :func:`averages` judges a group's mean, so the line is a fact about the numbers, not a
    reading of the code. ``""`` when DDP ran on the whole world, or neither matches.

    Two subgroups of one rank each; both ranks got the world's mean -0.5:

    >>> x = [[torch.tensor([0.0])], [torch.tensor([-1.0])]]
    >>> _world_hint(parse_tolerance("fp32"), [[torch.tensor([-0.5])]] * 2, x, [[0], [1]], None).splitlines()[1][:60]
    "(every rank's result is the mean over the whole world's 2 ra"
    """
    ranks = _groups_of(len(inputs), groups)
    world = len(inputs)
    if len(ranks) < 2:
        return ""
    if _violation(results, inputs, tol, [list(range(world))], buckets) is None:
        return (f"\n(every rank's result is the mean over the whole world's {world} ranks, not over its DDP group's "
                f"{len(ranks[0])}: what a hook gives that reduces on the default group — group=None, "
                "dist.group.WORLD — not on the process group DDP was given (its state, or DDP's process_group); "
                "a fact about the numbers, whatever groups the hook used)")
    scaled: list[Sequence[torch.Tensor]] = list(inputs)
    for g in ranks:
        for r in g:
            scaled[r] = [x.detach().to(torch.float64) * len(g) / world for x in inputs[r]]
    if _violation(results, scaled, tol, groups, buckets) is None:
        return (f"\n(every rank's result is its DDP group's sum divided by the world's size {world}, not by the "
                f"group's {len(ranks[0])}: what a hook gives that divides by dist.get_world_size() or "
                "dist.group.WORLD.size(), not by the size of the process group DDP was given)")
    return ""


def _other_param_hint(tol: Tolerance, results: Grads, inputs: Grads, groups: Sequence[Sequence[int]] | None,
                      buckets: Sequence[Sequence[int]] | None = None) -> str:
    """One line when some parameter's result is another parameter's average
    (:func:`another_params_average`): from another bucket (``buckets``: the step's parameter
    indices per bucket; None: one bucket of all), or from the same bucket's other place."""
    found = another_params_average(results, inputs, tol, groups)
    if found is None:
        return ""
    k, j = found
    same = next((i for i, params in enumerate(buckets or [range(len(inputs[0]))]) if k in params and j in params), None)
    if same is not None:
        return (f"\n(param {k}'s result is param {j}'s average, on every rank; both are in bucket {same}: the hook's "
                f"result holds param {j}'s values at param {k}'s place — an offset, or the bucket's parameters taken "
                "in another order than its buffer holds them?)")
    return (f"\n(param {k}'s result is param {j}'s average, on every rank: another bucket's data reached it — "
            "hook state holding \"the\" bucket while DDP calls the hook for the next one before this one's "
            "collective completed?)")


def another_params_average(results: Grads, inputs: Grads, tolerance: str | Tolerance,
                           groups: Sequence[Sequence[int]] | None = None) -> tuple[int, int] | None:
    """``(k, j)`` when parameter ``k``'s result is, on every rank of its group, parameter
    ``j``'s average (same shape, a different average, within the tolerance), else None:
    another bucket's data reached it. The usual cause is hook state that holds "the"
    bucket (a compressor keeping the buffer in ``self``) while DDP calls the hook for the
    next bucket before this one's collective completed. None under a lossy tolerance
    (judged per bucket, where shares blur) or ``none``.

    Two ranks, two one-element parameters whose averages are 2 and 6; both got 6:

    >>> inputs = [[torch.tensor([1.0]), torch.tensor([5.0])], [torch.tensor([3.0]), torch.tensor([7.0])]]
    >>> another_params_average([[torch.tensor([6.0]), torch.tensor([6.0])]] * 2, inputs, "fp32")
    (0, 1)
    """
    tol = parse_tolerance(tolerance)
    if tol.lossy or tol.kind == "none":
        return None

    def within(ranks: list[int], k: int, mean: torch.Tensor, abs_mean: torch.Tensor) -> bool:
        for r in ranks:
            got_t = results[r][k].detach()
            bound = error_bound(tol, len(ranks), mean, abs_mean, got_t.dtype)
            if not bool(((got_t.to(torch.float64).reshape(-1) - mean).abs() <= bound).all()):
                return False
        return True

    for ranks in _groups_of(len(inputs), groups):
        shapes = [tuple(x.shape) for x in inputs[ranks[0]]]
        mean, abs_mean = group_means(inputs, ranks)  # once for every parameter: each takes its slice
        means = [(mean[where], abs_mean[where]) for where in _param_slices(inputs[ranks[0]])]
        for k, shape in enumerate(shapes):
            if within(ranks, k, *means[k]):
                continue
            for j, other in enumerate(shapes):
                if j != k and other == shape and not torch.equal(means[j][0], means[k][0]) \
                        and within(ranks, k, *means[j]):
                    return k, j
    return None


def _wrap_hint(wrapped: Sequence[str]) -> str:
    """One line when some integer SUM of the hook's wrapped around (a quantizing hook's codes
    summed past their dtype's range: nothing raises, on gloo or NCCL — the result is off)."""
    if not wrapped:
        return ""
    more = f" (and {len(wrapped) - 1} more)" if len(wrapped) > 1 else ""
    return (f"\n(an integer sum wrapped around: {wrapped[0]}{more} — integer adds wrap silently on gloo "
            f"and NCCL alike; quantize to codes whose sum over the group's ranks fits the dtype, or sum "
            f"in a wider integer dtype)")


Spot = tuple[float, float, list[float], torch.dtype]
"""Where an element-wise violation is: (the result there, the float64 mean, each rank's
input there, the result's dtype)."""


def _nonfinite_spot(results: Grads, inputs: Grads, judged: Sequence[Sequence[int]]) -> Spot | None:
    """Under a lossy tolerance (judged per bucket, so no element is named): the first
    non-finite result element of a group whose inputs are finite, as a :data:`Spot` — so an
    overflow there is explained as under an element-wise tolerance (:func:`_overflow_hint`);
    None when every result is finite."""
    for ranks in judged:
        for k in range(len(inputs[ranks[0]])):
            for r in ranks:
                got = results[r][k].detach().reshape(-1)
                bad = ~torch.isfinite(got)
                if bool(bad.any()):
                    i = int(bad.nonzero()[0, 0])
                    mean = group_mean(inputs, ranks, k)[0].reshape(-1)
                    xs = [float(inputs[q][k].reshape(-1)[i]) for q in ranks]
                    return float(got[i]), float(mean[i]), xs, results[r][k].dtype
    return None


def _violation(results: Grads, inputs: Grads, tol: Tolerance, groups: Sequence[Sequence[int]] | None,
               buckets: Sequence[Sequence[int]] | None) -> tuple[str, Spot | None] | None:
    """The first violation of :func:`averages` under ``tol`` (not ``none``): its sentence,
    without hints, and its :data:`Spot` (None under a lossy tolerance, judged per bucket)."""
    if tol.lossy:
        judged = [g for g in _groups_of(len(inputs), groups) if not _nonfinite_in(inputs, g)]
        lossy = lossy_averages(results, inputs, tol, judged, buckets) if judged else None
        return None if lossy is None else (lossy, _nonfinite_spot(results, inputs, judged))
    for ranks in _groups_of(len(inputs), groups):
        mean, abs_mean = group_means(inputs, ranks)
        # an input that is inf/NaN makes its mean of |x| so (cheap to ask); float64 inputs near
        # their max can overflow it too, hence the scan of the inputs themselves, then only
        if not bool(torch.isfinite(abs_mean).all()) and _nonfinite_in(inputs, ranks):
            continue
        # every parameter of every rank at once (one comparison per group when the hook is
        # right); then, only where some element is out, the first in (parameter, rank) order
        wheres = _param_slices(inputs[ranks[0]])
        bounds: dict[torch.dtype, torch.Tensor] = {}

        def bound_of(dtype: torch.dtype) -> torch.Tensor:
            if dtype not in bounds:
                bounds[dtype] = error_bound(tol, len(ranks), mean, abs_mean, dtype)
            return bounds[dtype]

        gots = _rows(results, ranks)
        dtypes = [[t.dtype for t in results[r]] for r in ranks]
        if all(d == dtypes[0][0] for row in dtypes for d in row):
            bound = bound_of(dtypes[0][0])
        else:  # results of several dtypes: each element's bound is its own result's
            bound = torch.stack([torch.cat([bound_of(d)[where] for d, where in zip(row, wheres)]) for row in dtypes])
        errs = gots.sub(mean).abs_()
        within = errs <= bound  # False for NaN and inf too
        if bool(within.all()):
            continue
        bads = ~within
        for k, where in enumerate(wheres):
            for j, r in enumerate(ranks):
                bad = bads[j, where]
                if not bool(bad.any()):
                    continue
                got_t = results[r][k]
                got, err = gots[j, where], errs[j, where]
                at = int(bad.nonzero()[0, 0])
                i = where.start + at
                limit = bound[i] if bound.dim() == 1 else bound[j, i]
                shape = tuple(got_t.shape)
                here = [float(inputs[q][k].reshape(-1)[at]) for q in ranks]
                xs = [_fmt(x) for x in here]
                what = "is not finite" if not math.isfinite(float(got[at])) else (
                    f"|error| {float(err[at]):.3g} > bound {float(limit):.3g}")
                n_bad = int(bad.sum())
                more = f"; {n_bad - 1} more of its {bad.numel()} elements out of bound" if n_bad > 1 else ""
                message = (f"rank {r}, param {k} (shape {shape}), element {at}: got {_fmt(got[at])}, the float64 "
                           f"mean of the ranks' gradients is {_fmt(mean[i])}; {what} ({_bound_text(tol, len(ranks))})"
                           + (f"; inputs there, rank by rank: {xs}" if len(xs) <= 8 else "") + more)
                return message, (float(got[at]), float(mean[i]), here, got_t.dtype)
    return None


_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
"""The floating dtypes a trace may name (:meth:`Trace.dtypes <simcluster.engine.trace.Trace.dtypes>`), by name."""


def overflow_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to ``inf`` in ``dtype``: its largest value plus half
    the spacing of its top binade. That midpoint itself overflows: it is a tie, and ties go
    to the even neighbour, ``inf``, since the largest value's last bit is odd.

    >>> [f"{overflow_threshold(d):.9g}" for d in (torch.float16, torch.bfloat16, torch.float32)]
    ['65520', '3.39617753e+38', '3.40282357e+38']

    (Checked against torch's casts in ``tests/test_properties.py``: the value casts to
    ``inf``, the float32 just below it to the largest value.)
    """
    fi = torch.finfo(dtype)
    top_binade = 2.0 ** (math.frexp(fi.max)[1] - 1)
    return fi.max + fi.eps * top_binade / 2


def _rounds(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to nearest in ``dtype`` (ties to even), as a Python float."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def overflow_cause(xs: Sequence[float], dtype: torch.dtype) -> str:
    """Why a mean of ``xs`` (each rank's value, finite) computed through ``dtype`` can end
    in ``inf`` — or ``""`` if no step of a mean-computing hook in that dtype overflows.

    The steps, in the order a hook meets them (``T`` = :func:`overflow_threshold`):

    1. **the cast**: a value with ``|x| ≥ T`` becomes ``inf`` when cast to ``dtype``
       (only a narrower dtype than the gradients': float32 gradients sent as bfloat16 at
       ``|x| ≥ 3.39617753e38``) — a hook that casts before it divides;
    2. **the shares**: ``x/W`` rounded to ``dtype`` can round up, and W shares can sum past
       ``T`` although their exact mean is finite (float16, W = 3: ``65504/3`` rounds to
       21840, ``3 × 21840 = 65520`` rounds to ``inf``) — a hook that divides first;
    3. **the sum**: ``|Σ x| ≥ T`` — a hook that sums before it divides.

    The first step that overflows is named first; where a later one would overflow too,
    the sentence says that the other order of operations is not enough either.

    >>> print(overflow_cause([65504.0, 65504.0], torch.float16))
    the ranks' sum there, 131008, exceeds float16's largest value 65504: a hook that sums before it divides gets inf — an all_reduce SUM then a division, gloo's ReduceOp.AVG (which sums then divides), or an add of values received from peers; divide first, as torch's allreduce_hook does
    >>> overflow_cause([65504.0, 1.0], torch.float16)
    ''
    """
    world = len(xs)
    name = str(dtype).removeprefix("torch.")
    limit = overflow_threshold(dtype)
    largest = torch.finfo(dtype).max
    total = math.fsum(xs)
    # a hook divides first either before the cast (x/W, then cast) or after it, in the dtype (torch's
    # fp16_compress_hook: cast, then div_): the cast can round up first (65488.0039 -> 65504)
    direct = [_rounds(x / world, dtype) for x in xs]
    casts = [_rounds(x, dtype) for x in xs]
    after_cast = [_rounds(c / world, dtype) for c in casts]
    cast_first = (all(map(math.isfinite, after_cast)) and abs(math.fsum(after_cast)) >= limit
                  and not abs(math.fsum(direct)) >= limit and casts != list(xs))
    shares = after_cast if cast_first else direct
    share_sum = math.fsum(shares)
    shares_over = all(map(math.isfinite, shares)) and abs(share_sum) >= limit
    sum_over = abs(total) >= limit
    rounding = f"{name}'s largest value is {largest:.9g}; every magnitude from {limit:.9g} up rounds to inf"
    if cast_first and len(set(xs)) == 1:
        share_text = (f"{_fmt(xs[0])} cast to {name} rounds to {casts[0]:.9g}, {casts[0]:.9g}/{world} rounds to "
                      f"{shares[0]:.9g}, and {world} × {shares[0]:.9g} = {share_sum:.9g} rounds to inf")
    elif len(set(xs)) == 1:
        share_text = (f"{_fmt(xs[0])}/{world} rounds to {shares[0]:.9g} in {name}, and {world} × {shares[0]:.9g} = "
                      f"{share_sum:.9g} rounds to inf")
    else:
        shown = ", ".join(f"{y:.9g}" for y in shares[:8]) + (", …" if world > 8 else "")
        what = f"cast to {name} and divided by {world}" if cast_first else f"x/{world}"
        share_text = f"the shares {what} round in {name} to [{shown}], and their sum {share_sum:.9g} rounds to inf"
    clamp = "round each share toward zero and clamp it, as simcluster.hooks.reference.compress_share does"
    cast = next((r for r, x in enumerate(xs) if abs(x) >= limit), None)
    if cast is not None:
        text = (f"the cast to {name} overflowed, not the sum: rank {cast}'s gradient there, {_fmt(xs[cast])}, becomes "
                f"inf when cast to {name} ({rounding}), so a hook that casts before it divides gets inf")
        if not all(map(math.isfinite, shares)):
            return text + f"; divided by {world} it is still beyond {name}'s range: {name} cannot carry this mean"
        if shares_over:
            return text + f"; dividing first is not enough here either: {share_text}; {clamp}"
        return text + f"; divide by {world} first, then cast"
    if shares_over:
        if not sum_over:
            return f"dividing first is not enough here: {share_text} ({rounding}); {clamp}"
        return (f"the {name} sum overflows whether the hook divides first or not: dividing first is not enough here "
                f"— {share_text} ({rounding}) — and the ranks' sum there, {total:.9g}, is beyond {name}'s range; "
                f"{clamp}")
    if sum_over:
        return (f"the ranks' sum there, {total:.9g}, exceeds {name}'s largest value {largest:.9g}: a hook that sums "
                "before it divides gets inf — an all_reduce SUM then a division, gloo's ReduceOp.AVG (which sums then "
                "divides), or an add of values received from peers; divide first, as torch's allreduce_hook does")
    return ""


def _overflow_hint(got: float, mean: float, xs: Sequence[float], result_dtype: torch.dtype,
                   carried: Sequence[str] | None) -> str:
    """For a non-finite result whose mean is finite: the :func:`overflow_cause` in a floating
    dtype the hook's collectives ``carried`` — the narrowest that explains it, where a value
    overflows first — or, when what they carried is unknown (``None``), in the result's dtype;
    when they carried only wider dtypes, where the sum fits, the cause in the result's dtype,
    said so (a float64 sum cast to float32 before the division: round 22 of hooks from the wild)."""
    if math.isfinite(got) or not math.isfinite(mean) or not all(map(math.isfinite, xs)):
        return ""
    own = str(result_dtype).removeprefix("torch.")
    names = [own] if carried is None else list(carried)
    floats = sorted((d for d in map(_DTYPE_NAMES.get, names) if d is not None), key=overflow_threshold)
    for dtype in floats:
        cause = overflow_cause(xs, dtype)
        if cause:
            return f"\n({cause})"
    if floats and result_dtype.is_floating_point and own not in names \
            and all(overflow_threshold(d) > overflow_threshold(result_dtype) for d in floats):
        cause = overflow_cause(xs, result_dtype)
        if cause:
            return (f"\n(the collectives carried {' and '.join(names)}, where this sum fits, but the result is {own}, "
                    f"which does not hold it: {cause})")
    return ""


_DECISIVE = ("exact", "fp32", "fp16", "bf16")
"""Tolerances whose bound, a few roundings, tells a sum from a mean at any world size of 2 or more."""


def _sum_hint(tol: Tolerance, results: Grads, inputs: Grads, groups: Sequence[Sequence[int]] | None,
              buckets: Sequence[Sequence[int]] | None, carried: Sequence[str] | None) -> str:
    """When every result equals its group's *sum* within ``tol``, say so in one line: the
    hook did not divide. The sum is judged as :func:`averages` judges the mean — against
    the inputs times the group's size, in float64, so the bound scales with them — and a
    result that is ``±inf`` where the sum is beyond the range of a dtype the hook's
    collectives ``carried`` (or of the result's dtype) counts as that sum — but proves
    nothing (``inf / W`` is ``inf``): some finite result must be off the mean. Under a
    tolerance looser than a few roundings (``rtol=``/``atol=``, ``scale=``, ``norm=``) a
    match that is not exact may be the tolerance's doing: the line says to confirm it with
    ``--tolerance exact``."""
    ranks = _groups_of(len(inputs), groups)
    if all(len(g) < 2 for g in ranks):
        return ""
    scaled: list[Sequence[torch.Tensor]] = list(inputs)
    seen: list[list[torch.Tensor]] = [list(rank) for rank in results]
    finite: list[list[torch.Tensor]] = [list(rank) for rank in results]
    overflowed: set[str] = set()
    for g in ranks:
        for r in g:
            scaled[r] = [x.detach().to(torch.float64) * len(g) for x in inputs[r]]
        totals = group_means(scaled, g)[0]  # once for every parameter: each takes its slice
        for k, where in enumerate(_param_slices(scaled[g[0]])):
            total = totals[where]
            for r in g:
                got = results[r][k].detach()
                seen[r][k], name = _overflowed_sum(got, total, carried)
                overflowed.update([name] if name else [])
                if name:
                    flat = got.reshape(-1).to(torch.float64)
                    finite[r][k] = torch.where(torch.isfinite(flat), flat, total / len(g)).reshape(got.shape)
    if _violation(seen, scaled, tol, groups, buckets) is not None:
        return ""
    if overflowed and _violation(finite, inputs, tol, groups, buckets) is None:
        return ""  # only an inf is off the mean: a sum divided after it overflowed is inf as well
    if len(ranks) == 1:
        text = "the result is the sum over ranks: the hook did not divide by the world size"
    else:
        sizes = sorted({len(g) for g in ranks})
        text = (f"the result is the sum over each group's ranks: the hook did not divide by the group's size "
                f"({', '.join(map(str, sizes))})")
    zeros = [r for g in ranks if len(g) > 1 for r in g if not any(bool(x.any()) for x in inputs[r])]
    if zeros:  # 0 / W is 0: the sum is the same whether such a rank divided or not
        who = f"rank {zeros[0]}'s gradients are" if len(zeros) == 1 else f"ranks {zeros}' gradients are"
        text += (f" — on the ranks whose gradients are not zero here: {who} all zero in this example, so whether "
                 "its code divided does not show")
    if overflowed:
        text += f"; where the sum is beyond {' or '.join(sorted(overflowed))}'s range, inf"
    if tol.kind not in _DECISIVE and _violation(seen, scaled, parse_tolerance("exact"), groups, None) is not None:
        text += (f"; the sum matched within --tolerance {tol.describe()}, not exactly: re-run with --tolerance exact "
                 "to confirm it (exactly averageable inputs, on which a sum shows bit for bit)")
    return f"\n({text})"


def _overflowed_sum(got: torch.Tensor, total: torch.Tensor, carried: Sequence[str] | None) -> tuple[torch.Tensor, str]:
    """``got`` with each ``±inf`` that is the float64 ``total`` overflowing replaced by
    ``total`` — where ``|total|`` is at least the :func:`overflow_threshold` of the
    narrowest of the dtypes ``carried`` and ``got``'s own, same sign — and that dtype's
    name ("" when none was replaced)."""
    if not got.is_floating_point() or bool(torch.isfinite(got).all()):
        return got, ""
    names = [*(carried or ()), str(got.dtype).removeprefix("torch.")]
    narrowest = min((d for d in map(_DTYPE_NAMES.get, names) if d is not None), key=overflow_threshold)
    flat = got.reshape(-1).to(torch.float64)
    as_sum = torch.isinf(flat) & (total.abs() >= overflow_threshold(narrowest)) & (flat.sign() == total.sign())
    if not bool(as_sum.any()):
        return got, ""
    return torch.where(as_sum, total, flat).reshape(got.shape), str(narrowest).removeprefix("torch.")


def _looser_hint(tol: Tolerance, results: Grads, inputs: Grads, groups: Sequence[Sequence[int]] | None) -> str:
    """When a result fails a full-precision tolerance but every result is within a
    half-precision one, say so: the usual cause is a hook that compresses to float16 or
    bfloat16 on purpose, checked without the ``--tolerance`` its format needs."""
    if tol.kind not in ("exact", "fp32"):
        return ""
    for looser in ("fp16", "bf16"):
        if _violation(results, inputs, parse_tolerance(looser), groups, None) is None:
            return (f"\n(every result is within --tolerance {looser}: if the hook compresses to "
                    f"{'float16' if looser == 'fp16' else 'bfloat16'} on purpose, check it with --tolerance {looser})")
    return ""


def _nonfinite_in(inputs: Grads, ranks: Sequence[int]) -> bool:
    """Whether some rank of ``ranks`` holds a non-finite gradient (``inf``, ``NaN``)."""
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for r in ranks for t in inputs[r])


def _canonical_nans(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN made the same NaN (payload and sign dropped)."""
    if not t.is_floating_point() or not bool(t.isnan().any()):
        return t
    return torch.where(t.isnan(), torch.full_like(t, math.nan), t)


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    fa, fb = a.detach().reshape(-1), b.detach().reshape(-1)
    diff = ~((fa == fb) | (fa.isnan() & fb.isnan())) if fa.is_floating_point() else fa != fb
    if not bool(diff.any()):  # differ only in bits: -0.0 vs 0.0 or NaN payloads
        byte = fa.contiguous().view(torch.uint8) != fb.contiguous().view(torch.uint8)
        i = int(byte.nonzero()[0, 0]) // fa.element_size()
        what = "zeros of opposite signs" if bool(fa[i] == 0) else "NaNs with different bits (sign or payload)"
        return f"element {i}: {_fmt(fa[i])} vs {_fmt(fb[i])} ({what})"
    i = int(diff.nonzero()[0, 0])
    return f"element {i}: {_fmt(fa[i])} vs {_fmt(fb[i])} (differ by {abs(float(fa[i]) - float(fb[i])):.3g})"


def replicas_agree(results: Grads, groups: Sequence[Sequence[int]] | None = None,
                   inputs: Grads | None = None) -> str | None:
    """Every rank of each group holds bitwise-identical results — DDP's core invariant.

    Replicas that differ by one bit drift apart as training goes on, silently. With
    ``inputs``, a group whose inputs hold a non-finite value compares any NaN equal to any
    NaN (their payloads and signs are not compared): such a step's gradients are NaN
    wherever they are, and a NaN's payload changes no training — GradScaler skips the
    step on every rank that sees one (:func:`keeps_nonfinite`).
    """
    for ranks in _groups_of(len(results), groups):
        first = ranks[0]
        any_nan = inputs is not None and _nonfinite_in(inputs, ranks)
        for r in ranks[1:]:
            for k, (a, b) in enumerate(zip(results[first], results[r])):
                if any_nan:
                    a, b = _canonical_nans(a), _canonical_nans(b)
                if not bits_equal(a, b):
                    return f"rank {first} and rank {r} differ in param {k} (shape {tuple(a.shape)}): {_first_diff(a, b)}"
    return None


def keeps_nonfinite(results: Grads, inputs: Grads, groups: Sequence[Sequence[int]] | None = None,
                    buckets: Sequence[Sequence[int]] | None = None) -> str | None:
    """Where a rank's gradient holds ``inf`` or ``NaN``, every rank of its group finds a
    non-finite value in its result for that bucket (``buckets``: the parameter indices of
    each DDP bucket; default one bucket of all).

    Mixed-precision training relies on it: ``torch.amp.GradScaler`` skips
    ``optimizer.step()`` only when it finds an ``inf`` or ``NaN`` among *that rank's own*
    gradients after DDP's copy-back (``found_inf_per_device``; it asks no other rank). A
    hook that hides an overflow — ``nan_to_num``, a clamp, before or after the all_reduce —
    makes the optimizer step on gradients built from an overflow; when it is hidden on some
    ranks only, those step and the others skip: the replicas diverge. Where in the bucket
    the non-finite value lands, and whether it is ``inf`` or ``NaN``, does not matter
    (PowerSGD and quantizers rightly turn one ``inf`` into NaNs over the bucket).

        >>> inputs = [[torch.tensor([1.0, 2.0])], [torch.tensor([3.0, math.inf])]]
        >>> keeps_nonfinite([[torch.tensor([2.0, math.inf])]] * 2, inputs) is None
        True
        >>> print(keeps_nonfinite([[torch.tensor([2.0, 3.4e38])]] * 2, inputs))  # doctest: +ELLIPSIS
        bucket 0 (params [0]): rank 1's gradient holds inf at param 0, element 1, but the result ...: the overflow was hidden from GradScaler on every rank — ...
    """
    bucket_list = [list(b) for b in buckets] if buckets is not None else [list(range(len(inputs[0])))]
    for ranks in _groups_of(len(inputs), groups):
        for b, params in enumerate(bucket_list):
            source = _first_nonfinite(inputs, ranks, params)
            if source is None:
                continue
            q, flat_index, value = source
            k, i = bucket_position([t.shape for t in inputs[q]], params, flat_index)
            got = {r: bucket_values(results[r], params) for r in ranks}
            hidden = [r for r in ranks if bool(torch.isfinite(got[r]).all())]
            if not hidden:
                continue
            there = (", ".join(f"rank {r} {_fmt(float(got[r][flat_index]))}" for r in hidden[:4])
                     + (f", … ({len(hidden) - 4} more)" if len(hidden) > 4 else ""))
            head = (f"bucket {b} (params {params}): rank {q}'s gradient holds {_fmt(value)} at param {k}, element {i}, "
                    f"but the result for that bucket is all finite on {_ranks_text(hidden)} (there: {there})")
            if len(hidden) == len(ranks):
                return (f"{head}: the overflow was hidden from GradScaler on every rank "
                        "— torch.amp.GradScaler skips optimizer.step() only when a rank's own gradients hold an inf or "
                        "NaN, so every rank steps on gradients built from an overflow; let it through: no nan_to_num "
                        "or clamp of the bucket — or, if the hook has none, rank "
                        f"{q}'s gradient may never reach the result at all (a broadcast or a gathered list read as "
                        "one tensor: see an averages failure naming the ranks whose gradients reach the results)")
            kept = [r for r in ranks if r not in hidden]
            return (f"{head}: the overflow was hidden from GradScaler on {_ranks_text(hidden)} — torch.amp.GradScaler "
                    f"decides on each rank's own gradients, so {_ranks_text(hidden)} steps while {_ranks_text(kept)} "
                    "(whose result keeps it) skips the step: the replicas diverge")
    return None


def _first_nonfinite(inputs: Grads, ranks: Sequence[int], params: Sequence[int]) -> tuple[int, int, float] | None:
    """(rank, position in the bucket's flattened params, value) of the first non-finite input, or None."""
    for q in ranks:
        flat = bucket_values(inputs[q], params)
        bad = ~torch.isfinite(flat)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            return q, i, float(flat[i])
    return None


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0, 2``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


# --------------------------------------------------------------------------- contract
def registration_problem(hook: Callable[..., Any], api: str = "current") -> str | None:
    """What ``DistributedDataParallel.register_comm_hook`` (torch 2.13) says about ``hook``:
    ``None`` when it registers, else what it raises and why, in one sentence. The one home
    of the rule: ``check`` reports it (property *contract*), ``explain`` prints it (its
    ``registration:`` line), e2e's DDP model refuses such a hook as real DDP does.

    Its check (``_check_comm_hook``) requires a parameter named ``bucket`` (else
    ``KeyError: 'bucket'``), whose annotation, if any, is ``dist.GradBucket`` itself —
    a *string* annotation (``from __future__ import annotations``) fails the ``!=``
    test — and a return annotation, if any, of ``torch.futures.Future[torch.Tensor]``.
    Then it reads ``hook.__name__`` (to refuse the bf16 hooks without CUDA) and
    ``hook.__qualname__`` (the name DDP's logger keeps, which must be a ``str``): a
    ``functools.partial`` or a callable class instance has neither and is refused with
    ``AttributeError`` (measured: ``benchmarks/measure_registration.py``,
    ``docs/ddp-facts.md`` *Registration (measured)*); a bound method, a lambda, a
    ``staticmethod`` register. A wrong arity is not seen here (``hook(bucket)``
    registers and fails in ``backward()``). Under ``api="legacy"`` only the parameter
    name is checked (1.8's rule; the annotations of that era, ``dist._GradBucket`` and a
    bare ``Future``, differ; its name reads were not measured).

        >>> import functools
        >>> def hook(state, bucket): ...
        >>> registration_problem(hook) is None
        True
        >>> print(registration_problem(functools.partial(hook)))  # doctest: +ELLIPSIS
        the hook has no __name__ (...): register_comm_hook reads hook.__name__ (...) and raises AttributeError: 'functools.partial' object has no attribute '__name__' — ...
    """
    if not callable(hook):
        return f"{hook!r} is not callable: register_comm_hook raises TypeError"
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError) as exc:
        return f"inspect.signature fails on the hook ({exc}); register_comm_hook needs it"
    if "bucket" not in sig.parameters:
        names = list(sig.parameters)
        return (f"the hook's parameters are {names}: register_comm_hook looks up the one named 'bucket' and "
                "raises KeyError: 'bucket' — name the second parameter `bucket`")
    if api == "legacy":
        return None
    ann = sig.parameters["bucket"].annotation
    if ann is not inspect.Parameter.empty and ann != dist.GradBucket:
        return (f"the bucket parameter is annotated {ann!r}: register_comm_hook raises ValueError "
                "'Communication hook: bucket annotation should be dist.GradBucket.'"
                + (" (string annotations, e.g. from `from __future__ import annotations`, never compare equal)"
                   if isinstance(ann, str) else ""))
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty and ret != torch.futures.Future[torch.Tensor]:
        shown = "the bare torch.futures.Future" if ret is torch.futures.Future else repr(ret)
        return (f"the return annotation is {shown}: register_comm_hook raises ValueError 'Communication hook: "
                "return annotation should be torch.futures.Future[torch.Tensor].'")
    return _name_problem(hook)


def _name_problem(hook: Callable[..., Any]) -> str | None:
    """``register_comm_hook``'s reads of ``hook.__name__`` and ``hook.__qualname__`` (in that
    order, after the signature): what fails, quoting the error Python raises for ``hook``."""
    for attr, why in (("__name__", "it refuses the bf16 hooks by name without CUDA"),
                      ("__qualname__", "the name DDP's logger keeps")):
        try:
            value = getattr(hook, attr)
        except AttributeError as exc:
            return (f"the hook has no {attr} (a functools.partial or a callable class instance has none): "
                    f"register_comm_hook reads hook.{attr} ({why}) and raises AttributeError: {exc} — register a "
                    "def function (a closure or a bound method will do), or set __name__ and __qualname__ on it")
    if not isinstance(value, str):
        return (f"the hook's __qualname__ is {value!r}, not a str: register_comm_hook hands it to DDP's logger and "
                "raises TypeError: _set_comm_hook_name(): incompatible function arguments")
    return None


BF16_HOOK_NAMES = ("bf16_compress_hook", "bf16_compress_wrapper_hook")
"""The hook names ``register_comm_hook`` refuses on a torch build without bf16 collectives."""


def build_refusal(hook: Callable[..., Any]) -> str | None:
    """What ``register_comm_hook`` raises for ``hook`` on *this torch build*, apart from the
    hook's own shape (:func:`registration_problem`): torch 2.13 refuses any hook whose
    ``__name__`` is one of :data:`BF16_HOOK_NAMES` unless the build has CUDA (or ROCm) with
    NCCL 2.10+, or XPU with XCCL — by name, so a wrapper that copies the name
    (``functools.wraps``) is refused too (read from torch 2.13's ``register_comm_hook``;
    measured on this CPU build, hooks from the wild round 14). Not the hook's bug: on a GPU
    cluster it registers, and ``check`` checks the hook itself; ``check`` notes this,
    ``explain`` opens with it, and e2e's DDP model refuses as real DDP on this build does."""
    if getattr(hook, "__name__", None) not in BF16_HOOK_NAMES:
        return None
    if _build_has_bf16_collectives():
        return None
    return (f"this torch build ({torch.__version__}: no CUDA 11+ with NCCL 2.10+, no XPU with XCCL) refuses a hook "
            f"named {hook.__name__}: register_comm_hook raises TypeError 'BF16 all reduce communication hook required "
            "CUDA 11+ and NCCL 2.10+ or XPU and XCCL' — on a GPU cluster it registers")


def _build_has_bf16_collectives() -> bool:
    """torch's own condition for the bf16 hook names (see :func:`build_refusal`)."""
    cuda = torch.version.cuda is not None or torch.version.hip is not None
    try:
        nccl = cuda and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    except Exception:  # noqa: BLE001 - no NCCL library: not available
        nccl = False
    xccl = bool(getattr(dist, "is_xccl_available", lambda: False)()) and torch.xpu.is_available()
    return bool(nccl or xccl)


def result_problem(value: Any, buffer_numel: int, api: str = "current") -> str | None:
    """What DDP's reducer does with the value the hook's future resolved to (measured: docs/ddp-facts.md, *Copy-back*).

    Current DDP wants a Tensor whose *storage* holds at least the bucket's numel elements,
    contiguous and at storage offset 0 — it copies from the storage's element 0 on, as
    :func:`simcluster.fake.reducer.copy_bucket` does. A non-contiguous or offset tensor is
    *accepted with wrong gradients*; a list, ``None``, or a tensor whose storage is too
    short (a 0-d sum of a bigger bucket) raise in ``backward()``. The view's own shape does
    not count: a 0-d result for a one-element bucket and a short view of a long enough
    storage are accepted (measured: docs/ddp-facts.md, *Copy-back*). ``api="legacy"`` wants
    the 1.7–1.9 one-element list.
    """
    if api == "legacy":
        if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], torch.Tensor)):
            return f"a legacy (1.7–1.9) hook's future must resolve to [tensor]; got {_describe(value)}"
        value = value[0]
    elif isinstance(value, (list, tuple)):
        return (f"the future resolved to {_describe(value)} (the pre-1.10 list style): current DDP raises "
                "'Unable to cast [...] to Tensor' in backward(); return the tensor itself (check with api='legacy' "
                "for hooks written for PyTorch 1.7–1.9)")
    if not isinstance(value, torch.Tensor):
        return f"the future resolved to {_describe(value)}: current DDP raises 'Expected a proper Tensor' in backward()"
    stored = value.untyped_storage().nbytes() // value.element_size()
    if stored < buffer_numel:
        return (f"the result's storage holds {stored} element(s) (a tensor of shape {tuple(value.shape)}) for a "
                f"bucket of {buffer_numel}: DDP raises 'setStorage: ... out of bounds' in backward()")
    if not value.is_contiguous() or value.storage_offset() != 0:
        return (f"the result is a view with strides {value.stride()} and storage offset {value.storage_offset()}: "
                "DDP reads its storage from element 0 as contiguous and silently applies the wrong gradients; "
                "return a contiguous tensor at offset 0 (e.g. .clone())")
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value[:3])})"
    return f"{type(value).__name__} {value!r}"[:120]


# --------------------------------------------------------------------------- liveness
def liveness(error: BaseException | None) -> str | None:
    """``None`` unless ``error`` is a deadlock, mismatched collectives or a stuck rank.

    A real cluster hangs (or silently corrupts data) in each case; simcluster detects it
    and its message — returned whole, every line — names each rank's pending call.
    """
    if isinstance(error, (DeadlockError, CollectiveMismatchError, StuckError)):
        return f"{type(error).__name__}: {error}".rstrip(": ")
    return None


# --------------------------------------------------------------------------- schedules
def schedule_independence(run_a: Sequence[Grads], run_b: Sequence[Grads], label_a: str = "the drawn schedule",
                          label_b: str = "in-order completion") -> str | None:
    """Two runs of the same steps (``run[step][rank][param]``) are bitwise equal.

    Completion order is the one thing a correct hook must not depend on: a real cluster
    completes collectives in a different order on every run (gloo's 2 worker threads).
    """
    parted = first_parting(run_a, run_b)
    if parted is None:
        return None
    t, r, k = parted
    return (f"step {t}, rank {r}, param {k}: results under {label_a} and under {label_b} differ; "
            f"{_first_diff(run_a[t][r][k], run_b[t][r][k])}")


def first_parting(run_a: Sequence[Grads], run_b: Sequence[Grads]) -> tuple[int, int, int] | None:
    """``(step, rank, param)`` of the first tensor whose bits differ between two runs, or None."""
    for t, (a_step, b_step) in enumerate(zip(run_a, run_b)):
        for r, (a_rank, b_rank) in enumerate(zip(a_step, b_step)):
            for k, (a, b) in enumerate(zip(a_rank, b_rank)):
                if not bits_equal(a, b):
                    return t, r, k
    return None


# --------------------------------------------------------------------------- error feedback
NOT_DRAINED = "after"
"""How :func:`error_feedback`'s message begins when the lag did not drain (not when it grew)."""

_CARRIED_ROUNDOFF = {"float16": _ARITH["fp16"][0], "bfloat16": _ARITH["bf16"][0]}
"""The unit roundoff of each collective dtype coarser than float32 (a trace's ``dtypes()``
names): a SUM carried in it rounds on the wire, which no error feedback sees."""


def error_feedback(outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[Grads], *, drain_from: int,
                   lag: float | None = None, drained: float = 0.5, floor: float | None = None,
                   ranks: Sequence[int] | None = None, carried: Dtypes = ()) -> str | None:
    """A hook with error feedback sends, over time, everything it was given.

    ``outputs[t][param]``: one replica's result at step ``t``; ``inputs[t][rank][param]``
    the ranks' gradients (``ranks``: the group, default all). With ``m_t`` the float64
    mean of step ``t``, the *lag* is ``D_t = Σ_{s≤t} (output_s − m_s)`` — minus the mean
    residual the ranks still hold. Two checks:

    1. **Bounded:** ``max|D_t| ≤ lag · G`` at every step, ``G`` the largest ``|gradient|``
       seen so far (default ``lag`` = the model's numel: top-k sending ≥ 1 entry per
       bucket per step delays any entry at most that many steps' worth).
    2. **Drains:** steps ``drain_from`` on have all-zero gradients; a hook that keeps a
       residual sends it then, so at the end ``max|D|`` is at most ``drained`` × its peak
       (plus the rounding ``floor``, default 2^-20·G·steps). A hook that *drops* what it
       did not send keeps its lag forever; one whose memory goes astray grows it.

    ``carried``: the dtypes the collectives carried. A SUM carried in float16 or bfloat16
    rounds on the wire — after the residual was taken, so no error feedback can send it
    back — by up to ``u·(W−1)`` times the largest value summed, ``u`` the dtype's unit
    roundoff: the default floor then grows to ``2·u·(W−1)·Σ_t G_t`` (``G_t`` the largest
    ``|gradient|`` of step ``t``). Measured on a bf16 hook with fp32 error feedback (hooks
    from the wild, round 18): its lag after the drain was exactly two bf16 roundings of the
    sum, and the same hook summing in float32 drains to zero. A callable giving them is
    called only when the verdict depends on them (reading a trace builds its events).
    """
    group = list(ranks) if ranks is not None else list(range(len(inputs[0])))
    n_params = len(outputs[0]) if outputs else 0
    numel = sum(int(outputs[0][k].numel()) for k in range(n_params)) if outputs else 0
    lag = float(max(numel, 1)) if lag is None else lag
    total: torch.Tensor | None = None
    peak, g_max, began, g_sum = 0.0, 0.0, 0.0, 0.0
    for t in range(len(outputs)):
        out = _flat(outputs[t][:n_params])
        mean = group_means(inputs[t], group)[0]
        g_step = max((float(inputs[t][r][k].detach().abs().max()) if inputs[t][r][k].numel() else 0.0)
                     for r in group for k in range(n_params))
        g_max, g_sum = max(g_max, g_step), g_sum + g_step
        total = (out - mean) if total is None else total + (out - mean)
        now = float(total.abs().max()) if total.numel() else 0.0
        if not math.isfinite(now):
            return f"step {t}: the accumulated output minus the accumulated mean is not finite"
        if now > lag * g_max * (1 + 1e-9) + 1e-300:
            return (f"step {t}: the accumulated output is {now:.3g} away from the accumulated mean, more than "
                    f"lag·max|g| = {lag:g}·{g_max:.3g}: the error memory grows instead of being sent")
        if t < drain_from:
            peak = max(peak, now)
        if t == drain_from - 1:
            began = now
    end = float(total.abs().max()) if total is not None and total.numel() else 0.0
    rounding = floor if floor is not None else 2.0**-20 * g_max * len(outputs)
    if floor is None and drain_from < len(outputs) and end > drained * peak + rounding:  # the wire's share may decide
        dtypes = carried() if callable(carried) else carried
        wire = max((_CARRIED_ROUNDOFF.get(d, 0.0) for d in dtypes), default=0.0)
        rounding = max(rounding, 2 * wire * (len(group) - 1) * g_sum)
    if drain_from < len(outputs) and end > drained * peak + rounding:
        if end > began + rounding:  # the lag grew while no gradient came: the hook sent what it was never given
            return (f"{NOT_DRAINED} {len(outputs) - drain_from} steps of zero gradients the accumulated output is "
                    f"{end:.3g} away from the accumulated mean, {began:.3g} when they began (peak {peak:.3g} "
                    "before): the hook kept sending after its gradients stopped — more than it was given, not what "
                    "it held back (an estimator that resends its estimate, as EF21 does, a residual sent twice, or "
                    "one added to other parameters' gradients)")
        return (f"{NOT_DRAINED} {len(outputs) - drain_from} steps of zero gradients the accumulated output is still "
                f"{end:.3g} away from the accumulated mean (peak {peak:.3g}): what the hook held back is never "
                "sent (error feedback lost)")
    return None


def drain_progress(outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[Grads], *, drain_from: int,
                   ranks: Sequence[int] | None = None) -> tuple[float, float]:
    """How much of the lag a drain sent: ``Σ|D|`` (the L1 norm of :func:`error_feedback`'s lag
    vector) when the zero steps start and after the last one. The largest entry of ``D``
    cannot show progress — a top-k hook sending one of many equal entries per step keeps
    ``max|D|`` at its peak until the last is sent — while the sum falls by each entry sent."""
    group = list(ranks) if ranks is not None else list(range(len(inputs[0])))
    n_params = len(outputs[0]) if outputs else 0
    total: torch.Tensor | None = None
    start = 0.0
    for t in range(len(outputs)):
        out = _flat(outputs[t][:n_params])
        mean = group_means(inputs[t], group)[0]
        total = (out - mean) if total is None else total + (out - mean)
        if t == drain_from - 1:
            start = float(total.abs().sum())
    return start, float(total.abs().sum()) if total is not None else 0.0
