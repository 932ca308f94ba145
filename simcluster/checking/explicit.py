"""Explicit examples: known-dangerous inputs every check tries after its drawn examples.

Hypothesis draws examples at random, and some bugs need a combination that a 50-example
search reaches only now and then. These combinations are tried explicitly, the same
ones for every seed (they depend only on the options), so a check that passed them says
so for every seed:

* :func:`edge_example` — every rank at the inputs' largest finite value (sums of W such
  values overflow a hook that divides late; at W = 3 even a float16 sum of the divided
  values rounds to inf).
* :func:`large_edge_example` — the same with one bucket of :data:`LARGE_ELEMENTS` elements:
  a hook that sends small buckets as they are and compresses only large ones (``if
  bucket.buffer().numel() > 1024: fp16``) has the fp16 overflow in that branch alone, and the
  draw makes small buckets (round 25 of hooks from the wild: such a hook passed 4 seeds).

* :func:`race_example` — several buckets in flight at a small world size, completed under
  :data:`RANKS_DISAGREE`, a schedule under which the ranks see completions in different
  orders. A hook that posts a collective from a ``then`` callback (which runs when the
  bucket's collective completes) while DDP calls it for the next bucket then posts its
  collectives in a different order on different ranks: on real gloo the group hangs or
  aborts. The drawn search needs three things at once for that — a world of 2 or more,
  two buckets in one step (DDP's first iteration has one bucket; the rebuild splits it
  from step 1), and a drawn schedule with choices left for the step with two buckets
  (one schedule list serves every step, and step 0 mostly spends it) — and found the GCQ
  hook from the wild (docs/hooks.md) on 1 seed in 20 at the default 50 examples
  (docs/properties.md, "Explicit examples").

* :func:`twins_example` — several buckets *of the same size* in flight. The race example
  gives its buckets different sizes so that a collective paired with another bucket's
  fails loudly; a hook that confuses its buckets in flight (state keyed on "the" bucket:
  a compressor keeping the last buffer in ``self``, DDP calling the hook for bucket k+1
  before bucket k's collective completed) is *silently* wrong only when the sizes agree —
  another bucket's data, no error. The drawn search picks parameter shapes independently
  and rarely repeats one, so that form went unseen in the default 50 examples
  (docs/hooks.md: ``buggy.inflight_shared_compressor``).

* :func:`late_copy_example` — one bucket, the newer of its first two collectives completing
  first and DDP copying the bucket back before the older: a hook joining only the last of
  several collectives on its bucket (round 23 of hooks from the wild; the draw needed 100-200
  examples).

* :func:`nonfinite_examples` — one rank's gradient holding ``inf`` at one element (and,
  in a second example, ``NaN``), every other element finite: what a step of
  mixed-precision training with an overflow hands the hook. No draw produces a
  non-finite value (drawn values are clamped to the dtype's range), so a hook that
  decides on a *local* check of its own gradients — skip the all_reduce on overflow, as
  mixed-precision code does — or one that hides the overflow from
  ``torch.amp.GradScaler`` (``nan_to_num``, a clamp) went unseen: the first is a
  *liveness* failure (one rank skips the collective its peers post), the second a
  *keeps_nonfinite* failure (:func:`simcluster.checking.properties.keeps_nonfinite`).

* :func:`order_example` — three ranks whose sum depends on the order it is added in:
  ``1``, ``2**-24`` and ``-1`` (``(1 + 2**-24) - 1`` is 0 in float32, ``(2**-24 - 1) + 1``
  is ``2**-24``). A collective computes the sum once and every rank gets the same bits; a
  hook that adds the ranks' contributions itself, each rank in its own order (a Trivance
  or "sum the gathered list starting from my rank" all-reduce), hands the ranks different
  gradients, and the replicas drift apart. With two ranks addition is commutative: only
  worlds of 3 or more show it, and only on values like these — a hook refusing other world
  sizes spent the draw failing there, and its drift at world 3 went unreported on 2 seeds
  in 3 (hooks from the wild, round 8: a Trivance all-reduce).

* :func:`scalar_example` — a model with a 0-dim parameter (``nn.Parameter(torch.tensor(1.0))``,
  a learnable temperature) beside a matrix. Real DDP buckets it like any other and
  ``bucket.gradients()`` hands the hook a 0-dim view (measured:
  ``benchmarks/measure_scalar_param.py``), which ``g.shape[0]`` cannot index. The draw makes
  no 0-dim shape (drawing one changed what the default run finds: docs/hooks.md, round 12),
  so a hook reading the rows of every gradient passed (hooks from the wild, round 12:
  GreedyLore's counting hook).

All are plain :class:`~simcluster.checking.strategies.Example` values: a failure found
on one is reported, shrunk by nothing, with its replay token like any other — unless the
drawn search already reported that bug (same property, exception type and user line).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from simcluster.checking.options import Options
from simcluster.checking.strategies import DTYPES, Example, Layout, RankSpec, StepSpec
from simcluster.checking.tolerances import parse_tolerance

__all__ = ["RANKS_DISAGREE", "RACE_SHAPES", "TWIN_SHAPES", "NONFINITE", "NONFINITE_SHAPES", "ORDER_VALUES",
           "SCALAR_SHAPES", "NEWEST", "LATE_FIRST", "LATE_SHAPES", "LARGE_ELEMENTS", "explicit_examples", "edge_example",
           "large_edge_example", "race_example",
           "twins_example", "late_copy_example",
           "nonfinite_examples", "order_example", "scalar_example"]

RANKS_DISAGREE: tuple[int, ...] = (1,) * 256
"""The race example's schedule: the second option at every real choice (in order after 256
choices). On the gloo model the options are a rank's backward pass paused between two hook
calls (going on: option 0), the per-rank deliveries of completed collectives (oldest first),
then the ready collectives; taking the second each time completes a bucket's collective
before the paused rank's next hook call, delivers a collective to one rank before another,
and then the *next* collective to the other before the first one: the ranks see completions
in different orders, so callbacks run at different points of their programs. (Always-newest,
``reverse``, delivers to every rank in the same order.) The NCCL model completes each group's collectives in issue order and
delivers to every rank at once, so there it only picks which group's collective completes
next (a race between groups, when the hook uses several)."""

RACE_SHAPES: tuple[tuple[int, ...], ...] = ((3,), (5,), (4,))
"""The race example's parameters when ``--params`` gives none: three buckets of different
sizes (one parameter each), so a collective paired with another bucket's shows as a size
mismatch rather than silently summing the wrong data."""

TWIN_SHAPES: tuple[tuple[int, ...], ...] = ((4,), (4,), (4,))
"""The twins example's parameters when ``--params`` gives no two of the same size: three
buckets of 4 elements (one parameter each), whose gradients differ."""

_RACE_CAP_MB = 1 / 2**20
"""A 1-byte bucket cap: DDP closes a bucket at its first parameter, so from the rebuild
on each parameter is a bucket of its own."""


NONFINITE: tuple[str, ...] = ("inf", "nan")
"""The non-finite values the non-finite examples put in one rank's gradient, one example each."""

