"""Composable Hypothesis strategies for DDP hooks: world sizes, layouts, gradients, schedules.

Every strategy here draws **plain data** (ints, floats, strings, tuples) — a *spec* —
and a pure function turns the spec into tensors. Two things follow:

* a counterexample is small and readable, and shrinks well: a gradient is "ints times
  2**3, with 65504.0 at position 2", not 64 unrelated floats;
* a counterexample is *replayable*: :class:`Example` round-trips through JSON (see
  :func:`simcluster.checking.check.encode_example`), and materialising the same spec gives the
  same bits every time (data comes from a private ``torch.Generator`` seeded by the spec,
  never from the global RNG).

Typical use, composed::

    >>> from hypothesis import given, strategies as st
    >>> from simcluster.checking.strategies import layouts, gradients
    >>> @given(st.data())
    ... def test_my_oracle(data):
    ...     layout = data.draw(layouts())
    ...     grads = data.draw(gradients(layout.shapes, world_size=2))   # grads[rank][param]
    ...     assert len(grads) == 2 and len(grads[0]) == len(layout.shapes)

What the gradient strategy is built to hit, because each one breaks some hook: zeros
(whole tensors and single entries), **a rank whose gradient is all zero**, subnormals
of the value dtype, values **at and near its largest finite value** — also at the same
position on every rank, so that a sum overflows —, mixed magnitudes across ranks (each
rank its own scale) and within a tensor (``mixed`` fill), negatives, and — with
``exact=True`` — values whose mean and every partial sum are exactly representable
(``W * m * 2**e`` with small integers ``m``), for bitwise comparisons.

Schedules are lists of choices: entry ``k`` picks among the ready collectives at the
``k``-th point where there is more than one. An empty list (or all zeros) is in-order
completion, so a failing schedule shrinks towards it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from simcluster.errors import UsageError

__all__ = [
    "DTYPES",
    "Layout",
    "RankSpec",
    "StepSpec",
    "Example",
    "ScheduleChoices",
    "world_sizes",
    "shapes",
    "layouts",
    "fixed_shapes",
    "rank_specs",
    "step_specs",
    "gradient_specs",
    "gradients",
    "materialize_step",
    "schedules",
    "examples",
    "special_values",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""Gradient dtypes by name (the names used in specs and replay tokens)."""

_FILLS = ("zeros", "ints", "uniform", "mixed", "const")


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise UsageError(f"dtype={dtype!r} is not a gradient dtype simcluster draws: use one of {sorted(DTYPES)}")


# --------------------------------------------------------------------------- world, layout
def world_sizes(choices: Sequence[int] = (1, 2, 3, 4, 8)) -> st.SearchStrategy[int]:
    """One of ``choices``; shrinks towards the smallest."""
    sizes = sorted(set(choices))
    if not sizes or any(not isinstance(w, int) or w < 1 for w in sizes):
        raise UsageError(f"world sizes must be positive ints, got {list(choices)!r}")
    return st.sampled_from(sizes)


def shapes(*, max_side: int = 8, allow_2d: bool = True) -> st.SearchStrategy[tuple[int, ...]]:
    """A parameter shape: 1-D ``(n,)`` or 2-D ``(r, c)``.

    2-D sides go up to ``max_side`` (default 8): PowerSGD (rank 1, its default
    ``min_compression_rate=2``) compresses an ``r x c`` matrix only when
    ``(r + c) * 2 < r * c``, i.e. from 5 x 5 up; smaller matrices and vectors it
    all-reduces uncompressed, so both paths are drawn. Shrinks towards ``(1,)``.
    """
    one_d = st.tuples(st.integers(1, 2 * max_side))
    if not allow_2d:
        return one_d
    return st.one_of(one_d, st.tuples(st.integers(1, max_side), st.integers(1, max_side)))


