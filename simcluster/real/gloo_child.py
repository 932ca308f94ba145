"""The child side of :mod:`simcluster.real.gloo_runner`: what runs inside each gloo process.

:mod:`simcluster.real.gloo_runner` (the parent) starts one process per rank and talks to it
over a duplex pipe; this module is everything those processes execute. It imports no
parent-side code (the dependency runs one way: ``gloo_runner`` imports this module).

Entry points, one per start method:

* ``python -c`` children (``start_method="subprocess"``) run :data:`_CHILD_CODE`, which
  puts the parent's ``sys.path`` in front (from ``SIMCLUSTER_GLOO_SYS_PATH``) and calls
  :func:`_child_entry` with ``rank world_size store_path fd gloo_timeout persistent``.
* ``multiprocessing`` children (``"forkserver"``, ``"spawn"``, ``"fork"``) run
  :func:`_mp_child`, which first points stdout/stderr at the rank's log file.

Both end in :func:`_serve`, the rank's life:

1. ``init_process_group("gloo")`` on the shared ``FileStore`` with gloo's own timeout;
   ``torch.set_num_threads(1)``; every RNG (torch, ``random``, numpy) reseeded from OS
   entropy and the state saved; ``gc.freeze()``; then ``("ready", rank, None)``.
2. For each job ``(name, payload, sys_path, main_path)`` (a pickle on the pipe): extend
   ``sys.path``, restore the saved RNG state (so every job sees what a fresh process
   would), resolve ``name`` (:func:`resolve_target`; ``__main__`` targets load the
   parent's script by path), call ``fn(rank, world_size, payload)``, send ``returned``,
   pickle the result, ``gc.collect()``, pass the closing rendezvous (:func:`_closing_sync`),
   send ``("result", rank, bytes)``.
3. Leave with ``os._exit`` (:func:`_leave`): after the only job when not persistent
   (code 0), when the parent closes the pipe (0), after any exception — reported first as
   ``("error", rank, traceback text)`` naming the phase it failed in (1) — or when a
   watchdog thread sees the parent is gone (3). ``os._exit`` means no DDP object or group
   is destroyed at interpreter exit.
"""

from __future__ import annotations

import importlib
import multiprocessing.connection as mpc
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from simcluster.errors import TargetLoadError


def resolve_target(name: str) -> Callable[..., Any]:
    """Import ``"module:qualname"`` and return the callable; :class:`TargetLoadError` otherwise."""
    module_name, sep, qualname = name.partition(":")
    if not sep or not module_name or not qualname:
        raise TargetLoadError(f"target={name!r} is not of the form 'module:qualname'")
    try:
        obj: Any = sys.modules["__main__"] if module_name == "__main__" else importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise TargetLoadError(f"target={name!r} could not be loaded: {type(exc).__name__}: {exc}") from exc
    if not callable(obj):
        raise TargetLoadError(f"target={name!r} is not callable (type={type(obj).__name__})")
    return obj


#: the ``python -c`` program of a subprocess child: it imports this module (and what it
#: imports: :mod:`simcluster.errors`), never the parent side, :mod:`simcluster.real.gloo_runner`
_CHILD_CODE = (
    "import json, os, sys; "
    "sys.path[:0] = [p for p in json.loads(os.environ['SIMCLUSTER_GLOO_SYS_PATH']) if p not in sys.path]; "
    "from simcluster.real.gloo_child import _child_entry; _child_entry(sys.argv[1:])"
)


def _child_entry(argv: list[str]) -> None:
    """``python -c _CHILD_CODE rank world_size store_path fd gloo_timeout persistent``."""
    rank, world_size, store_path, fd, gloo_timeout, persistent = argv
    conn = mpc.Connection(int(fd))
    _serve(int(rank), int(world_size), store_path, conn, float(gloo_timeout), persistent == "1")


