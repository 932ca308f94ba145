"""Running user code in a child process that can always be ended.

Hook code can spin (``while True: pass``), block in C (``time.sleep``, a lock, a C++
future), end its process (``os._exit``, a crash) or never return in a hundred other
ways. Nothing *inside* a Python process can stop all of those: a pure-Python loop
ignores other threads, a C call ignores asynchronous exceptions until it returns, and
signals reach only the main thread. So a check runs in a **forked child** and the
parent watches it:

1. Before each example the child writes *what it is about to run* into a page of
   shared memory (:class:`Monitor`): the example's replay token, when it started, and —
   at every hook call — the rank, DDP step and bucket.
2. The parent polls that page. An example running longer than ``deadline`` seconds is
   stuck: the parent asks the child for every thread's Python stack (:data:`STACK_REQUEST`,
   answered by :mod:`faulthandler` from C, so it works whatever the stuck thread is
   doing), kills it (``SIGKILL``) and reports where it was (:class:`ChildDeath`).
3. A child that exits without answering (``os._exit``, a signal, a segfault) is reported
   the same way, with the example and position it was at.
4. A child that finishes sends its result back through a pipe (pickled).

The child is a ``fork`` of the caller, so closures and hooks defined in a test file
work as they are, and nothing is imported twice. torch's OpenMP pool does not survive
``fork`` (a parallel region in the child would hang), so the child runs torch with one
intra-op thread; reductions inside hook code can then differ in their last bits from a
multi-threaded run — identically on every simulated rank, and identically on every
replay, which also runs supervised.

The child also: runs in a process group of its own, so a terminal's Ctrl-C reaches only
the parent (which asks the child for its stack, kills it and re-raises), and raises
``KeyboardInterrupt`` on ``SIGINT`` as any Python process does (a hook that sends its own
process ``SIGINT`` stops the check with 130, as one raising ``KeyboardInterrupt`` does),
dies with its parent (``PR_SET_PDEATHSIG``), ends every process the code under test
started before it exits (:func:`end_descendants`: it is a subreaper, so orphans below it
stay below it), and turns a hook's
``os._exit(code)`` into :class:`~simcluster.errors.HookExited` raised at the call, so the
report can name the line. Time limits are the one place where wall-clock time reaches
a verdict: a hook that needs longer than ``deadline`` for one example is reported as
stuck. The default, :data:`DEFAULT_DEADLINE`, is generous (a typical example takes
milliseconds; the slowest of torch's hooks, under a second on 2 cores).

    >>> outcome = run_supervised(lambda monitor: 6 * 7, deadline=5)
    >>> outcome.value, outcome.death
    (42, None)
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import linecache
import mmap
import os
import pickle
import re
import select
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from simcluster.checking import ctrl_c
from simcluster.engine.frames import (collapse_recursions, is_internal, is_simcluster_code, recursion_mark, short_path,
                                      stack_user_frames, user_frames)
from simcluster.engine.inline import mark_forked
from simcluster.errors import HookExited
from simcluster.usercode.rank_state import CURRENT

_monotonic = time.monotonic
"""The clock of every deadline, taken when simcluster is imported: code under test that replaces
``time.monotonic`` (a clock pushed ahead, or stopped) must not move the start an example
writes or the parent's reading of it (an audit of hostile hooks, 2026-12-07: a hook that
pushed the clock ahead in one example and spun in the next was never stopped)."""

__all__ = ["DEFAULT_DEADLINE", "Monitor", "ChildDeath", "Outcome", "run_supervised", "fork_child", "write_all",
           "end_process", "one_torch_thread", "how_it_ended", "kill_and_reap", "format_stack", "stuck_in",
           "raise_site", "die_with_parent", "watchdog_under"]

DEFAULT_DEADLINE = 60.0
"""Seconds one example may take before it is reported stuck (``--deadline``)."""


def watchdog_under(deadline: float) -> float:
    """The stuck timeout of an engine whose run a supervisor bounds by ``deadline``: well past
    it, so a hang is always the supervisor's to end and tell (every thread's stack, where the
    hook's code was) — never a race with the engine's terser ``StuckError`` (which won it once,
    in a loaded CI run, with the same 8 s on both)."""
    return 2 * deadline + 30

_PAGE = 1 << 16
_HEADER = struct.Struct("<QdBiiiiI")
"""Example seq, last begin/end (monotonic), active, the last hook call's rank, step and bucket,
the rank whose code runs (-1: none yet), payload length."""
_RUNNING_AT = 29  # the running rank's offset: after seq (8), time (8), active (1), rank/step/bucket (12)
STACK_REQUEST, STACK_REQUEST_NAME = ((int(signal.SIGRTMAX) - 3, "SIGRTMAX-3") if hasattr(signal, "SIGRTMAX")
                                     else (int(signal.SIGUSR1), "SIGUSR1"))
"""The signal the parent asks a stuck child for its stacks with (faulthandler answers it), and
its name as ``kill -l`` prints it. A real-time signal where there are any (Linux): no training
library handles one. It was ``SIGUSR1``, which SLURM sends before a job's time limit, so a
hook module's preemption handler ran at the request — one that saves and exits turned a stuck
hook into a report of ``sys.exit(0)`` in that handler (an audit of hostile hooks, stop 42)."""

_DUMP_GRACE = 1.0  # seconds allowed for faulthandler to write the stacks
_real_getppid = os.getppid  # a run swaps in the ranks' simulated parent (rank_state.SIMULATED_PARENT_PID)
_real_getpid, _real_kill, _sleep = os.getpid, os.kill, time.sleep  # as the process started: code under test may replace them
_POLL = 0.05
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class Monitor:
    """The child's side: announces each example and each hook call in shared memory.

    Outside a supervised child (``enabled`` False) every method is a no-op, so the
    checking code calls it unconditionally.
    """

    def __init__(self, page: mmap.mmap | None = None, output_fd: int | None = None) -> None:
        self._page = page
        self._seq = 0
        self.enabled = page is not None
        self.output_fd = output_fd
        """Where the child captures what user code prints during an example (None: a file of
        its own per capture): the parent reads it when the child never answers."""

    def begin(self, payload: dict[str, Any]) -> None:
        """An example starts; ``payload`` (picklable: backend, replay token…) is what the
        parent reports if it never ends. It is pickled here and unpickled only by a parent
        that reports a death, so a value may defer its work to its unpickling
        (:class:`~simcluster.checking.replay.DeferredToken`: the token of every example
        announced, encoded only for the one that died)."""
        if self._page is None:
            return
        data = pickle.dumps(payload)
        if len(data) > _PAGE - _HEADER.size:  # too long to announce whole: its short plain parts
            data = pickle.dumps({key: value[:1000] if isinstance(value, str) else value
                                 for key, value in payload.items() if isinstance(value, (str, int, float))})
        self._seq += 1
        self._page[_HEADER.size:_HEADER.size + len(data)] = data
        _HEADER.pack_into(self._page, 0, self._seq, _monotonic(), 1, -1, -1, -1, -1, len(data))

    def at(self, rank: int, step: int, bucket: int) -> None:
        """A hook call starts on ``rank`` at DDP step ``step``, bucket ``bucket``."""
        if self._page is None:
            return
        struct.pack_into("<iii", self._page, 17, rank, step, bucket)

    def running(self, rank: int) -> None:
        """Rank ``rank``'s code runs from now on (its hook, a callback of its, DDP's work for
        it): called at every hand-over between ranks (:meth:`RankContexts.switch
        <simcluster.fake.rank_context.RankContexts.switch>`, through ``CURRENT.announce``), so a
        process that dies is placed at the rank whose code ended it — a ``then`` callback runs
        after other ranks' hook calls have started."""
        if self._page is None:
            return
        struct.pack_into("<i", self._page, _RUNNING_AT, rank)

    def end(self) -> None:
        """The example ended (passed or failed)."""
        if self._page is not None:
            struct.pack_into("<dB", self._page, 8, _monotonic(), 0)


