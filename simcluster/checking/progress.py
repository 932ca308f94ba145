"""A progress line for long runs, on stderr.

On a terminal the line is rewritten in place (``\\r`` and erase-to-end-of-line), so a
run of minutes shows one changing line; elsewhere (a CI log, a pipe) it prints plain
lines, at most one every ``interval`` seconds per row plus one when a new row starts,
so logs stay short. Progress is for people: nothing in a report depends on it.

Rows checked in parallel (``check --jobs N``) run in worker processes whose own progress
is not shown; :class:`PoolProgress` tells instead when each row starts and ends, and on
a terminal which rows are running.

>>> import io
>>> out = io.StringIO()
>>> line = ProgressLine(out, interval=0.0)
>>> line.set_prefix("[1/2] allreduce_hook")
>>> line("gloo, world 2: 10/50 examples")
>>> line.finish("ok (3.1s)")
>>> print(out.getvalue(), end="")
[1/2] allreduce_hook: starting
[1/2] allreduce_hook: gloo, world 2: 10/50 examples
[1/2] allreduce_hook: ok (3.1s)
"""

from __future__ import annotations

import shutil
import time
from typing import TextIO

__all__ = ["ProgressLine", "PoolProgress"]


class ProgressLine:
    """Callable as ``progress(text)``: show ``"<prefix>: <text>"``.

    ``enabled=False`` makes every call a no-op (``--quiet``).
    """

    def __init__(self, stream: TextIO, *, enabled: bool = True, interval: float = 5.0) -> None:
        self.stream = stream
        self.enabled = enabled
        self.interval = interval
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.prefix = ""
        self._shown = False  # a tty line is on screen
        self._last = float("-inf")

    def set_prefix(self, prefix: str) -> None:
        """Start a new row: print ``starting``; the next call prints too, interval or not."""
        self.prefix = prefix
        self._last = float("-inf")
        self("starting")
        self._last = float("-inf")

    def finish(self, text: str) -> None:
        """End the row with ``text`` (always printed, interval or not)."""
        self._last = float("-inf")
        self(text)

    def show(self, line: str) -> None:
        """Show ``line`` as it is (no prefix), interval or not."""
        self.prefix = ""
        self.finish(line)

    def __call__(self, text: str) -> None:
        if not self.enabled:
            return
        line = f"{self.prefix}: {text}" if self.prefix else text
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + line[:width] + "\x1b[K")
            self._shown = True
        else:
            now = time.monotonic()
            if now - self._last < self.interval:
                return
            self._last = now
            self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the tty line (before printing results); nothing to do for plain lines."""
        if self.enabled and self.tty and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


class PoolProgress:
    """The progress of rows checked in parallel, on a :class:`ProgressLine`.

    Plain lines (a log): ``[3/12] name: starting`` when a row is handed to a worker and
    ``[3/12] name: FAILED (4.2s)`` when its result arrives — in the order these happen,
    which is not the rows' order. On a terminal, one line rewritten in place: how many
    rows are done, the last result, the rows running.

    >>> import io
    >>> out = io.StringIO()
    >>> pool = PoolProgress(ProgressLine(out), total=12)
    >>> pool.started(3, "allreduce_hook")
    >>> pool.started(4, "fp16_compress_hook")
    >>> pool.finished(4, "fp16_compress_hook", "ok (1.5s)")
    >>> print(out.getvalue(), end="")
    [3/12] allreduce_hook: starting
    [4/12] fp16_compress_hook: starting
    [4/12] fp16_compress_hook: ok (1.5s)
    """

    def __init__(self, line: ProgressLine, total: int, *, done: int = 0) -> None:
        self.line = line
        self.total = total  # rows, skipped ones included (``done`` counts those already done)
        self.running: dict[int, str] = {}
        self.done = done

    def started(self, n: int, name: str) -> None:
        """Row ``n`` (1-based) went to a worker."""
        self.running[n] = name
        self._show(f"[{n}/{self.total}] {name}: starting")

    def finished(self, n: int, name: str, text: str) -> None:
        """Row ``n``'s result arrived; ``text`` is its verdict and time."""
        self.running.pop(n, None)
        self.done += 1
        self._show(f"[{n}/{self.total}] {name}: {text}")

    def _show(self, event: str) -> None:
        if not self.line.tty:
            self.line.show(event)
            return
        running = ", ".join(f"[{n}] {name}" for n, name in sorted(self.running.items()))
        self.line.show(f"{self.done}/{self.total} rows done (last: {event})" + (f"; running {running}" if running else ""))
