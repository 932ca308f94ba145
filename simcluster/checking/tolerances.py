"""Tolerances: the one parser of ``--tolerance`` / ``tolerance=``, and the bounds of lossy compressors.

A tolerance says how far a hook's result may be from the exact (float64) mean of the
ranks' gradients. Spellings (case and spaces ignored)::

    none | exact | fp32 | fp16 | bf16           named: derived from the arithmetic (properties.error_bound)
    rtol=R,atol=A                               per element: |error| <= A + R·|mean|
    scale=R[,atol=A]                            per element: |error| <= R·G + A, G = the largest |gradient|
                                                in that bucket, over every rank of the group, at that step
    norm=R[,atol=A]                             per bucket:  ||error||_2 <= R·||mean||_2 + A

``scale`` is the natural bound of a quantizer (its error is a fraction of the step size,
and the step size is a fraction of the bucket's range); ``norm`` that of sparsifiers and
low-rank methods (they drop a part of the bucket's energy). Both are judged **per DDP
bucket**, as the hook sees its data:

    >>> parse_tolerance("Scale=0.1").describe()
    'scale=0.1'
    >>> parse_tolerance("rtol=1e-3, atol=0")
    Tolerance(kind='explicit', rtol=0.001, atol=0.0, ratio=0.0)
    >>> import torch
    >>> inputs = [[torch.tensor([1.0, -4.0])], [torch.tensor([3.0, 0.0])]]     # [rank][param]
    >>> print(lossy_averages([[torch.tensor([2.3, -2.0])]] * 2, inputs, parse_tolerance("scale=0.1")))
    None
    >>> print(lossy_averages([[torch.tensor([2.5, -2.0])]] * 2, inputs, parse_tolerance("scale=0.1")))
    rank 0, bucket 0 (params [0]), param 0 (shape (2,)), element 0: got 2.5, the float64 mean of the ranks' gradients is 2.0; |error| 0.5 > bound 0.4 (tolerance scale=0.1: 0.1 × the bucket's largest |gradient| 4.0)

:func:`quantization_tolerance` derives the bound torch's 8-bit quantization hooks meet
(``docs/properties.md``, "Lossy compressors").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from simcluster.errors import UsageError

__all__ = ["Tolerance", "TOLERANCE_NAMES", "parse_tolerance", "lossy_averages", "quantization_tolerance",
           "bucket_values", "bucket_position"]

TOLERANCE_NAMES = ("none", "exact", "fp32", "fp16", "bf16")
"""Named tolerances; the keyed forms are ``rtol=R,atol=A``, ``scale=R[,atol=A]``, ``norm=R[,atol=A]``."""

_KEYS = ("rtol", "atol", "scale", "norm")
_HELP = "use none, exact, fp32, fp16, bf16, rtol=R,atol=A, scale=R[,atol=A] or norm=R[,atol=A]"

Grads = Sequence[Sequence[torch.Tensor]]  # [rank][param]


@dataclass(frozen=True)
class Tolerance:
    """A parsed tolerance.

    ``kind``: ``none``, ``exact``, ``fp32``, ``fp16``, ``bf16``, ``explicit`` (``rtol``,
    ``atol``), ``scale`` or ``norm`` (``ratio`` R, ``atol``). ``text``: how it was
    spelled (lower case, no spaces), kept so reports and replay lines echo the user.
    """

    kind: str
    rtol: float = 0.0
    atol: float = 0.0
    ratio: float = 0.0
    text: str = field(default="", compare=False, repr=False)

    def describe(self) -> str:
        """The spelling: as given when parsed, else a canonical one."""
        if self.text:
            return self.text
        if self.kind == "explicit":
            return f"rtol={self.rtol:g},atol={self.atol:g}"
        if self.kind in ("scale", "norm"):
            return f"{self.kind}={self.ratio:g}" + (f",atol={self.atol:g}" if self.atol else "")
        return self.kind

    @property
    def lossy(self) -> bool:
        """Whether this is a bucket-level bound of a lossy compressor (``scale`` / ``norm``)."""
        return self.kind in ("scale", "norm")


def _number(text: str, value: str, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"{what} {text!r}: {value!r} is not a number") from None
    if not 0.0 <= number < math.inf:
        raise UsageError(f"{what} {text!r}: {value!r} must be a finite number >= 0")
    return number


def parse_tolerance(tolerance: str | Tolerance, *, what: str = "tolerance") -> Tolerance:
    """``"fp32"`` → ``Tolerance("fp32")``; keyed forms as in the module docstring.

    ``what`` names the option in the one-line :class:`UsageError` (``"--tolerance"``).
    A :class:`Tolerance` is returned as is.
    """
    if isinstance(tolerance, Tolerance):
        return tolerance
    text = str(tolerance).strip().lower().replace(" ", "")
    if text in TOLERANCE_NAMES:
        return Tolerance(text, text=text)
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        if key not in _KEYS or not sep:
            raise UsageError(f"{what} {tolerance!r}: {_HELP}")
        if key in values:
            raise UsageError(f"{what} {tolerance!r}: {key} is given twice")
        values[key] = _number(str(tolerance), val, what)
    lossy = [k for k in ("scale", "norm") if k in values]
    if len(lossy) == 2 or (lossy and "rtol" in values):
        raise UsageError(f"{what} {tolerance!r}: combine scale= or norm= only with atol=")
    if lossy:
        return Tolerance(lossy[0], atol=values.get("atol", 0.0), ratio=values[lossy[0]], text=text)
    return Tolerance("explicit", values.get("rtol", 0.0), values.get("atol", 0.0), text=text)


# --------------------------------------------------------------------------- the lossy oracle
def _fmt(x: float) -> str:
    return repr(float(x)) if abs(x) >= 1e-3 or x == 0 else f"{float(x):.6g}"


def bucket_values(tensors: Sequence[torch.Tensor], params: Sequence[int]) -> torch.Tensor:
    """The bucket's parameters ``params`` of one rank's ``tensors``, flattened in order, as float64."""
    return torch.cat([tensors[k].detach().to(torch.float64).reshape(-1) for k in params])


def bucket_position(shapes: Sequence[torch.Size], params: Sequence[int], flat_index: int) -> tuple[int, int]:
    """(param, element within it) of a position in a bucket's flattened params."""
    for k in params:
        n = shapes[k].numel()
        if flat_index < n:
            return k, flat_index
        flat_index -= n
    raise IndexError(flat_index)


