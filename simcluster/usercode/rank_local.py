"""Per-rank copies of the code under test: every simulated rank imports the hook's module itself.

A real rank is a process, and every process imports the hook's module for itself: module
globals — call counters, residual dicts, caches, a module-level ``random.Random(1234)`` —
are its own. A :class:`RankLocal` gives simulated ranks the same: it names a callable by
the CLI's spelling, ``"path/to/file.py:name"`` or ``"package.module:name"``, and

* called inside a :class:`~simcluster.SimCluster` run, it calls the **running rank's own
  copy** of the callable's module, loaded the first time that rank calls it (inside the
  rank, with the rank's RNGs and process group in place, as a process imports its code);
* called outside any run, it calls the ordinary, shared module (imported once, normally).

Each cluster has its own copies (a fresh cluster is a fresh set of processes): under
``simcluster check`` every example builds fresh clusters, so no module state leaks from one
example into the next, and a replay starts from the same module state. Copies are kept by
module name per rank, so a hook and a state factory of the same file share rank ``r``'s
copy — ``isinstance`` between them works, as in one process.

What is copied per rank: the callable's module and every module named in ``isolate``
(import names, e.g. ``("mypkg.helpers",)``): while a rank's copy loads, those names are
taken out of ``sys.modules`` (or replaced by the rank's copies), so the import statements
of the copy load fresh ones, then everything is put back. What stays **shared** by every
rank: every other module — torch, numpy, the standard library, simcluster itself, C
extensions, and the target's own imports not named in ``isolate``. A target inside torch,
numpy, simcluster or the standard library is never copied. Attribute chains through a
shared package (``mypkg.helpers.x`` after ``import mypkg.helpers``) reach the shared
module; bind what you isolate by name (``from mypkg import helpers``).

A hook passed as a plain function object is not copied: its module is shared by every rank.

>>> hook = RankLocal("simcluster.hooks.reference:mean_allreduce_hook")
>>> hook.__name__, hook.spec
('mean_allreduce_hook', 'simcluster.hooks.reference:mean_allreduce_hook')
"""

from __future__ import annotations

import copy
import importlib.machinery
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from simcluster.errors import TargetLoadError, UsageError
from simcluster.fake.state import StateSpec
from simcluster.usercode.rank_state import CURRENT, imports_set_the_baseline
from simcluster.usercode.stand_in import StandIn
from simcluster.usercode.targets import (exec_file, file_path, import_module, is_file_spec, load_target, module_name_for,
                                         split_spec)

__all__ = ["RankLocal", "as_rank_local", "rank_local_state", "own_copies", "parse_isolate", "SHARED_PACKAGES"]

SHARED_PACKAGES = frozenset({"torch", "numpy", "simcluster", "hypothesis", "pytest", "_pytest"})
"""Top-level packages never copied per rank (with the standard library)."""

_ABSENT = object()
_CODE: dict[tuple[str, str], tuple[float, Any]] = {}
_LOADING = threading.RLock()
"""Held while a rank's copies load: a load swaps names in the process-wide ``sys.modules``.
Ranks that load at once (real DDP's rank threads under ``simcluster e2e``) otherwise take
each other's half-executed copies. A module whose import waits on another rank (a
collective at import time) would wait holding it; real processes import apart."""


class _CachedSourceLoader(importlib.machinery.SourceFileLoader):
    """A source loader that compiles each file once per process (per modification time):
    a rank's copy then costs an ``exec`` of the module body, not a compile.

    Not for a file that may use ``torch.compile`` (its source mentions ``compile`` or
    ``dynamo``): Dynamo keeps what it compiled on the *code object* and installs the names
    its rewritten bytecode loads (``__compiled_fn_3``, ``__resume_at_…``) in the globals of
    the first module that ran it; a second copy sharing the code object runs that bytecode
    with its own globals and raises ``NameError: name '__compiled_fn_3' is not defined``
    (a false alarm on a hook from the wild, round 13). Such a file gets fresh code objects
    for every copy (unmarshalled from the bytecode cache: still no compile)."""

    def get_code(self, fullname: str) -> Any:
        key = (fullname, str(self.path))
        mtime = os.stat(self.path).st_mtime
        hit = _CODE.get(key)
        if hit is None or hit[0] != mtime:
            shared = _MAY_COMPILE.search(self.get_data(str(self.path))) is None
            hit = _CODE[key] = (mtime, super().get_code(fullname) if shared else None)
        return hit[1] if hit[1] is not None else super().get_code(fullname)


_MAY_COMPILE = re.compile(rb"compile|dynamo")
"""Words in a file's source that mean its code objects must not be shared by rank copies."""


