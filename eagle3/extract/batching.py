"""Token-budget batching for extraction: length-sorted batches under a padded-token budget and a sample cap.

Cost of a batch = samples x longest sample (padded tokens): the attention and MLP work and the activation memory of
a right-padded batch. Samples are taken longest first, so every batch is as long as its first sample, padding stays
small, and a budget too large for the device fails on the first batches rather than after hours.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    indices: list[int]  # dataset indices, longest first
    lengths: list[int]  # tokens per sample

    @property
    def padded_tokens(self) -> int:
        return len(self.indices) * max(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


class TokenBudgetBatcher:
    """Hands out batches of at most ``budget`` padded tokens and ``max_samples`` samples (a sample longer than the
    budget goes alone). ``budget`` may be lowered between batches (OOM recovery); ``put_back`` returns a failed batch
    to the front, optionally as single-sample batches."""

    def __init__(self, lengths: dict[int, int], max_tokens: int, max_samples: int):
        order = sorted(lengths, key=lambda i: (-lengths[i], i))
        self._queue: deque[int] = deque(order)
        self._lengths = lengths
        self._single: set[int] = set()
        self.budget = int(max_tokens)
        self.max_samples = int(max_samples)

    def __len__(self) -> int:
        return len(self._queue)

    def next(self) -> Batch | None:
        if not self._queue:
            return None
        first = self._queue[0]
        longest = self._lengths[first]
        n = 1 if first in self._single else max(1, min(self.max_samples, self.budget // max(1, longest)))
        take = []
        while self._queue and len(take) < n and (not take or self._queue[0] not in self._single):
            take.append(self._queue.popleft())
        return Batch(take, [self._lengths[i] for i in take])

    def count(self) -> int:
        """Batches this batcher would hand out at its current budget (consumes a copy, not this one)."""
        copy = TokenBudgetBatcher(dict(self._lengths), self.budget, self.max_samples)
        copy._queue = type(self._queue)(self._queue)
        copy._single = set(self._single)
        n = 0
        while copy.next() is not None:
            n += 1
        return n

    def put_back(self, batch: Batch, singles: bool = False) -> None:
        for i in reversed(batch.indices):
            self._queue.appendleft(i)
        if singles:
            self._single.update(batch.indices)


def pad_right(seqs: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> (input_ids [B, T_max] int64, attention_mask [B, T_max] int64).

    Right padding keeps position ids 0..T-1 for every real token, and the causal mask keeps real tokens from ever
    seeing padding, so a sample's states do not depend on its batch.
    """
    t_max = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t_max), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t_max), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[b, : len(s)] = 1
    return ids, mask
