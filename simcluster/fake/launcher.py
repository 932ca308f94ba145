"""The launcher's environment a simulated rank sees: ``launcher="torchrun"``.

A real rank is a process, and ``torchrun --standalone --nproc-per-node W`` starts each with
its own environment variables: ``RANK``, ``LOCAL_RANK``, ``ROLE_RANK`` differ per rank, the
rest are the same on every rank of the run. Measured on torch 2.13 (how: docs/isolation.md,
"The launcher's environment"):

==============================  =================================  =========================
variable                        torchrun's value                   simcluster's
==============================  =================================  =========================
RANK, LOCAL_RANK, ROLE_RANK     the rank                           the rank
WORLD_SIZE, LOCAL_WORLD_SIZE,   W                                  W
ROLE_WORLD_SIZE
GROUP_RANK, GROUP_WORLD_SIZE    0, 1 (one node)                    0, 1
ROLE_NAME                       ``default``                        ``default``
MASTER_ADDR                     ``localhost``                      ``localhost``
MASTER_PORT                     a free port (differs per run)      ``29500`` (torchrun's default)
TORCHELASTIC_RUN_ID             a uuid4 (differs per run)          ``simcluster``
TORCHELASTIC_RESTART_COUNT,     ``0``, ``0``                       ``0``, ``0``
TORCHELASTIC_MAX_RESTARTS
TORCHELASTIC_USE_AGENT_STORE    ``True``                           ``True``
TORCHELASTIC_SIGNALS_TO_HANDLE  ``SIGTERM,SIGINT,SIGHUP,SIGQUIT``  the same
TORCH_NCCL_ASYNC_ERROR_HANDLING ``1``                              ``1``
OMP_NUM_THREADS                 ``1`` if unset and W > 1           the same
TORCHELASTIC_ERROR_FILE         a file in torchrun's temp dir      not set (no such dir here)
==============================  =================================  =========================

The run-dependent values are fixed (determinism: a replay sees what the failing run saw),
unless this process itself runs under torchrun (``TORCHELASTIC_RUN_ID`` is set): then
the constants are taken from the real environment (:meth:`LauncherEnvironment.from_process`).

How it is kept: :class:`~simcluster.fake.rank_context.RankContexts` calls :meth:`begin`
when a run starts (the caller's values of every variable saved, the constants set),
:meth:`enter` at every rank switch, the first rank's entry included (three variables written, and
the settings audit's baseline moved with them, so the switching is never reported while a
rank's own change still is) and :meth:`end` when the run ends, on errors too (the
caller's values back, a variable the caller lacked removed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from simcluster.errors import UsageError

LAUNCHERS = ("none", "torchrun")
"""The values of ``launcher=`` (``--launcher``): ``none`` sets no variable (the default)."""

PER_RANK = ("RANK", "LOCAL_RANK", "ROLE_RANK")
"""torchrun's variables whose value is the rank (single node)."""

_putenv, _unsetenv = os.putenv, os.unsetenv
_DATA: dict[Any, Any] = os.environ._data  # type: ignore[attr-defined]
"""``os.environ``'s own store (encoded keys and values), which ``os.environ[key] = value`` fills after ``putenv``."""

