"""What a simulated rank owns besides torch's world: its Python and numpy RNGs, and the
process-wide settings it must not change behind the other ranks' backs.

A real rank is a process; Python's ``random`` module and numpy's legacy global generator
(``numpy.random.rand``, ``numpy.random.seed``, …) are its own, as is torch's default
generator (swapped by :mod:`simcluster.fake.rank_context`). Here every rank gets its own
``random.Random`` and ``numpy.random.RandomState``, seeded by the cluster's ``rng=`` policy
exactly like torch's (``per_rank``: ``seed + rank``; ``same``: ``seed``) — the streams of
``random.seed(seed + rank)`` / ``numpy.random.seed(seed + rank)`` in a real process.

How: during a run (and only then) the module-level functions of ``random`` and
``numpy.random`` — bound methods of one hidden global instance — are answered by small
dispatchers that call the *current rank's* generator (:data:`CURRENT`, set at every rank
switch; outside a rank: the process's own global generator, untouched): the module's
class is swapped for the run's length, so every lookup through the module finds them
(:class:`_Dispatching`); its dict keeps the process's own functions. A switch thus
costs two attribute stores, not a state copy (``random.getstate``/``setstate`` cost
~15 µs, numpy's ``get_state``/``set_state`` ~120 µs: measured, see ``docs/isolation.md``).
Each rank's generators are created on its first draw.

Limits (documented in ``docs/isolation.md``): a function captured *before* the run
(``from random import choice`` in a module imported the ordinary way, i.e. not a per-rank
copy) is the shared generator's bound method and bypasses the dispatch; unseeded
generators made by user code (``random.Random()``, ``numpy.random.default_rng()``) draw
from OS entropy on a real process and here alike.

:class:`SettingsAudit` watches the process-wide settings a rank cannot own in one process
(``torch.set_default_dtype``, ``torch.set_num_threads``, deterministic-algorithm flags
with ``warn_only``, matmul precision, ``torch.backends.cudnn`` flags, ``warnings`` filters,
``os.environ``) and the thread-wide ones ranks share when they run on one OS thread
(``torch.set_flush_denormal``, ``torch.set_default_device``): a change made while a rank's
code ran is undone before any other rank runs and reported after the run as a
:class:`SharedSettingError` naming the setting, the rank and both values. Settings that
cost more to read or that hooks rarely touch (``os.getcwd()``, ``sys.path``, the recursion
limit, anomaly mode, ``sys.stdout``/``sys.stderr``, mkldnn/nnpack/fill flags) are compared
when the run starts and ends: reported for the run, not a rank (``docs/isolation.md``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import _signal
import random
import resource
import signal
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from threading import get_ident as _get_ident
from typing import Any

import torch

from simcluster.engine.frames import is_internal, short_path
from simcluster.errors import SharedSettingError

__all__ = ["CURRENT", "RankGenerators", "SettingsAudit", "install_generators", "restore_generators",
           "install_process_ids", "restore_process_ids", "SIMULATED_PID_BASE", "process_handlers_held",
           "ModulePatch", "apply_module_patches", "undo_module_patches", "checking_process_kept",
           "process_generator_states", "rank_seed", "seed_process_generators"]

try:  # numpy is optional for simcluster, but torch installs it almost always
    import numpy.random as _np_random
    import numpy.random.mtrand as _np_mtrand
except ImportError:  # pragma: no cover - no numpy: nothing to swap
    _np_random = None  # type: ignore[assignment]
    _np_mtrand = None  # type: ignore[assignment]


class _Current:
    """Which rank's code runs now: set by :meth:`RankContexts.switch` at every hand-over."""

    __slots__ = ("generators", "rank", "modules", "patches", "announce", "audit", "exits", "unmodelled")

    def __init__(self) -> None:
        self.generators: RankGenerators | None = None
        self.rank: int | None = None
        self.modules: dict[str, Any] | None = None  # the running rank's module copies (rank_local)
        self.patches: list[ModulePatch] | None = None
        """The running rank's own values of torch's module attributes: what its module copies'
        imports replaced (:func:`imports_set_the_baseline`); None outside a rank."""
        self.announce: Callable[[int], None] | None = None
        """Told each rank that starts running (a supervised child's ``Monitor.running``: a
        process that dies is placed at the rank whose code ran); None: nobody listens."""
        self.audit: SettingsAudit | None = None
        """The settings audit of the run in progress (None between runs): module copies
        loaded inside a run tell it what their import changed (:func:`imports_set_the_baseline`)."""
        self.exits: list[BaseException] = []
        """Every ``os._exit`` the code under test called in the run in progress, as the error
        raised in its place (a supervised child's: the call cannot end a rank that is not a
        process): a run whose code caught that error — ``except Exception``, a ``__del__``,
        a finalizer, a thread — still ends as a failure (``SimCluster`` reports it)."""
        self.unmodelled: list[BaseException] = []
        """Every ``UnsupportedError`` a call of the code under test got in the run in progress
        (``recv`` from any source, ``monitored_barrier``, …): caught or not, the run has no
        verdict (``SimCluster`` raises the first) — a hook that caught one went on as no real
        rank would, and its deadlock was reported as a finding."""


CURRENT = _Current()
"""The running rank (``None`` outside a run) and its per-rank registries."""


def rank_seed(seed: int, rank: int, rng: str = "per_rank") -> int:
    """The seed of rank ``rank``'s generators — torch's default one, Python's ``random``,
    numpy's legacy one — in a run seeded ``seed``: ``seed + rank`` with ``rng="per_rank"``
    (each process seeds its own, as a launcher script does with its rank), ``seed`` on
    every rank with ``"same"``. The one rule, for simulated ranks (:class:`RankGenerators`,
    the cluster's torch states) and real ones (:func:`seed_process_generators`)."""
    return seed + rank if rng == "per_rank" else seed


def _numpy_seed(seed: int) -> int:
    """numpy's legacy generator takes seeds below 2**32 only: the rank's seed, folded."""
    return seed % 2**32


class RankGenerators:
    """Every rank's ``random.Random`` and ``numpy.random.RandomState`` for one cluster."""

    def __init__(self, world_size: int, seed: int, rng: str) -> None:
        self.seeds = [rank_seed(seed, r, rng) for r in range(world_size)]
        self._python: list[random.Random | None] = [None] * world_size
        self._numpy: list[Any] = [None] * world_size

    def python(self, rank: int) -> random.Random:
        """Rank ``rank``'s ``random`` generator (seeded on first use)."""
        gen = self._python[rank]
        if gen is None:
            gen = self._python[rank] = random.Random(self.seeds[rank])
        return gen

    def numpy(self, rank: int) -> Any:
        """Rank ``rank``'s legacy ``numpy.random.RandomState`` (seeded on first use)."""
        gen = self._numpy[rank]
        if gen is None:
            gen = self._numpy[rank] = _np_random.RandomState(_numpy_seed(self.seeds[rank]))
        return gen


def process_generator_states() -> tuple[Any, Any, Any]:
    """The states of a process's global generators — torch's default CPU one, Python's
    ``random``, numpy's legacy one (``None`` without numpy): what a real rank owns, and what
    a comparison with real processes watches for draws."""
    return (torch.get_rng_state(), random.getstate(),
            _np_random.get_state() if _np_random is not None else None)