@dataclass(frozen=True)
class Layout:
    """A DDP model as far as bucketing sees it (see :mod:`simcluster.ddp.layout`).

    ``shapes``: parameter shapes in ``model.parameters()`` order. ``bucket_cap_mb``:
    ``None`` (DDP's default: everything in one bucket for models this small) or a cap
    small enough to split them. ``ready_order``: the order gradients become ready
    (a permutation of the parameter indices), which the rebuild follows.
    """

    shapes: tuple[tuple[int, ...], ...]
    bucket_cap_mb: float | None = None
    ready_order: tuple[int, ...] = ()
    static_graph: bool = False
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False

    @property
    def cap_bytes(self) -> int | None:
        return None if self.bucket_cap_mb is None else int(self.bucket_cap_mb * 2**20)

    def describe(self) -> str:
        """One readable line, e.g. ``params [(3,), (6, 6)], cap 64 B, ready order [1, 0]``."""
        cap = "default cap" if self.bucket_cap_mb is None else f"cap {self.cap_bytes} B"
        flags = [n for n in ("static_graph", "find_unused_parameters", "gradient_as_bucket_view") if getattr(self, n)]
        text = f"params {[tuple(s) for s in self.shapes]}, {cap}, ready order {list(self.ready_order)}"
        return text + (", " + ", ".join(flags) if flags else "")


