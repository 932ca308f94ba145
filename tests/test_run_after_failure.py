"""A run after a failed run is exactly a fresh cluster's run.

A cluster keeps a few things between runs to make a run cheaper (its simulated
``new_group`` and ``Future`` class, the settings audit; per process, the originals of the
``random``/numpy functions it swaps): none of them may carry anything of a failed run into
the next. Each failing run here draws no random numbers and makes no group (groups and RNG
streams do live across runs, by design), so a good run after it must match a fresh
cluster's run bit for bit, event for event and choice for choice.
"""

from __future__ import annotations

import os
import random

import numpy
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from simcluster import SimCluster
from simcluster.errors import CollectiveMismatchError, DeadlockError, SharedSettingError


def _good(rank: int) -> list[object]:
    """A rank's code touching everything a run swaps: a new group, both RNG families,
    a torch Future, a collective on WORLD and on the new group."""
    group = dist.new_group()
    t = torch.full((4,), float(rank + 1)) + torch.rand(4)
    dist.all_reduce(t)
    u = torch.ones(2) * (rank + 1)
    dist.all_reduce(u, group=group)
    future = torch.futures.Future()
    future.set_result(rank)
    return [t, u, random.random(), float(numpy.random.rand()), future.wait()]


def _raise(rank: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def _mismatch(rank: int) -> None:
    dist.all_reduce(torch.ones(2 + rank))


def _deadlock(rank: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(2))  # waits for a match rank 1 never posts


def _leak_environ(rank: int) -> None:
    if rank == 0:
        os.environ["SIMCLUSTER_TEST_AFTER_FAILURE"] = "1"


FAILURES = [
    (_raise, ValueError, "boom on rank 1"),
    (_mismatch, CollectiveMismatchError, "all_reduce"),
    (_deadlock, DeadlockError, "rank 0"),
    (_leak_environ, SharedSettingError, "SIMCLUSTER_TEST_AFTER_FAILURE"),
]


def _untouched() -> tuple[object, ...]:
    return (random.random, numpy.random.rand, dist.new_group, c10d.new_group, torch.futures.Future,
            torch.futures.collect_all, c10d._world, dict(os.environ))


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("failing, error, words", FAILURES, ids=[f[0].__name__ for f in FAILURES])
def test_a_good_run_after_a_failed_run_matches_a_fresh_clusters_run(backend, failing, error, words) -> None:
    before = _untouched()
    used = SimCluster(3, seed=5, backend=backend, schedule="in_order")
    with pytest.raises(error, match=words):
        used.run(failing)
    assert _untouched() == before  # the failed run put everything back
    after_failure = used.run(_good)
    fresh = SimCluster(3, seed=5, backend=backend, schedule="in_order").run(_good)
    for got, want in zip(after_failure.values, fresh.values):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[2:] == want[2:]
    assert after_failure.trace == fresh.trace
    assert after_failure.schedule == fresh.schedule
    assert _untouched() == before
    # the replay line names the failed run's choices too, and replays both runs
    replayed = eval(after_failure.replay, {"SimCluster": SimCluster})  # noqa: S307 - our own constructor call
    with pytest.raises(error, match=words):
        replayed.run(failing)
    assert replayed.run(_good).trace == after_failure.trace


def test_a_random_function_replaced_between_runs_is_what_a_run_puts_back() -> None:
    original = random.random
    cluster = SimCluster(2, seed=0)
    cluster.run(lambda rank: random.random())

    def mine() -> float:
        return 0.5

    random.random = mine
    try:
        values = cluster.run(lambda rank: random.random()).values
        assert random.random is mine  # not the original the previous run put back
        assert values != [0.5, 0.5]  # inside the run each rank drew from its own generator
    finally:
        random.random = original
    cluster.run(lambda rank: random.random())
    assert random.random is original
