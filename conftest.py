"""Test-suite set-up shared by every test.

* One intra-op thread per test process: ``pytest -n auto`` already runs one worker per
  core, and simulated ranks are one process anyway.
* Hypothesis profiles come from simcluster's pytest plugin (``ci`` when the ``CI``
  environment variable is set: derandomized, no deadline).
* ``gloo_world``: real gloo worlds shared by the tests of one module (see below).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from simcluster.real.gloo_runner import GlooCluster

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gloo_world() -> Iterator[Callable[[int], GlooCluster]]:
    """``gloo_world(n)``: a persistent world of ``n`` real gloo ranks, one per size per test module.

    Started lazily through multiprocessing's fork server (torch and ``torch._dynamo``
    are imported once per pytest worker, not once per rank: a fresh world then starts in
    ~0.2 s and each job costs milliseconds, DDP construction included). Jobs must not
    keep a ``DistributedDataParallel`` alive past their return (docs/gloo-facts.md §10): the
    runner collects garbage and barriers after each job, and its children leave with
    ``os._exit``. A failed job tears its world down; the next one starts afresh.
    """
    worlds: dict[int, GlooCluster] = {}

    def get(world_size: int) -> GlooCluster:
        if world_size not in worlds:
            worlds[world_size] = GlooCluster(world_size, timeout=120.0, start_method="forkserver")
        return worlds[world_size]

    try:
        yield get
    finally:
        for size in sorted(worlds):
            worlds[size].close()