def seed_process_generators(seed: int, rank: int) -> None:
    """Seed a real process's global generators — torch's, Python's ``random``, numpy's
    legacy one — as simulated rank ``rank``'s are in a run seeded ``seed`` (:func:`rank_seed`)."""
    mine = rank_seed(seed, rank)
    torch.manual_seed(mine)
    random.seed(mine)
    if _np_random is not None:
        _np_random.seed(_numpy_seed(mine))


def _python_generator() -> Any:
    gens, rank = CURRENT.generators, CURRENT.rank
    return random._inst if gens is None or rank is None else gens.python(rank)  # type: ignore[attr-defined]


def _numpy_generator() -> Any:
    gens, rank = CURRENT.generators, CURRENT.rank
    return _np_mtrand._rand if gens is None or rank is None else gens.numpy(rank)


def _dispatcher(get: Callable[[], Any], method: str, name: str) -> Callable[..., Any]:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return getattr(get(), method)(*args, **kwargs)

    dispatch.__name__ = dispatch.__qualname__ = name
    dispatch.__doc__ = f"simcluster: the running simulated rank's own {method} (see simcluster.usercode.rank_state)"
    return dispatch


def _targets() -> list[tuple[Any, dict[str, Callable[..., Any]]]]:
    """Per module, its dispatchers: one for every module-level function of a hidden global generator."""
    out = [(random, {name: _dispatcher(_python_generator, name, name) for name in sorted(vars(random))
                     if getattr(getattr(random, name), "__self__", None) is random._inst})]  # type: ignore[attr-defined]
    if _np_random is not None:
        names = {name: name for name in sorted(vars(_np_random))
                 if getattr(getattr(_np_random, name), "__self__", None) is _np_mtrand._rand}
        names.update(seed="seed", ranf="random_sample", sample="random_sample")
        out.append((_np_random, {name: _dispatcher(_numpy_generator, method, name) for name, method in names.items()}))
    return out


_MISSING = object()
"""What :class:`_Dispatching` remembers for a name a rank assigned that the module did not have."""


class _Dispatching:
    """How one module (``random`` or ``numpy.random``) answers its generator functions with
    the running rank's dispatchers during a run: the module's class is swapped, for the
    run, for a subclass of its own whose attribute lookup returns the dispatcher for those
    names (``random.random``, ``from numpy.random import rand``, ``getattr``: every lookup
    through the module object) and anything else from the module as usual.

    Two class assignments per module and run, where storing and restoring the ~70
    attributes themselves cost ~55,000 CPU instructions a run (docs/speed.md, stop 29).
    The module's dict keeps the process's own functions throughout (``vars(random)``, a
    function captured before the run: the shared generator's, as before). A name a rank's
    code assigns during the run (``random.seed = f``) is the rank's value from then on and
    the value from before the run is put back when it ends; assigned between runs, it is
    the process's value again after the next run (inside a run, the rank's generator)."""

    def __init__(self, module: Any, dispatchers: dict[str, Callable[..., Any]]) -> None:
        self.module = module
        self.dispatchers = dispatchers
        self.assigned: dict[str, Any] = {}
        """Names rank code assigned or deleted during this run -> the module's value before (or :data:`_MISSING`)."""
        self._classes: dict[type, type] = {}

    def class_for(self, base: type) -> type:
        """The dispatching subclass of ``base`` (the module's class before the run), made once
        per base. (The making is a method of its own: a function defining closures builds its
        cells at every call, ~3,000 instructions a run on this hot path.)"""
        return self._classes.get(base) or self._make_class(base)

    def _make_class(self, base: type) -> type:
        """Make and keep :meth:`class_for`'s class for ``base``."""
        dispatchers, assigned = self.dispatchers, self.assigned
        plain_get, plain_set, plain_del = base.__getattribute__, base.__setattr__, base.__delattr__

        def remember(module: Any, name: str) -> None:
            if name in dispatchers and name not in assigned:
                assigned[name] = plain_get(module, "__dict__").get(name, _MISSING)

        class Dispatching(base):  # type: ignore[valid-type, misc]
            def __getattribute__(self, name: str) -> Any:
                found = dispatchers.get(name)
                if found is None or name in assigned:
                    return plain_get(self, name)
                return found

            def __setattr__(self, name: str, value: Any) -> None:
                remember(self, name)
                plain_set(self, name, value)

            def __delattr__(self, name: str) -> None:
                remember(self, name)
                plain_del(self, name)

        Dispatching.__name__ = Dispatching.__qualname__ = base.__name__  # repr and messages unchanged
        self._classes[base] = Dispatching
        return Dispatching

    def put_back(self) -> None:
        """Undo what rank code assigned or deleted during the run (see :attr:`assigned`)."""
        namespace = vars(self.module)
        for name, value in self.assigned.items():
            if value is _MISSING:
                namespace.pop(name, None)
            else:
                namespace[name] = value
        self.assigned.clear()


_MODULES = [_Dispatching(module, dispatchers) for module, dispatchers in _targets()]
_set_class = object.__dict__["__class__"].__set__
"""``obj.__class__ = cls`` as one C call, past a dispatching class's own ``__setattr__``."""

Installed = list[tuple[_Dispatching, type]]
"""What :func:`install_generators` changed: each patched module's dispatching and its class before."""


def install_generators() -> Installed:
    """Make ``random`` and ``numpy.random`` answer with the per-rank dispatchers; returns what
    :func:`restore_generators` puts back (a run calls the pair around its ranks' code)."""
    installed: Installed = []
    try:
        for patched in _MODULES:
            before = type(patched.module)
            _set_class(patched.module, patched.class_for(before))
            installed.append((patched, before))
    except BaseException:
        restore_generators(installed)
        raise
    return installed


def restore_generators(installed: Installed) -> None:
    """Give the modules :func:`install_generators` patched their own class and values back."""
    for patched, before in installed:
        _set_class(patched.module, before)
        if patched.assigned:
            patched.put_back()


# --------------------------------------------------------------------------- process ids
SIMULATED_PID_BASE = 4_200_000
"""Rank ``r``'s ``os.getpid()`` during a run is ``SIMULATED_PID_BASE + r``: each rank a process
of its own, as on a cluster — a hook seeding a generator from its pid, a per-worker idiom,
draws the same numbers on every simulated rank otherwise, and its replicas agree where real
gloo's drift apart (an audit of hostile hooks; ``simcluster e2e`` exit 4). The same numbers
every run, so a replay repeats; above Linux's largest pid (2**22 = 4,194,304), so none is
another process's: ``os.kill`` of one signals this process (:func:`simulated_kill`)."""

SIMULATED_PARENT_PID = SIMULATED_PID_BASE - 1
"""Every rank's ``os.getppid()`` during a run: the process that started the ranks (a launcher
such as torchrun's agent), simulated. A hook's ``os.kill(os.getppid(), SIGKILL)`` killed the
real parent — the checking process, with no report (exit 137: an audit of hostile hooks,
2026-12-07); on a cluster it ends the rank's job, so it signals the process the ranks run
in (:func:`simulated_kill`), whose death the supervisor reports with the hook call it came in."""

_real_getpid, _real_getppid, _real_kill = os.getpid, os.getppid, os.kill