NONFINITE_SHAPES: tuple[tuple[int, ...], ...] = ((6, 6), (4,))
"""The non-finite examples' parameters when ``--params`` gives none: a 6 x 6 matrix, which
PowerSGD (rank 1) compresses — a vector or a small matrix it all-reduces as is — and a
vector; one bucket (DDP's default cap)."""

_NONFINITE_AT = 1
"""The element (of the flattened parameters, modulo their numel) that holds the non-finite
value: in the first parameter, the matrix of :data:`NONFINITE_SHAPES`."""


ORDER_VALUES: tuple[float, ...] = (1.0, 2.0**-24, -1.0)
"""The order example's values, one per rank (every element of the rank's gradients; ranks
past the third hold 0): their float32 sum is 0 or ``2**-24`` depending on the order of the
additions. Representable in float16 and bfloat16 too (``2**-24`` is float16's smallest
subnormal), so they are inputs of every tolerance's domain."""


LARGE_ELEMENTS = 2**18 + 1
"""The large edge example's bucket: one parameter of 262,145 elements — past DDP's first bucket
cap (1 MiB of float32, 262,144) and any size threshold a hook sets below it (1,024, 4,096,
65,536 elements were seen in hooks from the wild)."""


SCALAR_SHAPES: tuple[tuple[int, ...], ...] = ((2, 3), ())
"""The scalar example's parameters: a 2 x 3 matrix and a 0-dim parameter, in one bucket at
step 0 and (DDP's default cap) after the rebuild."""


