"""What a simulated rank owns besides torch's world: its Python and numpy RNGs, and the
process-wide settings it must not change behind the other ranks' backs.

A real rank is a process; Python's ``random`` module and numpy's legacy global generator
(``numpy.random.rand``, ``numpy.random.seed``, …) are its own, as is torch's default
generator (swapped by :mod:`simcluster.fake.rank_context`). Here every rank gets its own
``random.Random`` and ``numpy.random.RandomState``, seeded by the cluster's ``rng=`` policy
exactly like torch's (``per_rank``: ``seed + rank``; ``same``: ``seed``) — the streams of
``random.seed(seed + rank)`` / ``numpy.random.seed(seed + rank)`` in a real process.

How: during a run (and only then) the module-level functions of ``random`` and
``numpy.random`` — bound methods of one hidden global instance — are replaced by small
dispatchers that call the *current rank's* generator (:data:`CURRENT`, set at every rank
switch; outside a rank: the process's own global generator, untouched). A switch thus
costs two attribute stores, not a state copy (``random.getstate``/``setstate`` cost
~15 µs, numpy's ``get_state``/``set_state`` ~120 µs: measured, see ``docs/isolation.md``).
Each rank's generators are created on its first draw.

Limits (documented in ``docs/isolation.md``): a function captured *before* the run
(``from random import choice`` in a module imported the ordinary way, i.e. not a per-rank
copy) is the shared generator's bound method and bypasses the dispatch; unseeded
generators made by user code (``random.Random()``, ``numpy.random.default_rng()``) draw
from OS entropy on a real process and here alike.

:class:`SettingsAudit` watches the process-wide settings a rank cannot own in one process
(``torch.set_default_dtype``, ``torch.set_num_threads``, deterministic-algorithm and
matmul-precision flags, ``torch.backends.cudnn`` flags, ``warnings`` filters,
``os.environ``): a change made while a rank's code ran is undone before any other rank
runs and reported after the run as a :class:`SharedSettingError` naming the setting, the
rank and both values.
"""

from __future__ import annotations

import operator
import os
import random
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from simcluster.errors import SharedSettingError

__all__ = ["CURRENT", "RankGenerators", "SettingsAudit", "install_generators", "restore_generators"]

try:  # numpy is optional for simcluster, but torch installs it almost always
    import numpy.random as _np_random
    import numpy.random.mtrand as _np_mtrand
except ImportError:  # pragma: no cover - no numpy: nothing to swap
    _np_random = None  # type: ignore[assignment]
    _np_mtrand = None  # type: ignore[assignment]


class _Current:
    """Which rank's code runs now: set by :meth:`RankContexts.switch` at every hand-over."""

    __slots__ = ("generators", "rank", "modules", "announce")

    def __init__(self) -> None:
        self.generators: RankGenerators | None = None
        self.rank: int | None = None
        self.modules: dict[str, Any] | None = None  # the running rank's module copies (rank_local)
        self.announce: Callable[[int], None] | None = None
        """Told each rank that starts running (a supervised child's ``Monitor.running``: a
        process that dies is placed at the rank whose code ran); None: nobody listens."""


CURRENT = _Current()
"""The running rank (``None`` outside a run) and its per-rank registries."""


class RankGenerators:
    """Every rank's ``random.Random`` and ``numpy.random.RandomState`` for one cluster."""

    def __init__(self, world_size: int, seed: int, rng: str) -> None:
        self.seeds = [seed + (r if rng == "per_rank" else 0) for r in range(world_size)]
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
            gen = self._numpy[rank] = _np_random.RandomState(self.seeds[rank] % 2**32)
        return gen


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


def _targets() -> list[tuple[Any, str, Callable[..., Any]]]:
    """(module, attribute, dispatcher) for every module-level function of a hidden global generator."""
    out = [(random, name, _dispatcher(_python_generator, name, name))
           for name in sorted(vars(random))
           if getattr(getattr(random, name), "__self__", None) is random._inst]  # type: ignore[attr-defined]
    if _np_random is not None:
        names = {name: name for name in sorted(vars(_np_random))
                 if getattr(getattr(_np_random, name), "__self__", None) is _np_mtrand._rand}
        names.update(seed="seed", ranf="random_sample", sample="random_sample")
        out += [(_np_random, name, _dispatcher(_numpy_generator, method, name)) for name, method in names.items()]
    return out


