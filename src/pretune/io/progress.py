"""Progress bars: every one of pretune's goes through ``progress``.

On a terminal (or in a notebook) it is tqdm's bar, redrawn in place. Anywhere else — stderr sent to a file or a
pipe (``make demo > log``, a batch job) — tqdm would rewrite its line every 0.1 s with carriage returns, and a log
would grow to megabytes, so the bar is a ``LogBar``: whole lines, the first when it starts, then at most one per
``LINE_EVERY`` of the total *and* per ``LINE_SECONDS`` (one per ``LINE_SECONDS`` when the total is unknown), and
the final count when it closes. A bar of a few seconds writes two lines; any bar writes at most about 22.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm.auto import tqdm as _auto_tqdm
from tqdm.autonotebook import tqdm as _notebook_tqdm  # tqdm's plain class unless in a notebook
from tqdm.std import tqdm as _std_tqdm

LINE_EVERY = 0.05  # fraction of the total between two lines of a bar outside a terminal
LINE_SECONDS = 30.0  # seconds between two lines of a bar outside a terminal
_now = time.monotonic  # the clock of those seconds


def _is_terminal(file) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LogBar(_std_tqdm):
    """tqdm for a stream that is not a terminal: plain lines (no carriage returns), few of them (module docstring).
    Takes tqdm's arguments."""

    def __init__(self, iterable=None, *args, **kwargs):
        total = kwargs.get("total")
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self._line_step = max(1, int(total * LINE_EVERY)) if total else 0
        self._line_n: float | None = None  # the count the last line showed (None: no line yet)
        self._line_t = 0.0
        # tqdm's own gate only decides when display() is asked; display() decides whether a line is written
        kwargs.setdefault("mininterval", 1.0)
        super().__init__(iterable, *args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg is not None:  # '' clears the bar's line on a terminal: nothing to clear in a log
            return False
        now = _now()
        first = self._line_n is None
        if not first and (self.n == self._line_n or now - self._line_t < LINE_SECONDS
                          or (self._line_step and self.n - self._line_n < self._line_step)):
            return True
        self._write_line(now)
        return True

    def _write_line(self, now: float) -> None:
        self.fp.write(self.__str__() + "\n")
        getattr(self.fp, "flush", lambda: None)()
        self._line_n, self._line_t = self.n, now

    def clear(self, nolock: bool = False) -> None:  # tqdm.write clears bars first: a log's lines stay
        pass

    def close(self) -> None:
        if not self.disable and self._line_n is not None and self.n != self._line_n:
            self._ema_dt = lambda: None  # the final line shows the average rate, as tqdm's does
            self._write_line(_now())
        self.leave = False  # the final line is written: tqdm's close has nothing more to draw
        super().close()


def progress(iterable=None, **kwargs: Any) -> _std_tqdm:
    """A progress bar over ``iterable`` (or updated by hand with ``total=``), with tqdm's keyword arguments
    (``desc``, ``unit``, ``disable``, ``leave``, ...): tqdm's bar on a terminal or in a notebook, a ``LogBar``'s
    few plain lines when its stream (``file``, default stderr) is not a terminal."""
    file = kwargs.get("file") or sys.stderr
    if _notebook_tqdm is not _std_tqdm or _is_terminal(file):  # a notebook's widget, or a terminal's bar
        return _auto_tqdm(iterable, **kwargs)
    return LogBar(iterable, **kwargs)
