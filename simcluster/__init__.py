"""simcluster: run real DDP communication hooks on N simulated ranks in one process.

The public face; the code lives in the modules behind it::

    from simcluster import SimCluster
    result = SimCluster(world_size=4, seed=0).run_hook(my_hook, grads, state="group")
"""

from simcluster.cluster import HookRun, RunResult, SimCluster
from simcluster.errors import (
    BackendError,
    CollectiveMismatchError,
    DeadlockError,
    HookContractError,
    HookFailure,
    SimClusterError,
    StuckError,
    UnsupportedError,
    UsageError,
)
from simcluster.futures import SimFuture
from simcluster.process_group import SimProcessGroup, SimWork
from simcluster.scheduler import ChoiceList, InOrder, Reverse, Scheduler, SeededRandom
from simcluster.trace import Trace

__all__ = [
    "SimCluster",
    "RunResult",
    "HookRun",
    "SimProcessGroup",
    "SimWork",
    "SimFuture",
    "Trace",
    "Scheduler",
    "InOrder",
    "Reverse",
    "SeededRandom",
    "ChoiceList",
    "SimClusterError",
    "UsageError",
    "UnsupportedError",
    "HookFailure",
    "CollectiveMismatchError",
    "DeadlockError",
    "BackendError",
    "HookContractError",
    "StuckError",
]
