"""What real torch's dist.new_group raises for a bad rank list, on real gloo (world 1 and 2):
an empty list, an out-of-range rank, a duplicated rank. Each case is run in a fresh
process group; every rank calls it. Run: python benchmarks/measure_new_group_errors.py
(docs/gloo-facts.md, "new_group with a bad rank list")."""
import os

import torch.distributed as dist
import torch.multiprocessing as mp

CASES = {"empty": [], "out of range": [0, 5], "duplicate": [0, 0]}


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name, ranks in CASES.items():
        try:
            group = dist.new_group(ranks)
            out = f"returned {group!r}"
        except Exception as exc:  # noqa: BLE001 - the measurement
            out = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        print(f"world {world} rank {rank} new_group({ranks}): {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    for world, port in ((1, 29551), (2, 29552)):
        mp.spawn(run, args=(world, port), nprocs=world)
