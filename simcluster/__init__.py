"""simcluster: run real DDP communication hooks on N simulated ranks in one process.

The public face; the code lives in the modules behind it::

    from simcluster import SimCluster
    result = SimCluster(world_size=4, seed=0).run_hook(my_hook, grads, state="group")

Names are imported on first use (PEP 562), so importing ``simcluster`` — as pytest does
for the plugin — does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    # running hooks
    "SimCluster",
    "RunResult",
    "HookRun",
    "SimDDP",
    "DDPConfig",
    "StepResult",
    "run_real_ddp",
    "RankLocal",
    # checking hooks
    "check_hook",
    "assert_hook",
    "CheckReport",
    "PropertyFailure",
    # the fakes
    "SimProcessGroup",
    "SimWork",
    "SimFuture",
    "SimGradBucket",
    "Trace",
    # schedules
    "Scheduler",
    "InOrder",
    "Reverse",
    "SeededRandom",
    "ChoiceList",
    # errors
    "SimClusterError",
    "UsageError",
    "UnsupportedError",
    "HookFailure",
    "CollectiveMismatchError",
    "DeadlockError",
    "BackendError",
    "HookContractError",
    "StuckError",
    "ForeignThreadError",
    "HookExited",
    "SimulatorFidelityError",
]

_HOME = {
    "SimCluster": "fake.cluster",
    "RunResult": "fake.cluster",
    "HookRun": "fake.cluster",
    "SimDDP": "ddp.model",
    "DDPConfig": "ddp.model",
    "StepResult": "ddp.model",
    "run_real_ddp": "ddp.real_ddp",
    "RankLocal": "usercode.rank_local",
    "check_hook": "checking.check",
    "assert_hook": "checking.check",
    "CheckReport": "checking.report",
    "PropertyFailure": "checking.report",
    "SimProcessGroup": "fake.process_group",
    "SimWork": "fake.process_group",
    "SimFuture": "fake.futures",
    "SimGradBucket": "fake.bucket",
    "Trace": "engine.trace",
    "Scheduler": "engine.scheduler",
    "InOrder": "engine.scheduler",
    "Reverse": "engine.scheduler",
    "SeededRandom": "engine.scheduler",
    "ChoiceList": "engine.scheduler",
    "SimClusterError": "errors",
    "UsageError": "errors",
    "UnsupportedError": "errors",
    "HookFailure": "errors",
    "CollectiveMismatchError": "errors",
    "DeadlockError": "errors",
    "BackendError": "errors",
    "HookContractError": "errors",
    "StuckError": "errors",
    "ForeignThreadError": "errors",
    "HookExited": "errors",
    "SimulatorFidelityError": "errors",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'simcluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"simcluster.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from simcluster.fake.bucket import SimGradBucket
    from simcluster.checking.check import assert_hook, check_hook
    from simcluster.fake.cluster import HookRun, RunResult, SimCluster
    from simcluster.ddp.model import DDPConfig, SimDDP, StepResult
    from simcluster.errors import (
        BackendError,
        CollectiveMismatchError,
        DeadlockError,
        ForeignThreadError,
        HookContractError,
        HookExited,
        HookFailure,
        SimClusterError,
        SimulatorFidelityError,
        StuckError,
        UnsupportedError,
        UsageError,
    )
    from simcluster.fake.futures import SimFuture
    from simcluster.fake.process_group import SimProcessGroup, SimWork
    from simcluster.usercode.rank_local import RankLocal
    from simcluster.ddp.real_ddp import run_real_ddp
    from simcluster.checking.report import CheckReport, PropertyFailure
    from simcluster.engine.scheduler import ChoiceList, InOrder, Reverse, Scheduler, SeededRandom
    from simcluster.engine.trace import Trace
