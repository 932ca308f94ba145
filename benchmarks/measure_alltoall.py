"""What real gloo does with an ``all_to_all_single`` whose sizes do not fit the group
(torch 2.13, 1 and 2 ranks): split sizes of the wrong count or sum, no split sizes on a
tensor whose dim 0 (or bytes) do not divide by the group, input and output of different
sizes; where each error is raised (at the call or at ``wait()``) and what the data is when
none is. Run: python benchmarks/measure_alltoall.py (docs/gloo-facts.md §8)."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def cases(world: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, list[int], list[int]]]:
    return {
        "split count != group": (torch.empty(2 * world), torch.arange(2.0 * world), [1] * (world + 1), [1] * (world + 1)),
        "split sum != dim 0": (torch.empty(world), torch.arange(float(world)), [1] * world, [2] * world),
        "uint8[2W+1], no splits": (torch.empty(2 * world + 1, dtype=torch.uint8),
                                   torch.arange(2 * world + 1, dtype=torch.uint8), [], []),
        "float32[5], no splits": (torch.full((5,), 99.0), torch.arange(5.0), [], []),
        "float32[3, 2], no splits": (torch.full((3, 2), 99.0), torch.arange(6.0).reshape(3, 2), [], []),
        "out 6, in 4 floats": (torch.empty(6), torch.arange(4.0), [], []),
    }


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name, (out, inp, out_splits, in_splits) in cases(world).items():
        inp = inp + 10 * rank if inp.dtype != torch.uint8 else inp
        where = "call"
        try:
            work = dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                          async_op=True)
            where = "wait"
            work.wait()
            outcome = f"ok {out.flatten().tolist()}"
        except Exception as exc:  # noqa: BLE001 - the measurement
            outcome = f"raised at {where}: {type(exc).__name__}: {str(exc).splitlines()[0]!r}"
        print(f"world {world} rank {rank} {name}: {outcome}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    for world, port in ((1, 29561), (2, 29562)):
        mp.spawn(run, args=(world, port), nprocs=world)