def explicit_examples(opts: Options, world_sizes: Sequence[int], steps: int) -> list[Example]:
    """The explicit examples that apply to these options, in the order they are run."""
    return [ex for ex in (edge_example(opts, world_sizes, steps), large_edge_example(opts, world_sizes, steps),
                          race_example(opts, world_sizes, steps),
                          twins_example(opts, world_sizes, steps), late_copy_example(opts, world_sizes, steps),
                          *nonfinite_examples(opts, world_sizes, steps),
                          order_example(opts, world_sizes, steps), scalar_example(opts, world_sizes, steps))
            if ex is not None]


def _values(opts: Options) -> str | None:
    """The name of the dtype whose values the tolerance's inputs hold (None: float32's)."""
    lossy = opts.tolerance not in ("exact", "none") and parse_tolerance(opts.tolerance).lossy
    if lossy or (opts.tolerance == "none" and "error_feedback" in opts.props):
        return "float16"
    return {"fp16": "float16", "bf16": "bfloat16"}.get(opts.tolerance)


def edge_example(opts: Options, world_sizes: Sequence[int], steps: int) -> Example | None:
    """Every rank of world 3 (else the largest) at the value dtype's largest finite value —
    float16's under a lossy tolerance (``scale=``/``norm=``), whose inputs are float16-range.
    Only under tolerances that judge *averages* against inputs of that range."""
    lossy = opts.tolerance not in ("exact", "none") and parse_tolerance(opts.tolerance).lossy
    if (opts.tolerance not in ("fp32", "fp16", "bf16") and not lossy) or max(world_sizes) < 2:
        return None
    values = _values(opts)
    world = 3 if 3 in world_sizes else max(world_sizes)
    top = torch.finfo(DTYPES[values or "float32"]).max
    base = StepSpec((RankSpec("const", value=top),) * world)
    shapes = opts.params or ((4,),)
    layout = Layout(shapes, None, tuple(range(len(shapes))), gradient_as_bucket_view=opts.bucket_view)
    return Example(world, layout, base, (0,) * (steps - 1), (), "float32", values or "float32")


def large_edge_example(opts: Options, world_sizes: Sequence[int], steps: int) -> Example | None:
    """:func:`edge_example` with one parameter of :data:`LARGE_ELEMENTS` elements (one bucket
    at every step), unless ``--params`` chose the shapes (the edge example has them)."""
    edge = edge_example(opts, world_sizes, steps)
    if edge is None or opts.params:
        return None
    layout = Layout(((LARGE_ELEMENTS,),), None, (0,), gradient_as_bucket_view=opts.bucket_view)
    return dataclasses.replace(edge, layout=layout)


def race_example(opts: Options, world_sizes: Sequence[int], steps: int) -> Example | None:
    """Several buckets in flight at the smallest world of 2 or more, under :data:`RANKS_DISAGREE`.

    The parameters are ``--params`` (when there are two or more) or :data:`RACE_SHAPES`,
    one bucket each from the rebuild (step 1) on; with ``steps == 1`` DDP's
    ``find_unused_parameters`` layout, which applies the cap from step 0. Gradients: small
    integers, different on every rank and step — exactly averageable (``exact`` when the
    tolerance is), within every tolerance's inputs. None when no world size is 2 or more
    or ``--params`` has a single parameter."""
    world = _smallest_world(world_sizes, 2)
    shapes = opts.params or RACE_SHAPES
    if world is None or len(shapes) < 2:
        return None
    return _bucket_per_parameter(opts, shapes, world, steps, RANKS_DISAGREE)