class _CachedFinder:
    """On ``sys.meta_path`` while a rank's copies load: the copied modules get the cached loader."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _CachedSourceLoader(fullname, spec.loader.path)
        return spec


def parse_isolate(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"a.b,c"`` or ``["a.b", "c"]`` → ``("a.b", "c")``; each a dotted module name.

    >>> parse_isolate("mypkg.helpers, mypkg.state")
    ('mypkg.helpers', 'mypkg.state')
    """
    if value is None:
        return ()
    parts = [p.strip() for p in (value.split(",") if isinstance(value, str) else value)]
    for part in parts:
        if not isinstance(part, str) or not part or not all(x.isidentifier() for x in part.split(".")):
            raise UsageError(f"--isolate {value!r}: {part!r} is not a module name (e.g. mypkg.helpers)")
        if not _copyable(part):
            raise UsageError(f"--isolate {value!r}: {part} is part of {part.split('.')[0]}, which every rank "
                             "shares (torch, numpy, simcluster and the standard library are never copied)")
    return tuple(dict.fromkeys(parts))


def _copyable(module_name: str) -> bool:
    top = module_name.partition(".")[0]
    return top not in SHARED_PACKAGES and top not in sys.stdlib_module_names


class RankLocal(StandIn):
    """A callable named by ``spec`` whose module every simulated rank loads for itself.

    ``isolate``: more modules to copy per rank (import names). ``what`` names the thing in
    load errors (``"TARGET"``, ``"--state factory"``). The spec is loaded once here, the
    ordinary way, so a bad spec fails at once with a one-line :class:`TargetLoadError`.
    It looks like the callable (a :class:`~simcluster.usercode.stand_in.StandIn`):
    ``__name__``, ``__qualname__``, ``__module__`` and ``__doc__`` are the callable's — one
    the callable lacks (a ``functools.partial``'s ``__name__``) it lacks too, as real DDP's
    ``register_comm_hook`` would find — and ``inspect.signature`` sees its signature.
    """

    def __init__(self, spec: str, *, isolate: Sequence[str] | str | None = (), what: str = "TARGET") -> None:
        self.spec, self.what = spec, what
        self.isolate = parse_isolate(isolate)
        self.shared = load_target(spec, what=what)
        where, self._attr = split_spec(spec, what)
        self._path: Path | None = file_path(where, spec, what) if is_file_spec(where) else None
        self._module = module_name_for(self._path) if self._path is not None else where
        self.per_rank = self._path is not None or _copyable(where)
        self._key = f"{spec}|{','.join(self.isolate)}"
        super().__init__(self.shared)

    def __repr__(self) -> str:
        extra = f", isolate={self.isolate!r}" if self.isolate else ""
        return f"RankLocal({self.spec!r}{extra})"

    @property
    def portable_spec(self) -> str:
        """The spec with a file's path made absolute (for another process with another cwd)."""
        return self.spec if self._path is None else f"{self._path}:{self._attr}"

    def portable(self) -> RankLocal:
        """This callable spelled by :attr:`portable_spec` (a file's path absolute), as
        ``RankLocal(self.portable_spec)`` would be, without loading the spec again."""
        if self.portable_spec == self.spec:
            return self
        twin = copy.copy(self)
        twin.spec = self.portable_spec
        twin._key = f"{twin.spec}|{','.join(self.isolate)}"
        return twin

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        modules = CURRENT.modules
        if modules is None or not self.per_rank:
            return self.shared(*args, **kwargs)
        fn = modules.get(self._key)
        if fn is None:
            fn = modules[self._key] = self.load(modules)
        return fn(*args, **kwargs)

    def load(self, modules: dict[str, Any]) -> Callable[..., Any]:
        """The callable from the copies in ``modules`` (one rank's registry), loading what is missing."""
        if not self.per_rank:
            return self.shared
        module = _load_into(modules, self._module, self._path, self.isolate, self.spec, self.what)
        obj: Any = module
        for part in self._attr.split("."):
            obj = getattr(obj, part)
        return obj

    def fresh(self) -> Callable[..., Any]:
        """The callable from a brand-new copy of its module (what a new process would import)."""
        return self.load({})


def as_rank_local(obj: Any, *, isolate: Sequence[str] | str | None = (), what: str = "TARGET") -> Any:
    """A spec string becomes a :class:`RankLocal`; anything else (a callable, a word) is returned as is."""
    return RankLocal(obj, isolate=isolate, what=what) if isinstance(obj, str) else obj


