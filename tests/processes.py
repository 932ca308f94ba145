"""Process census for tests, from ``/proc`` (Linux): which processes live under this one.

Used by tests that start processes (the supervisor in ``test_hostile.py``, the real gloo
ranks in ``test_e2e.py``) to assert that none survives a run. Zombies count as gone: a
process that exited but was not yet reaped runs no code.
"""

from __future__ import annotations

import os
from pathlib import Path


def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (state, ppid, ...); ``None`` if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()  # the name may hold spaces and parentheses


def parents() -> dict[int, int]:
    """pid → parent pid of every live (non-zombie) process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None and fields[0] != "Z":
            out[int(entry)] = int(fields[1])
    return out


def children(root: int | None = None) -> set[int]:
    """Live children of ``root`` (default: this process)."""
    root = os.getpid() if root is None else root
    return {pid for pid, ppid in parents().items() if ppid == root}


def descendants(root: int | None = None) -> set[int]:
    """Live descendants of ``root`` (default: this process), at any depth."""
    parent = parents()
    found: set[int] = set()
    frontier = {os.getpid() if root is None else root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def in_session(session: int) -> set[int]:
    """Live processes of session ``session`` (a command started with ``start_new_session``:
    its pid), whatever their process group or parent now."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None and fields[0] != "Z" \
                and int(fields[3]) == session:
            found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def ctrl_c_as_from_a_terminal() -> None:
    """``preexec_fn`` for a child that a test sends SIGINT: its SIGINT at the default, as a
    terminal starts a command. A shell's ``cmd &`` starts ``cmd`` with SIGINT ignored, the
    child inherits that, and Python then never raises KeyboardInterrupt: pytest run in the
    background failed the Ctrl-C tests (a flaky-test hunt, 2026-12-07)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