@dataclass
class ChildDeath:
    """Why a supervised child ended without a result, and where it was."""

    kind: str  # "deadline" | "exited" | "signal"
    detail: str  # a predicate: "did not return within 2 s", "exited with code 3 without reporting", "was killed by SIGSEGV"
    payload: dict[str, Any] | None  # what Monitor.begin announced (None: between examples)
    position: tuple[int, int, int] | None  # (rank, step, bucket) of the last hook call
    stacks: str  # faulthandler's dump of every thread ('' if none was taken)
    output: str = ""  # what user code printed in the example it was running (captured)
    running: int | None = None  # the rank whose code ran last (None: unknown)
    previous: dict[str, Any] | None = None
    """Between examples: what the last example that *returned* announced (None: none had
    begun). A hook that closed every file descriptor, started a timer thread or armed an
    alarm ends the process after its example returned — the example to replay."""
    stopped: bool = False
    """At the deadline the process was stopped by a signal (``SIGSTOP``, ``SIGTSTP``, …), not
    running: its code stopped it, not spinning or blocked."""

    def where(self) -> str:
        """``rank 1, DDP step 0, bucket 0`` (the last hook call), or what is known; and the
        rank whose code was running when that is another rank (a callback, run after a
        peer's hook call started)."""
        if self.previous is not None:
            text = "between two examples, after one had returned"
            if self.position is not None:
                rank, step, bucket = self.position
                text += f" (its last hook call: rank {rank}, DDP step {step}, bucket {bucket})"
            return f"{text}: what its code left behind (a thread, a timer, closed files) ended the process"
        if self.position is None:
            text = "before the first hook call of the example"
            return text if self.running is None else f"{text}; rank {self.running}'s code was running"
        rank, step, bucket = self.position
        text = f"rank {rank}, DDP step {step}, bucket {bucket} (the last hook call that started)"
        if self.running is not None and self.running != rank:
            text += f"; rank {self.running}'s code was running"
        return text


    def summary(self, subject: str) -> str:
        """One sentence: what ``subject`` (``"the example"``, ``"the hook"``) did and where
        its code was — the function it was stuck in, from the stack sample."""
        function = stuck_in(self.stacks)
        inside = f", in {function}" if function else ""
        place = self.where()
        place = place if place.startswith(("before", "between")) else f"at {place}"  # not "stuck at before …"
        if self.kind == "deadline":
            why = ("its process was stopped by a signal (SIGSTOP, SIGTSTP, …) and never went on" if self.stopped
                   else "hook code spinning or blocked")
            return f"{subject} {self.detail} ({why}); stuck {place}{inside}"
        return f"{subject}'s process {self.detail}; it was {place}{inside}"


