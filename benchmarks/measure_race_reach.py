"""Measure how often a default check finds a hook's callback-vs-next-bucket race, over seeds.

Why: the GCQ hook from the wild (docs/hooks.md) posts an un-awaited ``dist.barrier`` from its
``then`` callback while DDP calls it for the next bucket; real gloo hangs. The drawn search at
the default 50 examples found it on 1 seed in 20, which is why every check now also runs the
explicit race example (simcluster.checking.explicit, docs/properties.md "Explicit examples").

    python benchmarks/measure_race_reach.py HOOK [--state STATE] [--tolerance T] [--seeds 20]

For each seed: ``check_hook(HOOK, state=STATE, tolerance=T, seed=s, backends=("gloo",))`` with
every other option at its default, and whether it reported *liveness*. Every example judged is
recorded (by wrapping ``check.run_example``, inherited by the supervised child) up to the seed's
first failure: its world size (per DDP group), the most buckets of any of its steps, and whether
it failed. Printed: the detections, and how many examples had the shape the race needs (world
≥ 2 and ≥ 2 buckets in a step) — the rest of the reach is the schedule's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from simcluster.checking import check as C
from simcluster.ddp.layout import bucket_calls
from simcluster.errors import Violation


def _most_buckets(example: C.Example) -> int:
    lay = example.layout
    params = [torch.empty(s) for s in lay.shapes]
    return max(len(bucket_calls(params, iteration=it, bucket_cap_mb=lay.bucket_cap_mb, static_graph=lay.static_graph,
                                find_unused_parameters=lay.find_unused_parameters, ready_order=list(lay.ready_order)))
               for it in range(example.steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hook")
    parser.add_argument("--state", default="none")
    parser.add_argument("--tolerance", default="fp32")
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    log = os.path.join(tempfile.mkdtemp(), "examples.jsonl")
    real = C.run_example
    seed_now = [0]

    def recording(opts, example, backend):  # type: ignore[no-untyped-def]
        record = {"seed": seed_now[0], "world": example.world_size // example.subgroups,
                  "buckets": _most_buckets(example), "fail": None}
        try:
            real(opts, example, backend)
        except Violation as violation:
            record["fail"] = violation.prop
            raise
        finally:
            with open(log, "a") as f:  # the search runs in a forked child: a file carries it back
                f.write(json.dumps(record) + "\n")

    C.run_example = recording  # type: ignore[assignment]
    found = 0
    for seed in range(args.seeds):
        seed_now[0] = seed
        start = time.monotonic()
        report = C.check_hook(args.hook, state=args.state, tolerance=args.tolerance, seed=seed, backends=("gloo",))
        hit = any(f.property == "liveness" for f in report.failures)
        found += hit
        print(f"seed {seed}: {'found' if hit else 'missed'} ({time.monotonic() - start:.1f} s)", flush=True)
    judged, failed = [], set()
    for line in open(log):
        record = json.loads(line)
        if record["seed"] not in failed:
            judged.append(record)
            if record["fail"]:
                failed.add(record["seed"])
    shaped = [r for r in judged if r["world"] >= 2 and r["buckets"] >= 2]
    print(f"found on {found} of {args.seeds} seeds; {len(judged)} examples judged up to each seed's first failure: "
          f"world >= 2: {sum(r['world'] >= 2 for r in judged)}, >= 2 buckets: {sum(r['buckets'] >= 2 for r in judged)}, "
          f"both: {len(shaped)}, of which failed: {sum(bool(r['fail']) for r in shaped)}")


if __name__ == "__main__":
    main()
