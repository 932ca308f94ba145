"""Loading what the command line names: hooks, state factories, tolerances, world sizes.

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

>>> load_target("hooks.reference:mean_allreduce_hook").__name__
'mean_allreduce_hook'
>>> parse_world_sizes("1,2,4")
(1, 2, 4)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from simcluster.errors import TargetLoadError, UsageError

__all__ = [
    "load_target",
    "load_state",
    "parse_tolerance",
    "parse_world_sizes",
    "legacy_aliases",
    "TOLERANCE_NAMES",
]

TOLERANCE_NAMES = ("none", "exact", "fp32", "fp16", "bf16")
"""Named tolerances; ``rtol=…,atol=…`` (either or both) is the explicit form."""

_EXPLICIT_TOLERANCE = re.compile(r"^(rtol|atol)=([^,=]+)(,(rtol|atol)=([^,=]+))?$")


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


def _split(spec: str, what: str) -> tuple[str, str]:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise TargetLoadError(
            f"{what} {spec!r} is not of the form package.module:name or path/to/file.py:name"
        )
    if not all(part.isidentifier() for part in name.split(".")):
        raise TargetLoadError(f"{what} {spec!r}: {name!r} is not a Python name")
    return where, name


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _import_module(where: str, spec: str, what: str) -> ModuleType:
    try:
        with legacy_aliases():
            return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (where == exc.name or where.startswith(exc.name + ".")):
            raise TargetLoadError(f"{what} {spec!r}: no module named {exc.name!r}") from None
        raise TargetLoadError(f"{what} {spec!r}: importing {where} failed: {_one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - any error in the user's module is a load error
        raise TargetLoadError(f"{what} {spec!r}: importing {where} raised {_one_line(exc)}") from None


def _module_name_for(path: Path) -> str:
    """A stable, unique module name for a file (the same file always gets the same name)."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    return f"simcluster_target_{stem}_{digest}"


def _file_path(where: str, spec: str, what: str) -> Path:
    path = Path(where).expanduser()
    if not path.is_file():
        raise TargetLoadError(f"{what} {spec!r}: file not found: {where}")
    return path.resolve()


def _load_file(where: str, spec: str, what: str) -> ModuleType:
    path = _file_path(where, spec, what)
    name = _module_name_for(path)
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
        with legacy_aliases():
            module_spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, Exception):
            raise
        line = ""
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == str(path):
                line = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
        raise TargetLoadError(f"{what} {spec!r}: loading {path} raised {_one_line(exc)}{line}") from None
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    return module


def load_target(spec: str, *, what: str = "TARGET") -> Callable[..., Any]:
    """The callable that ``spec`` (``module:name`` or ``file.py:name``) names.

    ``what`` names the thing in error messages (``"TARGET"``, ``"--state factory"``).
    Raises :class:`TargetLoadError` (one line) for every way loading can fail.
    """
    if not isinstance(spec, str):
        raise TargetLoadError(f"{what} {spec!r} (type={type(spec).__name__}) must be a string")
    where, name = _split(spec, what)
    module = _load_file(where, spec, what) if _is_file(where) else _import_module(where, spec, what)
    obj: Any = module
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetLoadError(f"{what} {spec!r}: {where} has no attribute {name!r}") from None
    if not callable(obj):
        raise TargetLoadError(
            f"{what} {spec!r}: {name} is a {type(obj).__name__}, not callable"
        )
    return obj


def load_state(spec: str) -> str | Callable[[Any], Any]:
    """``--state``: ``"none"`` and ``"group"`` are kept as words; anything else must be a
    ``module:factory`` or ``file.py:factory`` called once per rank as ``factory(process_group)``.
    """
    if spec in ("none", "group"):
        return spec
    return load_target(spec, what="--state factory")


def parse_tolerance(text: str) -> str:
    """Validate a ``--tolerance`` value and return it normalised (lower case, no spaces).

    >>> parse_tolerance("rtol=1e-3, atol=0")
    'rtol=1e-3,atol=0'
    """
    norm = text.strip().lower().replace(" ", "")
    if norm in TOLERANCE_NAMES:
        return norm
    match = _EXPLICIT_TOLERANCE.match(norm)
    if match is None or (match.group(4) is not None and match.group(4) == match.group(1)):
        raise UsageError(
            f"--tolerance {text!r}: use one of {', '.join(TOLERANCE_NAMES)} or rtol=R,atol=A"
        )
    for value in (match.group(2), match.group(5)):
        if value is None:
            continue
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"--tolerance {text!r}: {value!r} is not a number") from None
        if not number >= 0.0 or number == float("inf"):
            raise UsageError(f"--tolerance {text!r}: {value!r} must be a finite number >= 0")
    return norm


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,3,4,8"`` → ``(1, 2, 3, 4, 8)``; each size a positive int, no repeats."""
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise UsageError(f"--world-sizes {text!r}: {part!r} is not a positive integer")
        if int(part) in sizes:
            raise UsageError(f"--world-sizes {text!r}: {part} is listed twice")
        sizes.append(int(part))
    return tuple(sizes)