@dataclass
class Outcome:
    """What :func:`run_supervised` returns: exactly one of the three is set."""

    value: Any = None
    error: BaseException | None = None  # raised by the job in the child, to re-raise
    death: ChildDeath | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def run_supervised(job: Callable[[Monitor], Any], *, deadline: float = DEFAULT_DEADLINE) -> Outcome:
    """Run ``job(monitor)`` in a forked child; return its value, its exception or its death.

    ``deadline`` bounds each example the job announces with ``monitor.begin`` (and the
    time before its first one). A ``BaseException`` in the caller while waiting
    (Ctrl-C, pytest-timeout's signal method) first collects the child's stacks — added
    to the exception as a note, so the report says where the checked code was — then
    kills the child and propagates.
    """
    start = _monotonic()
    page = mmap.mmap(-1, _PAGE)
    stack_file = tempfile.TemporaryFile()
    output_file = tempfile.TemporaryFile()
    pid, read_end = fork_child(lambda out, parent: _child(job, Monitor(page, output_file.fileno()), out,
                                                          stack_file.fileno(), parent))
    try:
        outcome = _watch(pid, page, read_end, stack_file, deadline, start)
        if outcome.death is not None:  # what it printed last is what it was doing
            size = os.fstat(output_file.fileno()).st_size
            kept = os.pread(output_file.fileno(), _OUTPUT_KEPT, max(0, size - _OUTPUT_KEPT))
            outcome.death.output = kept.decode("utf-8", "replace")
        return outcome
    finally:
        os.close(read_end)
        stack_file.close()
        output_file.close()
        page.close()


_OUTPUT_KEPT = 1 << 20
"""Bytes of a dead child's captured output read back (its last MiB)."""


