"""What simcluster supports, in one place: option ranges and the memory a run needs.

Every front door (the CLI, :func:`~simcluster.checking.check.check_hook`, the pytest plugin,
:class:`~simcluster.SimCluster`) validates through these functions, so an option out of
range is one clear :class:`~simcluster.errors.UsageError` (exit 2) that states the
supported range — never a traceback or a machine brought to its knees.

=============  ==================  ===================================================
option         supported           why
=============  ==================  ===================================================
world sizes    1 … 1024            a simulated rank costs ~150 KiB before gradients
                                   (measured at world 1024); checks draw several
                                   examples per world size
seed           0 … 2**32 − 1       every generator a rank owns (torch, Python's
                                   ``random``, numpy's legacy one) must accept
                                   ``seed + rank``; numpy's takes 32 bits
steps          1 … 100             each step is a whole simulated DDP iteration
examples       1 … 100 000         per backend; Hypothesis keeps them in memory
deadline       0 < s ≤ 86 400      seconds one example may run (see supervisor)
jobs           1 … 64              rows checked at once, one worker process each;
                                   more workers than cores only add memory
=============  ==================  ===================================================

>>> check_int("--steps", 3, *STEPS)
3
>>> check_int("--steps", 0, *STEPS)
Traceback (most recent call last):
...
simcluster.errors.UsageError: --steps 0: must be an integer from 1 to 100
"""

from __future__ import annotations

import math
import os
from typing import Any

from simcluster.errors import UsageError

__all__ = [
    "BACKEND_NAMES",
    "WORLD_SIZES", "SEEDS", "STEPS", "EXAMPLES", "JOBS", "DEADLINE_MAX", "RANK_OVERHEAD_BYTES",
    "check_int", "check_deadline", "check_output_file", "check_database_dir", "default_jobs", "check_memory",
    "available_memory",
]

BACKEND_NAMES: tuple[str, ...] = ("gloo", "nccl")
"""The modelled backends (:mod:`simcluster.fake.backends` holds their models): the one list every
``--backend`` option, default and check draws from. Here, not beside the models, so the CLI can
build its options without importing torch."""
WORLD_SIZES = (1, 1024)
SEEDS = (0, 2**32 - 1)
STEPS = (1, 100)
EXAMPLES = (1, 100_000)
JOBS = (1, 64)
DEADLINE_MAX = 86_400.0
RANK_OVERHEAD_BYTES = 160 * 1024
"""Memory one simulated rank costs before its gradients (RSS, measured: ~140 KiB at
world 1024 with ``allreduce_hook``: its world, process groups, generator states,
bucket and future objects)."""


E2E_TIMEOUT = 120.0
"""Seconds one end-to-end run may take, each side (start-up of its gloo world included):
``simcluster e2e --timeout``'s and ``check --e2e-timeout``'s default."""


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """``value`` if it is an int in ``low..high``; else a one-line :class:`UsageError`."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise UsageError(f"{name} {value!r}: must be an integer from {low} to {high:,}")
    return value


def default_jobs() -> int:
    """``check --jobs``' default: the CPUs this process may run on (its affinity mask,
    which a container or ``taskset`` may narrow), within :data:`JOBS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(JOBS[0], min(JOBS[1], cpus))


def check_deadline(value: Any, name: str = "--deadline") -> float:
    """A per-example deadline in seconds: a finite number in ``(0, 86400]``."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} {value!r}: must be a number of seconds") from None
    if isinstance(value, bool) or not (0 < seconds <= DEADLINE_MAX) or math.isnan(seconds):
        raise UsageError(f"{name} {value!r}: must be more than 0 and at most {DEADLINE_MAX:.0f} seconds")
    return seconds


def check_output_file(name: str, path: str) -> str:
    """A file an option writes when the run ends (``--json``, ``--timeline``, ``--chrome-trace``):
    its folder must exist and be writable, and the path must not be a folder — checked before
    any work, so a finished run never dies writing it (``--json /tmp`` ran the whole check,
    then raised ``IsADirectoryError`` and exited 1 after a passing hook)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{name} {path}: directory {folder} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"{name} {path}: is a directory; give a file name")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{name} {path}: cannot be written (permission denied)")
    return path


def check_database_dir(name: str, path: str) -> str:
    """``--database DIR``: a folder (made if missing), not an existing file — whose examples
    would silently never be saved."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{name} {path}: is a file, not a directory")
    return path


def available_memory() -> int | None:
    """Bytes the machine can still give (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


SMALL_RUN_BYTES = 64 * 2**20
"""A run estimated to need at most this much is never refused: no machine that runs torch is that short."""


def check_memory(world_size: int, gradient_bytes_per_rank: int = 0, *, what: str = "world_size") -> None:
    """Refuse a run whose estimated memory exceeds half of what the machine has left
    (one estimated at most :data:`SMALL_RUN_BYTES` passes unread).

    Estimate: per rank, :data:`RANK_OVERHEAD_BYTES` plus six copies of its gradients
    (input, bucket, result, copy-back and the collective's work buffers).
    """
    need = world_size * (RANK_OVERHEAD_BYTES + 6 * gradient_bytes_per_rank)
    if need <= SMALL_RUN_BYTES:  # not worth a read of /proc/meminfo (~60 µs: a new cluster is made per example)
        return
    have = available_memory()
    if have is not None and need > have // 2:
        raise UsageError(
            f"{what}={world_size}: a run needs about {need / 2**30:.1f} GiB "
            f"({world_size} ranks × {(RANK_OVERHEAD_BYTES + 6 * gradient_bytes_per_rank) / 2**10:.0f} KiB), "
            f"more than half of the {have / 2**30:.1f} GiB this machine has available"
        )
