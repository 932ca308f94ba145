"""How simcluster names user callables (hooks, state factories, gloo jobs): the one home.

Three names, for three readers:

* :func:`callable_name` — for a person reading a message: ``__qualname__``, else
  ``__name__``, else the type's name (``"fp16_hook"``, ``"Wrapper.__call__"``,
  ``"partial"``) — the user's object's, through simcluster's stand-ins
  (``__wrapped__``). Never a memory address, so messages stay the same from run to run.
* :func:`target_spec` — for a fresh process that imports it: ``"module:qualname"``, or
  ``None`` when there is no such name (lambdas, closures, objects without one).
* :func:`loadable_spec` — for the ``simcluster`` command line run from the current
  directory: a file under it is named by its relative path (``tests/test_x.py:hook``),
  anything else by :func:`target_spec`.

And :func:`wear_torchs_name`, for the simulator's stand-ins of torch's C++ types: Python's
own errors (``'…' object has no attribute 'x'``, ``… is not subscriptable``) then name the
type as a real run names it.

And :func:`without_addresses`, for text that quotes an object as Python's default
``repr`` does (``<torch.Future object at 0x7f2e…>``, in torch's own error messages): the
address masked, so such a message is the same from run to run and process to process.

>>> import os.path
>>> callable_name(os.path.join), target_spec(os.path.join)
('join', 'posixpath:join')
>>> target_spec(lambda: 0) is None
True
>>> without_addresses("Unable to cast <torch.Future object at 0x7f2ef87c5430> to Tensor")
'Unable to cast <torch.Future object at 0x…> to Tensor'
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
from typing import Any

__all__ = ["callable_name", "target_spec", "loadable_spec", "without_addresses", "wear_torchs_name", "MASKED_ADDRESS",
           "MASKED_NUMBER", "MASKED_STAMP", "looks_like_an_address"]

MASKED_ADDRESS = "0x…"
"""What stands for a memory address in a default ``repr``."""

MASKED_STAMP = "…"
"""What stands for the date and time in a glog line's prefix (``[rank0]:[F1207 00:48:31.841924681
ProcessGroupGloo.cpp:1537] Check failed: …``, gloo's failed checks): ``[F… ProcessGroupGloo…``."""

_ADDRESS = re.compile(r"(?<= object at )0x[0-9a-fA-F]+(?=>)")
_NUMBER = re.compile(r"(?<![\w.])(?:0x[0-9a-fA-F]{9,12}|[0-9]{10,15})(?![\w.])")
MASKED_NUMBER = "<address>"
"""What stands for a bare memory address a message quotes as a number (``id(x)``, ``t.data_ptr()``,
``hex(id(x))``): :func:`looks_like_an_address`."""


def looks_like_an_address(value: int) -> bool:
    """Whether ``value`` reads as a 64-bit Linux process's memory address: from 2**32 up to
    the top of user space (2**47) and a multiple of 8 (every Python object and every tensor's
    storage is at least 8-byte aligned: ``id(1) % 16 == 8`` on CPython 3.11, ``data_ptr()`` a
    multiple of 64). ``id()`` and ``data_ptr()`` differ from run to run (address-space
    randomisation); a report quotes them masked so a replay prints what it printed.

    >>> looks_like_an_address(140280508735456), looks_like_an_address(140280508735457)
    (True, False)
    >>> looks_like_an_address(1_000_000)
    False
    """
    return 2**32 <= value < 2**47 and value % 8 == 0


def _masked_number(match: re.Match[str]) -> str:
    text = match.group(0)
    if not looks_like_an_address(int(text, 0) if text.startswith("0x") else int(text)):
        return text
    return MASKED_ADDRESS if text.startswith("0x") else MASKED_NUMBER
_STAMP = re.compile(r"(?<=\]:\[[FEWI])\d{4} \d\d:\d\d:\d\d\.\d+(?= )")


def without_addresses(text: str) -> str:
    """``text`` with what differs run to run masked: every default-``repr`` address (``<…
    object at 0x…>``), every other number that looks like an address (a hook quoting
    ``id(bucket)`` or ``t.data_ptr()``: :func:`looks_like_an_address`) and every glog time
    stamp (``[rank0]:[F1207 00:48:31.84…``).

    >>> without_addresses("[rank1]:[F1207 00:48:31.842460036 ProcessGroupGloo.cpp:1537] Check failed")
    '[rank1]:[F… ProcessGroupGloo.cpp:1537] Check failed'
    >>> without_addresses("bucket 140280508735456 seen twice; 4096 elements at 0x7f9599e45fe0")
    'bucket <address> seen twice; 4096 elements at 0x…'
    """
    return _STAMP.sub(MASKED_STAMP, _NUMBER.sub(_masked_number, _ADDRESS.sub(MASKED_ADDRESS, text)))


