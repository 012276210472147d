"""Log-friendly progress: plain log lines every N items or S seconds (progress bars do not survive in logs).

A line reads, e.g.::

    [extract] samples 120/1000 (12.0%) | tokens 61,440 | 2,512 tok/s | elapsed 0:00:24 | ETA 0:02:55

A ``total`` of 0 means unknown (a stream): lines then show the count without a percentage or ETA.
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

    def update(self, n: int = 1, tokens: int = 0, extra: str = "") -> None:
        self.done += n
        self.tokens += tokens
        now = time.monotonic()
        due_n = self.every_n and self.done - self._last_n >= self.every_n
        due_s = self.every_s and now - self._last_t >= self.every_s
        if due_n or due_s or (self.total and self.done >= self.total):
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
        if 0 < self.done < self.total and elapsed > 0:
            parts.append(f"ETA {fmt_duration(elapsed * (self.total - self.done) / self.done)}")
        if extra:
            parts.append(extra)
        return " | ".join(parts)

    def emit(self, extra: str = "") -> str:
        text = self.line(extra)
        self.logger.info(text)
        self._last_t, self._last_n = time.monotonic(), self.done
        if self.on_update:
            self.on_update(self.done, self.total, text)
        return text
