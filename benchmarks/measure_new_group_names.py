"""How real torch names a dist.new_group, and what happens on real gloo when ranks do not
all call it (docs/gloo-facts.md §7, "Which calls make the same group").

torch names a group ``str(_world.group_count)`` and counts every ``new_group`` call a
process makes, member or not (``use_local_synchronization=True``: a hash of the ranks
instead, and only members call it); the members then meet under that name in the store.
Cases, each in fresh processes (a case may abort its processes, so each runs alone):

* ``every rank``: world 4, every rank calls ``new_group([0, 1])`` then ``new_group([2, 3])``;
* ``members only``: world 4, ranks 0, 1 call ``new_group([0, 1])``, ranks 2, 3
  ``new_group([2, 3])`` — both groups are named ``"1"``;
* ``local sync``: the same with ``use_local_synchronization=True`` (and a non-member's call);
* ``one member missing``: world 2, only rank 0 calls ``new_group([0, 1])``;
* ``counts differ``: world 2, rank 0 made ``new_group([0])`` first, then both ranks call
  ``new_group([0, 1])`` — rank 0's is its 2nd group, rank 1's its 1st;
* ``one-rank groups``: world 2, each rank calls ``new_group([rank])`` only — both named
  ``"1"``, but a one-rank group connects to no one.

Each rank prints the group's name, then the result of an ``all_reduce`` of ``rank + 1`` on
its group. Creation is given a 10 s timeout. Run: python benchmarks/measure_new_group_names.py
"""
import datetime
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _gloo import gloo_world

TIMEOUT = datetime.timedelta(seconds=10)


def _name(group: object) -> str:
    if not isinstance(group, dist.ProcessGroup):
        return repr(group)
    return repr(dist.distributed_c10d._get_process_group_name(group))


def _reduce(group: object) -> str:
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t, group=group)
    return str(t.tolist())


def run(rank: int, case: str, world: int, port: int) -> None:
    with gloo_world(rank, world, port):
        start = time.monotonic()
        try:
            mine: object = None
            if case == "every rank":
                a, b = dist.new_group([0, 1], timeout=TIMEOUT), dist.new_group([2, 3], timeout=TIMEOUT)
                mine = a if rank < 2 else b
                out = f"names {_name(a)}, {_name(b)}"
            elif case in ("members only", "local sync"):
                local = case == "local sync"
                mine = dist.new_group([0, 1] if rank < 2 else [2, 3], timeout=TIMEOUT, use_local_synchronization=local)
                out = f"name {_name(mine)}"
                if local:
                    out += f"; a non-member's call returns {dist.new_group([0, 1] if rank >= 2 else [2, 3], timeout=TIMEOUT, use_local_synchronization=True)!r}"
            elif case == "one member missing":
                if rank == 0:
                    mine = dist.new_group([0, 1], timeout=TIMEOUT)
                out = f"name {_name(mine)}" if mine is not None else "made no group"
            elif case == "one-rank groups":
                mine = dist.new_group([rank], timeout=TIMEOUT)
                out = f"name {_name(mine)}"
            elif case == "counts differ":
                if rank == 0:
                    dist.new_group([0], timeout=TIMEOUT)
                mine = dist.new_group([0, 1], timeout=TIMEOUT)
                out = f"name {_name(mine)}"
            if mine is not None:
                out += f"; all_reduce on it: {_reduce(mine)}"
        except Exception as exc:  # noqa: BLE001 - the measurement
            out = f"raised after {time.monotonic() - start:.0f} s: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        print(f"{case}: rank {rank}: {out}", flush=True)
        sys.stdout.flush()


CASES = (("every rank", 4), ("members only", 4), ("local sync", 4), ("one member missing", 2), ("counts differ", 2),
         ("one-rank groups", 2))

if __name__ == "__main__":
    for number, (case, world) in enumerate(CASES):
        try:
            mp.spawn(run, args=(case, world, 29600 + number), nprocs=world)
        except Exception as exc:  # noqa: BLE001 - a case that kills its processes is a result too
            print(f"{case}: the processes ended abnormally: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                  flush=True)
