"""What real gloo does with an ``all_to_all_single`` whose sizes do not fit the group
(torch 2.13, 1 and 2 ranks): split sizes of the wrong count or sum, no split sizes on a
tensor whose dim 0 (or bytes) do not divide by the group, input and output of different
sizes; where each error is raised (at the call or at ``wait()``) and what the data is when
none is. Run: python benchmarks/measure_alltoall.py (docs/gloo-facts.md §8)."""
import torch
import torch.distributed as dist

from _gloo import call_and_wait, gloo_world, spawn_worlds


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
    with gloo_world(rank, world, port):
        for name, (out, inp, out_splits, in_splits) in cases(world).items():
            inp = inp + 10 * rank if inp.dtype != torch.uint8 else inp
            failed = call_and_wait(lambda: dist.all_to_all_single(
                out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, async_op=True))
            print(f"world {world} rank {rank} {name}: {failed or f'ok {out.flatten().tolist()}'}", flush=True)


if __name__ == "__main__":
    spawn_worlds(run, ((1, 29561), (2, 29562)))
