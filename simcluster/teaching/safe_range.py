"""A hook's safe input range: the largest gradient magnitude it averages correctly, found by search.

Compression hooks narrow the number format on the wire, so they stop working above some
gradient magnitude — and where exactly depends on the order of their roundings and on
the world size. This module does not assume the bound: it **runs the real hook** in the
simulator (one DDP step, one bucket of ``numel`` elements, every rank holding ``+M`` in
every element — the worst case for a sum of same-sign values) and asks
:func:`simcluster.checking.properties.averages` whether the result is finite and within the
tolerance. The search brackets the boundary by multiplying ``M`` by 16 from 1, then
bisects on the float32 bit patterns between the last safe and the first unsafe value, so
the answer is exact: ``safe`` is a float32 that passes and the next float32 up fails.

It assumes one boundary (safe below, unsafe above), which holds for overflow; the probe
at ``unsafe`` is printed so the claim can be checked by hand.

Worked bound (checked in ``tests/test_safe_range.py``): torch's ``fp16_compress_hook`` at
W = 3 divides first, ``x = fp16(fp16(M) / 3)``, then sums three ``x`` in fp16. fp16 rounds
sums ≥ 65520 to inf, and 3·21840 = 65520, so ``x`` must round to 21824 or less (fp16
spacing 16 there): ``fp16(M)/3 ≤ 21832`` (the tie goes to the even 21824), i.e.
``fp16(M) ≤ 65472`` (spacing 32), i.e. ``M ≤ 65488`` (the tie again goes to the even
65472). So the largest safe float32 is exactly **65488**.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from simcluster.fake.cluster import SimCluster
from simcluster.ddp.model import DDPConfig, SimDDP
from simcluster.checking.properties import averages
from simcluster.engine.guard import is_stop_request
from simcluster.errors import NOT_THE_HOOKS, exit_meaning, first_line

__all__ = ["RangeResult", "probe", "safe_range", "range_command"]

_F32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]


@dataclass(frozen=True)
class RangeResult:
    """``safe``: largest float32 magnitude that passed (None: not even 1.0); ``unsafe``: the next
    float32 up, which failed for ``reason`` (None when every finite float32 passed)."""

    world_size: int
    safe: float | None
    unsafe: float | None
    reason: str
    probes: int


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def probe(hook: Callable[[Any, Any], Any], world_size: int, magnitude: float, *, backend: str = "gloo",
          state: Any = None, api: str = "current", tolerance: str = "fp16", numel: int = 4,
          monitor: Any = None, launcher: str = "none") -> str | None:
    """Run ``hook`` once with every rank holding ``magnitude``; None if the result is right, else why not.

    ``monitor``: as for :func:`~simcluster.teaching.story.record` (each probe is one run);
    ``launcher``: SimCluster's (``"torchrun"``: each rank sees torchrun's variables)."""
    cluster = SimCluster(world_size=world_size, seed=0, backend=backend, schedule="in_order", launcher=launcher)
    ddp = SimDDP(cluster, hook, [(numel,)], state=state, config=DDPConfig(api=api))
    grads = [[torch.full((numel,), magnitude, dtype=torch.float32)] for _ in range(world_size)]
    if monitor is not None:
        ddp.on_hook_call = monitor.at
        monitor.begin({"phase": "explain --range", "world_size": world_size, "magnitude": magnitude})
    try:
        result = ddp.step(grads)
    except NOT_THE_HOOKS:  # not modelled, or a bug of ours: no range, exit 3
        raise
    except BaseException as exc:  # a hook that raises (or exits) on this input is not safe there
        if is_stop_request(exc):
            raise
        return exit_meaning(exc) or f"the hook raised {first_line(exc, typed=True)}"
    return averages(result.grads, grads, tolerance, dtypes=result.trace.dtypes)


def safe_range(hook: Callable[[Any, Any], Any], world_size: int, **kwargs: Any) -> RangeResult:
    """The largest float32 ``M`` for which :func:`probe` passes (see the module docstring)."""
    probes = 1
    first = probe(hook, world_size, 1.0, **kwargs)
    if first is not None:
        return RangeResult(world_size, None, 1.0, first, probes)
    lo, hi, why = 1.0, None, ""
    while hi is None:
        nxt = min(lo * 16.0, _F32_MAX)
        probes += 1
        reason = probe(hook, world_size, nxt, **kwargs)
        if reason is None:
            if nxt == _F32_MAX:
                return RangeResult(world_size, _F32_MAX, None, "every finite float32 passed", probes)
            lo = nxt
        else:
            hi, why = nxt, reason
    a, b = _bits(lo), _bits(hi)
    while b - a > 1:
        mid = (a + b) // 2
        probes += 1
        reason = probe(hook, world_size, _float(mid), **kwargs)
        if reason is None:
            a = mid
        else:
            b, why = mid, reason
    return RangeResult(world_size, _float(a), _float(b), why, probes)


def range_command(hook: Callable[[Any, Any], Any], args: Any, state: Any, monitor: Any = None) -> int:
    """``simcluster explain TARGET --range``: print the safe range per world size; exit 0."""
    from simcluster.checking.properties import registration_problem
    from simcluster.teaching.explain import registration_lines
    from simcluster.usercode.targets import parse_world_sizes

    sizes = parse_world_sizes(args.world_sizes)
    print(f"simcluster explain --range: {args.target}, {args.backend} backend model, tolerance {args.tolerance}; "
          "every rank holds +M in every element; largest M whose average stays finite and within tolerance")
    for line in registration_lines(registration_problem(hook, args.api)):
        print(line)
    for w in sizes:
        r = safe_range(hook, w, backend=args.backend, state=state, api=args.api, tolerance=args.tolerance,
                       monitor=monitor, launcher=args.launcher)
        if r.safe is None:
            print(f"world {w}: not safe even at M = 1: {r.reason}")
        elif r.unsafe is None:
            print(f"world {w}: safe for every finite float32 (up to {r.safe:.9g}); {r.probes} runs")
        else:
            print(f"world {w}: safe up to M = {r.safe:.9g}; at {r.unsafe:.9g} (the next float32): {r.reason} "
                  f"[{r.probes} runs]")
    return 0