def fork_child(body: Callable[[int, int], None]) -> tuple[int, int]:
    """Fork with a pipe from child to parent: the child runs ``body(write_fd, parent_pid)``,
    which must end the process (:func:`end_process`) and never return into the caller's
    code; the parent gets ``(child_pid, read_fd)``. Buffered output is flushed first, so
    the child does not print the parent's pending lines a second time."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its coverage is the tests' subject
        os.close(read_end)
        body(write_end, parent)
    os.close(write_end)
    return pid, read_end


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd`` (a pipe takes it in pieces)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def end_process(code: int, exit: Callable[[int], Any] = os._exit) -> None:
    """Flush what this forked process printed, then end it at once with ``code`` (no
    ``atexit`` handlers or interpreter teardown: they belong to the parent's program)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to keep
            pass
    exit(code)


def _child(job: Callable[[Monitor], Any], monitor: Monitor, out: int, stack_fd: int,
           parent: int) -> None:  # pragma: no cover
    real_exit = os._exit
    code = 0
    try:
        _prepare_child(stack_fd, parent)
        CURRENT.announce = monitor.running  # this process is the child's: no one else's run to announce
        try:
            message: tuple[str, Any] = ("value", job(monitor))
        except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
            # the traceback does not survive pickling: keep what it said as notes
            exc.add_note(f"simcluster: raised in the supervised child{raise_site(exc)}")
            if isinstance(exc, Exception):  # a bug of ours or a usage error: keep the traceback's text
                exc.add_note("".join(traceback.format_exception(exc)).rstrip())
            message = ("error", exc)
        try:
            data = pickle.dumps(message)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception
            stand_in = _builtin_stand_in(message[1]) if message[0] == "error" else None
            data = pickle.dumps(("error", stand_in if stand_in is not None else
                                 RuntimeError(f"unpicklable result from the supervised child: {exc!r}")))
        write_all(out, data)
        _say_unraisable()
    except BaseException:  # noqa: BLE001 - never let the child return into the caller's code
        code = 70
    finally:
        with contextlib.suppress(BaseException):  # noqa: BLE001 - the child ends whatever happens
            end_descendants(_real_getpid())  # what the checked code started ends with the child
        end_process(code, real_exit)


def _builtin_stand_in(exc: BaseException) -> BaseException | None:
    """``exc`` as the nearest builtin exception class it derives from, with its message and
    notes, and a note naming its own class: for an exception whose class the parent cannot
    unpickle (one defined in a module copy of the code under test). A ``KeyboardInterrupt``
    subclass a hook raised then stops the check as Ctrl-C does, not as an internal error."""
    import builtins

    base = next((k for k in type(exc).__mro__ if getattr(builtins, k.__name__, None) is k), None)
    if base is None:
        return None
    try:
        stand_in = base(str(exc))
    except Exception:  # noqa: BLE001 - a builtin that takes other arguments
        return None
    stand_in.__notes__ = [f"simcluster: raised as {type(exc).__module__}.{type(exc).__qualname__}, a class of the "
                          "code under test this process cannot unpickle", *getattr(exc, "__notes__", ())]
    return stand_in


def die_with_parent(parent: int) -> None:  # pragma: no cover - runs in a forked child
    """In a child forked by ``parent``: have the kernel ``SIGKILL`` this process when its
    parent ends (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing), so no child outlives a
    killed parent. A parent that already ended between the ``fork`` and this call would
    never send the signal: the child then ends itself at once."""
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) and _real_getppid() != parent:
        os._exit(70)


def _become_subreaper() -> None:  # pragma: no cover - runs in a forked child
    """Make this process a subreaper (Linux ``PR_SET_CHILD_SUBREAPER``; elsewhere nothing): a
    process below it whose parent ends becomes its child, not ``init``'s, so
    :func:`end_descendants` still finds it — a daemon's double fork, a shell that started a
    process in the background and exited."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _prctl(option: int, value: int) -> bool:  # pragma: no cover - runs in a forked child
    """Linux's ``prctl(option, value)`` for this process; False where there is none (not Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):
        return False
    return True


def one_torch_thread() -> None:  # pragma: no cover - runs in a forked child
    """In a forked child: run torch with one intra-op thread (its OpenMP pool does not
    survive ``fork``: a parallel region would hang). Only if the caller imported torch:
    importing it here would cost seconds."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (``<malloc.h>``)."""

