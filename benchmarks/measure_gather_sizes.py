"""What real gloo raises for ``all_gather`` / ``all_gather_into_tensor`` outputs that do not
fit the input (torch 2.13, 2 ranks), and where (call or ``wait()``).
Run: python benchmarks/measure_gather_sizes.py (docs/gloo-facts.md §8)."""
import torch
import torch.distributed as dist

from _gloo import call_and_wait, gloo_world, spawn_worlds

CASES = {
    "into (12,) from (2, 3)": lambda: dist.all_gather_into_tensor(torch.empty(12), torch.ones(2, 3), async_op=True),
    "into (4, 3) from (2, 3)": lambda: dist.all_gather_into_tensor(torch.empty(4, 3), torch.ones(2, 3), async_op=True),
    "into (2, 6) from (2, 3)": lambda: dist.all_gather_into_tensor(torch.empty(2, 6), torch.ones(2, 3), async_op=True),
    "into (5,) from (3,)": lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(3), async_op=True),
    "into (1,) from (1,)": lambda: dist.all_gather_into_tensor(torch.empty(1), torch.ones(1), async_op=True),
    "into (0,) from (0,)": lambda: dist.all_gather_into_tensor(torch.empty(0), torch.ones(0), async_op=True),
    "list of 3 (1,)": lambda: dist.all_gather([torch.empty(1)] * 3, torch.ones(1), async_op=True),
    "list (1,), (2,)": lambda: dist.all_gather([torch.empty(1), torch.empty(2)], torch.ones(1), async_op=True),
    "list (1, 1) x2 from (1,)": lambda: dist.all_gather([torch.empty(1, 1)] * 2, torch.ones(1), async_op=True),
}


def run(rank: int, world: int, port: int) -> None:
    with gloo_world(rank, world, port):
        for name, call in CASES.items():
            print(f"rank {rank} {name}: {call_and_wait(call) or 'ok'}", flush=True)


if __name__ == "__main__":
    spawn_worlds(run, ((2, 29571),))
