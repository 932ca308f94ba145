"""Run a function on N real gloo processes: the ground truth for differential checks.

Every process joins a real gloo default group built on a ``FileStore`` in a private
``tempfile.mkdtemp()`` directory (no ports are picked, so parallel pytest-xdist workers
cannot collide), runs ``fn(rank, world_size, payload)`` and sends back its result.

>>> def total(rank, world_size, payload):          # in an importable module
...     import torch, torch.distributed as dist
...     t = torch.tensor([float(rank + 1)])
...     dist.all_reduce(t)
...     return t.item()
>>> run_gloo(total, 2)                               # doctest: +SKIP
[3.0, 3.0]

Two front doors:

* :func:`run_gloo` starts a fresh world per call: ~1.5 s on 2 idle cores, mostly each
  child's ``import torch`` (and ~1.6 s more per rank for ``torch._dynamo`` if the job
  builds a DDP); ~0.2 s with ``start_method="forkserver"`` (torch and ``torch._dynamo``
  preloaded in multiprocessing's fork server, which re-runs the caller's ``__main__`` in
  each child: scripts then need the ``if __name__ == "__main__":`` guard).
* :class:`GlooCluster` keeps a world alive and reuses it for many jobs (~1 ms each).
  Between jobs every rank's RNGs are reset to the state they had when the world started,
  so a job sees what a fresh process would; other process state (``new_group`` groups,
  module globals, ``torch.set_*`` settings) carries over. After a failed job the world
  is torn down and the next :meth:`GlooCluster.run` starts a new one.

Guarantees (the hazards they answer are in docs/gloo-facts.md §10): the parent never
hangs — it has its own watchdog, and on timeout it kills every child, reaps it and
raises :class:`GlooRunError` naming the ranks that did not finish and what each was doing. A rank that raises exits at once, so its
peers fail fast with gloo's ``Connection closed by peer``; the error puts the failing
rank's own traceback first and the peers' consequential errors last. A rank killed by a
signal (gloo aborts the process on some mismatches) is reported with the tail of its
captured stdout/stderr. Children are reaped on every path, KeyboardInterrupt included.
Children leave with ``os._exit`` after a closing barrier, so no DDP object or group is
destroyed at interpreter exit. Each child runs ``torch.set_num_threads(1)``.

This module is the parent side: starting, watching, killing and reaping the processes
and turning what they report into results or a :class:`GlooRunError`. What runs inside
each process (joining the group, the job loop, RNG reset, leaving) is
:mod:`simcluster.real.gloo_child`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from simcluster.checking import ctrl_c
from simcluster.errors import GlooRunError, UsageError
from simcluster.names import target_spec

# resolve_target is part of this module's public API (the children have their own import of it).
from simcluster.real.gloo_child import _CHILD_CODE, _mp_child, resolve_target  # noqa: F401

__all__ = ["GlooCluster", "run_gloo", "first_failed_rank", "primary_ranks", "is_consequence", "CONSEQUENCE_MARKERS",
           "TIMEOUT_MARKERS"]

Target = Callable[[int, int, Any], Any] | str

#: seconds the parent waits for the other ranks once one rank has failed
_GRACE_AFTER_FAILURE = 2.0
_CTRL_C_POLL = 0.25
"""Seconds :meth:`_World.collect` waits on its ranks before it looks whether a Ctrl-C was
pressed and its ``KeyboardInterrupt`` swallowed (:mod:`simcluster.checking.ctrl_c`)."""
CONSEQUENCE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""Substrings of a rank's error text that mark it as a consequence of another rank's failure:
the peer's process ended (a rank that raises leaves at once), so gloo's TCP pair reading from
it says ``Connection closed by peer`` (measured: docs/gloo-facts.md §6), or the socket was reset
(``Connection reset by peer``) or written after the close (``Broken pipe``)."""

TIMEOUT_MARKERS = ("Timed out", "timed out")
"""Substrings of the error of a collective that outlived the backend's timeout (either
capitalisation). A consequence only where a failed rank's process *stays* in the
world: under torchrun a rank that raised posts its outcome and waits for rank 0's verdict
(:mod:`simcluster.real.e2e_torchrun`), so its peers' collectives time out instead of seeing a
closed connection. Here (:func:`primary_ranks`) a failed rank leaves at once and the parent
kills the others within seconds, so a timeout is no sign of a peer's failure: the rank's own."""