_KEPT_BYTES = 32 << 20
"""The largest ``M_MMAP_THRESHOLD`` glibc takes on 64-bit systems (32 MiB)."""


def keep_freed_memory() -> None:  # pragma: no cover - runs in a forked child
    """In a forked child: have glibc's ``malloc`` keep what is freed, for the next allocation.

    By default glibc serves every block over its *mmap threshold* (128 KiB at first, raised
    as such blocks are freed) with an ``mmap`` of its own, returned to the kernel at ``free``,
    and gives the heap's free top back once it exceeds twice that. A search allocates and frees
    tensors of a few MiB over and over (the explicit large example: 262,145 elements per rank;
    the oracles' float64 copies of them), so every allocation came back as fresh pages, each
    zeroed by a page fault: 17,000 faults and ~85 ms per backend search of ``allreduce_hook``,
    against 2,600-6,700 faults and ~45 ms with blocks up to 32 MiB served from the heap and
    128 MiB of free heap kept (docs/speed.md, stop 44). Nothing the checked code can observe
    changes but the process's resident memory, and the child is short-lived. Elsewhere than
    glibc (no ``mallopt``, or musl's, which ignores these): nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _KEPT_BYTES)
    mallopt(_M_TRIM_THRESHOLD, 4 * _KEPT_BYTES)


def how_it_ended(status: int) -> str:
    """A reaped process's end, from its ``waitpid`` status: ``"was killed by SIGKILL"``,
    ``"exited with code 3"``."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by {signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f'signal {sig}'}"
    return f"exited with code {os.WEXITSTATUS(status)}"


def kill_and_reap(pid: int) -> int:
    """``SIGKILL`` process ``pid`` (it may have ended already) and reap it; its status."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitpid(pid, 0)[1]


def _reap_with_its_group(pid: int, *, kill: bool = False) -> int:
    """Wait for the supervised child ``pid`` to end (``kill``: stop it, end every process
    below it — :func:`end_descendants` — and ``SIGKILL`` it), ``SIGKILL`` what is left of its
    process group, then reap it; its status. The child leads a group of its own (:func:`_prepare_child`),
    which every process the code under test started inherits — a ``subprocess.Popen`` per
    hook call left 138 ``sleep`` processes running after a three-example check (an audit of
    hostile hooks, 2026-12-07) — so whatever it left running ends with the child, as a
    rank's processes end with its job. The child is reaped only after the group is killed:
    until then it is a zombie, and its id, the group's, cannot name another process.
    A process that left the group (``start_new_session=True``, ``os.setsid``) is ended by the
    child itself when it finishes, or here before a stuck child is killed."""
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)  # it starts no more processes while those below it are ended
            end_descendants(pid)
            os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


_ENDING_ROUNDS = 100
"""How many times :func:`end_descendants` looks again for processes below its root (each
look finds those started, or orphaned onto the root, while the previous ones were killed)."""


def _living_descendants(root: int) -> list[int]:
    """The ids of the processes below ``root`` in the process tree that have not ended
    (zombies left out: they are only waiting to be reaped), read from ``/proc``; ``[]``
    where there is no ``/proc``."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        fields = _proc_stat(name) if name.isdigit() else None
        if fields is not None and fields[0] not in (b"Z", b"X"):
            children.setdefault(int(fields[1]), []).append(int(name))
    found: list[int] = []
    below = children.get(root, [])
    while below:
        found += below
        below = [grandchild for child in below for grandchild in children.get(child, ())]
    return found


def end_descendants(root: int) -> int:
    """``SIGKILL`` every process below process ``root`` — the processes the code under test
    started, and theirs, also those that left its process group (``start_new_session=True``,
    ``os.setsid``) — until none is left; how many were killed. A process whose parent ended is
    found too when ``root`` is a subreaper (:func:`_prepare_child` makes the supervised child
    one): the kernel makes such an orphan ``root``'s child, not ``init``'s. Linux only (``/proc``)."""
    killed = 0
    for _ in range(_ENDING_ROUNDS):
        found = _living_descendants(root)
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                _real_kill(pid, signal.SIGKILL)
        killed += len(found)
        _sleep(0.001)  # SIGKILL is delivered asynchronously: let them become zombies
    return killed


