"""The in-job out-of-memory rule: a batch budget (tokens or rows) halved on each out-of-memory error, down to its
floor, with the history kept for the stage's artifact. Used inside the vLLM drivers (regeneration's rows per
generate call) and in-process (extraction's padded tokens per forward, the vLLM extraction restart's tokens per
step); the pipeline's OOM-only task retry (``eagle3.support.gpu``) is the outer layer, at smaller batches again.

Standard library only: the drivers import it in the vLLM environment.
"""

from __future__ import annotations


class HalvingBudget:
    """``value`` units (e.g. "tokens", "rows") per batch; ``halve()`` after an out-of-memory error."""

    def __init__(self, value: int, floor: int, unit: str):
        if floor < 1 or value < floor:
            raise ValueError(f"batch budget {value} {unit} below its floor {floor} {unit}")
        self.value, self.floor, self.unit = int(value), int(floor), unit
        self.history: list[int] = []  # the budget after each halving
        self.previous = self.value

    @property
    def at_floor(self) -> bool:
        return self.value <= self.floor

    def halve(self) -> bool:
        """Halve the budget (not below the floor); False when it already was at the floor (nothing left to try)."""
        if self.at_floor:
            return False
        self.previous, self.value = self.value, max(self.value // 2, self.floor)
        self.history.append(self.value)
        return True

    def describe_halving(self) -> str:
        """'1,024 -> 512 tokens': the last halving, for the log line."""
        return f"{self.previous:,} -> {self.value:,} {self.unit}"
