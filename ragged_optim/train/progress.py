"""A one-line progress bar on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
    """One line on stderr, redrawn with ``\\r``: step, bar, loss, tokens/s."""

    def __init__(self, total: int, enabled: bool = True, stream=None, min_interval_s: float = 0.1) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._width = 0

    def update(self, step: int, loss: float, tokens_per_s: float, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s and step < self.total:
            return
        self._last = now
        n = 24
        filled = int(n * step / max(1, self.total))
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (n - filled)}] "
            f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
        )
        pad = " " * max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + pad)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