_TARGETS = _targets()
def _getter(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """``namespace -> tuple of namespace[name] for names``, in C (``operator.itemgetter``)."""
    if len(names) == 1:
        one = operator.itemgetter(names[0])
        return lambda namespace: (one(namespace),)
    return operator.itemgetter(*names)


_BY_MODULE: list[tuple[dict[str, Any], dict[str, Callable[..., Any]], tuple[str, ...], Callable[[Any], Any]]] = [
    (namespace, dispatchers, tuple(dispatchers), _getter(tuple(dispatchers)))
    for namespace, dispatchers in (
        (vars(owner), {name: dispatch for o, name, dispatch in _TARGETS if o is owner})
        for owner in dict.fromkeys(owner for owner, _, _ in _TARGETS)
    )
]
"""Per patched module: its namespace, the dispatchers to install in it, their names and
a C getter of the names' current values (one ``dict.update`` per module and run instead
of ~140 ``setattr`` calls, and the originals read without a Python loop: docs/speed.md)."""


_ORIGINALS: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [None] * len(_BY_MODULE)
"""Per patched module: the originals last read and the same as a dict, reused while they
are equal (one C ``dict.update`` restores them: half the cost of ``update(zip(...))``).
Equal here means the same module-level functions (bound methods compare equal only for the
same instance and function), so what is put back behaves as what was there."""


def install_generators() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Install the per-rank dispatchers of ``random`` and ``numpy.random``; returns what
    :func:`restore_generators` puts back (a run calls the pair around its ranks' code)."""
    saved = []
    for index, (namespace, dispatchers, names, get) in enumerate(_BY_MODULE):
        originals = get(namespace)
        cached = _ORIGINALS[index]
        if cached is None or cached[0] != originals:  # changed since the last run (or the first run)
            cached = _ORIGINALS[index] = (originals, dict(zip(names, originals)))
        saved.append((namespace, cached[1]))
        namespace.update(dispatchers)
    return saved


def restore_generators(saved: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Put back the originals :func:`install_generators` replaced."""
    for namespace, originals in saved:
        namespace.update(originals)


# --------------------------------------------------------------------------- settings
def _cudnn() -> tuple[bool, bool]:
    # what torch.backends.cudnn.deterministic / .benchmark read, without their property
    # machinery (7x cheaper: this runs at every rank switch)
    return torch._C._get_cudnn_deterministic(), torch._C._get_cudnn_benchmark()


def _set_cudnn(value: tuple[bool, bool]) -> None:
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = value


def _filters() -> tuple[int, Any]:
    filters = warnings.filters
    return len(filters), filters[0] if filters else None


_SETTINGS: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...] = (
    ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
    ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
    ("torch.are_deterministic_algorithms_enabled()", torch.are_deterministic_algorithms_enabled,
     torch.use_deterministic_algorithms),
    ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("torch.backends.cudnn (deterministic, benchmark)", _cudnn, _set_cudnn),
)


_C = torch._C
_get_default_dtype, _get_num_threads = torch.get_default_dtype, torch.get_num_threads  # C functions already


def _all_settings() -> tuple[Any, ...]:
    """Every ``_SETTINGS`` getter's value in one tuple, read through torch's C functions
    directly (the fast path of :meth:`SettingsAudit.check`, run at every rank switch)."""
    return (_get_default_dtype(), _get_num_threads(), _C._get_deterministic_algorithms(),
            _C._get_float32_matmul_precision(), (_C._get_cudnn_deterministic(), _C._get_cudnn_benchmark()))


class SettingsAudit:
    """Snapshots the shared settings when a run starts; checks them whenever a rank's code
    stops running; undoes a change at once and remembers the first one for the report."""

    def __init__(self) -> None:
        self._all: tuple[Any, ...] = ()
        self._filters: list[Any] = []
        self._environ: dict[Any, Any] = {}
        self.changes: list[tuple[str, int, str, str]] = []  # (setting, rank, before, after)

    def start(self) -> None:
        """Snapshot every watched setting (once per run, when the first rank enters)."""
        self._all = _all_settings()  # the same values _SETTINGS' getters read (through torch's wrappers)
        self._filters = list(warnings.filters)
        self._filter_key = _filters()
        self._modules = len(sys.modules)
        self._environ = dict(os.environ._data)  # type: ignore[attr-defined]
        if self.changes:  # a new list only after a run that saw a change (the report keeps the old one)
            self.changes = []

    def check(self, rank: int) -> None:
        """Called when rank ``rank``'s code stops running (cheap when nothing changed)."""
        if _all_settings() != self._all:
            self._check_settings(rank)
        if _filters() != self._filter_key:
            self._check_filters(rank)
        if os.environ._data != self._environ:  # type: ignore[attr-defined]
            self._check_environ(rank)
        self._modules = len(sys.modules)

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
            self._filters, self._filter_key = list(now), _filters()
            return
        self.changes.append(("warnings.filters", rank, f"{len(self._filters)} filters",
                             f"{len(now)} filters, first {now[:1]!r}"))
        warnings.filters[:] = self._filters
        warnings._filters_mutated()  # type: ignore[attr-defined]

    def _check_settings(self, rank: int) -> None:
        for (name, get, put), before in zip(_SETTINGS, self._all):
            now = get()
            if now != before:
                self.changes.append((name, rank, repr(before), repr(now)))
                put(before)

    def raise_if_changed(self, replay: Callable[[], str]) -> None:
        """Raise :class:`SharedSettingError` for the first change seen in the run, if any."""
        if not self.changes:
            return
        name, rank, before, after = self.changes[0]
        what = f"changed {after}" if name == "os.environ" else f"changed {name} from {before} to {after}"
        more = f" ({len(self.changes) - 1} more change(s) after it)" if len(self.changes) > 1 else ""
        raise SharedSettingError(
            f"rank {rank} {what} while its code ran{more}: simulated ranks share this process-wide setting, so "
            "the other ranks would see it (on a real cluster each process has its own); simcluster undid it and "
            f"cannot check this hook faithfully — set it before training starts, not in the hook. Replay: {replay()}")


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