def simulated_getpid() -> int:
    """``os.getpid()`` during a run: the running rank's simulated pid (the real one outside rank code)."""
    rank = CURRENT.rank
    return _real_getpid() if rank is None else SIMULATED_PID_BASE + rank


def simulated_getppid() -> int:
    """``os.getppid()`` during a run: :data:`SIMULATED_PARENT_PID` in rank code (the real one outside it)."""
    return _real_getppid() if CURRENT.rank is None else SIMULATED_PARENT_PID


def simulated_kill(pid: int, sig: int) -> None:
    """``os.kill`` during a run: a rank's simulated pid, and the ranks' simulated parent's, is
    this process (a hook that signals itself, or its launcher, signals the process it runs in)."""
    if SIMULATED_PARENT_PID <= pid < SIMULATED_PID_BASE + 2**20:
        pid = _real_getpid()
    _real_kill(pid, sig)


def install_process_ids() -> tuple[Any, ...]:
    """Give ``os.getpid``, ``os.getppid`` and ``os.kill`` their per-rank stand-ins, and the exit
    and fork handler registries theirs (:func:`process_handlers_held`); returns the originals."""
    saved = os.getpid, os.getppid, os.kill, _hold_process_handlers()
    os.getpid, os.getppid, os.kill = simulated_getpid, simulated_getppid, simulated_kill
    return saved


def restore_process_ids(saved: tuple[Any, ...]) -> None:
    os.getpid, os.getppid, os.kill, handlers = saved
    _release_process_handlers(handlers)


_real_register, _real_unregister, _real_register_at_fork = atexit.register, atexit.unregister, os.register_at_fork
_FORK_HANDLER_KINDS = ("before", "after_in_child", "after_in_parent")


def _held_register(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """``atexit.register`` while held: a call from the code under test is checked as the real
    one checks it and never run; one from Python's library, torch or simcluster (``weakref``,
    ``multiprocessing`` registering their own at first use) is registered for real."""
    if is_internal(sys._getframe(1).f_code.co_filename):
        return _real_register(func, *args, **kwargs)
    if not callable(func):
        raise TypeError("the first argument must be callable")
    return func


def _held_unregister(func: Callable[..., Any], /) -> None:
    """``atexit.unregister`` while held: the code under test's handlers were never registered."""
    if is_internal(sys._getframe(1).f_code.co_filename):
        _real_unregister(func)


def _held_register_at_fork(**handlers: Any) -> None:
    """``os.register_at_fork`` while held: a call from the code under test is checked as the
    real one checks it and never registered; one from Python's library, torch or simcluster is."""
    if is_internal(sys._getframe(1).f_code.co_filename):
        return _real_register_at_fork(**handlers)
    if not handlers:
        raise TypeError("At least one argument is required.")
    for kind, handler in handlers.items():
        if kind not in _FORK_HANDLER_KINDS:
            raise TypeError(f"{kind!r} is an invalid keyword argument for register_at_fork()")
        if not callable(handler):
            raise TypeError(f"{kind!r} must be callable, not {type(handler).__name__}")
    return None


def _hold_process_handlers() -> tuple[Any, Any, Any]:
    """Swap in the held registries (:func:`process_handlers_held`); returns the ones replaced."""
    saved = atexit.register, atexit.unregister, os.register_at_fork
    atexit.register, atexit.unregister, os.register_at_fork = _held_register, _held_unregister, _held_register_at_fork
    return saved


def _release_process_handlers(saved: tuple[Any, Any, Any]) -> None:
    atexit.register, atexit.unregister, os.register_at_fork = saved


@contextlib.contextmanager
def process_handlers_held() -> Iterator[None]:
    """Keep the exit and fork handlers that code under test registers (``atexit.register(f)``,
    also as a decorator; ``os.register_at_fork(after_in_child=f)``) out of this process: each
    is accepted — checked, and refused, as the real functions do — and never run.

    A simulated rank's handlers belong to a process that, here, never exits and never forks:
    on a cluster each rank runs its exit handlers when its process ends, after training,
    where no verdict depends on them, and its fork handlers when *it* forks. Registered for
    real, they ran at the *checking* process's exit — one that ended it
    (``atexit.register(os._exit, 0)`` in a hook's module) made a failed ``simcluster check``
    exit 0 — and in every child it forked to check an example — one that ended the child
    made every example a liveness failure, "exited with code 0 without reporting" (an audit
    of hostile hooks, 2026-12-07). Held while a target module is imported
    (:mod:`simcluster.usercode.targets`) and during every run (:func:`install_process_ids`).
    A module that bound ``from atexit import register`` while held keeps the stand-in; one
    that bound the real function before is not covered."""
    saved = _hold_process_handlers()
    try:
        yield
    finally:
        _release_process_handlers(saved)


# --------------------------------------------------------------------------- settings
_C = torch._C


def _cudnn() -> tuple[bool, bool]:
    # what torch.backends.cudnn.deterministic / .benchmark read, without their property
    # machinery (7x cheaper: this runs at every rank switch)
    return torch._C._get_cudnn_deterministic(), torch._C._get_cudnn_benchmark()


def _set_cudnn(value: tuple[bool, bool]) -> None:
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = value


def _deterministic() -> bool | str:
    """``torch.are_deterministic_algorithms_enabled()``, or ``"warn_only"`` when enabled with
    ``warn_only=True``. The flag is read only while enabled: disabled, it has no effect (and
    enabling sets it anew: ``use_deterministic_algorithms(True)`` means ``warn_only=False``)."""
    return _C._get_deterministic_algorithms() and (
        "warn_only" if _C._get_deterministic_algorithms_warn_only() else True)


def _set_deterministic(value: bool | str) -> None:
    torch.use_deterministic_algorithms(bool(value), warn_only=value == "warn_only")


_SETTINGS: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...] = (
    ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
    ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
    ("torch.are_deterministic_algorithms_enabled()", _deterministic, _set_deterministic),
    ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("torch.backends.cudnn (deterministic, benchmark)", _cudnn, _set_cudnn),
)
"""The process-wide settings read at every rank switch: (name in reports, getter, setter
that undoes a change). :func:`_all_settings` reads the same values in one tuple, in this
order, then the calling thread's own (flush-denormal, torch function mode depth). A read
costs ~300-450 instructions (callgrind: ``benchmarks/measure_shared_settings.py``), paid
16 times per world-8 step: what else is watched is read once per run
(:data:`_RUN_SETTINGS`)."""


def _set_anomaly(value: bool | tuple[bool, bool]) -> None:
    if value:
        torch.set_anomaly_enabled(True, value[1])  # type: ignore[index]
    else:
        torch.set_anomaly_enabled(False)


def _set_streams(value: tuple[Any, Any]) -> None:
    sys.stdout, sys.stderr = value


_OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _tracing() -> tuple[Any, Any]:
    """The thread's trace and profile functions, None for simcluster's own (``explain``'s
    line tracer, :class:`~simcluster.engine.write_watch.WriteWatch`, is set and taken back
    around the rank code it watches)."""
    def code_under_test(function: Any) -> Any:
        code = getattr(function, "__code__", None) or getattr(getattr(function, "__func__", None), "__code__", None)
        return None if code is not None and code.co_filename.startswith(_OWN_CODE) else function
    trace, profile = sys.gettrace(), sys.getprofile()
    return (trace and code_under_test(trace), profile and code_under_test(profile))


