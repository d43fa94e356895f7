"""A plain progress bar on stderr: redrawn in place on a terminal, a line every few seconds
otherwise (CI logs), nothing when disabled."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Final, TextIO

_WIDTH: Final = 30
_TTY_INTERVAL_S: Final = 0.25
_LOG_INTERVAL_S: Final = 5.0


def render(label: str, done: int, total: int, extra: str = "", width: int = _WIDTH) -> str:
    """``label [#########.........]  300/1000 extra`` (the bar is full when total is 0)."""
    share = 1.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
    filled = round(share * width)
    digits = len(str(max(total, 0)))
    bar = "#" * filled + "." * (width - filled)
    return f"{label} [{bar}] {done:>{digits}}/{total} {extra}".rstrip()


class Progress:
    """``update`` as often as you like; it draws at most every so often. ``close`` ends the
    line."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._label = label
        self._total = total
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._clock = clock
        self._tty = self._stream.isatty()
        self._last = float("-inf")
        self._line = ""

    def update(self, done: int, extra: str = "", *, force: bool = False) -> None:
        if not self._enabled:
            return
        now = self._clock()
        interval = _TTY_INTERVAL_S if self._tty else _LOG_INTERVAL_S
        if not force and now - self._last < interval:
            return
        self._last = now
        line = render(self._label, done, self._total, extra)
        if self._tty:
            pad = " " * max(0, len(self._line) - len(line))
            self._stream.write("\r" + line + pad)
        else:
            self._stream.write(line + "\n")
        self._line = line
        self._stream.flush()

    def close(self, done: int, extra: str = "") -> None:
        self.update(done, extra, force=True)
        if self._enabled and self._tty:
            self._stream.write("\n")
            self._stream.flush()
