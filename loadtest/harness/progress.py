"""A one-line live progress bar on the terminal (stderr), redrawn with a carriage return."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self._drawn = False
        self._started = time.monotonic()

    def update(self, label: str, done: float, total: float, detail: str = "") -> None:
        """Redraw the bar: ``label`` at ``done / total``, then ``detail``."""
        if not self.enabled:
            return
        width = shutil.get_terminal_size((100, 20)).columns
        fraction = 0.0 if total <= 0 else max(0.0, min(1.0, done / total))
        bar_width = 24
        filled = int(fraction * bar_width)
        bar = "#" * filled + "-" * (bar_width - filled)
        elapsed = time.monotonic() - self._started
        line = f"{elapsed:6.1f}s {label:<22.22} [{bar}] {fraction * 100:3.0f}% {detail}"
        self.stream.write("\r" + line[: width - 1].ljust(width - 1))
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        if self.enabled and self._drawn:
            width = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + " " * (width - 1) + "\r")
            self.stream.flush()
            self._drawn = False

    def log(self, message: str) -> None:
        """A line of its own above the bar (always shown, bar or not)."""
        self.clear()
        elapsed = time.monotonic() - self._started
        self.stream.write(f"[{elapsed:6.1f}s] {message}\n")
        self.stream.flush()
