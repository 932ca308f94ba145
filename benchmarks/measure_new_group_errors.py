"""What real torch's dist.new_group raises for a bad rank list, on real gloo (world 1 and 2):
an empty list, an out-of-range rank, a duplicated rank. Each case is run in a fresh
process group; every rank calls it. Run: python benchmarks/measure_new_group_errors.py
(docs/gloo-facts.md, "new_group with a bad rank list")."""
import torch.distributed as dist

from _gloo import gloo_world, spawn_worlds

CASES = {"empty": [], "out of range": [0, 5], "duplicate": [0, 0]}


def run(rank: int, world: int, port: int) -> None:
    with gloo_world(rank, world, port):
        for name, ranks in CASES.items():
            try:
                group = dist.new_group(ranks)
                out = f"returned {group!r}"
            except Exception as exc:  # noqa: BLE001 - the measurement
                out = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            print(f"world {world} rank {rank} new_group({ranks}): {out}", flush=True)


if __name__ == "__main__":
    spawn_worlds(run, ((1, 29551), (2, 29552)))