def fixed_shapes(params: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``params`` as a tuple of shapes, validated (UsageError): a non-empty sequence of
    shapes of positive ints, e.g. ``[(4, 5), (5,)]``; ``()`` is a 0-dim (scalar) parameter."""
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence) or not params:
        raise UsageError(f"params={params!r}: give a non-empty list of shapes, e.g. [(4, 5), (5,)]")
    out = []
    for shape in params:
        shape = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
        if (isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence)
                or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in shape)):
            raise UsageError(f"params={params!r}: {shape!r} is not a shape of positive ints, e.g. (4, 5)")
        out.append(tuple(shape))
    return tuple(out)


def layouts(*, max_params: int = 4, max_side: int = 8, flags: bool = True,
            params: Sequence[Sequence[int]] | None = None, bucket_view: bool = False) -> st.SearchStrategy[Layout]:
    """A :class:`Layout`: 1 to ``max_params`` parameters, a cap, a ready order.

    Caps are drawn as 1/8 to 8/8 of the parameters' float32 bytes (at least 16) (so the rebuild makes
    several buckets, as bugs of buckets in flight need) or ``None`` (DDP's default). ``flags`` also draws DDP's
    ``static_graph`` / ``find_unused_parameters`` / ``gradient_as_bucket_view`` (rarely
    on; they shrink to off). Shrinks towards one ``(1,)`` parameter, the smallest
    cap, identity ready order. ``params``: fixed parameter shapes (``--params``); caps,
    ready orders and flags are still drawn. ``bucket_view``: every layout has
    ``gradient_as_bucket_view=True`` (``--gradient-as-bucket-view``: for hooks whose owner
    requires it, e.g. an optimizer stepping on ``p.grad`` as the bucket's views).
    """
    fixed = None if params is None else fixed_shapes(params)
    # Sub-strategies are built once, not per draw (building costs more than drawing).
    counts = st.just(len(fixed)) if fixed is not None else st.integers(1, max_params)
    shape = shapes(max_side=max_side)
    quarter, eighths, flag = st.integers(0, 3), st.integers(1, 8), st.booleans()
    top = max_params if fixed is None else len(fixed)
    orders = {n: st.permutations(range(n)) for n in range(1, top + 1)}

    return _layout(counts, shape, quarter, eighths, flag, orders, fixed, flags, bucket_view)


@st.composite
def _layout(draw: st.DrawFn, counts: st.SearchStrategy[int], shape: st.SearchStrategy[tuple[int, ...]],
            quarter: st.SearchStrategy[int], eighths: st.SearchStrategy[int], flag: st.SearchStrategy[bool],
            orders: dict[int, st.SearchStrategy[list[int]]], fixed: tuple[tuple[int, ...], ...] | None,
            flags: bool, bucket_view: bool) -> Layout:
    """:func:`layouts`' draw, from the sub-strategies it built."""
    n = draw(counts)
    param_shapes = fixed if fixed is not None else tuple(draw(shape) for _ in range(n))
    # mostly a cap of 1/8 .. 8/8 of the parameters' bytes, so the rebuild makes several
    # buckets (bugs of buckets in flight need them); DDP's default cap when quarter == 3
    total = 4 * sum(math.prod(s) for s in param_shapes)
    cap = None if draw(quarter) == 3 else max(16, total * draw(eighths) // 8) / 2**20
    order = tuple(draw(orders[n]))
    static = fu = view = False
    if flags and draw(quarter) == 3:
        static, fu, view = draw(flag), draw(flag), draw(flag)
    return Layout(param_shapes, cap, order, static, fu, view or bucket_view)


# --------------------------------------------------------------------------- values
def special_values(values: torch.dtype) -> tuple[float, ...]:
    """The values of ``values``' type that break hooks: zeros, extremes, subnormals, ±1.

    >>> special_values(torch.float16)[:4]
    (0.0, -0.0, 65504.0, -65504.0)
    """
    fi = torch.finfo(values)
    sub = fi.smallest_normal * fi.eps  # smallest positive subnormal: 2**(emin - mantissa bits)
    return (0.0, -0.0, fi.max, -fi.max, fi.max / 2, fi.max * (1 - fi.eps), sub, -sub,
            fi.smallest_normal - sub, fi.smallest_normal, 1.0, -1.0)


def _exponent_range(values: torch.dtype) -> tuple[int, int]:
    fi = torch.finfo(values)
    return math.frexp(fi.smallest_normal * fi.eps)[1] - 1, math.frexp(fi.max)[1] - 1


@dataclass(frozen=True)
class RankSpec:
    """How to fill one rank's gradients for one step (all parameters, flattened and concatenated).

    ``fill``: ``zeros``; ``ints`` (integers in [-8, 8] times ``2**exp``); ``uniform``
    (uniform in (-1, 1) times ``2**exp``); ``mixed`` (uniform times a per-element power
    of two spread over 40 binades around ``exp``: mixed magnitudes within a tensor);
    ``const`` (``value`` everywhere). ``seed`` drives a private generator.
    ``specials``: ``(position, value)`` overrides (position modulo the total numel).
    ``zero``: the whole rank is zero (overrides everything but ``nonfinite``).
    ``nonfinite``: ``(position, "inf" | "-inf" | "nan")`` overrides set last, after the
    values are rounded to the value dtype — values no draw produces (drawn values are
    finite and clamped to the dtype's range); only the explicit non-finite examples
    (:func:`simcluster.checking.explicit.nonfinite_examples`) set them. Spelled as strings
    so that a spec equals (and hashes like) its decoded replay token: ``nan != nan``.
    """

    fill: str = "zeros"
    exp: int = 0
    seed: int = 0
    value: float = 0.0
    specials: tuple[tuple[int, float], ...] = ()
    zero: bool = False
    nonfinite: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class StepSpec:
    """Every rank's gradients for one step.

    ``shared``: ``(position, value)`` set on every non-zero rank — how extremes land at
    the same place on all ranks so that their *sum* overflows. ``exp``: the step's scale
    in exact mode. ``shift``: added to every rank's seed (how later steps get new values
    of the same kind cheaply: see :class:`Example`).
    """

    ranks: tuple[RankSpec, ...]
    shared: tuple[tuple[int, float], ...] = ()
    exp: int = 0
    shift: int = 0


def _value_strategy(values: torch.dtype, exact: bool) -> st.SearchStrategy[float]:
    if exact:
        return st.integers(-64, 64).map(float)
    width = {torch.float16: 16, torch.float64: 64}.get(values, 32)
    return st.one_of(st.sampled_from(special_values(values)),
                     st.floats(allow_nan=False, allow_infinity=False, width=width))


def rank_specs(values: torch.dtype = torch.float32, *, exact: bool = False) -> st.SearchStrategy[RankSpec]:
    """A :class:`RankSpec` whose values live in ``values``' representable set.

    Exponents shrink towards 0 but range over the whole dtype (subnormals to the
    largest binade); fills shrink towards ``zeros``; a zero rank comes 1 time in 6.
    """
    lo, hi = _exponent_range(values)
    fills = st.sampled_from(("zeros", "ints", "const") if exact else _FILLS)
    exps = st.just(0) if exact else st.one_of(st.integers(-4, 4), st.integers(lo, hi))
    value = _value_strategy(values, exact)
    specials = st.lists(st.tuples(st.integers(0, 63), value), max_size=2).map(tuple)
    seeds = st.integers(0, 2**16)
    zero = st.integers(0, 5)

    return _rank_spec(zero, fills, specials, value, exps, seeds)


@st.composite
def _rank_spec(draw: st.DrawFn, zero: st.SearchStrategy[int], fills: st.SearchStrategy[str],
               specials: st.SearchStrategy[tuple[tuple[int, float], ...]], value: st.SearchStrategy[float],
               exps: st.SearchStrategy[int], seeds: st.SearchStrategy[int]) -> RankSpec:
    """:func:`rank_specs`' draw, from the sub-strategies it built."""
    if draw(zero) == 5:
        return RankSpec(zero=True)
    fill = draw(fills)
    if fill == "zeros":
        return RankSpec("zeros", specials=draw(specials))
    constant = draw(value) if fill == "const" else 0.0
    return RankSpec(fill, draw(exps), draw(seeds) if fill != "const" else 0, constant, draw(specials))


def step_specs(world_size: int, values: torch.dtype = torch.float32, *, exact: bool = False,
               _ranks: st.SearchStrategy[RankSpec] | None = None) -> st.SearchStrategy[StepSpec]:
    """A :class:`StepSpec` for ``world_size`` ranks.

    Its parts' strategies are built here, once, not inside each draw: a strategy built in a
    draw is built and validated again for every example (a ``lists`` of ``tuples`` is not
    cached by Hypothesis; ~1 % of the default ``simcluster check``'s samples)."""
    ranks_st = _ranks if _ranks is not None else rank_specs(values, exact=exact)
    alike = st.integers(0, 3)
    # shared values: the extremes whose *sum* over ranks misbehaves (overflow, underflow)
    fi = torch.finfo(values)
    extremes = (fi.max, -fi.max, fi.max * (1 - fi.eps), fi.smallest_normal * fi.eps, 1.0)
    value = st.integers(-64, 64).map(float) if exact else st.sampled_from(extremes)
    shared_st = st.lists(st.tuples(st.integers(0, 63), value), max_size=2)
    exps = st.integers(-3, 3)

    return _step_spec(world_size, ranks_st, alike, shared_st, exps, exact)


@st.composite
def _step_spec(draw: st.DrawFn, world_size: int, ranks_st: st.SearchStrategy[RankSpec], alike: st.SearchStrategy[int],
               shared_st: st.SearchStrategy[list[tuple[int, float]]], exps: st.SearchStrategy[int],
               exact: bool) -> StepSpec:
    """:func:`step_specs`' draw, from the sub-strategies it built."""
    if draw(alike) == 3:  # every rank the same gradient: sums reach W times a value
        ranks = (draw(ranks_st),) * world_size
    else:
        ranks = tuple(draw(ranks_st) for _ in range(world_size))
    shared = draw(shared_st)
    exp = draw(exps) if exact else 0
    return StepSpec(ranks, tuple(shared), exp)


def gradient_specs(world_size: int, steps: int = 1, values: torch.dtype = torch.float32,
                   *, exact: bool = False) -> st.SearchStrategy[tuple[StepSpec, tuple[int, ...]]]:
    """``(base, shifts)``: step 0's :class:`StepSpec` and one shift per later step.

    Shift ``0`` repeats the previous step's gradients exactly (what error-feedback bugs
    need: gradients that repeat); ``k > 0`` redraws every rank's values from seed + k,
    keeping their kind and scale. Shrinks towards repeating.
    """
    # the rank strategy is built once here and shared by step_specs
    ranks = rank_specs(values, exact=exact)
    return st.tuples(step_specs(world_size, values, exact=exact, _ranks=ranks),
                     st.tuples(*(st.integers(0, 7) for _ in range(steps - 1))))


def materialize_step(spec: StepSpec, param_shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32,
                     values: torch.dtype | None = None, *, exact: bool = False,
                     previous: list[list[torch.Tensor]] | None = None) -> list[list[torch.Tensor]]:
    """The tensors ``grads[rank][param]`` a :class:`StepSpec` describes (pure, deterministic).

    Values are built in float64, clamped to ``values``' finite range and rounded to it
    (so under ``values=torch.float16`` every entry is a float16 value, stored as
    ``dtype``). In exact mode each entry is ``W * m * 2**spec.exp`` for a small integer
    ``m``, so the mean ``sum_r m_r 2**exp`` and every partial sum are exact in float32.
    """
    if spec.shift == 0 and previous is not None:
        return [[t.clone() for t in rank] for rank in previous]
    values = dtype if values is None else values
    world = len(spec.ranks)
    fi = torch.finfo(values)
    sizes = [math.prod(s) for s in param_shapes]
    numel = sum(sizes)
    scale = float(world) * 2.0**spec.exp if exact else 1.0
    flats = torch.zeros(world, numel, dtype=torch.float64)  # every rank's values, one row each
    gen = torch.Generator()  # re-seeded for each rank: the same stream a fresh one would give
    for r, rank in enumerate(spec.ranks):
        if rank.zero or not numel:
            continue
        flat = flats[r]
        flat.copy_(_fill(rank, numel, world, spec.exp, exact, spec.shift, gen))
        for pos, value in spec.shared:
            flat[pos % numel] = value * scale
    # clamped and rounded to the value dtype, then stored as ``dtype``: element-wise, so the
    # whole matrix at once gives each rank the bits it would get alone
    flats = flats.clamp(-fi.max, fi.max).to(values).to(dtype)
    for r, rank in enumerate(spec.ranks):
        for pos, value in rank.nonfinite:
            if numel:
                flats[r, pos % numel] = float(value)
    # each parameter's block copied once; rank r's gradient is its row, shaped (own storage per parameter)
    blocks = [piece.reshape((world, *shape)).clone() for piece, shape in
              zip(flats.split(sizes, dim=1), (tuple(shape) for shape in param_shapes))]
    return [[block[r] for block in blocks] for r in range(world)]


def _fill(rs: RankSpec, numel: int, world: int, exp: int, exact: bool, shift: int = 0,
          gen: torch.Generator | None = None) -> torch.Tensor:
    gen = (torch.Generator() if gen is None else gen).manual_seed(rs.seed + shift)
    scale = float(world) * 2.0**exp if exact else 2.0**rs.exp
    if rs.fill == "ints":
        flat = torch.randint(-8, 9, (numel,), generator=gen).to(torch.float64) * scale
    elif rs.fill == "uniform":
        flat = (torch.rand(numel, generator=gen, dtype=torch.float64) * 2 - 1) * scale
    elif rs.fill == "mixed":
        spread = torch.randint(-20, 21, (numel,), generator=gen).to(torch.float64)
        flat = (torch.rand(numel, generator=gen, dtype=torch.float64) * 2 - 1) * torch.pow(2.0, spread + rs.exp)
    elif rs.fill == "const":
        flat = torch.full((numel,), rs.value * (scale if exact else 1.0), dtype=torch.float64)
    else:
        flat = torch.zeros(numel, dtype=torch.float64)
    for pos, value in rs.specials:
        if numel:
            flat[pos % numel] = value * scale if exact else value
    return torch.nan_to_num(flat, nan=0.0)


def gradients(param_shapes: Sequence[Sequence[int]], world_size: int, dtype: torch.dtype = torch.float32,
              *, values: torch.dtype | None = None, exact: bool = False) -> st.SearchStrategy[list[list[torch.Tensor]]]:
    """Per-rank gradients ``grads[rank][param]`` of ``dtype`` for one step.

    ``values``: the dtype whose representable values are drawn (default ``dtype``);
    e.g. ``values=torch.float16`` gives float32 tensors holding only float16 values up
    to ±65504, the inputs an fp16-compressing hook must handle.
    """
    _dtype_name(dtype)
    shapes_t = [tuple(s) for s in param_shapes]
    return step_specs(world_size, values or dtype, exact=exact).map(
        lambda spec: materialize_step(spec, shapes_t, dtype, values, exact=exact))


# --------------------------------------------------------------------------- schedules
def schedules(max_len: int = 16, max_choice: int = 7) -> st.SearchStrategy[tuple[int, ...]]:
    """Completion choices for :class:`ScheduleChoices`; shrink towards ``()`` = in-order."""
    return st.lists(st.integers(0, max_choice), max_size=max_len).map(tuple)


@dataclass
class ScheduleChoices:
    """A scheduler that replays drawn choices, spending one only on a real choice.

    At a point with ``n_ready > 1`` ready collectives the next entry ``c`` picks
    ``c % n_ready``; forced picks (one option) and picks after the list runs out are
    ``0`` (in-order). ``taken`` records ``(n_ready, pick)`` of every real choice, so
    ``[c for _, c in taken]`` replays the run exactly.
    """

    choices: Sequence[int]
    taken: list[tuple[int, int]] = field(default_factory=list)
    _next: int = 0

    def choose(self, n_ready: int) -> int:
        if n_ready <= 1:
            return 0
        pick = self.choices[self._next] % n_ready if self._next < len(self.choices) else 0
        self._next += 1
        self.taken.append((n_ready, pick))
        return pick

    def describe(self) -> str:
        return f"choices{list(self.choices)!r}"


# --------------------------------------------------------------------------- a whole example
@dataclass(frozen=True)
class Example:
    """One complete check input: everything a replay needs, as plain data.

    ``base`` is step 0's gradients; step ``t >= 1`` is ``base`` with every seed
    shifted by ``shifts[t-1]``, or a repeat of step ``t - 1`` when that shift is 0.
    ``rng_seed``: the seed of the ranks' torch, ``random`` and numpy generators (the
    cluster's ``seed``; ``None``: the check's ``--seed``), drawn so that a hook's random
    choices are explored and shrink.
    """

    world_size: int
    layout: Layout
    base: StepSpec
    shifts: tuple[int, ...] = ()
    schedule: tuple[int, ...] = ()
    dtype: str = "float32"
    values: str = "float32"
    exact: bool = False
    subgroups: int = 1  # DDP runs on world_size // subgroups ranks per group
    rng_seed: int | None = None

    @property
    def steps(self) -> int:
        return 1 + len(self.shifts)

    @property
    def nonfinite(self) -> bool:
        """Whether some rank's gradients hold an ``inf`` or ``NaN`` (:attr:`RankSpec.nonfinite`)."""
        return any(rank.nonfinite for rank in self.base.ranks)

    def grads(self) -> list[list[list[torch.Tensor]]]:
        """``grads[step][rank][param]``, materialised (deterministic)."""
        out: list[list[list[torch.Tensor]]] = []
        for t in range(self.steps):
            spec = self.base if t == 0 else dataclasses.replace(self.base, shift=self.shifts[t - 1])
            out.append(materialize_step(spec, self.layout.shapes, DTYPES[self.dtype], DTYPES[self.values],
                                        exact=self.exact, previous=out[-1] if out else None))
        return out


def examples(*, world_size_choices: Sequence[int] = (1, 2, 3, 4, 8), steps: int = 3,
             dtype: torch.dtype = torch.float32, values: torch.dtype | None = None, exact: bool = False,
             subgroups: bool = False, max_params: int = 4,
             params: Sequence[Sequence[int]] | None = None, bucket_view: bool = False) -> st.SearchStrategy[Example]:
    """A whole :class:`Example`. ``subgroups=True`` also draws a split of the world into
    equal groups of consecutive ranks (DDP runs on each), when the world size allows.
    ``params``: fixed parameter shapes, ``bucket_view``: DDP's gradient_as_bucket_view always
    on (see :func:`layouts`).

    Every sub-strategy is built once here, not per example: building Hypothesis
    strategies costs more than drawing from them.
    """
    values = values or dtype
    worlds = world_sizes(world_size_choices)
    layout_st = layouts(max_params=max_params, params=params, bucket_view=bucket_view)
    grads_st = {w: gradient_specs(w, steps, values, exact=exact) for w in sorted(set(world_size_choices))}
    group_st = {w: st.sampled_from([d for d in range(1, w + 1) if w % d == 0]) for w in grads_st}
    schedule_st = schedules()
    rng_seed_st = st.integers(0, 2**31 - 1)
    names = (_dtype_name(dtype), _dtype_name(values))

    return _example(worlds, layout_st, grads_st, group_st, schedule_st, rng_seed_st, subgroups, names, exact)


@st.composite
def _example(draw: st.DrawFn, worlds: st.SearchStrategy[int], layout_st: st.SearchStrategy[Layout],
             grads_st: dict[int, st.SearchStrategy[tuple[StepSpec, tuple[int, ...]]]],
             group_st: dict[int, st.SearchStrategy[int]], schedule_st: st.SearchStrategy[tuple[int, ...]],
             rng_seed_st: st.SearchStrategy[int], subgroups: bool, names: tuple[str, str], exact: bool) -> Example:
    """:func:`examples`' draw, from the sub-strategies it built."""
    world = draw(worlds)
    layout = draw(layout_st)
    base, shifts = draw(grads_st[world])
    groups = draw(group_st[world]) if subgroups else 1
    schedule = draw(schedule_st)
    rng_seed = draw(rng_seed_st)  # drawn last: earlier draws keep their place in the choice sequence
    return Example(world, layout, base, shifts, schedule, names[0], names[1], exact, groups, rng_seed)
