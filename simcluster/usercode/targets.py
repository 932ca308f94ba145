"""Loading what the command line names: hooks, state factories, world sizes, parameter shapes.

A TARGET names one callable, in one of two spellings::

    package.module:name          # imported like ``import package.module``
    path/to/file.py:name         # executed from the file (its folder goes first on sys.path
                                 # while it loads, so it can import its siblings)

``name`` may be dotted (``module:Class.method``). Everything that can go wrong — no colon,
no such file, no such module, the module raising while it imports, no such attribute, an
attribute that is not callable — is raised as one :class:`~simcluster.errors.TargetLoadError`
whose message is a single line naming the target and the cause, so the CLI can print it
and exit 2 without a traceback.

**Old hooks load under any torch.** Hooks written for PyTorch 1.7–1.9 annotate their
bucket as ``dist._GradBucket``, which torch 2.x no longer has, and Python evaluates those
annotations when the ``def`` runs. While a target's module is being imported (and only
then), ``torch.distributed._GradBucket`` is provided as an alias of ``dist.GradBucket``
if torch lacks it; the alias is removed again afterwards, so nothing outside the import
sees it.

>>> load_target("simcluster.hooks.reference:mean_allreduce_hook").__name__
'mean_allreduce_hook'
>>> parse_world_sizes("1,2,4")
(1, 2, 4)
>>> parse_shapes("4x5,5,1000")
((4, 5), (5,), (1000,))
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from simcluster.errors import TargetLoadError, UsageError, first_line
from simcluster.fake.state import StateSpec
from simcluster.usercode.rank_state import checking_process_kept, process_handlers_held

__all__ = [
    "load_target",
    "load_state",
    "parse_world_sizes",
    "format_shapes",
    "parse_shapes",
    "legacy_aliases",
    "split_spec",
    "is_file_spec",
    "import_module",
    "file_path",
    "module_name_for",
    "exec_file",
]



@contextlib.contextmanager
def legacy_aliases() -> Iterator[None]:
    """Provide ``torch.distributed._GradBucket`` (the PyTorch 1.7–1.9 name) while importing.

    Does nothing when torch has the attribute; otherwise sets it to ``dist.GradBucket``
    and deletes it on exit, even if the import raised.
    """
    import torch.distributed as dist

    if hasattr(dist, "_GradBucket"):
        yield
        return
    dist._GradBucket = dist.GradBucket  # type: ignore[attr-defined]
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            delattr(dist, "_GradBucket")


def split_spec(spec: str, what: str) -> tuple[str, str]:
    """``(where, name)`` of a TARGET spec: the module or file before the last colon, the
    (possibly dotted) attribute name after it; a malformed spec is a :class:`TargetLoadError`.

    >>> split_spec("path/to/hooks.py:Hooks.mean", "TARGET")
    ('path/to/hooks.py', 'Hooks.mean')
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise TargetLoadError(
            f"{what} {spec!r} is not of the form package.module:name or path/to/file.py:name"
        )
    if not all(part.isidentifier() for part in name.split(".")):
        raise TargetLoadError(f"{what} {spec!r}: {name!r} is not a Python name")
    return where, name


def is_file_spec(where: str) -> bool:
    """Whether a spec's ``where`` names a file (ends in ``.py`` or has a path separator)
    rather than an importable module."""
    return where.endswith(".py") or "/" in where or "\\" in where


def import_module(where: str, spec: str, what: str) -> ModuleType:
    """``importlib.import_module(where)`` with the legacy aliases in place
    (:func:`legacy_aliases`); any failure is a one-line :class:`TargetLoadError` naming ``spec``."""
    try:
        with legacy_aliases(), process_handlers_held():
            return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (where == exc.name or where.startswith(exc.name + ".")):
            raise TargetLoadError(f"{what} {spec!r}: no module named {exc.name!r}") from None
        raise TargetLoadError(f"{what} {spec!r}: importing {where} failed: {first_line(exc, typed=True)}") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any error in the user's module is a load error
        raise TargetLoadError(f"{what} {spec!r}: importing {where} raised {first_line(exc, typed=True)}") from None


