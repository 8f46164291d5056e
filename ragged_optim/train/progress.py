"""Progress on stderr: a bar redrawn in place on a terminal, plain lines in a log.

On a terminal, one line redrawn with ``\\r``: step, bar, loss, tokens/s, ETA. Anywhere else (stderr redirected
to a file, a pipe, CI) ``\\r`` would pile every redraw into one unreadable line, so it writes a plain line at each
tenth of the run, and at least every ``log_interval_s`` seconds:
``step 40/200 (20%)  loss 2.3456  12,345 tok/s  elapsed 0:21  ETA 1:24``.
The ETA is the wall time per step so far (evaluations and checkpoints included) times the steps left.
"""

from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    """``1:05`` (m:ss) or ``2:03:04`` (h:mm:ss)."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """``update(step, loss, tokens_per_s)`` after each step; ``close()`` at the end.

    ``tty``: redraw one line (True) or write plain lines (False); None: whether ``stream`` is a terminal.
    ``start``: the step the run starts from (a resumed run): the ETA counts only the steps run here.
    ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(
        self,
        total: int,
        enabled: bool = True,
        stream=None,
        min_interval_s: float = 0.1,
        *,
        tty: bool | None = None,
        start: int = 0,
        log_interval_s: float = 60.0,
        clock=time.monotonic,
    ) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.min_interval_s = min_interval_s
        self.log_interval_s = log_interval_s
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.start = start
        self._clock = clock
        self._t0 = clock()
        self._last = float("-inf")
        self._last_tenth = (10 * start) // max(1, total)
        self._width = 0

    def eta_s(self, step: int) -> float | None:
        """Seconds left at ``step``: the mean wall time per step since the start, times the steps left."""
        done = step - self.start
        if done <= 0:
            return None
        return (self._clock() - self._t0) / done * (self.total - step)

    def update(self, step: int, loss: float, tokens_per_s: float, force: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            self._redraw(step, loss, tokens_per_s, force)
        else:
            self._log(step, loss, tokens_per_s, force)

    def _eta_text(self, step: int) -> str:
        eta = self.eta_s(step)
        return "" if eta is None or step >= self.total else f"  ETA {format_duration(eta)}"

    def _redraw(self, step: int, loss: float, tokens_per_s: float, force: bool) -> None:
        now = self._clock()
        if not force and now - self._last < self.min_interval_s and step < self.total:
            return
        self._last = now
        n = 24
        filled = int(n * step / max(1, self.total))
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (n - filled)}] "
            f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s{self._eta_text(step)}"
        )
        pad = " " * max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + pad)
        self.stream.flush()

    def _log(self, step: int, loss: float, tokens_per_s: float, force: bool) -> None:
        now = self._clock()
        tenth = (10 * step) // max(1, self.total)
        due = force or step >= self.total or tenth > self._last_tenth or now - self._last >= self.log_interval_s
        if not due:
            return
        self._last, self._last_tenth = now, tenth
        pct = 100 * step // max(1, self.total)
        self.stream.write(
            f"step {step}/{self.total} ({pct}%)  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
            f"elapsed {format_duration(now - self._t0)}{self._eta_text(step)}\n"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