def lossy_averages(results: Grads, inputs: Grads, tolerance: Tolerance,
                   groups: Sequence[Sequence[int]] | None = None,
                   buckets: Sequence[Sequence[int]] | None = None) -> str | None:
    """The ``averages`` property under a ``scale=`` or ``norm=`` tolerance; ``None`` if it holds.

    ``buckets``: the parameter indices of each DDP bucket of the step (default: one bucket
    of every parameter). For each group and bucket, with ``m`` the float64 mean of the
    group's gradients and ``G`` the largest ``|gradient|`` in the bucket on any rank of the
    group: ``scale=R`` wants every element within ``R·G + atol`` of ``m``; ``norm=R`` wants
    the bucket's L2 error within ``R·||m||_2 + atol``. A non-finite result always fails.
    """
    n_params = len(inputs[0])
    bucket_list = [list(b) for b in buckets] if buckets is not None else [list(range(n_params))]
    for ranks in [list(g) for g in groups] if groups is not None else [list(range(len(inputs)))]:
        for b, params in enumerate(bucket_list):
            stack = torch.stack([bucket_values(inputs[r], params) for r in ranks])
            mean = stack.mean(0)
            g_max = float(stack.abs().max()) if stack.numel() else 0.0
            for r in ranks:
                msg = _judge(bucket_values(results[r], params), mean, g_max, tolerance)
                if msg is None:
                    continue
                where = f"rank {r}, bucket {b} (params {params})"
                if isinstance(msg, str):
                    return f"{where}: {msg}"
                k, i = bucket_position([t.shape for t in results[r]], params, msg)
                got, want = float(bucket_values(results[r], params)[msg]), float(mean[msg])
                err = abs(got - want)
                what = "is not finite" if not math.isfinite(got) else (
                    f"|error| {err:.3g} > bound {tolerance.ratio * g_max + tolerance.atol:.3g}")
                return (f"{where}, param {k} (shape {tuple(results[r][k].shape)}), element {i}: got {_fmt(got)}, the "
                        f"float64 mean of the ranks' gradients is {_fmt(want)}; {what} (tolerance "
                        f"{tolerance.describe()}: {tolerance.ratio:g} × the bucket's largest |gradient| {_fmt(g_max)}"
                        + (f" + {tolerance.atol:g})" if tolerance.atol else ")"))
    return None


