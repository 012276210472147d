"""The learning-rate schedule: linear warmup, then cosine decay to a floor (or constant). The one schedule of the
project (the draft trainer and tools/tiny_verifier.py both use it)."""

from __future__ import annotations

import math


def lr_at(step: int, total_steps: int, peak_lr: float, warmup_steps: int, schedule: str = "cosine",
          min_lr_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total_steps``: ``(step + 1) / warmup_steps`` of the
    peak during warmup, then cosine from the peak down to ``min_lr_ratio * peak`` at the last step (or constant)."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    floor = min_lr_ratio * peak_lr
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