def twins_example(opts: Options, world_sizes: Sequence[int], steps: int) -> Example | None:
    """Buckets of the same size in flight together, completed in order, at the smallest
    world of 2 or more (else the largest drawn, 1: the confusion needs no peer).

    The parameters are ``--params`` when two of them have the same number of elements, else
    :data:`TWIN_SHAPES` — None when ``--params`` has no two of one size (the race example
    covers those buckets). One bucket per parameter as in :func:`race_example` (a 1-byte
    cap: from the rebuild at step 1 on, or from step 0 with ``--steps 1``). Gradients:
    small integers, different on every rank, parameter and step, so a bucket handed
    another bucket's average is wrong, not coincidentally right."""
    if opts.params:
        sizes = [math.prod(shape) for shape in opts.params]
        if len(set(sizes)) == len(sizes):
            return None
    world = _smallest_world(world_sizes, 2) or max(world_sizes)
    return _bucket_per_parameter(opts, opts.params or TWIN_SHAPES, world, steps, ())


NEWEST = 720719
"""A choice that is the last of ``n`` options for every ``n`` up to 16: ``lcm(1..16) - 1``
(a replayed choice past the options is taken modulo their number, ``ChoiceList``)."""

LATE_FIRST: tuple[int, ...] = (NEWEST, 0, NEWEST)
"""The late-copy example's schedule (then in order): of the ready collectives the newest
completes; rank 0 sees it first (0, the oldest delivery); then the newest option runs — DDP's
copy-back of rank 0, which the gloo model lists after the deliveries and ready collectives —
before the older collectives complete."""

LATE_SHAPES: tuple[tuple[int, ...], ...] = ((8,),)
"""The late-copy example's parameters when ``--params`` gives none: one bucket of 8 elements."""


def late_copy_example(opts: Options, world_sizes: Sequence[int], steps: int) -> Example | None:
    """One bucket at the smallest world of 2 or more, under :data:`LATE_FIRST`: a hook that
    posts two collectives on its bucket (halves) and returns a future tied to the second only
    gets that one completing first — gloo's two worker threads may finish the
    group's collectives in either order — and DDP copying the bucket back before the first
    does. The drawn search needed 100-200 examples to meet this (round 23 of hooks from the
    wild: a ``then`` of the last chunk's future); a ``wait()`` on the last was found at 15.
    With three or more, gloo's model starts the third only once a worker of the group's two
    is free — after an earlier one completed — a longer schedule this example does not take.
    Small-integer gradients as the race example's; None when no world size is 2 or more."""
    world = _smallest_world(world_sizes, 2)
    if world is None:
        return None
    shapes = opts.params or LATE_SHAPES
    layout = Layout(shapes, None, tuple(range(len(shapes))), gradient_as_bucket_view=opts.bucket_view)
    return _small_ints_example(opts, layout, world, steps, LATE_FIRST)


def _bucket_per_parameter(opts: Options, shapes: tuple[tuple[int, ...], ...], world: int, steps: int,
                          schedule: tuple[int, ...]) -> Example:
    """The race and twins examples' common form: each parameter a bucket of its own (a 1-byte
    cap: from the rebuild at step 1 on; with ``steps == 1`` DDP's ``find_unused_parameters``
    layout, capped from step 0), so every bucket is in flight before the first completes;
    small-integer gradients, different per rank, parameter and step (exactly averageable:
    ``exact`` under ``--tolerance exact``); completed under ``schedule``."""
    layout = Layout(shapes, _RACE_CAP_MB, tuple(range(len(shapes))), find_unused_parameters=steps == 1,
                    gradient_as_bucket_view=opts.bucket_view)
    return _small_ints_example(opts, layout, world, steps, schedule)


def _small_ints_example(opts: Options, layout: Layout, world: int, steps: int, schedule: tuple[int, ...]) -> Example:
    """``layout`` at ``world`` with small-integer gradients, different per rank, parameter and
    step (exactly averageable: ``exact`` under ``--tolerance exact``), completed under
    ``schedule``: the common form of the race, twins and scalar examples."""
    base = StepSpec(tuple(RankSpec("ints", seed=rank) for rank in range(world)))
    return Example(world, layout, base, (1,) * (steps - 1), schedule, "float32", _values(opts) or "float32",
                   exact=opts.tolerance == "exact")


