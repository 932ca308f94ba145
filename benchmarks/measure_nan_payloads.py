"""Do real gloo and simcluster's gloo model agree on NaN payloads in SUM (and MAX, MIN, PRODUCT)? (docs/collectives.md §3)

    python benchmarks/measure_nan_payloads.py [--worlds 2,3,5,17] [--sizes 64,4099,70000] [--ops SUM]

Every third element of every rank holds a NaN with a rank- and position-dependent payload;
the rest are random. Each world all-reduces the same inputs on real gloo processes and in
``simcluster.fake.collectives.reduce`` (float16, bfloat16, float32) and counts the elements
whose bits differ on any rank. The sizes and worlds reach the model's three fold layouts
(gathered, per chunk, strided: 17 ranks × 4,096 elements); ``--skewed`` forces the fourth
(chunks of at most 16 bytes, reached by sums at 130+ ranks) on float32 SUM at small worlds.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

CASES = [(torch.float16, torch.int16), (torch.bfloat16, torch.int16), (torch.float32, torch.int32)]


def inputs(world: int, dtype: torch.dtype, bits_dtype: torch.dtype, n: int, stagger: bool = False) -> list[torch.Tensor]:
    """Every rank's input. ``stagger``: rank r's NaNs sit at elements ``r % 3, r % 3 + 3, …``
    instead of at the same elements on every rank, so a NaN meets numbers (as a NaN that one
    rank's overflow makes does)."""
    gen = torch.Generator().manual_seed(7)
    nan = torch.tensor([float("nan")], dtype=dtype).view(bits_dtype)[0]
    out = []
    for rank in range(world):
        x = torch.randn(n, generator=gen).to(dtype)
        bits = x.view(bits_dtype)
        for e in range(rank % 3 if stagger else 0, n, 3):
            bits[e] = nan + (rank + 1) * (e % 5 + 1)
        out.append(x)
    return out


def worker(rank: int, world: int, payload: tuple[int, str, bool]) -> list[torch.Tensor]:
    """In a real gloo process: this rank's result bits for each dtype."""
    n, op, stagger = payload
    results = []
    for dtype, bits_dtype in CASES:
        x = inputs(world, dtype, bits_dtype, n, stagger)[rank].clone()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        results.append(x.view(bits_dtype).clone())
    return results


def main() -> None:
    from simcluster.fake import collectives
    from simcluster.real.gloo_runner import run_gloo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,3,5,17")
    parser.add_argument("--sizes", default="64,4099,70000")
    parser.add_argument("--ops", default="SUM", help="comma-separated reduce ops (SUM, PRODUCT, MAX, MIN)")
    parser.add_argument("--stagger", action="store_true", help="each rank's NaNs at other elements (NaN meets numbers)")
    parser.add_argument("--skewed", action="store_true",
                        help="fold float32 SUM with the tiny-chunk layout (collectives._fold_skewed) whatever the "
                             "size would pick, so that a few real processes check the layout 130+ ranks reach")
    args = parser.parse_args()
    for op in args.ops.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            for n in (int(s) for s in args.sizes.split(",")):
                real = run_gloo(worker, world, [(n, op, args.stagger)] * world, timeout=600)
                for k, (dtype, bits_dtype) in enumerate(CASES):
                    raw = inputs(world, dtype, bits_dtype, n, args.stagger)
                    chunk = collectives.ring_chunks(n, raw[0].element_size(), world)[0][1]
                    if args.skewed and op == "SUM" and dtype == torch.float32 and chunk * 4 in collectives._WIDE:
                        sim = collectives._fold_skewed(raw, torch.Tensor.add_, chunk).view(bits_dtype)
                        dtype = "float32, skewed"
                    else:
                        sim = collectives.reduce(raw, op, "gloo").view(bits_dtype)
                    differing = sum(int((real[r][k] != sim).sum()) for r in range(world))
                    print(f"{op} world {world:>2}, {n:>6} elements, {str(dtype):>14}: {differing} differing "
                          f"elements (over all ranks)", flush=True)


if __name__ == "__main__":
    main()
