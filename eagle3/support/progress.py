"""Log-friendly progress: plain log lines every N items or S seconds (progress bars do not survive in logs).

A line reads, e.g.::

    [extract] samples 120/1000 (12.0%) | tokens 61,440 | 2,512 tok/s | elapsed 0:00:24 | ETA 0:02:55

A ``total`` of 0 means unknown (a stream): lines then show the count without a percentage or ETA; otherwise it is
the number of items the stage will really process (a caller that stops at a cap passes the cap). The first update
always writes a line, so a stage's first progress line comes as soon as its first item or batch is done, whatever the
interval. The ETA waits for a rate to base it on: it is measured from the first update on (the first batch carries
the warm-up and the model's first-call costs), so the first line has none.
``on_update`` lets a caller (a Prefect task) mirror progress elsewhere without this module importing Prefect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("eagle3")


def fmt_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(
        self,
        stage: str,
        total: int,
        unit: str = "samples",
        every_n: int = 0,
        every_s: float = 30.0,
        logger: logging.Logger | None = None,
        on_update: Callable[[int, int, str], None] | None = None,
    ):
        self.stage, self.total, self.unit = stage, max(0, int(total)), unit
        self.every_n, self.every_s = every_n, every_s
        self.logger = logger or log
        self.on_update = on_update
        self.done = 0
        self.tokens = 0
        self.start = time.monotonic()
        self._last_t = self.start
        self._last_n = 0
        self._rate_from: tuple[float, int] | None = None  # (time, done) of the first update: where the rate starts

    def update(self, n: int = 1, tokens: int = 0, extra: str = "", force: bool = False) -> None:
        """Count ``n`` more items; a line when one is due (the first update, every_n, every_s, the total) or when
        ``force`` (a caller that decides itself, e.g. training at its log steps, so that ``extra`` is never lost)."""
        first = self._rate_from is None
        if first:
            self._rate_from = (time.monotonic(), self.done + n)
        self.done += n
        self.tokens += tokens
        now = time.monotonic()
        due_n = self.every_n and self.done - self._last_n >= self.every_n
        due_s = self.every_s and now - self._last_t >= self.every_s
        if first or force or due_n or due_s or (self.total and self.done >= self.total):
            self.emit(extra)

    def line(self, extra: str = "") -> str:
        elapsed = time.monotonic() - self.start
        if self.total:
            parts = [f"[{self.stage}] {self.unit} {self.done:,}/{self.total:,} ({100.0 * self.done / self.total:.1f}%)"]
        else:  # total unknown (a stream)
            parts = [f"[{self.stage}] {self.unit} {self.done:,}"]
        if self.tokens:
            parts.append(f"tokens {self.tokens:,}")
            parts.append(f"{self.tokens / elapsed:,.0f} tok/s" if elapsed > 0 else "- tok/s")
        parts.append(f"elapsed {fmt_duration(elapsed)}")
        if self._rate_from is not None and 0 < self.done < self.total:
            since, at = self._rate_from
            if self.done > at and time.monotonic() > since:  # a rate measured after the first update
                rate = (self.done - at) / (time.monotonic() - since)
                parts.append(f"ETA {fmt_duration((self.total - self.done) / rate)}")
        if extra:
            parts.append(extra)
        return " | ".join(parts)

    def note(self, text: str) -> None:
        """A line between updates (e.g. "batch 3 of ~40 started") when one is due by time, or before the first
        update: a long first batch is never silent."""
        now = time.monotonic()
        if self._rate_from is None or (self.every_s and now - self._last_t >= self.every_s):
            self.logger.info("[%s] %s", self.stage, text)
            self._last_t = now

    def finish(self) -> None:
        """The last line, unless the last line already said where the count ended (a stage that stopped short of
        its total, skipped rows, still gets its final count)."""
        if self._last_n != self.done or self._rate_from is None:
            self.emit()

    def emit(self, extra: str = "") -> str:
        text = self.line(extra)
        self.logger.info(text)
        self._last_t, self._last_n = time.monotonic(), self.done
        if self.on_update:
            self.on_update(self.done, self.total, text)
        return text