# --------------------------------------------------------------------------- target


def target_name(fn: Target) -> str:
    """``"module:qualname"`` for ``fn``; raises :class:`UsageError` for lambdas and closures.

    The name is what travels to the children: they import the module and look the
    function up, so ``fn`` must be reachable from an importable module (or ``__main__``).
    """
    if isinstance(fn, str):
        resolve_target(fn)  # fail early, in the caller's process
        return fn
    spec = target_spec(fn) if callable(fn) else None
    if spec is None:
        raise UsageError(
            f"fn={fn!r} (type={type(fn).__name__}) cannot be sent to gloo processes: pass a "
            "module-level function or a 'module:qualname' string"
        )
    return spec


# --------------------------------------------------------------------------- processes


class _Child:
    """One child process, started by ``subprocess`` (default) or a ``multiprocessing`` context."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    def exitcode(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return self.proc.exitcode

    def kill(self) -> None:
        if self.exitcode() is None:
            try:
                self.proc.kill()
            except (OSError, ValueError):
                pass

    def join(self, timeout: float) -> None:
        try:
            if isinstance(self.proc, subprocess.Popen):
                self.proc.wait(timeout)
            else:
                self.proc.join(timeout)
        except subprocess.TimeoutExpired:
            pass


class _World:
    """N gloo child processes, their pipes and captured logs, in one private temp dir.

    ``start_method="subprocess"`` runs ``python -c`` children that import only
    simcluster and the target's module (no re-import of the caller's ``__main__``, so
    scripts need no ``if __name__ == "__main__"`` guard). Any other value is a
    ``multiprocessing`` start method; ``"forkserver"`` preloads torch in the fork server.
    A child's death is noticed through its pipe: EOF once the process is gone.
    """

    def __init__(self, world_size: int, timeout: float, *, persistent: bool, start_method: str) -> None:
        _validate(world_size, timeout, start_method)
        self.world_size, self.timeout, self.persistent = world_size, float(timeout), persistent
        self.start_method = start_method
        self.dir = tempfile.mkdtemp(prefix="simcluster-gloo-")
        self.children: list[_Child] = []
        self.conns: list[mpc.Connection] = []
        self.log_offsets = [0] * world_size
        self.phase = ["its start-up"] * world_size

    def log_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.log")

    def start(self) -> None:
        store = os.path.join(self.dir, "store")
        for rank in range(self.world_size):
            if self.start_method == "subprocess":
                ours, theirs = socket.socketpair()
                env = dict(os.environ, SIMCLUSTER_GLOO_SYS_PATH=json.dumps(sys.path))
                argv = [str(rank), str(self.world_size), store, str(theirs.fileno()), repr(self.timeout),
                        "1" if self.persistent else "0"]
                with open(self.log_path(rank), "ab") as log:
                    proc: Any = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, *argv], env=env,
                                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                 pass_fds=(theirs.fileno(),))
                theirs.close()
                conn = mpc.Connection(ours.detach())
            else:
                ctx = mp.get_context(self.start_method)
                if self.start_method == "forkserver":
                    # A process-wide setting of multiprocessing's fork server; it only
                    # takes effect if the server has not started yet. torch._dynamo is
                    # what constructing a DistributedDataParallel imports (measured: ~1.6 s
                    # alone, ~3.7 s with 2 ranks on 2 cores, in *every* rank of every
                    # world); preloaded, the children inherit it and the gc.freeze() in
                    # gloo_child._serve covers its objects, so each job's gc.collect() stays ~1 ms
                    # instead of ~0.1-0.25 s once a job has built a DDP.
                    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "numpy"])
                    _short_multiprocessing_temp_dir()
                conn, theirs_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_mp_child, name=f"simcluster-gloo-rank{rank}", daemon=True,
                                   args=(rank, self.world_size, store, self.log_path(rank), theirs_conn,
                                         self.timeout, self.persistent))
                proc.start()
                theirs_conn.close()
            self.children.append(_Child(proc))
            self.conns.append(conn)

    def submit(self, name: str, payloads: Sequence[Any]) -> None:
        main_path = getattr(sys.modules.get("__main__"), "__file__", None)
        for rank, conn in enumerate(self.conns):
            self.log_offsets[rank] = _file_size(self.log_path(rank))
            self.phase[rank] = f"the job {name}"
            job = (name, payloads[rank], list(sys.path), main_path)
            conn.send_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))

    def collect(self, want: str, limit: float, what: str, *, deadline: float | None = None) -> list[Any]:
        """Wait until every rank sent ``want``; raise :class:`GlooRunError` on failure or timeout.

        After the first failure the others get ``_GRACE_AFTER_FAILURE`` seconds to report
        (their errors are usually consequences); then everyone left is killed.
        """
        deadline = time.monotonic() + limit if deadline is None else deadline
        got: dict[int, Any] = {}
        failures: dict[int, str] = {}  # in the order the failures arrived
        while len(got) + len(failures) < self.world_size:
            waiting = {self.conns[r]: r for r in range(self.world_size) if r not in got and r not in failures}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = mpc.wait(list(waiting), timeout=min(remaining, _CTRL_C_POLL))
            ctrl_c.raise_if_lost()  # a press swallowed (a __del__'s, a gc callback's): end now, not at the deadline
            if not ready:
                continue
            for conn in sorted(ready, key=lambda c: waiting[c]):
                rank = waiting[conn]
                try:
                    kind, _, data = conn.recv()
                except (EOFError, OSError):
                    kind, data = "died", self._death(rank)
                if kind == want:
                    got[rank] = data
                elif kind == "returned":
                    self.phase[rank] = "the closing barrier (its fn returned; a peer's did not, or collectives are unmatched)"
                elif kind in ("error", "died"):
                    failures[rank] = data
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
        if failures or len(got) < self.world_size:
            unfinished = [r for r in range(self.world_size) if r not in got and r not in failures]
            error = self._error(what, limit, failures, unfinished)
            self.kill()
            raise error
        return [got[r] for r in range(self.world_size)]

    def _death(self, rank: int) -> str:
        child = self.children[rank]
        child.join(timeout=2.0)
        code = child.exitcode()
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"rank {rank} {how} while in {self.phase[rank]}, without reporting an error"

    def log_tail(self, rank: int, lines: int = 25) -> str:
        """The last ``lines`` lines rank ``rank`` printed during the current job."""
        try:
            with open(self.log_path(rank), "rb") as f:
                f.seek(self.log_offsets[rank])
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def _error(self, what: str, limit: float, failures: dict[int, str], unfinished: list[int]) -> GlooRunError:
        primary = primary_ranks(failures)
        secondary = [r for r in failures if r not in primary]
        if primary:
            parts = [f"{what} failed on a world of {self.world_size} gloo ranks: rank {primary[0]} failed first"]
        else:
            parts = [f"{what} did not finish within timeout={limit:g} s on a world of {self.world_size} gloo ranks"]
        for rank in primary:
            parts.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
            tail = self.log_tail(rank)
            if tail:
                parts.append(f"--- rank {rank} output (last lines) ---\n{tail}")
        for rank in secondary:
            last = failures[rank].rstrip().splitlines()[-1]
            parts.append(f"--- rank {rank} (consequence of rank {primary[0]}'s failure) ---\n{last}")
        if unfinished:
            doing = "; ".join(f"rank {r}: in {self.phase[r]}" for r in unfinished)
            parts.append(f"ranks {unfinished} did not finish and were killed ({doing})")
            for rank in unfinished:
                tail = self.log_tail(rank, lines=10)
                if tail:
                    parts.append(f"--- rank {rank} output (last lines) ---\n{tail}")
        return GlooRunError("\n".join(parts), failures=failures, unfinished=unfinished, reproduce="")

    def kill(self) -> None:
        """Kill and reap every child, close the pipes, remove the temp dir. Idempotent."""
        for child in self.children:
            child.kill()
        for child in self.children:
            child.join(timeout=10.0)
        for conn in self.conns:
            conn.close()
        self.children, self.conns = [], []
        shutil.rmtree(self.dir, ignore_errors=True)


# A Unix socket's path holds at most 107 bytes (``sun_path`` is 108 with the NUL).
_SOCKET_PATH_LIMIT = 107
# What multiprocessing appends to its temp dir for the fork server's socket:
# "/pymp-XXXXXXXX/listener-XXXXXXXX" (8 random characters each).
_LISTENER_SUFFIX = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def _short_multiprocessing_temp_dir() -> None:
    """Make sure multiprocessing's fork server can bind its socket.

    The fork server listens on a Unix socket in ``multiprocessing.util.get_temp_dir()``,
    a ``pymp-*`` directory made under ``tempfile.gettempdir()`` the first time it is asked
    for. Under a long ``TMPDIR`` (pytest's ``tmp_path``, CI sandboxes) the socket's path
    passes 107 bytes and the server dies with ``OSError: AF_UNIX path too long``. So,
    before the server first starts, the directory is made under the first short,
    writable system temp dir instead (it is removed at exit like multiprocessing's own).
    Only that directory moves: the world's store and logs stay under ``TMPDIR``. If
    multiprocessing already chose a long directory (something else asked first), this
    raises :class:`UsageError` naming the fix rather than failing inside the server.
    (Measured: Python 3.11's ``multiprocessing.forkserver`` binds
    ``<get_temp_dir()>/listener-XXXXXXXX``; see docs/gloo-facts.md.)
    """
    from multiprocessing import util

    base = tempfile.gettempdir()
    if len(base) + _LISTENER_SUFFIX > _SOCKET_PATH_LIMIT:
        short = next((d for d in ("/tmp", "/var/tmp", "/dev/shm")
                      if len(d) + _LISTENER_SUFFIX <= _SOCKET_PATH_LIMIT and os.access(d, os.W_OK | os.X_OK)), None)
        if short is None:
            raise UsageError(f"the temp dir {base!r} is too long for multiprocessing's fork server socket and no "
                             f"short one is writable: set TMPDIR to a shorter directory or use "
                             f"start_method='subprocess'")
        base = short
    saved = tempfile.tempdir
    tempfile.tempdir = base
    try:
        chosen = util.get_temp_dir()  # made once per process, then cached by multiprocessing
    finally:
        tempfile.tempdir = saved
    if len(chosen) + len("/listener-xxxxxxxx") > _SOCKET_PATH_LIMIT:
        raise UsageError(f"multiprocessing's temp dir {chosen!r} is too long for its fork server socket: "
                         f"set TMPDIR to a shorter directory or use start_method='subprocess'")


def _validate(world_size: int, timeout: float, start_method: str) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise UsageError(f"world_size={world_size!r} (type={type(world_size).__name__}) must be an int >= 1")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise UsageError(f"timeout={timeout!r} must be a number of seconds > 0")
    if start_method not in ("subprocess", *mp.get_all_start_methods()):
        raise UsageError(f"start_method={start_method!r} must be 'subprocess' or one of {mp.get_all_start_methods()}")


def is_consequence(text: str, *, timeouts: bool = False) -> bool:
    """Whether a rank's error ``text`` is a consequence of another rank's failure
    (:data:`CONSEQUENCE_MARKERS`; with ``timeouts``, :data:`TIMEOUT_MARKERS` too: for a
    launcher whose failed ranks stay alive, as torchrun's)."""
    markers = CONSEQUENCE_MARKERS + TIMEOUT_MARKERS if timeouts else CONSEQUENCE_MARKERS
    return any(marker in text for marker in markers)


def primary_ranks(failures: dict[int, str]) -> list[int]:
    """The ranks whose failure is their own (not a consequence of another's, such as a
    peer's ``Connection closed by peer``), in the order they reported; if every failure
    is such a consequence, the first to report."""
    return [r for r, text in failures.items() if not is_consequence(text)] or list(failures)[:1]


def first_failed_rank(err: GlooRunError) -> int:
    """The rank whose own failure started ``err`` (:func:`primary_ranks`); -1 if none failed."""
    primary = primary_ranks(err.failures)
    return primary[0] if primary else -1


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _payloads(payloads: Sequence[Any] | None, world_size: int) -> Sequence[Any]:
    if payloads is None:
        return [None] * world_size
    if len(payloads) != world_size:
        raise UsageError(f"payloads has {len(payloads)} entries; world_size={world_size} needs one per rank")
    return payloads


def _loads(blobs: list[bytes]) -> list[Any]:
    results = []
    for rank, blob in enumerate(blobs):
        try:
            results.append(pickle.loads(blob))
        except Exception as exc:
            raise GlooRunError(f"rank {rank}'s result could not be unpickled in the caller: "
                               f"{type(exc).__name__}: {exc}", failures={}, unfinished=[], reproduce="") from exc
    return results


def _reproduce(name: str, world_size: int, timeout: float) -> str:
    return (f"python -c \"from simcluster.real.gloo_runner import run_gloo; "
            f"print(run_gloo({name!r}, {world_size}, timeout={timeout:g}))\"  (pass the same payloads)")


def _with_reproduce(err: GlooRunError, line: str) -> GlooRunError:
    err.reproduce = line
    err.args = (f"{err.args[0]}\nreproduce: {line}",)
    return err


def run_gloo(fn: Target, world_size: int, payloads: Sequence[Any] | None = None, *,
             timeout: float = 60.0, start_method: str = "subprocess") -> list[Any]:
    """Run ``fn(rank, world_size, payload)`` on ``world_size`` fresh gloo processes.

    ``fn`` is a module-level function or ``"module:qualname"``; ``payloads`` holds one
    picklable value per rank (``None`` each by default). Returns each rank's result in
    rank order (results travel by pickle: tensors come back as copies). ``timeout`` bounds
    the whole call, start-up included; on expiry every child is killed and reaped and a
    :class:`GlooRunError` names the ranks that did not finish. ``start_method`` is a
    ``"subprocess"`` (default: ``python -c`` children, no ``__main__`` guard needed) or a
    ``multiprocessing`` start method such as ``"forkserver"`` (see docs/gloo-facts.md).
    """
    name = target_name(fn)
    payloads = _payloads(payloads, world_size)
    world = _World(world_size, timeout, persistent=False, start_method=start_method)
    deadline = time.monotonic() + timeout
    try:
        world.start()
        world.submit(name, payloads)
        world.collect("ready", timeout, f"starting gloo for {name}", deadline=deadline)
        return _loads(world.collect("result", timeout, name, deadline=deadline))
    except GlooRunError as err:
        raise _with_reproduce(err, _reproduce(name, world_size, timeout)) from None
    finally:
        world.kill()


class GlooCluster:
    """A persistent world of ``world_size`` gloo processes reused across many jobs.

    >>> with GlooCluster(2) as cluster:                 # doctest: +SKIP
    ...     cluster.run(total)                           # ~1 ms per tiny job
    ...     cluster.run("mypkg.checks:other", payloads=[a, b])

    The world starts lazily on the first :meth:`run` (``start_timeout`` bounds that; it
    is also gloo's own collective timeout inside the world). Each job has ``timeout``
    seconds. A failed or timed-out job tears the world down (its collective state is
    unknown) and the next job starts a fresh one; ``starts`` counts the worlds started.
    Always :meth:`close` it (or use ``with``); children also leave on their own when the
    parent process dies.
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0, start_timeout: float = 120.0,
                 start_method: str = "subprocess") -> None:
        _validate(world_size, timeout, start_method)
        _validate(world_size, start_timeout, start_method)
        self.world_size, self.timeout, self.start_method = world_size, float(timeout), start_method
        self.start_timeout = float(start_timeout)
        self._world: _World | None = None
        self.starts = 0

    def __enter__(self) -> "GlooCluster":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run(self, fn: Target, payloads: Sequence[Any] | None = None, *,
            timeout: float | None = None) -> list[Any]:
        """Run ``fn(rank, world_size, payload)`` on every rank; see :func:`run_gloo`.

        ``timeout`` overrides the cluster's per-job timeout for this call (start-up of
        the world, when needed, is bounded by ``start_timeout`` separately).
        """
        name = target_name(fn)
        payloads = _payloads(payloads, self.world_size)
        job_timeout = self.timeout if timeout is None else float(timeout)
        _validate(self.world_size, job_timeout, self.start_method)
        ok = False
        try:
            if self._world is None:
                gloo_timeout = max(self.start_timeout, self.timeout)
                self._world = _World(self.world_size, gloo_timeout, persistent=True, start_method=self.start_method)
                self.starts += 1
                self._world.start()
                self._world.collect("ready", self.start_timeout, "starting the gloo world")
            self._world.submit(name, payloads)
            results = _loads(self._world.collect("result", job_timeout, name))
            ok = True
            return results
        except GlooRunError as err:
            raise _with_reproduce(err, _reproduce(name, self.world_size, job_timeout)) from None
        finally:
            if not ok:
                self.close()

    def close(self) -> None:
        """Kill and reap the world's processes. Idempotent."""
        world, self._world = self._world, None
        if world is not None:
            world.kill()