def module_name_for(path: Path) -> str:
    """A stable, unique module name for a file (the same file always gets the same name)."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    return f"simcluster_target_{stem}_{digest}"


def file_path(where: str, spec: str, what: str) -> Path:
    """The absolute, resolved path of the file ``where`` (``~`` expanded); a missing file is
    a :class:`TargetLoadError` naming ``spec``."""
    path = Path(where).expanduser()
    if not path.is_file():
        raise TargetLoadError(f"{what} {spec!r}: file not found: {where}")
    return path.resolve()


def _load_file(where: str, spec: str, what: str) -> ModuleType:
    path = file_path(where, spec, what)
    name = module_name_for(path)
    if name in sys.modules:  # loaded before in this process: same file, same module
        return sys.modules[name]
    return exec_file(name, path, spec, what)


def exec_file(name: str, path: Path, spec: str, what: str, loader: Any = None) -> ModuleType:
    """Execute the file ``path`` as a new module ``name`` (registered in ``sys.modules``, its
    folder first on ``sys.path`` while it runs); a failure is a one-line :class:`TargetLoadError`."""
    module_spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if module_spec is None or module_spec.loader is None:
        raise TargetLoadError(f"{what} {spec!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before executing, as the import system does: dataclasses and pickling
    # look modules up in sys.modules by name.
    sys.modules[name] = module
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        with legacy_aliases(), process_handlers_held():  # its exit and fork handlers are not this process's
            module_spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, (Exception, SystemExit)):
            raise
        line = ""
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == str(path):
                line = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
        raise TargetLoadError(f"{what} {spec!r}: loading {path} raised {first_line(exc, typed=True)}{line}") from None
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    return module


def _suggestions(namespace: Any, missing: str) -> str:
    """``"; did you mean 'x'?"`` (a close name), else the namespace's own public functions and
    classes (at most 6), so a mistyped TARGET's one error line says what to write instead."""
    import difflib

    home = getattr(namespace, "__name__", None)
    names = sorted(n for n, v in vars(namespace).items() if not n.startswith("_") and callable(v)
                   and getattr(v, "__module__", home) == home) if hasattr(namespace, "__dict__") else []
    close = difflib.get_close_matches(missing, names, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    if not names:
        return ""
    more = f", … ({len(names) - 6} more)" if len(names) > 6 else ""
    return f"; it defines {', '.join(names[:6])}{more}"


def load_target(spec: str, *, what: str = "TARGET") -> Callable[..., Any]:
    """The callable that ``spec`` (``module:name`` or ``file.py:name``) names.

    ``what`` names the thing in error messages (``"TARGET"``, ``"--state factory"``).
    Raises :class:`TargetLoadError` (one line) for every way loading can fail.
    """
    if not isinstance(spec, str):
        raise TargetLoadError(f"{what} {spec!r} (type={type(spec).__name__}) must be a string")
    where, name = split_spec(spec, what)
    with checking_process_kept():  # what its import does to the process, each rank's copy does for itself
        module = _load_file(where, spec, what) if is_file_spec(where) else import_module(where, spec, what)
    obj: Any = module
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetLoadError(f"{what} {spec!r}: {where} has no attribute {name!r}"
                                  + _suggestions(obj, part)) from None
    if not callable(obj):
        raise TargetLoadError(
            f"{what} {spec!r}: {name} is {_article(type(obj).__name__)} {type(obj).__name__}, not callable"
        )
    return obj


def _article(word: str) -> str:
    """``a`` or ``an`` before ``word`` (by its first letter: "an int", "a float")."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def load_state(spec: str) -> StateSpec:
    """``--state``: ``none``, ``group``, or a ``module:factory`` / ``file.py:factory`` loaded
    here, once (shared by every rank), and called once per rank as ``factory(process_group)``
    (:class:`~simcluster.fake.state.StateSpec`). Errors are one line, quoting ``spec``.
    """
    return StateSpec.parse(spec, load=lambda text: load_target(text, what="--state factory"))


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,3,4,8"`` → ``(1, 2, 3, 4, 8)``; each size an int in 1..1024, no repeats."""
    from simcluster.limits import WORLD_SIZES

    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise UsageError(f"--world-sizes {text!r}: {part!r} is not a positive integer")
        if int(part) > WORLD_SIZES[1]:
            raise UsageError(f"--world-sizes {text!r}: {part} is more than the {WORLD_SIZES[1]} ranks "
                             "simcluster supports")
        if int(part) in sizes:
            raise UsageError(f"--world-sizes {text!r}: {part} is listed twice")
        sizes.append(int(part))
    return tuple(sizes)


_MAX_NUMEL = 2**26  # 64 Mi elements per parameter: beyond that a simulated step takes minutes


def format_shapes(shapes: Sequence[Sequence[int]]) -> str:
    """Parameter shapes as ``--params`` takes them, the inverse of :func:`parse_shapes`.

    >>> format_shapes([(4, 5), (5,), ()])
    '4x5,5,scalar'
    """
    return ",".join("x".join(map(str, shape)) if len(shape) else "scalar" for shape in shapes)


def parse_shapes(text: str, *, what: str = "--params") -> tuple[tuple[int, ...], ...]:
    """``"4x5,5,1000"`` → ``((4, 5), (5,), (1000,))``: parameter shapes in ``model.parameters()`` order.

    Each shape is sides joined by ``x`` (``4x5``, ``2x3x4``), each side a positive integer,
    or ``scalar`` — a 0-dim parameter, shape ``()`` (``nn.Parameter(torch.tensor(1.0))``, a
    learnable temperature, say: real DDP buckets it, and ``bucket.gradients()`` hands the hook
    a 0-dim view, which ``g.shape[0]`` cannot index); shapes are separated by commas.
    Anything else is a one-line :class:`UsageError`.

    >>> parse_shapes("2x3,scalar")
    ((2, 3), ())
    """
    shapes: list[tuple[int, ...]] = []
    for part in str(text).split(","):
        if part.strip().lower() == "scalar":
            shapes.append(())
            continue
        sides = part.strip().lower().split("x")
        if not all(s.strip().isdigit() for s in sides):
            raise UsageError(f"{what} {text!r}: {part.strip()!r} is not a shape like 4x5, 1000 or scalar")
        shape = tuple(int(s) for s in sides)
        if min(shape) < 1:
            raise UsageError(f"{what} {text!r}: {part.strip()!r} has a side of 0; every side must be >= 1")
        if math.prod(shape) > _MAX_NUMEL:
            raise UsageError(f"{what} {text!r}: {part.strip()!r} has more than {_MAX_NUMEL} elements")
        shapes.append(shape)
    return tuple(shapes)