def _mp_child(rank: int, world_size: int, store_path: str, log_path: str, conn: mpc.Connection,
              gloo_timeout: float, persistent: bool) -> None:
    """Entry point under a ``multiprocessing`` start method: send output to the log, then serve."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    _serve(rank, world_size, store_path, conn, gloo_timeout, persistent)


def _serve(rank: int, world_size: int, store_path: str, conn: mpc.Connection,
           gloo_timeout: float, persistent: bool) -> None:
    """One rank: join the group, then run the jobs arriving on ``conn``.

    Messages to the parent are ``(kind, rank, data)``: ``ready``, ``returned`` (fn came
    back; the closing barrier follows), ``result`` (pickled bytes) and ``error``
    (traceback text). The child leaves with ``os._exit``: after its only job when not
    ``persistent``, after any error, and when the parent closes the pipe.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    phase = "init_process_group"
    try:
        import datetime
        import gc

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=gloo_timeout))
        fresh_rng = _rng_snapshot()
        gc.freeze()  # torch's own objects: keeps the per-job gc.collect() at ~1 ms, not ~50 ms
        conn.send(("ready", rank, None))
        while True:
            phase = "waiting for a job"
            try:
                name, payload, sys_path, main_path = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                _leave(0)
            sys.path[:0] = [p for p in sys_path if p not in sys.path]
            _rng_restore(fresh_rng)
            phase = f"the job {name}"
            result = _child_target(name, main_path)(rank, world_size, payload)
            conn.send(("returned", rank, None))
            phase = "pickling its result"
            data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
            del result
            phase = "the closing barrier"
            gc.collect()
            _closing_sync(dist, torch, world_size)
            conn.send(("result", rank, data))
            if not persistent:
                _leave(0)
    except BaseException:  # report everything, KeyboardInterrupt included, then leave
        text = f"rank {rank} failed in {phase}:\n{traceback.format_exc()}"
        try:
            conn.send(("error", rank, text))
        except (OSError, ValueError):
            pass
        _leave(1)


def _closing_sync(dist: Any, torch: Any, world_size: int) -> None:
    """Return once every rank's job has returned: a one-element all_reduce, not ``dist.barrier()``.

    gloo's barrier first waits on every work its worker threads still hold and re-raises the
    first one's error, and a worker lets go of a failed work only a moment after ``wait()``
    has raised in the job: a job that caught an error from a collective (an op gloo refuses
    for the dtype, say) failed the closing barrier in 1 of 23-74 trials, and the group was
    broken after it (docs/gloo-facts.md, "A barrier re-raises"). An all_reduce waits for no
    earlier work; like the barrier it hangs until gloo's timeout when a peer never gets here,
    and a sum other than the world size says the job left collectives unmatched.
    """
    arrived = torch.ones(1, dtype=torch.int64)
    dist.all_reduce(arrived)
    if int(arrived) != world_size:
        raise RuntimeError(f"the closing all_reduce summed to {int(arrived)}, not the world size {world_size}: "
                           "the job left collectives unmatched across ranks")


def _child_target(name: str, main_path: str | None) -> Callable[..., Any]:
    """Resolve ``name`` in a child; ``__main__`` targets load the parent's script by path.

    The script is run under the module name ``__simcluster_main__`` (so its
    ``if __name__ == "__main__":`` block does not run), once per child.
    """
    if name.startswith("__main__:"):
        if "__simcluster_main__" not in sys.modules:
            if not main_path:
                raise TargetLoadError(f"target={name!r}: the parent's __main__ has no file to load")
            import runpy
            import types

            module = types.ModuleType("__simcluster_main__")
            module.__dict__.update(runpy.run_path(main_path, run_name="__simcluster_main__"))
            sys.modules["__simcluster_main__"] = module
        name = "__simcluster_main__:" + name.partition(":")[2]
    return resolve_target(name)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Backstop if the parent is killed outright: its watchdog died with it."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    _leave(3)


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rng_snapshot() -> tuple[Any, Any, Any]:
    """Seed every RNG from OS entropy (a forked child shares its server's state) and save it."""
    import random

    import numpy
    import torch

    torch.seed()
    random.seed()
    numpy.random.seed()
    return torch.get_rng_state(), random.getstate(), numpy.random.get_state()


def _rng_restore(state: tuple[Any, Any, Any]) -> None:
    import random

    import numpy
    import torch

    torch.set_rng_state(state[0])
    random.setstate(state[1])
    numpy.random.set_state(state[2])