def callable_name(obj: Any) -> str:
    """``obj``'s name for a message: its ``__qualname__``, ``__name__`` or type name (of the
    object it wraps, if it wraps one: a nameless hook in a stand-in is ``"partial"``)."""
    return (getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
            or type(inspect.unwrap(obj)).__name__)


def target_spec(obj: Any) -> str | None:
    """``"module:qualname"`` under which a fresh process can import ``obj``; ``None`` for
    lambdas, closures (``<locals>`` in the qualified name) and nameless objects."""
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}:{qual}" if module and qual and "<" not in qual else None


def loadable_spec(obj: Any) -> str | None:
    """A TARGET spelling ``simcluster check`` can load from the current directory.

    A function defined in a file under the current directory (a test module, a script)
    is named by that file's relative path, ``tests/test_x.py:hook`` — its module name
    (``test_x``) means nothing to a fresh ``simcluster`` process. Anything else
    (an installed package) by ``module:qualname``. ``None`` for lambdas and closures.
    """
    spec = target_spec(obj)
    if spec is None:
        return None
    module, _, qual = spec.partition(":")
    file = getattr(sys.modules.get(module), "__file__", None)
    if file:
        rel = os.path.relpath(os.path.abspath(file))
        if not rel.startswith("..") and not os.path.isabs(rel) and not _installed(file):
            return f"{rel}:{qual}"
    return spec


def _installed(file: str) -> bool:
    path = os.path.abspath(file)
    return os.sep + "site-packages" + os.sep in path or os.sep + "dist-packages" + os.sep in path


def wear_torchs_name(cls: type, torch_type: type) -> None:
    """Name ``cls`` as ``torch_type``, the torch type it stands in for, is named — everywhere
    a hook or a report may read a type's name (measured on torch 2.13: docs/gloo-facts.md §8
    and §16, docs/ddp-facts.md):

    * ``type(x).__name__``, ``__qualname__``, ``__module__`` and so ``repr(type(x))``:
      ``Future``, ``<class 'torch.Future'>`` for a collective's future;
    * Python's own errors, which name a type by its C ``tp_name`` — a pybind type's is its
      dotted path: ``'torch._C.Future' object has no attribute 'vale'``, ``cannot pickle
      'torch._C._distributed_c10d.ProcessGroup' object``.

    A Python class has one name for both (setting ``__name__`` sets ``tp_name``), so the
    ``tp_name`` pointer is copied from ``torch_type`` once the names are set (the layout is
    checked once, :func:`_tp_names_copyable`; the string it points to lives as long as
    torch's type, for ever). Until 2026-12-07 ``__name__`` held the dotted path, so errors read right but a
    hook's ``f"got {type(fut).__name__}"`` said ``torch._C.Future`` where a real run says
    ``Future`` (``simcluster e2e``: FIDELITY BUG). Where the copy cannot be trusted (not
    64-bit CPython, or the layout check fails) errors name the short name.

    Done this way rather than with a ``__getattr__`` that words the error: a class with
    ``__getattr__`` gets a slower attribute lookup for *every* attribute, found or not,
    and none of its attribute reads is specialised by the interpreter — ~5 % of a
    simulated step's instructions (docs/speed.md, stop 23)."""
    cls.__name__ = torch_type.__name__
    cls.__qualname__ = torch_type.__qualname__
    cls.__module__ = torch_type.__module__
    if _tp_names_copyable():
        _tp_name_slot(cls).value = _tp_name_slot(torch_type).value


_TP_NAME_OFFSET = 3 * 8  # ob_refcnt, ob_type, ob_size: the first fields of every type object (64-bit CPython)


def _tp_name_slot(cls: type) -> Any:
    """``cls``'s C ``tp_name`` pointer, as a ``ctypes.c_void_p`` over the type object's memory."""
    import ctypes

    return ctypes.c_void_p.from_address(id(cls) + _TP_NAME_OFFSET)


@functools.cache
def _tp_names_copyable() -> bool:
    """Whether this interpreter's type objects are laid out as :func:`wear_torchs_name` expects:
    64-bit CPython, ``tp_name`` at :data:`_TP_NAME_OFFSET`, and Python's errors reading it —
    checked once, on a throwaway class that takes ``int``'s name."""
    import ctypes

    if sys.implementation.name != "cpython" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return False
    try:
        probe = type("_TpNameProbe", (), {})
        if ctypes.c_char_p.from_address(id(probe) + _TP_NAME_OFFSET).value != b"_TpNameProbe":
            return False
        _tp_name_slot(probe).value = _tp_name_slot(int).value
        try:
            probe().no_such_attribute  # noqa: B018
        except AttributeError as exc:
            return str(exc).startswith("'int' object")
        return False
    except (ValueError, OSError):  # pragma: no cover - defensive: ctypes refused the address
        return False
