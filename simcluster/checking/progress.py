"""A progress line for long runs, on stderr.

On a terminal the line is rewritten in place (``\\r`` and erase-to-end-of-line), so a
run of minutes shows one changing line; elsewhere (a CI log, a pipe) it prints plain
lines, at most one every ``interval`` seconds per row plus one when a new row starts,
so logs stay short. Progress is for people: nothing in a report depends on it.

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

__all__ = ["ProgressLine"]


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
