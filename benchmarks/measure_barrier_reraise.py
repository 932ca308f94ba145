"""Measure whether gloo's ``barrier()`` re-raises the error of an earlier collective.

Why: ProcessGroupGloo's barrier first waits on every work its worker threads still hold
(queued or running) and only then exchanges; a work that failed re-raises its error there.
A worker lets go of a failed work a moment after ``wait()`` has raised in the caller, so a
barrier right after a caught error may still see it. simcluster's gloo runner ended every
job with ``dist.barrier()`` and failed, once in a CI run, on a test job that had caught such
an error (docs/gloo-facts.md, "A barrier re-raises an earlier collective's error").

    python benchmarks/measure_barrier_reraise.py [--runs 3] [--trials 1000] [--no-wait] [--between K]

Each run starts a fresh world of 2 real gloo processes (``torch.multiprocessing.spawn``,
FileStore in a private temp dir). Per trial every rank posts ``all_reduce(ones(4),
op=BAND, async_op=True)`` (gloo refuses BAND on floats at ``wait()``), waits on it and
catches the error (``--no-wait``: does not wait), makes ``--between`` successful synchronous
``all_reduce(ones(4))`` calls (default 0: does a failed work stay held past later
collectives?), then calls ``dist.barrier()``. A run stops
at the first barrier that raises, on either rank (the group is out of step after a
one-sided failure); the script prints, per run, the trial and each rank's first line.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile


def _rank(rank: int, world: int, store: str, trials: int, wait: bool, out: str, between: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    line = f"no barrier raised in {trials} trials"
    for trial in range(trials):
        work = dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND, async_op=True)
        if wait:
            try:
                work.wait()
            except RuntimeError:
                pass
        del work
        for _ in range(between):
            dist.all_reduce(torch.ones(4))
        try:
            dist.barrier()
        except RuntimeError as exc:
            line = f"barrier raised at trial {trial}: {str(exc).splitlines()[0][:100]}"
            break
    with open(f"{out}.{rank}", "w") as f:
        f.write(line)
    os._exit(0)  # a peer may be stuck in a barrier the group can no longer finish


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--no-wait", action="store_true")
    parser.add_argument("--between", type=int, default=0, help="successful all_reduces between the failure and the barrier")
    args = parser.parse_args()
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "line")
            mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), args.trials, not args.no_wait, out, args.between), nprocs=2)
            lines = [open(f"{out}.{r}").read() for r in range(2)]
        print(f"run {run}: " + " | ".join(f"rank {r}: {line}" for r, line in enumerate(lines)))


if __name__ == "__main__":
    main()
