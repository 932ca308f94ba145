"""Where in the user's code something happened: frames outside simcluster, torch and Python.

A report names the line of *user* code a failure arose at — the hook, its callbacks,
its state factory — not the simulator's or torch's internals it went through.

>>> import torch, simcluster.engine.inline
>>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
>>> is_internal(torch.__file__), is_internal(simcluster.engine.inline.__file__), is_internal("my_hooks.py")
(True, True, False)
>>> is_internal(default_hooks.__file__)   # torch's own hooks are checked like anyone's
False
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import CodeType, FrameType, TracebackType
from typing import Any, TypeVar

__all__ = ["Frame", "user_frames", "stack_user_frames", "is_internal", "is_simcluster_code", "format_frames",
           "short_path", "run_boundary"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the simcluster package
_SHIPPED_HOOKS = _PACKAGE + "hooks" + os.sep
"""The repository's ``hooks/`` folder as installed (``simcluster.hooks``). An editable install
leaves it beside the package; a wheel puts it inside — where it is still code under test."""


def is_simcluster_code(filename: str) -> bool:
    """Whether ``filename`` is the simulator's own code (not the hooks it ships to be checked)."""
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE) and not path.startswith(_SHIPPED_HOOKS)


def _roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(package folders and single files that are never user code, the stdlib folders)."""
    import torch

    import simcluster

    packages = [os.path.dirname(os.path.abspath(simcluster.__file__)), os.path.dirname(os.path.abspath(torch.__file__)),
                os.path.join(os.path.abspath(sys.prefix), "bin"), os.path.join(os.path.abspath(sys.prefix), "Scripts")]
    for name in ("hypothesis", "_pytest", "pluggy"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            packages.append(os.path.dirname(os.path.abspath(module.__file__)))
    # single-file modules torch calls through on the hook's behalf: typing_extensions'
    # @deprecated wrapper sits between a hook and dist.all_gather_into_tensor (torch 2.13)
    files = [os.path.abspath(m.__file__) for name in ("typing_extensions",)
             if (m := sys.modules.get(name)) is not None and getattr(m, "__file__", None)]
    stdlib = {os.path.abspath(p) for key in ("stdlib", "platstdlib") if (p := sysconfig.get_paths().get(key))}
    return tuple(p + os.sep for p in packages) + tuple(files), tuple(p + os.sep for p in sorted(stdlib))


_ROOTS: tuple[tuple[str, ...], tuple[str, ...]] | None = None
_TORCH_HOOKS = (os.sep + os.path.join("algorithms", "ddp_comm_hooks") + os.sep,
                os.sep + os.path.join("algorithms", "model_averaging") + os.sep)


def is_internal(filename: str) -> bool:
    """Whether ``filename`` belongs to simcluster (but not the hooks it ships), torch (but not
    torch's DDP communication hooks), Python's stdlib, the test runner, a console script or
    ``typing_extensions`` (whose ``@deprecated`` wrapper torch puts around some collectives).
    The hooks are the code under test: their lines are what a report points at.

    Answered once per absolute file name (a dict lookup after that): every
    ``torch.futures.Future()`` a hook makes asks it for the line that made the future, and
    working it out costs ~25 µs of path arithmetic."""
    known = _INTERNAL.get(filename)
    if known is None:
        known = _is_internal(filename)
        if os.path.isabs(filename):  # a relative name's answer depends on the current directory
            _INTERNAL[filename] = known
    return known


_INTERNAL: dict[str, bool] = {}
""":func:`is_internal`'s answers for absolute file names (which folders are internal is fixed
once :data:`_ROOTS` is set, at the first question)."""


def _is_internal(filename: str) -> bool:
    """:func:`is_internal`, worked out."""
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _roots()
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    packages, stdlib = _ROOTS
    if any(part in path for part in _TORCH_HOOKS) or path.startswith(_SHIPPED_HOOKS):  # code under test
        return False
    if path.startswith(packages):
        return True
    installed = os.sep + "site-packages" + os.sep in path or os.sep + "dist-packages" + os.sep in path
    return path.startswith(stdlib) and not installed


@dataclass(frozen=True)
class Frame:
    """One frame of user code: ``file:line in function``, with its source line."""

    file: str
    line: int
    function: str
    source: str
    cycle: int = 0
    """Whether this frame ends a recursion, and how many frames the recursing block has: 0
    if not; 1 when a function called itself from this line again and again, 2 for two
    functions calling each other, … — shown once (:func:`collapse_recursions`). How many
    times is not said: the depth a recursion reaches before Python's limit depends on how
    deep the stack was where it began, and a replay of the failure starts it from another
    depth (measured: 1,979 frames in a check, 962 in its replay) — a report and its replay
    say the same."""

    @property
    def repeated(self) -> bool:
        """Whether this frame ends a recursion (:attr:`cycle`)."""
        return self.cycle > 0

    def __str__(self) -> str:
        text = f"{short_path(self.file)}:{self.line} in {self.function}"
        text = f"{text}: {self.source}" if self.source else text
        return text + recursion_mark(self.cycle) if self.cycle else text


def recursion_mark(cycle: int) -> str:
    """What follows the last line of a recursion shown once (:func:`collapse_recursions`)."""
    if cycle == 1:
        return "  [the same line again and again: a recursion]"
    return f"  [the last {cycle} lines again and again: a recursion]"


_T = TypeVar("_T")

LONGEST_CYCLE = 8
"""The most frames a recursing block may have for :func:`collapse_recursions` to find it."""


def collapse_recursions(items: list[_T]) -> list[tuple[_T, int]]:
    """``items`` (frames, outermost first) with each recursion shown once: ``(item, cycle)``
    pairs, ``cycle`` > 0 on the last item of a block of ``cycle`` items that followed itself
    on the stack — at least twice for one item (a function calling itself from one line), at
    least three times for a longer block (functions calling each other: ``ping`` → ``pong`` →
    ``ping`` …; two passes through two functions are as likely a shallow walk as a runaway
    recursion) — else 0. The shortest block is tried first; where the recursion stopped part
    way through a block (Python's limit is reached in either function), the rest belongs to it.

        >>> collapse_recursions(["hook", "ping", "pong", "ping", "pong", "ping", "pong", "ping"])
        [('hook', 0), ('ping', 0), ('pong', 2)]
        >>> collapse_recursions(["hook", "down", "down", "down"])
        [('hook', 0), ('down', 1)]
        >>> collapse_recursions(["hook", "walk", "visit", "walk", "visit"])
        [('hook', 0), ('walk', 0), ('visit', 0), ('walk', 0), ('visit', 0)]

    Python's own traceback collapses only a line that repeats (``[Previous line repeated 996
    more times]``): a mutual recursion's report was three lines of the two functions, and the
    hook's line where it began was cut (an audit of reports, stop 42)."""
    out: list[tuple[_T, int]] = []
    i, n = 0, len(items)
    while i < n:
        for cycle in range(1, min(LONGEST_CYCLE, (n - i) // 2) + 1):
            block = items[i:i + cycle]
            end = i + cycle
            while items[end:end + cycle] == block:
                end += cycle
            if (end - i) // cycle >= (2 if cycle == 1 else 3):
                while end < n and items[end] == block[(end - i) % cycle]:  # stopped part way through
                    end += 1
                out += [(item, 0) for item in block[:-1]]
                out.append((block[-1], cycle))
                i = end
                break
        else:
            out.append((items[i], 0))
            i += 1
    return out


def short_path(path: str) -> str:
    """``path`` as a report shows it: a file of an installed package or of Python's own
    library by its import path (``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``),
    wherever the environment lives — a virtual environment inside the project is no part of
    the user's code; else relative to the current directory when it is inside it; else as is.

    Remembered per (current directory, path): a label of every ``torch.futures.Future()`` a
    hook makes names its line, and ``os.path.relpath`` costs ~10 µs; reading the current
    directory is one system call."""
    try:
        key = (os.getcwd(), path)
    except OSError:  # the current directory was removed
        return path
    found = _SHORT.get(key)
    if found is None:
        found = without_library_dirs(path)
        if found == path:
            try:
                rel = os.path.relpath(path, key[0])
            except ValueError:
                rel = ".."
            found = path if rel.startswith("..") else rel
        _SHORT[key] = found
    return found


def without_library_dirs(text: str) -> str:
    """``text`` with every installed package's and Python's own folder dropped from the paths
    it quotes — a traceback torch wrote into a message (``At:\n  /…/site-packages/torch/…``)
    — as :func:`short_path` names such files."""
    for library in _LIBRARIES:
        if library in text:
            text = text.replace(library, "")
    return text


_LIBRARIES = sorted({os.path.join(sysconfig.get_paths()[name], "") for name in ("purelib", "platlib", "stdlib",
                                                                                 "platstdlib")}, key=len, reverse=True)
"""Where installed packages and Python's own modules live (site-packages first: it may lie
inside the standard library's folder), each ending in a separator: :func:`short_path` names
a file under one by what follows."""

_SHORT: dict[tuple[str, str], str] = {}
""":func:`short_path`'s answers by (current directory, path)."""


_F = TypeVar("_F", bound=Callable[..., Any])
_RUN_BOUNDARIES: set[CodeType] = set()
""":func:`run_boundary`'s functions' code."""


def run_boundary(function: _F) -> _F:
    """Mark ``function`` as where an engine starts a rank's code (a task: the rank's function,
    a callback). A frame outside it on the same stack is the caller's — a script or test that
    called ``SimCluster.run`` or ``explain``'s ``record`` — not a rank's, and no "where" list
    names it: a tutorial script's own lines once stood in a PowerSGD deadlock's list."""
    _RUN_BOUNDARIES.add(function.__code__)
    return function


def _inside_the_run(frames: list[tuple[CodeType, int]]) -> list[tuple[CodeType, int]]:
    """``frames`` (outermost first, each ``(code, line)``) from the innermost run boundary in, or all."""
    for i in range(len(frames) - 1, -1, -1):
        if frames[i][0] in _RUN_BOUNDARIES:
            return frames[i + 1:]
    return frames


def _frames(frames: list[tuple[CodeType, int]]) -> list[Frame]:
    """The user frames of ``frames`` (outermost first) inside the run, each recursion shown
    once (:func:`collapse_recursions`: a report's last three lines were three copies of the
    recursing line, and the hook's own call of it — where the recursion began — was cut)."""
    user = [(code, line) for code, line in _inside_the_run(frames) if not is_internal(code.co_filename)]
    return [_frame_at(code, line, cycle) for (code, line), cycle in collapse_recursions(user)]


def user_frames(exc: BaseException, limit: int = 3) -> list[Frame]:
    """The last ``limit`` frames of user code in ``exc``'s traceback (outermost first).

    An exception that carries ``simcluster_frames`` (set where simcluster raises on the
    user's behalf, e.g. a mismatch detected at a rank's call) gives those instead.
    """
    given = getattr(exc, "simcluster_frames", None)
    if given is not None:
        return list(given)[-limit:]
    tb: TracebackType | None = exc.__traceback__
    walked = []
    while tb is not None:
        walked.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    found = _frames(walked)
    if not found:
        found = _at_frames(str(exc))
    if not found and exc.__cause__ is not None and exc.__cause__ is not exc:
        return user_frames(exc.__cause__, limit)
    return found[-limit:]


_AT_LINE = re.compile(r"^\s+(.+)\((\d+)\): (\S+)$")


def _at_frames(message: str) -> list[Frame]:
    """Frames from the ``At:`` stack torch writes into the message of an exception raised
    in a future's callback (``  /path/hooks.py(12): <lambda>``, innermost first)."""
    lines = message.splitlines()
    if "At:" not in (line.strip() for line in lines):
        return []
    found = []
    for line in lines[[line.strip() for line in lines].index("At:") + 1:]:
        match = _AT_LINE.match(line)
        if match is None:
            break
        file, number, function = match.group(1), int(match.group(2)), match.group(3)
        if not is_internal(file):
            found.append(Frame(file, number, function, linecache.getline(file, number).strip()))
    return found[::-1]


def stack_user_frames(frame: FrameType | None, limit: int = 3) -> list[Frame]:
    """The last ``limit`` user frames of the stack ending at ``frame`` (outermost first)."""
    walked = []
    while frame is not None:
        walked.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return _frames(walked[::-1])[-limit:]


def posting_site(frame: FrameType | None) -> str | None:
    """Where user code posted a collective, for a report: the innermost user frame of the
    stack ending at ``frame``, and the user frame that called it when there is one —
    ``hooks.py:559 in _mean_unless: … (called from hooks.py:577 in skip_if_zero: …)``: a
    hook's helper that posts is rarely where the decision that broke the run was made
    (an audit of reports: deadlocks named the helper's line only). ``None``: no user frame."""
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return line_site(frame, frame.f_lineno)


def line_site(frame: FrameType, line: int) -> str:
    """User ``frame`` at ``line`` for a report, with the user frame that called it when there
    is one: ``hooks.py:559 in _mean_unless: … (called from hooks.py:577 in skip_if_zero: …)``
    (:func:`posting_site`; the line that wrote to a tensor in flight,
    :class:`~simcluster.engine.write_watch.WriteWatch`)."""
    here = _frame_at(frame.f_code, line)
    caller = frame.f_back  # the direct caller only: a user frame further out (a test calling SimCluster.run) is not
    if caller is None or is_internal(caller.f_code.co_filename):
        return str(here)
    return f"{here} (called from {_frame_at(caller.f_code, caller.f_lineno)})"


def _frame_at(code: CodeType, line: int, cycle: int = 0) -> Frame:
    """The :class:`Frame` of ``code`` at ``line``, with its source line."""
    return Frame(code.co_filename, line, code.co_name, linecache.getline(code.co_filename, line).strip(), cycle)


def format_frames(frames: Iterable[Frame], indent: str = "  ") -> list[str]:
    """One line per frame, innermost last, as ``at file:line in function: source``."""
    return [f"{indent}at {f}" for f in frames]