def _set_tracing(value: tuple[Any, Any]) -> None:
    """Put the thread's trace and profile functions back (a hook that left one that raises
    broke simcluster's own code after the run: an audit of hostile hooks, 2026-12-07)."""
    sys.settrace(value[0])
    sys.setprofile(value[1])


def _error_hooks() -> tuple[Any, Any, Any]:
    """What prints an uncaught or unraisable exception: ``sys.excepthook``,
    ``sys.unraisablehook``, ``threading.excepthook`` (torch's ``init_process_group`` wraps the
    first to prefix ``[rankN]:``; a supervised child caps the second's output)."""
    return sys.excepthook, sys.unraisablehook, threading.excepthook


def _set_error_hooks(value: tuple[Any, Any, Any]) -> None:
    sys.excepthook, sys.unraisablehook, threading.excepthook = value


_SIGNALS = tuple(int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGHUP, signal.SIGUSR1,
                             signal.SIGUSR2, signal.SIGCHLD, signal.SIGPIPE, signal.SIGQUIT))
"""The signals whose handlers the run's end compares (what a hook plausibly installs)."""


def _signal_handlers() -> tuple[Any, ...]:
    """The handlers, as ``_signal.getsignal`` gives them (``signal.getsignal`` wraps each in an
    enum: 11 µs for the nine, against 0.7)."""
    return tuple(map(_signal.getsignal, _SIGNALS))


def _function_name(function: Any) -> str:
    """A hook, tracer or signal handler in a report, never an address: ``None``, ``SIG_DFL``,
    ``SIG_IGN`` (a signal's built-in handlers are numbers), or its qualified name."""
    if function is None:
        return "None"
    if isinstance(function, int):
        return signal.Handlers(function).name
    return getattr(function, "__qualname__", None) or type(function).__qualname__


def _set_signal_handlers(value: tuple[Any, ...]) -> None:
    """Put the handlers back — from the main thread only, as Python allows (a run on another
    thread: its ranks could not set one either, ``signal.signal`` refuses them)."""
    if threading.current_thread() is threading.main_thread():
        for number, handler in zip(_SIGNALS, value):
            if handler is not None:  # None: installed outside Python, nothing Python can put back
                signal.signal(number, handler)


class _Timer:
    """An interval timer as read (``signal.getitimer``): equal to another when both are off, or
    both armed with the same interval — its time left moves by itself."""

    __slots__ = ("left", "interval")

    def __init__(self, left: float, interval: float) -> None:
        self.left, self.interval = left, interval

    @property
    def armed(self) -> bool:
        return self.left > 0 or self.interval > 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Timer) and self.armed == other.armed and self.interval == other.interval

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "off" if not self.armed else "armed" + (f" every {self.interval:g} s" if self.interval else "")


def _set_timer(timer: _Timer) -> None:
    """Put the wall-clock timer back as last read: off, or armed with the time it had left then
    (a test runner's timeout — pytest-timeout's signal method — a little longer than it was)."""
    signal.setitimer(signal.ITIMER_REAL, timer.left, timer.interval)


