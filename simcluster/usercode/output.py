"""What the code under test prints, kept instead of shown while a property search runs.

A search runs a hook hundreds of times; a hook that prints or logs once per call would
bury the report under thousands of lines (and with ``check --jobs`` the rows' lines would
interleave). As pytest does, the output is captured while each example runs and shown only
where it helps: with the example a failure is reported on (the report's ``output:`` lines).

Captured at the file-descriptor level (fds 1 and 2, in the order written: ``print``,
``logging``, ``warnings`` and C++ writes alike) and at the Python level (``sys.stdout`` /
``sys.stderr``, which may be objects of their own under pytest), into one temporary file.

    >>> with captured_output() as box:
    ...     print("from the hook")
    >>> box.text
    'from the hook\\n'
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["Captured", "captured_output", "marking_ranks", "rank_lines"]


class Captured:
    """The text written while :func:`captured_output` was active (``""`` until it ends),
    and who wrote which part when the block said so (:meth:`mark`, :meth:`parts`)."""

    def __init__(self) -> None:
        self.text = ""
        self._data = b""
        self._marks: list[tuple[int, Any]] = []

    def mark(self, owner: Any) -> None:
        """From now on, what is written is ``owner``'s (a rank, say): called inside the block,
        each time the writer changes. Python's streams are flushed first, so what was
        written before lands before the mark (C++ buffered writes may not)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd in (1, 2):  # both write to the block's file: one offset
            try:
                self._marks.append((os.lseek(fd, 0, os.SEEK_CUR), owner))
                return
            except OSError:  # the code under test closed it (harmless to a real rank that prints nothing after)
                continue

    def parts(self) -> list[tuple[Any, str]]:
        """The captured text in ``(owner, text)`` pieces, in the order written: each piece
        is what was written after a :meth:`mark` (owner ``None``: before the first); empty
        pieces are left out. Without marks, one piece: ``[(None, text)]``."""
        cuts = [(0, None), *self._marks, (len(self._data), None)]
        pieces = [(owner, self._data[start:end].decode("utf-8", errors="replace"))
                  for (start, owner), (end, _) in zip(cuts, cuts[1:])]
        return [(owner, text) for owner, text in pieces if text]


_STREAM: TextIO | None = None


def _fd1_stream() -> TextIO:
    """The text stream ``sys.stdout``/``sys.stderr`` are while output is captured: one object
    for the life of the process, writing to fd 1 — a real text file (fileno, buffer,
    encoding: what code writing to ``sys.stdout`` may use), line-buffered so that lines keep
    their order with fd-level writes.

    One object, never closed, because code keeps it: a ``logging.StreamHandler(sys.stdout)``
    made in one captured block (a state factory at step 0) writes to it in later blocks, as a
    process's handler writes to its one stdout for the whole training. A stream made and closed
    per block left such a handler a closed file ('--- Logging error --- ValueError: I/O
    operation on closed file' from step 1 on: hooks from the wild, round 13). Writing to fd 1
    (not to the block's file) sends what it writes to the block capturing fd 1 at the time, and
    outside any block to the process's own stdout."""
    global _STREAM
    if _STREAM is None or _STREAM.closed:
        _STREAM = open(1, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
    return _STREAM


def rank_lines(parts: list[tuple[Any, str]]) -> list[str]:
    """The non-blank lines of :meth:`Captured.parts`, each as ``rank r: text`` (a line
    written outside every rank's code, owner ``None``, as it is)."""
    return [f"rank {owner}: {line.rstrip()}" if owner is not None else line.rstrip()
            for owner, text in parts for line in text.splitlines() if line.strip()]


@contextlib.contextmanager
def marking_ranks(printed: Captured) -> Iterator[None]:
    """Mark ``printed`` (:meth:`Captured.mark`) at every hand-over to a rank's code while
    inside, so each line it captured is told with the rank that wrote it, as each real
    rank's process prints its own: through ``CURRENT.announce``, which
    :meth:`~simcluster.fake.rank_context.RankContexts.switch` calls on entering a rank (a
    supervising monitor's announcement, if any, is still made). Two system calls per
    hand-over: for a run that is told (explain, a reported example), not for a search."""
    from simcluster.usercode.rank_state import CURRENT

    previous = CURRENT.announce

    def announce(rank: int) -> None:
        printed.mark(rank)
        if previous is not None:
            previous(rank)

    CURRENT.announce = announce
    try:
        yield
    finally:
        CURRENT.announce = previous


@contextlib.contextmanager
def captured_output(sink_fd: int | None = None) -> Iterator[Captured]:
    """Capture fds 1 and 2 and ``sys.stdout``/``sys.stderr`` for the block; the text is in
    the yielded :class:`Captured` afterwards (decoded as UTF-8, bad bytes replaced).

    ``sink_fd``: a file to capture into, emptied first and left open — a supervised child's
    (:class:`~simcluster.checking.supervisor.Monitor.output_fd`), which its parent reads if
    the child is killed in the block; None: a temporary file of its own."""
    box = Captured()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = os.dup(1), os.dup(2)
    old_streams = sys.stdout, sys.stderr
    if sink_fd is not None:
        os.ftruncate(sink_fd, 0)
        os.lseek(sink_fd, 0, os.SEEK_SET)
    with (open(os.dup(sink_fd), "w+b") if sink_fd is not None else tempfile.TemporaryFile()) as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        stream = _fd1_stream()
        sys.stdout = sys.stderr = stream
        try:
            yield box
        finally:
            with contextlib.suppress(Exception):
                stream.flush()  # not closed: code may keep it (below)
            sys.stdout, sys.stderr = old_streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            box._data = sink.read()
            box.text = box._data.decode("utf-8", errors="replace")
