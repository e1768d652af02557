"""A terminal progress bar for long operations (warmup, conversions, scrubs, drains, fsck).

On a terminal it redraws one line on stderr at most ten times a second. When
stderr is not a terminal (logs, CI) it prints nothing until ``close``, so
logs get the final report only; or, with ``lines=True``, a plain line at
every tenth of the way ("scrub: 40% ...").

It lives in common/ because a role's tool (client/convert.py) shows it too:
a role never imports the command-line package.
"""

from __future__ import annotations

import sys
import time


class Progress:
    #: the bar of the long operation under way in this process (the command line's Ctrl-C line says how far it got)
    current: "Progress | None" = None

    def __init__(self, total: int, *, label: str, unit: str = "files", total_bytes: int = 0, stream=None,
                 lines: bool = False):
        self.total = total
        self.label = label
        self.unit = unit
        self.total_bytes = total_bytes
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.lines = lines
        self.start = time.monotonic()
        self._drawn = 0.0
        self._last_pct = -1
        self.note = ""
        self.done = 0
        self.bytes = 0
        Progress.current = self

    def how_far(self) -> str:
        """``93 of 2,000 files (migrate)``."""
        return f"{self.done:,} of {self.total:,} {self.unit} ({self.label})"

    def update(self, done: int, done_bytes: int = 0, note: str = "") -> None:
        self.done, self.bytes, self.note = done, done_bytes, note
        now = time.monotonic()
        if self.tty and now - self._drawn >= 0.1:
            self._drawn = now
            self.stream.write("\r" + self._line(now) + "\x1b[K")
            self.stream.flush()
        elif not self.tty and self.lines:
            pct = min(100, int(100 * done / max(self.total, 1)))
            if pct // 10 != self._last_pct // 10 or pct == 100:
                print(f"{self.label}: {pct}% {note}", file=self.stream, flush=True)
            self._last_pct = pct

    def _line(self, now: float) -> str:
        fraction = min(self.done / self.total, 1.0) if self.total else 1.0
        width = 30
        bar = "#" * int(fraction * width) + "-" * (width - int(fraction * width))
        elapsed = max(now - self.start, 1e-6)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0
        mib = f" {self.bytes / elapsed / (1 << 20):.0f} MiB/s" if self.bytes else ""
        note = f" {self.note}" if self.note else ""
        return f"{self.label} [{bar}] {fraction:4.0%} {self.done:,}/{self.total:,} {self.unit} {rate:,.0f}/s{mib} ETA {eta:.0f}s{note}"

    def close(self) -> float:
        """Finish the line; the seconds it all took."""
        elapsed = time.monotonic() - self.start
        if Progress.current is self:
            Progress.current = None
        if self.tty:
            self.stream.write("\r" + self._line(time.monotonic()) + "\x1b[K\n")
            self.stream.flush()
        return elapsed
