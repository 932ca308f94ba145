"""Measure real gloo on a DDP hook whose ranks all_reduce buffers of different sizes.

Why: ``simcluster e2e`` compares a real run with the simulator. For a hook that posts
mismatched collectives the simulator reports a ``CollectiveMismatchError``; real gloo may
abort a rank's process (SIGABRT, ``gloo::EnforceNotMet``), hang, or finish. How often each
happens decides how e2e may reconcile them (docs/e2e.md, docs/gloo-facts.md §6).

    python benchmarks/measure_mismatch_abort.py [--trials 20] [--world 2] [--steps 1]

Each trial runs ``tests/e2e_hooks.py:mismatched_sizes`` (rank 1 all_reduces one element more
than rank 0) in torch's real DDP on a fresh world of real gloo processes
(:func:`simcluster.real.e2e.run_real`, fork server, 20 s watchdog) and tallies the outcome:
which rank failed first and how (killed by a signal / raised / hung / finished), and
whether the gloo enforce message was in its output.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

HOOK = str(Path(__file__).resolve().parent.parent / "tests" / "e2e_hooks.py") + ":mismatched_sizes"


def main() -> None:
    from simcluster.real.e2e import Scenario, run_real

    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    tally: collections.Counter[str] = collections.Counter()
    seconds = []
    for _ in range(args.trials):
        started = time.monotonic()
        side = run_real(Scenario(args.world, ((4, 5), (5,)), steps=args.steps), HOOK, timeout=20,
                        start_method="forkserver")
        seconds.append(time.monotonic() - started)
        f = side.failure
        if f is None:
            key = "finished"
        else:
            enforce = "EnforceNotMet" in f.detail
            key = f"{f.kind} rank {f.rank}: {f.message.split(';')[0][:60]} | enforce message: {enforce}"
        tally[key] += 1
    for key, n in tally.most_common():
        print(f"{n:4d}/{args.trials}  {key}")
    print(f"seconds per trial: min {min(seconds):.2f} max {max(seconds):.2f}")


if __name__ == "__main__":
    main()