FIXED_RUN_VALUES = {"MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "simcluster"}
"""The variables constant within a run but different in every real run, and the values
simcluster fixes them to (the real ones under torchrun: :func:`torchrun_constants`)."""


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE",
                      "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                      "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")
"""Every variable of the table above that simcluster models: what a real rank's launcher
environment is read as (``TORCHELASTIC_ERROR_FILE``, a path in torchrun's own temporary
directory, is left out)."""


def launcher_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The :data:`TORCHRUN_VARIABLES` set in ``environ`` (a real torchrun rank's own: ``os.environ``)."""
    return {name: environ[name] for name in TORCHRUN_VARIABLES if name in environ}


def check_launcher(launcher: object) -> str:
    """``launcher`` if it is one of :data:`LAUNCHERS`, else :class:`UsageError` (one line)."""
    if launcher not in LAUNCHERS:
        raise UsageError(f"launcher={launcher!r} must be 'none' or 'torchrun'")
    return launcher  # type: ignore[return-value]


def torchrun_constants(world_size: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables torchrun sets alike on every rank of a single-node run of
    ``world_size`` ranks, given the environment it would start them from (``environ``:
    ``OMP_NUM_THREADS`` is set only where the caller left it unset; under a real torchrun
    the run-dependent values are the real ones)."""
    w = str(world_size)
    constants = {
        "WORLD_SIZE": w, "LOCAL_WORLD_SIZE": w, "ROLE_WORLD_SIZE": w, "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default", "MASTER_ADDR": "localhost", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        **FIXED_RUN_VALUES,
    }
    if "TORCHELASTIC_RUN_ID" in environ:  # this process runs under torchrun: its run's values
        for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS", "ROLE_NAME"):
            if key in environ:
                constants[key] = environ[key]
    if world_size > 1 and "OMP_NUM_THREADS" not in environ:
        constants["OMP_NUM_THREADS"] = "1"
    return constants


def rank_environment(world_size: int, rank: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every variable torchrun gives rank ``rank`` of ``world_size``, in one dict (the
    table above; the tests' reference for what a rank sees).

    >>> env = rank_environment(2, 1, {})
    >>> env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]
    ('1', '1', '2', '29500')
    """
    return {**torchrun_constants(world_size, os.environ if environ is None else environ),
            **dict.fromkeys(PER_RANK, str(rank))}


class LauncherEnvironment:
    """torchrun's variables for the ranks of one cluster, set in ``os.environ`` per rank.

    ``ranks``: each rank's variables exactly as given (``ranks[r]``: name -> value), instead
    of the single-node model of the table above — what ``simcluster e2e`` under a real
    torchrun hands its simulation: every real rank's own values, gathered from the real ranks
    (on several nodes ``LOCAL_RANK``, ``GROUP_RANK`` … follow the real layout). The variables
    with one value on every rank are set when a run starts; the others at every rank switch
    (one a rank lacks is removed while that rank's code runs).
    """

    def __init__(self, world_size: int, ranks: Sequence[Mapping[str, str]] | None = None) -> None:
        self.world_size = world_size
        encode_key, encode_value = os.environ.encodekey, os.environ.encodevalue  # type: ignore[attr-defined]
        self._given: dict[str, str] | None = None
        """The constants of given ``ranks`` (None: the single-node model, :func:`torchrun_constants`)."""
        if ranks is None:
            self.varying: list[str] = list(PER_RANK)
            per_rank = [dict.fromkeys(PER_RANK, str(rank)) for rank in range(world_size)]
        else:
            if len(ranks) != world_size:
                raise UsageError(f"launcher environments for {len(ranks)} ranks, but the cluster has {world_size}")
            names = sorted({name for env in ranks for name in env})
            self._given = {name: ranks[0][name] for name in names
                           if name in ranks[0] and all(env.get(name) == ranks[0][name] for env in ranks)}
            self.varying = [name for name in names if name not in self._given]
            per_rank = [{name: env[name] for name in self.varying if name in env} for env in ranks]
        """``varying``: the variables whose value depends on the rank (written at every switch)."""
        self._encoded = [{encode_key(key): encode_value(value) for key, value in env.items()} for env in per_rank]
        """Per rank: its per-rank variables as ``os.environ`` stores them (encoded once, here)."""
        self._absent = [[encode_key(key) for key in self.varying if key not in env] for env in per_rank]
        """Per rank: the per-rank variables it does not have (encoded)."""
        self._saved: dict[str, str | None] = {}

    def begin(self) -> None:
        """A run starts: save the caller's values of every variable, set the constants (the
        per-rank ones are set by the :meth:`enter` that follows, for the first rank)."""
        constants = torchrun_constants(self.world_size, os.environ) if self._given is None else self._given
        self._saved = {key: os.environ.get(key) for key in (*constants, *self.varying)}
        os.environ.update(constants)

    def enter(self, rank: int, baseline: dict[Any, Any]) -> None:
        """Rank ``rank``'s code is about to run: its values in ``os.environ`` and in the
        settings audit's ``baseline`` (its snapshot of ``os.environ._data``)."""
        encoded = self._encoded[rank]
        for key, value in encoded.items():  # what os.environ[key] = value does, without re-encoding
            _putenv(key, value)
        _DATA.update(encoded)
        baseline.update(encoded)
        for key in self._absent[rank]:  # only with given environments that differ in their names
            _unsetenv(key)
            _DATA.pop(key, None)
            baseline.pop(key, None)

    def end(self) -> None:
        """The run ended (also by an error): the caller's environment back, exactly."""
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved = {}