_LIMITS = tuple((name, getattr(resource, name)) for name in
                ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NOFILE") if hasattr(resource, name))


_LIMIT_NUMBERS = tuple(which for _, which in _LIMITS)


def _set_limits(value: tuple[tuple[int, int], ...]) -> None:
    """Put each limit back where the process may (a lowered hard limit needs privileges to raise)."""
    for (_, which), limit in zip(_LIMITS, value):
        with contextlib.suppress(ValueError, OSError):
            if resource.getrlimit(which) != limit:
                resource.setrlimit(which, limit)


def _set_path(value: tuple[list[str], tuple[str, ...]]) -> None:
    listed, entries = value
    listed[:] = entries  # the same list object as before the run (a rank may have replaced it)
    sys.path = listed


_RUN_SETTINGS: tuple[tuple[str, Callable[[Any], None]], ...] = (
    ("os.getcwd()", os.chdir),
    ("sys.path", _set_path),
    ("sys.getrecursionlimit()", sys.setrecursionlimit),
    ("torch.is_anomaly_enabled() (and check_nan, while enabled)", _set_anomaly),
    ("sys.stdout, sys.stderr", _set_streams),
    ("torch.backends.mkldnn.enabled", torch._C._set_mkldnn_enabled),
    ("torch.backends.nnpack (torch._C._get_nnpack_enabled())", torch._C._set_nnpack_enabled),
    ("torch.utils.deterministic.fill_uninitialized_memory", torch._C._set_deterministic_fill_uninitialized_memory),
    ("sys.gettrace(), sys.getprofile() (the run's thread)", _set_tracing),
    ("sys.excepthook, sys.unraisablehook, threading.excepthook", _set_error_hooks),
    ("signal handlers (signal.getsignal)", _set_signal_handlers),
)
"""The settings read when a run starts and when it ends, not at every rank switch: (name,
setter that undoes a change), in :func:`_run_settings`' order. ``os.getcwd()`` is a system
call (245 ns, ~1,300 instructions); the others are process-wide flags a hook has rarely a
reason to touch, each read at every switch would add ~0.2 % to a world-8 step. A change is
reported for the run ("a rank changed … during the run"), not for a rank, and undone
when the run ends: the run is void either way."""


_LAZY_SETTINGS: tuple[tuple[str, Callable[[Any], None]], ...] = (
    ("interval timers (signal.setitimer, signal.alarm)", _set_timer),
    ("resource limits (resource.getrlimit)", _set_limits),
)
"""Settings read when a run *ends* only (:func:`_lazy_settings`), compared with what the
previous read found (the cluster's first run's start, then each end, and around each import
of a rank's module copies): four system calls, ~3 µs — read at both ends of every run they
would cost a world-2 tiny step ~5 %. A change made between two runs by code outside them is
reported for the next run. (name, setter that undoes a change)."""


_getitimer, _getrlimit = signal.getitimer, resource.getrlimit
_OFF = _Timer(0.0, 0.0)


def _lazy_settings() -> tuple[Any, ...]:
    """The values of :data:`_LAZY_SETTINGS`, in order: the wall-clock interval timer
    (``ITIMER_REAL``, which ``signal.alarm`` arms too; the CPU-time ones, profilers', are not
    read) as a :class:`_Timer` — one a hook arms goes off in a later example, or in the
    harness's own code, a death no replay repeats — and the process's
    resource limits (``resource.getrlimit``) — a CPU-time limit a hook sets kills the process
    after a second of everyone's work, a verdict that depends on the machine's speed (both
    from an audit of hostile hooks)."""
    left, interval = _getitimer(signal.ITIMER_REAL)
    return _OFF if left == interval == 0.0 else _Timer(left, interval), tuple(map(_getrlimit, _LIMIT_NUMBERS))


def _run_settings() -> tuple[Any, ...]:
    """The values of :data:`_RUN_SETTINGS`, in order (C getters called directly)."""
    return (os.getcwd(), (sys.path, tuple(sys.path)), sys.getrecursionlimit(),
            _C.is_anomaly_enabled() and (True, _C.is_anomaly_check_nan_enabled()), (sys.stdout, sys.stderr),
            _C._get_mkldnn_enabled(), _C._get_nnpack_enabled(), _C._get_deterministic_fill_uninitialized_memory(),
            _tracing(), _error_hooks(), _signal_handlers())


_get_default_dtype, _get_num_threads = torch.get_default_dtype, torch.get_num_threads  # C functions already
_TINY = 5e-324  # the smallest float64 subnormal
_DEVICE = torch._GLOBAL_DEVICE_CONTEXT  # a threading.local: torch.set_default_device's context
_modes = _C._len_torch_function_stack
_PROCESS = len(_SETTINGS)
"""Where :func:`_all_settings`' per-thread values start: ``5e-324 > 0.0`` (False: the
thread flushes subnormals), the torch function mode depth."""
_FLUSH_NAME = "torch.set_flush_denormal (the thread's DAZ/FTZ bits)"
_DEVICE_NAME = "torch.get_default_device()"
_NEW_THREAD = -1
"""A thread's last rank when no rank's code ran on it yet in this run."""


def _all_settings() -> tuple[Any, ...]:
    """Every ``_SETTINGS`` getter's value, then the calling thread's own settings, in one
    flat tuple read through torch's C functions directly (the fast path of
    :meth:`SettingsAudit.check`, run at every rank switch: one comparison when nothing
    changed).

    The thread's own: torch has no getter for ``set_flush_denormal``; it sets the calling
    thread's x86 MXCSR FTZ and DAZ bits, which Python's floats obey too: with DAZ, a
    subnormal operand counts as zero, so ``5e-324 > 0.0`` is False exactly when they are
    set (one comparison, no arithmetic; valgrind ignores the bits: under
    ``count_instructions.py`` the probe reads True). ``torch.set_default_device`` pushes a
    torch function mode, as ``with torch.device(...)`` does: the mode depth (one C call)
    catches both; a default device replaced by another while one was already set keeps
    the depth and is missed."""
    return (_get_default_dtype(), _get_num_threads(),
            _C._get_deterministic_algorithms() and (
                "warn_only" if _C._get_deterministic_algorithms_warn_only() else True),
            _C._get_float32_matmul_precision(), (_C._get_cudnn_deterministic(), _C._get_cudnn_benchmark()),
            _TINY > 0.0, _modes())


def _device_context() -> Any:
    """The calling thread's ``torch.set_default_device`` context (None: none set)."""
    return _DEVICE.__dict__.get("device_context")  # through getattr, a missing attribute costs 340 ns


def _set_thread_settings(before: tuple[bool, int, Any]) -> None:
    """Undo a change of the calling thread's own settings: flush-denormal, the default
    device, a ``with torch.device(...)`` (or other torch function mode) entered and not left."""
    keeps_subnormals, depth, context = before
    torch.set_flush_denormal(not keeps_subnormals)
    if _device_context() is not context:
        torch.set_default_device(None if context is None else context.device)
    while _modes() > depth:
        _C._pop_torch_function_stack()


def _mutation_stamp(mapping: dict[Any, Any]) -> Callable[[], int] | None:
    """A reader of ``mapping``'s mutation stamp, or None where the interpreter has none we trust.

    CPython 3.11 and 3.12 give every dict a version tag (PEP 509, ``ma_version_tag``, right
    after the object header and ``ma_used``) that changes at every insertion, replacement by
    another object or deletion. Reading it through ``ctypes`` costs ~60 ns, where comparing
    ``os.environ._data`` with the run's snapshot costs ~5 k instructions (one lookup per
    variable; 2.8 % of a W=8 tiny step, done at every rank switch). The layout is checked on a
    fresh dict before it is trusted (its entry count where ``ma_used`` should be, a stamp that
    moves when an item is set and again when it is replaced); anything else — another
    interpreter, another version, a failed check — gets None and the plain comparison.
    The caller keeps ``mapping`` alive while it reads (the reader points into its memory).
    """
    if sys.implementation.name != "cpython" or sys.version_info[:2] not in ((3, 11), (3, 12)):
        return None
    try:
        probe: dict[str, object] = {}
        used = ctypes.c_ssize_t.from_address(id(probe) + 2 * ctypes.sizeof(ctypes.c_void_p))
        stamp = ctypes.c_uint64.from_address(id(probe) + 3 * ctypes.sizeof(ctypes.c_void_p))
        before = stamp.value
        probe["set"] = 1
        after_set = stamp.value
        probe["set"] = object()
        if used.value != 1 or len(probe) != 1 or after_set == before or stamp.value == after_set:
            return None
    except (ValueError, OSError):  # pragma: no cover - defensive: ctypes refused the address
        return None
    tag = ctypes.c_uint64.from_address(id(mapping) + 3 * ctypes.sizeof(ctypes.c_void_p))
    return lambda: tag.value


WATCHED_MODULES = ("torch.distributed", "torch.futures")
"""Modules whose attributes a hook might replace for every rank (``dist.all_reduce = wrapped``,
``torch.futures.Future = Mine``), compared when a run starts and ends (:class:`_WatchedModule`)."""

_MISSING = object()


class _WatchedModule:
    """One of :data:`WATCHED_MODULES`: its attributes when the run started, to tell at the end
    which a rank replaced, added or deleted — shared by every simulated rank, a patch one rank
    made is every rank's (an audit of hostile hooks: rank 0 alone wrapping ``dist.all_reduce``
    passed where real gloo disagreed). The namespace's mutation stamp (:func:`_mutation_stamp`)
    makes a run that changed nothing cost two reads; the snapshot is taken again only when the
    namespace moved between runs (the run's own patches of ``dist.new_group`` and
    ``torch.futures.Future`` are installed before the audit starts and undone after it ends)."""

    __slots__ = ("name", "namespace", "stamp", "seen", "snapshot")

    def __init__(self, name: str, namespace: dict[str, Any] | None = None) -> None:
        self.name = name
        self.namespace: dict[str, Any] = sys.modules[name].__dict__ if namespace is None else namespace
        self.stamp = _mutation_stamp(self.namespace)
        self.seen: int | None = None
        self.snapshot: dict[str, Any] = {}

    def start(self) -> None:
        now = self.stamp() if self.stamp is not None else None
        if now is None or now != self.seen:
            self.snapshot, self.seen = dict(self.namespace), now

    def _named(self, key: str) -> str:
        return f"{self.name}[{key!r}]" if self.name == "sys.modules" else f"{self.name}.{key}"

    def accept(self, before: dict[str, Any]) -> None:
        """What an import changed since ``before`` (its namespace then) is the baseline — unless
        a rank had already changed that attribute before the import: still to be reported."""
        if self.stamp is not None and self.stamp() == self.seen:
            return
        namespace, snapshot = self.namespace, self.snapshot
        for key in {*before, *namespace}:
            was, now = before.get(key, _MISSING), namespace.get(key, _MISSING)
            if now is not was and snapshot.get(key, _MISSING) is was:
                if now is _MISSING:
                    del snapshot[key]
                else:
                    snapshot[key] = now

    def finish(self, imported: bool) -> list[tuple[str, None, str, str]]:
        """What changed since :meth:`start`, undone (attributes an import added while the
        run imported modules stay: what that import does in every process)."""
        if self.stamp is not None and self.stamp() == self.seen:
            return []
        namespace, snapshot = self.namespace, self.snapshot
        found: list[tuple[str, None, str, str]] = []
        for key, was in snapshot.items():
            now = namespace.get(key, _MISSING)
            if now is not was:
                found.append((self._named(key), None, _attribute_name(was), _attribute_name(now)))
                namespace[key] = was
        for key in [k for k in namespace if k not in snapshot]:
            if not imported and not isinstance(namespace[key], types.ModuleType):
                found.append((self._named(key), None, "(not set)", _attribute_name(namespace[key])))
                del namespace[key]
        self.snapshot = dict(namespace)
        self.seen = self.stamp() if self.stamp is not None else None
        return found


def _attribute_name(value: Any) -> str:
    """A module attribute's value in a report, never an address: a function of the code under
    test by name and line (``patches_all_reduce.<locals>.wrapped at hooks.py:9``: its module is
    a rank's private copy, whose name means nothing), others by module and qualified name."""
    if value is _MISSING:
        return "(deleted)"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    name = getattr(value, "__qualname__", None)
    if not isinstance(name, str):
        return f"a {type(value).__qualname__}"
    code = getattr(value, "__code__", None)
    if code is not None and not is_internal(code.co_filename):
        return f"{name} at {short_path(code.co_filename)}:{code.co_firstlineno}"
    module = getattr(value, "__module__", None)
    return f"{module}.{name}" if isinstance(module, str) else name


class SettingsAudit:
    """Snapshots the shared settings when a run starts; checks them whenever a rank's code
    stops running; undoes a change at once and remembers the first one for the report.

    Three kinds, by what reading them costs and where they live:

    - process-wide settings read at every rank switch (:data:`_SETTINGS`,
      ``warnings.filters``, ``os.environ``), blamed on the rank that stops running;
    - the OS thread's own (flush-denormal, default device: the end of
      :func:`_all_settings`), which ranks share when their code runs on the same thread —
      the engine runs every rank on the caller's thread until one waits on a pending
      future. Read at every switch, on the thread about to run the next rank's code, and
      blamed on the rank whose code last ran *on that thread*; not reported when that rank
      is the one resuming there (a change it made before it waited was seen by nobody
      else: its thread was parked);
    - :data:`_RUN_SETTINGS` (``os.getcwd()``, ``sys.path``, the recursion limit, anomaly
      mode, …): read when the run starts and when it ends; a change is reported for the
      run, not for a rank.
    """

    def __init__(self) -> None:
        self._all: tuple[Any, ...] = ()
        self._run: tuple[Any, ...] = ()
        self._filters: list[Any] = []
        self._environ: dict[Any, Any] = {}
        self._environ_data: dict[Any, Any] | None = None
        """``os.environ._data`` when the run started (held: :attr:`_environ_stamp` reads its memory)."""
        self._environ_stamp: Callable[[], int] | None = None
        """Reads :attr:`_environ_data`'s mutation stamp (:func:`_mutation_stamp`), or None: compare it."""
        self._environ_seen = 0
        """The stamp when ``os.environ`` last matched the snapshot."""
        self._thread = 0
        """The OS thread the last switch happened on (the last rank entered runs there)."""
        self._home: tuple[bool, int, Any] = (True, 0, None)
        """The run's first thread's own settings: keeps subnormals, mode depth, default device."""
        self._thread_base: dict[int, tuple[bool, int, Any]] = {}
        """A pooled thread whose own settings differed from :attr:`_home` when it first ran
        rank code (the caller had set a default device: a new thread has none): its own."""
        self._thread_last: dict[int, int] = {}
        """Per OS thread left for another: the rank whose code last ran on it."""
        self.changes: list[tuple[str, int | None, str, str]] = []  # (setting, rank or None: the run, before, after)
        self._watched = [*(_WatchedModule(name) for name in WATCHED_MODULES),
                         _WatchedModule("sys.modules", sys.modules)]  # sys.modules["numpy"] = None: every rank's
        self._lazy: tuple[Any, ...] | None = None
        """:data:`_LAZY_SETTINGS` as last read (None: not yet)."""
        self._modules_at_start = 0

    def start(self) -> None:
        """Snapshot every watched setting (once per run, when the first rank enters)."""
        self._all = _all_settings()  # the same values _SETTINGS' getters read (through torch's wrappers)
        self._run = _run_settings()
        self._filters = list(warnings.filters)
        self._modules = self._modules_at_start = len(sys.modules)
        for module in self._watched:
            module.start()
        if self._lazy is None:
            self._lazy = _lazy_settings()
        self._environ = dict(os.environ._data)  # type: ignore[attr-defined]
        if self._environ_data is not os.environ._data:  # type: ignore[attr-defined]  # once per process, as a rule
            self._environ_data = os.environ._data  # type: ignore[attr-defined]
            self._environ_stamp = _mutation_stamp(self._environ_data)
        self.environ_synced()
        self._thread = _get_ident()
        self._home = (*self._all[_PROCESS:], _device_context() if self._all[-1] else None)  # no mode: no device
        CURRENT.audit = self
        if self._thread_last:  # new dicts only after a run whose ranks ran on several threads
            self._thread_base, self._thread_last = {}, {}
        if self.changes:  # a new list only after a run that saw a change (the report keeps the old one)
            self.changes = []

    def check(self, rank: int, new: int | None) -> None:
        """Called when rank ``rank``'s code stops running and ``new``'s (None: nobody's, the
        run ends) is about to, on the thread that will run it (cheap when nothing changed)."""
        thread = _get_ident()
        here = rank if thread == self._thread else self._moved(thread, rank)
        if _all_settings() != self._all:
            self._check_settings(rank, new, thread, here)
        if warnings.filters != self._filters:  # every filter (identical ones compare by identity: ~0.1 µs)
            self._check_filters(rank)
        data = os.environ._data  # type: ignore[attr-defined]
        if data is not self._environ_data or self._environ_stamp is None or self._environ_stamp() != self._environ_seen:
            if data != self._environ:
                self._check_environ(rank)
            self.environ_synced()
        self._modules = len(sys.modules)

    def environ_synced(self) -> None:
        """``os.environ`` matches the snapshot now (the run's start, a change undone, the
        launcher model's own writes for the entering rank): remember its mutation stamp, so
        :meth:`check` compares the two again only after something writes to it."""
        if self._environ_stamp is not None and os.environ._data is self._environ_data:  # type: ignore[attr-defined]
            self._environ_seen = self._environ_stamp()

    def watched_namespaces(self) -> list[dict[str, Any]]:
        """A copy of each :data:`WATCHED_MODULES` namespace, as :meth:`accept_import_changes` takes it."""
        return [dict(module.namespace) for module in self._watched]

    def accept_import_changes(self, before: tuple[Any, ...], after: tuple[Any, ...],
                              namespaces: list[dict[str, Any]] | None = None,
                              lazy: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None) -> None:
        """The run-level settings that changed from ``before`` to ``after`` while module copies
        were imported take their new values as the run's baseline (:func:`imports_set_the_baseline`)
        — unless the setting had already moved off the baseline before the import (a rank's
        call changed it): that change is still to be reported, the import's with it."""
        self._run = _imported_baseline(self._run, before, after)
        for module, was in zip(self._watched, namespaces or ()):  # a hook file wrapping dist.all_reduce at its top
            module.accept(was)
        if lazy is not None and self._lazy is not None:
            self._lazy = _imported_baseline(self._lazy, *lazy)

    def _moved(self, thread: int, rank: int) -> int:
        """This switch happens on another thread than the last one (rank ``rank``'s code
        waited, or finished and the thread woke a waiting rank's): remember that ``rank``'s
        code ran last on the thread left, and say whose code ran last on this one."""
        self._thread_last[self._thread] = rank
        self._thread = thread
        return self._thread_last.get(thread, _NEW_THREAD)

    def finish(self) -> None:
        """The run ended: compare the settings read once per run (:data:`_RUN_SETTINGS`)."""
        if CURRENT.audit is self:
            CURRENT.audit = None
        self._undo(_RUN_SETTINGS, self._run, _run_settings())
        imported = len(sys.modules) > self._modules_at_start
        for module in self._watched:
            self.changes += module.finish(imported)
        if self._lazy is not None:
            self._undo(_LAZY_SETTINGS, self._lazy, _lazy_settings())

    def _undo(self, settings: tuple[tuple[str, Callable[[Any], None]], ...], was: tuple[Any, ...],
              now: tuple[Any, ...]) -> None:
        """Each of ``settings`` (name, setter) whose value moved from ``was`` to ``now``: reported
        for the run, and put back."""
        if now != was:
            for (name, put), before, value in zip(settings, was, now):
                if value != before:
                    self.changes.append((name, None, *_describe(name, before, value)))
                    put(before)

    def _check_settings(self, rank: int, new: int | None, thread: int, here: int) -> None:
        """Something in :func:`_all_settings` differs from the run's start. Process-wide:
        blamed on ``rank``, whose code stops running. The thread's own: blamed on ``here``,
        the rank whose code last ran on this thread."""
        now, before = _all_settings(), self._all
        for (name, get, put), was, value in zip(_SETTINGS, before, now):
            if value != was:
                self.changes.append((name, rank, repr(was), repr(get())))
                put(was)
        mine = now[_PROCESS:]
        if here == _NEW_THREAD:  # a pooled thread's first rank code: started when ``rank``'s code waited.
            # Function modes (the default device) are per thread, a new one has none: its
            # own baseline. The flush-denormal bits it inherited (pthread) from ``rank``'s thread.
            base = self._thread_base[thread] = (before[_PROCESS], mine[1], _device_context())
            here = rank
        else:
            base = self._thread_base.get(thread, self._home)
        if mine != base[:2] and here != new:  # else: a rank resumes on its own thread, where nobody else ran
            found = []
            if mine[0] != base[0]:
                found.append((_FLUSH_NAME, here, repr(not base[0]), repr(not mine[0])))
            if mine[1] != base[1]:
                found.append((_DEVICE_NAME, here, str(getattr(base[2], "device", "cpu")),
                              f"{torch.get_default_device()} ({mine[1] - base[1]:+d} torch function mode(s))"))
            # once per rank: a thread started while the rank waited inherits its flush bits
            self.changes += [change for change in found if change not in self.changes]
            _set_thread_settings(base)

    def _check_environ(self, rank: int) -> None:
        """``os.environ`` changed while rank ``rank``'s code ran. Variables only added while
        modules were imported for the first time in this process are that import's doing in
        every process (torch's inductor, imported on the first optimizer step, sets
        ``TORCHINDUCTOR_CACHE_DIR``): the new baseline. Any other change is undone and reported."""
        now = os.environ._data  # type: ignore[attr-defined]
        if len(sys.modules) > self._modules and all(now.get(k) == v for k, v in self._environ.items()):
            self._environ = dict(now)
            return
        self.changes.append(("os.environ", rank, "", _environ_diff(self._environ)))
        self._restore_environ()

    @property
    def environ_baseline(self) -> dict[Any, Any]:
        """The run's ``os.environ._data`` snapshot that :meth:`check` compares with; the
        launcher model (:mod:`simcluster.fake.launcher`) moves its per-rank variables to the
        entering rank's values in it, so only a rank's own change is a change."""
        return self._environ

    def _restore_environ(self) -> None:
        """Put ``os.environ`` back to the baseline (a rank's change undone)."""
        for key in [k for k in os.environ if os.environ.encodekey(k) not in self._environ]:  # type: ignore[attr-defined]
            del os.environ[key]
        for key, value in self._environ.items():
            os.environ[os.environ.decodekey(key)] = os.environ.decodevalue(value)  # type: ignore[attr-defined]

    def _check_filters(self, rank: int) -> None:
        """``warnings.filters`` changed while rank ``rank``'s code ran. Filters only added
        while modules were imported for the first time in this process (the rank's own
        copies are not in ``sys.modules``) are what that import does in every process —
        torch imports sympy on the first optimizer step, adding a filter — so they become
        the new baseline. Any other change is the rank's own: undone and reported."""
        now = warnings.filters
        if len(sys.modules) > self._modules and _kept_in_order(self._filters, now):
            self._filters = list(now)
            return
        at = next((i for i, (was, new) in enumerate(zip(self._filters, now)) if was != new),
                  min(len(self._filters), len(now)))
        self.changes.append(("warnings.filters", rank, f"{len(self._filters)} filters",
                             f"{len(now)} filters" + (f", filter {at} now {now[at]!r}" if at < len(now) else "")))
        warnings.filters[:] = self._filters
        warnings._filters_mutated()  # type: ignore[attr-defined]

    def raise_if_changed(self, replay: Callable[[], str]) -> None:
        """Raise :class:`SharedSettingError` for the first change seen in the run, if any."""
        if not self.changes:
            return
        name, rank, before, after = self.changes[0]
        what = f"changed {after}" if name == "os.environ" else f"changed {name} from {before} to {after}"
        more = f" ({len(self.changes) - 1} more change(s) after it)" if len(self.changes) > 1 else ""
        who = (f"rank {rank} {what} while its code ran{more}" if rank is not None else
               f"a rank {what} during the run{more} (read when the run starts and ends, not at every rank "
               "switch: which rank is not known)")
        shared = ("this setting of the OS thread they run on" if name in (_FLUSH_NAME, _DEVICE_NAME)
                  else "this process-wide setting")
        raise SharedSettingError(
            f"{who}: simulated ranks share {shared}, so "
            "the other ranks would see it (on a real cluster each process has its own); simcluster undid it and "
            f"cannot check this hook faithfully — set it before training starts, not in the hook. Replay: {replay()}")


def _imported_baseline(base: tuple[Any, ...], before: tuple[Any, ...], after: tuple[Any, ...]) -> tuple[Any, ...]:
    """``base`` with each value an import moved from ``before`` to ``after`` taken as the new
    baseline — unless it had already moved off ``base`` before the import (a rank's call
    changed it: still to be reported)."""
    if after == before:
        return base
    return tuple(new if new != old and was == old else was for was, old, new in zip(base, before, after))


def _kept_in_order(before: list[Any], now: list[Any]) -> bool:
    """Every filter of ``before`` is still in ``now``, in the same order (others only added)."""
    rest = iter(now)
    return all(any(f is g or f == g for g in rest) for f in before)


def _environ_diff(before: dict[Any, Any]) -> str:
    now = os.environ._data  # type: ignore[attr-defined]
    keys = sorted({*before, *now} - {k for k in before if now.get(k) == before[k]})
    decode = os.environ.decodekey  # type: ignore[attr-defined]
    return "os.environ: " + ", ".join(
        f"{decode(k)} {'set' if k not in before else 'removed' if k not in now else 'modified'}" for k in keys[:5])


ModulePatch = tuple[dict[str, Any], str, Any, Any]
"""A rank's own value of an attribute of one of :data:`WATCHED_MODULES`: ``(namespace, name,
the rank's value, the value under it)`` — ``dist.all_reduce`` as a hook file's top wrapped it."""


def apply_module_patches(patches: list[ModulePatch]) -> None:
    """Give the module attributes the entering rank's own values (:class:`ModulePatch`)."""
    for namespace, name, mine, _ in patches:
        namespace[name] = mine


def undo_module_patches(patches: list[ModulePatch]) -> None:
    """Give the module attributes back the values under the leaving rank's (last patch first)."""
    for namespace, name, _, under in reversed(patches):
        namespace[name] = under


def _replaced(namespaces: list[dict[str, Any]], before: list[dict[str, Any]]) -> list[ModulePatch]:
    """The attributes of ``namespaces`` that hold another object than in ``before`` (added or
    deleted ones are not replacements: an import's new attribute is every process's)."""
    return [(namespace, name, namespace[name], was[name])
            for namespace, was in zip(namespaces, before) for name in was
            if name in namespace and namespace[name] is not was[name]]


@contextlib.contextmanager
def imports_set_the_baseline() -> Iterator[None]:
    """Around the import of a rank's module copies inside a run: a run-level setting
    (:data:`_RUN_SETTINGS`) the import changes — a hook module's ``sys.path.insert(0, here)``
    or ``sys.setrecursionlimit(…)`` at its top — is what that import does in every process,
    so the running audit takes the new value as its baseline instead of reporting it at the
    run's end (it did: a false ``SharedSettingError`` for a common way to write a hook file).
    An attribute of :data:`WATCHED_MODULES` the import *replaces* (a hook file that wraps
    ``dist.all_reduce`` at its top) is the importing rank's own: a process imports its code
    once, so each real rank runs one wrapper around torch's function. Shared, each rank's
    copy wrapped what the copy before it left, and every example's fresh copies wrapped
    again: a wrapper that divided by the world size divided W times, then more, and a correct
    hook failed *averages* (an audit of hostile hooks, 2026-12-07; real gloo: no failure).
    So the rank's value is undone for the others and kept as a :class:`ModulePatch` of that
    rank, put in place whenever its code runs (:meth:`RankContexts.switch`). An attribute the
    import adds is every process's. A change the hook makes when it is *called* is still
    reported. No run in progress: nothing to do (a TARGET's shared import, outside every
    run: :func:`checking_process_kept`)."""
    audit = CURRENT.audit
    before = _run_settings() if audit is not None else ()
    namespaces = audit.watched_namespaces() if audit is not None else None
    lazy = _lazy_settings() if audit is not None else ()
    try:
        yield
    finally:
        if audit is not None:
            patches = _replaced(_watched_namespaces(), namespaces or [])
            undo_module_patches(patches)  # what every other rank sees
            audit.accept_import_changes(before, _run_settings(), namespaces, (lazy, _lazy_settings()))
            if CURRENT.patches is not None:
                CURRENT.patches.extend(patches)
                apply_module_patches(patches)  # the importing rank goes on with its own


def _watched_namespaces() -> list[dict[str, Any]]:
    """The namespaces of :data:`WATCHED_MODULES`, in that order."""
    return [sys.modules[name].__dict__ for name in WATCHED_MODULES]


@contextlib.contextmanager
def checking_process_kept() -> Iterator[None]:
    """Around the import of a TARGET's (or state factory's) shared module, outside every run:
    what the checking process relies on is put back after it — the working directory,
    ``sys.stdout`` and ``sys.stderr``, the signal handlers (:data:`_SIGNALS`: Ctrl-C and
    SIGTERM stop a check) and the attributes of :data:`WATCHED_MODULES` it replaced. That
    import is the one place the checking process runs the code under test (all else runs
    in supervised children, or in runs, which audit it); each rank's copy
    imports the module again and keeps what its import did (:func:`imports_set_the_baseline`).
    Left in place, a module's ``sys.stdout = io.StringIO()`` swallowed the whole report (exit
    1, nothing on stdout), its ``os.chdir("/")`` made the next load of ``hooks.py:hook`` say
    "file not found" (exit 2), its ``signal.signal(SIGINT, SIG_IGN)`` left Ctrl-C without
    effect on the whole check, and its ``dist.all_reduce`` wrapper sat under every rank's own
    — two wrappers where a real rank runs one (an audit of hostile hooks, 2026-12-07). Code
    holding a plain function (not a TARGET string) was imported by its caller, whose process
    it is: untouched."""
    namespaces = _watched_namespaces()
    before = [dict(namespace) for namespace in namespaces]
    cwd, streams, handlers = os.getcwd(), (sys.stdout, sys.stderr), _signal_handlers()
    try:
        yield
    finally:
        undo_module_patches(_replaced(namespaces, before))
        sys.stdout, sys.stderr = streams
        if os.getcwd() != cwd:
            os.chdir(cwd)
        if _signal_handlers() != handlers:
            _set_signal_handlers(handlers)


def _describe(name: str, before: Any, now: Any) -> tuple[str, str]:
    """A run-level setting's two values as the report shows them: the same text in every
    run (no object addresses)."""
    if name == "sys.path":
        added = [p for p in now[1] if p not in before[1]]
        removed = [p for p in before[1] if p not in now[1]]
        what = f"added {added[:3]!r}" if added else f"removed {removed[:3]!r}" if removed else "reordered"
        return f"{len(before[1])} entries", f"{len(now[1])} entries, {what}"
    if name == "sys.stdout, sys.stderr":
        def streams(pair: tuple[Any, Any]) -> str:
            return ", ".join(type(s).__name__ + (f"({s.name!r})" if isinstance(getattr(s, "name", None), str) else "")
                             for s in pair)
        return f"({streams(before)})", f"({streams(now)})"
    if name.startswith("sys.gettrace()") or name.startswith("sys.excepthook"):
        return f"({', '.join(map(_function_name, before))})", f"({', '.join(map(_function_name, now))})"
    if name.startswith("interval timers"):
        return f"ITIMER_REAL: {before!r}", f"ITIMER_REAL: {now!r}"
    if name.startswith("resource limits"):
        changed = [i for i, (was, value) in enumerate(zip(before, now)) if was != value]
        return (", ".join(f"{_LIMITS[i][0]} {before[i]}" for i in changed),
                ", ".join(f"{_LIMITS[i][0]} {now[i]}" for i in changed))
    if name.startswith("signal handlers"):
        changed = [i for i, (was, value) in enumerate(zip(before, now)) if was != value]

        def handlers(value: tuple[Any, ...]) -> str:
            return ", ".join(f"{signal.Signals(_SIGNALS[i]).name}: {_function_name(value[i])}" for i in changed)
        return f"({handlers(before)})", f"({handlers(now)})"
    return repr(before), repr(now)