def _prepare_child(stack_fd: int, parent: int) -> None:  # pragma: no cover - runs in the child
    # A process group of its own: the terminal's Ctrl-C goes to the foreground group, so it
    # reaches the parent only, which asks this child for its stack and then kills it. The
    # child keeps Python's own SIGINT handler: a rank that sends itself SIGINT ends on a real
    # cluster, and ignoring it let such a hook pass (an audit of hostile hooks, 2026-12-07).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the command's handler: a hook's SIGTERM to itself kills it
    die_with_parent(parent)
    _become_subreaper()
    faulthandler.enable(file=stack_fd, all_threads=True)
    faulthandler.register(STACK_REQUEST, file=stack_fd, all_threads=True, chain=False)
    one_torch_thread()
    keep_freed_memory()

    real_exit = os._exit

    def exit_is_a_finding(status: int = 0) -> None:
        exc = HookExited(f"os._exit({status}) was called: on a real cluster this rank's process ends here")
        exc.simcluster_frames = stack_user_frames(sys._getframe(1))  # type: ignore[attr-defined] - the calling line
        CURRENT.exits.append(exc)  # caught or not, the run fails (SimCluster)
        raise exc

    def forked_by_user_code() -> None:
        """In a process the code under test forked from this child (``os.fork``, a
        ``multiprocessing`` fork): ``os._exit`` ends it again, it dies with this child, and
        it never runs simcluster's own code on (:func:`~simcluster.engine.inline.leave_if_forked`)."""
        os._exit = real_exit  # type: ignore[assignment]
        mark_forked(real_exit)
        die_with_parent(_real_getppid())  # the process that forked, not a rank's simulated parent

    os._exit = exit_is_a_finding  # type: ignore[assignment]
    os.register_at_fork(after_in_child=forked_by_user_code)
    sys.unraisablehook = _capped_unraisable


UNRAISABLE_SHOWN = 10
"""How many exceptions Python "ignores" (``Exception ignored in: …``: raised in a gc callback,
a ``__del__``, a weakref callback) a supervised child prints; the rest are counted. A hook
that left a raising gc callback with ``gc.set_threshold(1)`` wrote 3.1 million such lines
(an audit of hostile hooks, 2026-12-07)."""

_unraisable = [0]  # how many the child saw


def _capped_unraisable(unraisable: Any) -> None:  # pragma: no cover - runs in the child
    """``sys.unraisablehook`` of a supervised child: Python's own for the first
    :data:`UNRAISABLE_SHOWN`, then a count (said when the child ends: :func:`_say_unraisable`)."""
    _unraisable[0] += 1
    if _unraisable[0] <= UNRAISABLE_SHOWN:
        sys.__unraisablehook__(unraisable)


def _say_unraisable() -> None:  # pragma: no cover - runs in the child
    hidden = _unraisable[0] - UNRAISABLE_SHOWN
    if hidden > 0:
        with contextlib.suppress(OSError):
            os.write(2, f"simcluster: the checked code raised {_unraisable[0]} exceptions Python ignored (in gc "
                        f"callbacks, __del__ methods or weakref callbacks); only the first {UNRAISABLE_SHOWN} were "
                        "printed (in the output of the example running then, if one was)\n".encode())


def _watch(pid: int, page: mmap.mmap, pipe: int, stack_file: Any, deadline: float, start: float) -> Outcome:
    chunks: list[bytes] = []
    try:
        while True:
            ctrl_c.raise_if_lost()  # a Ctrl-C whose KeyboardInterrupt was swallowed (a gc callback's)
            readable, _, _ = select.select([pipe], [], [], _POLL)
            if readable:
                chunk = os.read(pipe, 1 << 20)
                if chunk:
                    chunks.append(chunk)
                    continue
                return _finish(pid, page, b"".join(chunks), stack_file, start)
            stamp, active = _HEADER.unpack_from(page, 0)[1:3]
            # ``deadline`` bounds an example; simcluster's own work between examples
            # (Hypothesis generating, shrinking) gets the generous default as a backstop.
            limit = deadline if active else max(deadline, DEFAULT_DEADLINE)
            if _monotonic() - (stamp or start) > limit:
                stopped = _stopped(pid)
                # continued to answer (below), a stopped child runs on for a moment: where it was is read first
                where = bytes(page) if stopped else page
                stacks = _dump_and_kill(pid, stack_file, stopped)
                death = _death(where, "deadline", f"did not return within {deadline:g} s", stacks)
                death.stopped = stopped
                return Outcome(death=death, seconds=_monotonic() - start)
    except BaseException as exc:
        stacks = _dump_and_kill(pid, stack_file)
        if stacks:
            exc.add_note("simcluster: the checked code was here when this arrived:\n" + format_stack(stacks))
        raise