def _judge(got: torch.Tensor, mean: torch.Tensor, g_max: float, tol: Tolerance) -> int | str | None:
    """None if ``got`` is within the bound; else the first bad element's index (scale) or a sentence (norm)."""
    if tol.kind == "scale":
        bad = ~((got - mean).abs() <= tol.ratio * g_max + tol.atol)  # NaN and inf fail too
        return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None
    if not bool(torch.isfinite(got).all()):
        return int((~torch.isfinite(got)).nonzero()[0, 0])
    err, norm = float(torch.linalg.vector_norm(got - mean)), float(torch.linalg.vector_norm(mean))
    bound = tol.ratio * norm + tol.atol
    if err <= bound:
        return None
    i = int((got - mean).abs().argmax())
    return (f"the L2 error of the bucket's result is {err:.3g} > bound {bound:.3g} (tolerance {tol.describe()}: "
            f"{tol.ratio:g} × the L2 norm {norm:.3g} of the ranks' float64 mean"
            + (f" + {tol.atol:g})" if tol.atol else ")")
            + f"; largest error at flat element {i}: got {_fmt(got[i])}, mean {_fmt(mean[i])}")


# --------------------------------------------------------------------------- torch's quantizers
def _gamma(k: int, u: float) -> float:
    return k * u / (1.0 - k * u)


def quantization_tolerance(world_size: int) -> Tolerance:
    """The ``scale=R,atol=A`` that torch's 8-bit quantization hooks meet at ``world_size``.

    ``quantization_pertensor_hook`` / ``quantization_perchannel_hook`` (torch 2.13): each
    rank quantizes its bucket (or each 512-element channel) with ``MinMaxObserver``'s
    affine uint8 parameters — step ``s = max((max⁺ − min⁻)/255, ε)``, ``ε = 2^-23``,
    ``max⁺ = max(x.max(), 0)``, ``min⁻ = min(x.min(), 0)`` — all-gathers the bytes,
    dequantizes every rank's copy, sums them in float32 and divides by W.

    * One rank: ``round`` errs by at most ``s/2``, and the clamp to [0, 255] never adds to
      it (the zero point is ``round(−min⁻/s)``, so the ends of the range land within half
      a step of 0 and 255). With ``max⁺ − min⁻ ≤ 2·M_r`` (``M_r`` = the rank's largest
      |x|): ``e_r ≤ max(M_r/255, 2^-24)``, plus float32 roundings of ``x/s`` and
      ``s·(q − z)`` worth ``u·(|x| + |x̂|)``, u = 2^-24.
    * The mean: ``(1/W)·Σ e_r ≤ max(G/255, 2^-24)``, and the float32 sum of W dequantized
      values then the division add ``γ_{W+1}·max|x̂| ≤ γ_{W+1}·(G·256/255 + 2^-24)``.

    So ``|result − mean| ≤ R_W·G + A_W`` with ``R_W = 1/255 + γ_{W+4}(2^-24)·256/255`` and
    ``A_W = 2^-24·(1 + γ_{W+1})``. The bound is tight: a value half a step off the grid on
    every rank errs by ``G/255`` (tests/test_tolerances.py measures 0.997–0.9997 of it).
    """
    u = 2.0**-24
    ratio = 1.0 / 255.0 + _gamma(world_size + 4, u) * 256.0 / 255.0
    atol = 2.0**-24 * (1.0 + _gamma(world_size + 1, u))
    return Tolerance("scale", atol=atol, ratio=ratio)


def round_up(tolerance: Tolerance, digits: int = 4) -> str:
    """A ``scale=``/``norm=`` spelling with ``digits`` significant digits, rounded *up* (still a bound)."""
    def up(x: float) -> str:
        if x == 0:
            return "0"
        exp = math.floor(math.log10(abs(x))) - digits + 1
        return f"{math.ceil(x / 10.0**exp) * 10.0**exp:.{digits}g}"

    return f"{tolerance.kind}={up(tolerance.ratio)}" + (f",atol={up(tolerance.atol)}" if tolerance.atol else "")