def rank_local_state(state: Any, *, isolate: Sequence[str] | str | None = ()) -> StateSpec:
    """``state=`` parsed once, a ``module:factory`` / ``file.py:factory`` string loaded as a
    :class:`RankLocal` (each rank calls its own copy); a given ``RankLocal`` goes by its spec.
    Shared loading (one copy for every rank) is :func:`~simcluster.usercode.targets.load_state`."""
    return StateSpec.parse(state, load=lambda spec: RankLocal(spec, isolate=isolate, what="--state factory"),
                           name=state.spec if isinstance(state, RankLocal) else None)


def own_copies(hook: RankLocal, state: StateSpec,
               modules: dict[str, Any] | None = None) -> tuple[Callable[..., Any], StateSpec]:
    """The hook and its state as one process imports them: the hook, and a :class:`RankLocal`
    state factory, from the copies in ``modules`` (default: brand-new ones) — one registry,
    so a hook and a factory of the same file come from one copy, as in one process. Other
    states are returned as they are. A simulated rank passes its own registry; a real rank
    that a persistent gloo process runs job after job passes none, so every job starts from
    fresh module globals (of the hook's module and the ``isolate`` modules), as a fresh
    process would."""
    modules = {} if modules is None else modules
    if state.kind == "factory" and isinstance(state.factory, RankLocal):
        state = StateSpec.parse(state.factory.load(modules), name=state.name)
    return hook.load(modules), state


def _load_into(modules: dict[str, Any], name: str, path: Path | None, isolate: tuple[str, ...],
               spec: str, what: str) -> ModuleType:
    """Load ``name`` (and, through its imports, the ``isolate`` modules) as copies into
    ``modules``, with a private ``sys.modules`` view while it runs; restore everything after."""
    with _LOADING:
        if name not in modules:
            with imports_set_the_baseline():  # what its import changes, every process's import does
                _load_copies(modules, name, path, isolate, spec, what)
        module = modules[name]
    if not isinstance(module, ModuleType):  # pragma: no cover - import_module always gives a module
        raise TargetLoadError(f"{what} {spec!r}: {name} did not load as a module")
    return module


def _load_copies(modules: dict[str, Any], name: str, path: Path | None, isolate: tuple[str, ...],
                 spec: str, what: str) -> None:
    """:func:`_load_into`'s work, under its lock: ``name`` and the ``isolate`` modules it
    imports, loaded fresh into ``modules``."""
    names = (name, *(n for n in isolate if n != name))
    saved = {n: sys.modules.get(n, _ABSENT) for n in names}
    finder = _CachedFinder(names)
    sys.meta_path.insert(0, finder)
    try:
        for n in names:
            if n in modules:
                sys.modules[n] = modules[n]
            else:
                sys.modules.pop(n, None)
            # ``from pkg import helpers`` reads the attribute of the shared package first
            _set_parent_attribute(n, modules.get(n, _ABSENT))
        if path is not None:
            modules[name] = exec_file(name, path, spec, what, loader=_CachedSourceLoader(name, str(path)))
        else:
            modules[name] = import_module(name, spec, what)
        for n in names:
            if n not in modules and n in sys.modules:
                modules[n] = sys.modules[n]
        _require_modules([n for n in isolate if n not in modules], path)
    finally:
        sys.meta_path.remove(finder)
        for n, original in saved.items():
            if original is _ABSENT:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = original
            _restore_parent_attribute(n, original)


def _require_modules(names: list[str], path: Path | None) -> None:
    """An ``isolate`` name the target did not import must at least name a module (looked up as
    the target's import would: its folder first): a typo isolated nothing, silently."""
    import importlib.util

    folder = [str(path.parent)] if path is not None else []
    sys.path[:0] = folder
    try:
        for n in names:
            try:
                found = importlib.util.find_spec(n)
            except (ImportError, ValueError):
                found = None
            if found is None:
                raise TargetLoadError(f"--isolate {n}: no module named {n!r}"
                                      + (f" (looked in {folder[0]} and sys.path)" if folder else ""))
    finally:
        del sys.path[:len(folder)]


def _set_parent_attribute(name: str, value: Any) -> None:
    """Point ``parent.child`` at ``value`` (remove it for ``_ABSENT``), if the parent is loaded."""
    parent_name, _, child = name.rpartition(".")
    parent = sys.modules.get(parent_name) if parent_name else None
    if parent is None:
        return
    if value is not _ABSENT:
        setattr(parent, child, value)
    elif child in vars(parent):
        delattr(parent, child)


def _restore_parent_attribute(name: str, original: Any) -> None:
    """The import system set ``parent.child`` to the copy it loaded: point it back."""
    _set_parent_attribute(name, original)