def _finish(pid: int, page: mmap.mmap, data: bytes, stack_file: Any, start: float) -> Outcome:
    status = _reap_with_its_group(pid)
    seconds = _monotonic() - start
    if data:
        try:
            kind, payload = pickle.loads(data)
        except Exception:  # noqa: BLE001 - a truncated message: the child died while writing
            kind, payload = "broken", None
        if kind == "value":
            return Outcome(value=payload, seconds=seconds)
        if kind == "error":
            return Outcome(error=payload, seconds=seconds)
    if os.WIFSIGNALED(status):
        detail, kind = how_it_ended(status), "signal"
    else:
        detail, kind = f"{how_it_ended(status)} without reporting", "exited"
    stack_file.flush()
    stacks = os.pread(stack_file.fileno(), 1 << 20, 0).decode(errors="replace")
    return Outcome(death=_death(page, kind, detail, stacks), seconds=seconds)


def _proc_stat(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name — state, parent id, process
    group, … (the name, in parentheses, may hold spaces and parentheses itself) — or None:
    no ``/proc`` (not Linux), or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return fields if len(fields) >= 2 else None


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (its state in ``/proc``: ``T``)."""
    fields = _proc_stat(pid)
    return fields is not None and fields[0] == b"T"


def _dump_and_kill(pid: int, stack_file: Any, stopped: bool = False) -> str:
    """Ask the child for every thread's stack, then kill and reap it; return the dump. A child
    ``stopped`` by a signal is continued first: stopped, it answers nothing (the report of a
    hook that sent itself ``SIGSTOP`` had no stack), continued, it dumps where it stopped."""
    try:
        os.kill(pid, STACK_REQUEST)  # first: pending when it goes on, it is answered before any more of its code runs
        if stopped:
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    else:
        limit = _monotonic() + _DUMP_GRACE
        size = -1
        while _monotonic() < limit:
            time.sleep(0.05)
            now = os.fstat(stack_file.fileno()).st_size
            if now and now == size:
                break
            size = now
    _reap_with_its_group(pid, kill=True)
    return os.pread(stack_file.fileno(), 1 << 20, 0).decode(errors="replace")


def _death(page: mmap.mmap | bytes, kind: str, detail: str, stacks: str) -> ChildDeath:
    _seq, _started, active, rank, step, bucket, running, length = _HEADER.unpack_from(page, 0)
    announced = None
    if length:
        try:
            announced = pickle.loads(bytes(page[_HEADER.size:_HEADER.size + length]))
        except Exception:  # noqa: BLE001 - torn by the death mid-write: nothing announced
            announced = None
    position = (rank, step, bucket) if rank >= 0 and announced is not None else None
    if not active:  # between examples: the last one returned (Monitor.end keeps its announcement)
        return ChildDeath(kind, detail, None, position, stacks, previous=announced)
    return ChildDeath(kind, detail, announced, position, stacks, running=running if running >= 0 else None)


# --------------------------------------------------------------------------- stacks
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
def _threads(dump: str) -> list[list[tuple[str, int, str]]]:
    """faulthandler's dump as a list of threads, each a list of (file, line, function),
    innermost frame first (faulthandler's order). A forked child's main thread stops at
    :func:`fork_child`: the frames outside it are the parent's caller (a CLI, or a test
    function — which, being user code, was once named as where a hung hook was stuck)."""
    return [frames for frames, _ in _threads_cut(dump)]


_DEEPER = "  ..."
"""What faulthandler writes after a thread's 100th frame when its stack goes deeper: the outer
frames are not in the dump."""


def _threads_cut(dump: str) -> list[tuple[list[tuple[str, int, str]], bool]]:
    """:func:`_threads`, each with whether faulthandler cut its stack (:data:`_DEEPER`)."""
    threads: list[tuple[list[tuple[str, int, str]], bool]] = []
    cut = False
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (")):  # the last: one thread's dump
            threads.append(([], False))
            cut = False
        elif threads and line.rstrip() == _DEEPER.rstrip() and not cut:
            threads[-1] = (threads[-1][0], True)
        elif threads and not cut and (match := _FRAME.match(line)):
            if match["func"] == "fork_child" and match["file"] == __file__:
                cut = True
                continue
            threads[-1][0].append((match["file"], int(match["line"]), match["func"]))
    return threads


def stuck_in(dump: str) -> str:
    """``spins (tests/hostile/hooks.py)``: the innermost user-code function of the stuck
    thread — stable run to run, unlike the line a spinning loop happened to be on when
    sampled; ``''`` when no user code is on the stack."""
    threads = _threads(dump)
    for thread in sorted(threads, key=_parked_by_simcluster):
        for path, _, func in thread:
            if not is_internal(path):
                return f"{func} ({short_path(path)})"
    return ""


def format_stack(dump: str, *, limit: int = 8) -> str:
    """The stuck code's stack from a faulthandler dump, outermost call first, with source
    lines: the thread whose innermost frames are user code (not simcluster, torch, the
    standard library), else the thread that was running. ``''`` for an empty dump."""
    cut_threads = _threads_cut(dump)
    threads = [frames for frames, _ in cut_threads]
    if not threads:
        return ""
    with_user = [t for t in threads if any(not is_internal(f) for f, _, _ in t)]
    # a thread parked by simcluster (waiting its turn inside a simulated wait) is not the stuck one
    running = [t for t in with_user if not _parked_by_simcluster(t)]
    chosen = (running or with_user or threads)[0 if (running or with_user) else -1]
    deeper = next(cut for frames, cut in cut_threads if frames is chosen)
    user = [i for i, (f, _, _) in enumerate(chosen) if not is_internal(f)]
    if user:  # the innermost run of user frames, and up to 3 library frames it called into
        end = user[0]
        while end + 1 < len(chosen) and not is_internal(chosen[end + 1][0]):
            end += 1
        deeper = deeper and end + 1 == len(chosen)  # the run of user frames reaches the cut
        chosen = chosen[max(0, user[0] - 3): end + 1]
    # a recursion once, said so: the sample of a deep recursion was eight copies of its
    # recursing line (an audit of reports)
    collapsed = collapse_recursions(chosen[::-1])
    lines = []
    if deeper or len(collapsed) > limit:
        lines.append("    … (outer calls not shown: " + ("the stack is deeper than the 100 frames a sample "
                     "holds)" if deeper else f"{len(collapsed) - limit} more)"))
    for (path, lineno, func), cycle in collapsed[-limit:]:
        lines.append(f"    {short_path(path)}:{lineno} in {func}" + (recursion_mark(cycle) if cycle else ""))
        source = linecache.getline(path, lineno).strip()
        if source:
            lines.append(f"        {source}")
    return "\n".join(lines)


def _parked_by_simcluster(thread: list[tuple[str, int, str]]) -> bool:
    """Whether the innermost frames (inside the innermost user frame) are simcluster's."""
    for path, _, _ in thread:
        if not is_internal(path):
            return False
        if is_simcluster_code(path):
            return True
    return False


def raise_site(exc: BaseException) -> str:
    """`` (rank 0, at hostile.py:3 in hook: sys.exit(0))``: the rank simcluster noted
    and the innermost frame of user code in ``exc``'s traceback; ``''`` if neither."""
    parts = []
    for note in getattr(exc, "__notes__", ()):
        match = re.search(r"raised on rank (\d+)", note)
        if match:
            parts.append(f"rank {match[1]}")
            break
    frames = user_frames(exc, limit=1)
    if frames:
        parts.append(f"at {frames[0]}")
    return f" ({', '.join(parts)})" if parts else ""