def _smallest_world(world_sizes: Sequence[int], least: int) -> int | None:
    """The smallest of ``world_sizes`` that is ``least`` or more; None when none is."""
    return min((w for w in world_sizes if w >= least), default=None)


def nonfinite_examples(opts: Options, world_sizes: Sequence[int], steps: int) -> list[Example]:
    """One rank's gradient holding ``inf`` at one element, every other element finite — and
    the same with ``NaN`` (:data:`NONFINITE`, one example each).

    The smallest world of 2 or more (else the largest drawn, 1); the last rank holds the
    value, at element 1 of its flattened parameters (``--params``, else
    :data:`NONFINITE_SHAPES`), DDP's default cap (one bucket); every step, so the hook meets it in every iteration
    (after the rebuild too, and where a stateful hook such as PowerSGD starts compressing).
    The other elements are small integers, different per rank and step (exactly
    averageable; ``exact`` under ``--tolerance exact``). Judged by *liveness* (a rank that
    skips its collective on a local overflow check leaves its peers' collective unmatched)
    and *keeps_nonfinite*; *averages* and *error_feedback* do not judge a step whose
    inputs are not finite (:func:`simcluster.checking.properties.averages`). Only when one
    of those two properties is checked."""
    if "liveness" not in opts.props and "keeps_nonfinite" not in opts.props:
        return []
    world = _smallest_world(world_sizes, 2) or max(world_sizes)
    values = _values(opts) or "float32"
    shapes = opts.params or NONFINITE_SHAPES
    layout = Layout(shapes, None, tuple(range(len(shapes))), gradient_as_bucket_view=opts.bucket_view)
    out = []
    for value in NONFINITE:
        ranks = tuple(RankSpec("ints", seed=rank, nonfinite=((_NONFINITE_AT, value),) if rank == world - 1 else ())
                      for rank in range(world))
        out.append(Example(world, layout, StepSpec(ranks), (1,) * (steps - 1), (), "float32", values,
                           exact=opts.tolerance == "exact"))
    return out


def order_example(opts: Options, world_sizes: Sequence[int], steps: int) -> Example | None:
    """Ranks holding :data:`ORDER_VALUES` (rank r its r-th value everywhere, later ranks 0) at
    the smallest world of 3 or more, every step; ``--params`` or one 4-vector, DDP's default
    cap, completed in order. Judged by *replicas_agree*: every rank must get the same bits
    (and by *averages*, whose float32 bound a correct mean meets: the exact mean is
    ``2**-24 / 3``, the error a rounding of ``1/3``). None when no world size is 3 or more,
    when *replicas_agree* is not checked, or under ``--tolerance exact`` (the mean is not
    exactly representable: a correct hook would fail there)."""
    world = _smallest_world(world_sizes, 3)
    if world is None or "replicas_agree" not in opts.props or opts.tolerance == "exact":
        return None
    values = _values(opts) or "float32"
    shapes = opts.params or ((4,),)
    layout = Layout(shapes, None, tuple(range(len(shapes))), gradient_as_bucket_view=opts.bucket_view)
    ranks = tuple(RankSpec("const", value=ORDER_VALUES[r] if r < len(ORDER_VALUES) else 0.0) for r in range(world))
    return Example(world, layout, StepSpec(ranks), (0,) * (steps - 1), (), "float32", values)


def scalar_example(opts: Options, world_sizes: Sequence[int], steps: int) -> Example | None:
    """:data:`SCALAR_SHAPES` at the smallest world of 2 or more (else the smallest), DDP's
    default cap, small-integer gradients different per rank (exactly averageable), every
    step. None when ``--params`` fixes the shapes (the user's model is what it says)."""
    if opts.params is not None:
        return None
    world = _smallest_world(world_sizes, 2) or max(world_sizes)
    layout = Layout(SCALAR_SHAPES, None, tuple(range(len(SCALAR_SHAPES))), gradient_as_bucket_view=opts.bucket_view)
    return _small_ints_example(opts, layout, world, steps, ())
