"""The trainer's input: split the store's samples, pack them into rows of max_seq_len tokens, collate rows into
micro-batches, and serve the run's optimizer steps through a torch DataLoader (worker processes read and collate
while the model computes; pinned memory on CUDA).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from eagle3.extract.store import SCALE_SUFFIX, HiddenStateStore, dequantize_states
from eagle3.train.config import TrainError
from eagle3.train.ttt import ttt_counted

# ----------------------------------------------------------------------------- data: split, pack, collate


def split_indices(indices: list[int], val_ratio: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, val) split of sample indices; val gets round(ratio * N) samples, at least 1 when
    ratio > 0 and N >= 2, and never all of them."""
    n = len(indices)
    n_val = 0 if val_ratio <= 0 or n < 2 else min(n - 1, max(1, round(val_ratio * n)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    val = sorted(indices[i] for i in perm[:n_val])
    train = sorted(indices[i] for i in perm[n_val:])
    return train, val


def pack_samples(lengths: dict[int, int], max_seq_len: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing of samples (index -> tokens, each <= max_seq_len) into rows of
    ``max_seq_len`` tokens. Deterministic; O(N log N + N * bins) worst case with a sorted free-space list."""
    import bisect

    order = sorted(lengths, key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (free tokens, bin id)
    for i in order:
        n = lengths[i]
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            space, b = free.pop(j)
            bins[b].append(i)
            space -= n
        else:
            b = len(bins)
            bins.append([i])
            space = max_seq_len - n
        if space > 0:
            bisect.insort(free, (space, b))
    return bins


def packing_efficiency(bins: list[list[int]], lengths: dict[int, int], max_seq_len: int) -> float:
    """Real tokens / token slots (rows * max_seq_len)."""
    return sum(lengths[i] for b in bins for i in b) / max(1, len(bins) * max_seq_len)


@dataclass
class Batch:
    """Packed rows of one micro-batch (tensors on CPU until ``to``)."""

    input_ids: torch.Tensor  # [B, T] int64, target-vocab ids (0 in padding)
    aux: torch.Tensor  # [B, T, n_aux * H] store dtype (a scaled store's: dequantized to collate's dequant_dtype)
    final: torch.Tensor  # [B, T, H] same dtype, last layer output BEFORE the verifier's final norm
    loss_mask: torch.Tensor  # [B, T] bool
    seq_ids: torch.Tensor  # [B, T] int64 sample slot within its row, -1 = padding
    position_ids: torch.Tensor  # [B, T] int64 position inside its own sample
    tokens: int  # real tokens in the batch
    counted: torch.Tensor  # [K] int64 entries counted per TTT step

    def to(self, device: torch.device) -> Batch:
        move = {"device": device, "non_blocking": True}
        return Batch(self.input_ids.to(**move), self.aux.to(**move), self.final.to(**move),
                     self.loss_mask.to(**move), self.seq_ids.to(**move), self.position_ids.to(**move), self.tokens,
                     self.counted)

    def pin_memory(self) -> Batch:
        """Page-locked copies, so ``to(cuda, non_blocking=True)`` overlaps the copy (the DataLoader calls this)."""
        return Batch(self.input_ids.pin_memory(), self.aux.pin_memory(), self.final.pin_memory(),
                     self.loss_mask.pin_memory(), self.seq_ids.pin_memory(), self.position_ids.pin_memory(),
                     self.tokens, self.counted)


def collate(store: HiddenStateStore, bins: list[list[int]], max_seq_len: int, ttt_steps: int,
            vocab_size: int, dequant_dtype: torch.dtype = torch.float32) -> Batch:
    """Load the samples of ``bins`` (one packed row each) into padded tensors (length = longest row).

    States keep the store dtype; a scaled store's (float8_e4m3fn) are dequantized here, into ``dequant_dtype``
    (the training compute dtype), so the loader workers do it rather than the training loop."""
    rows = [[store.load(i) for i in b] for b in bins]
    lens = [[min(int(s["input_ids"].shape[0]), max_seq_len) for s in r] for r in rows]
    b, t = len(bins), max(1, max(sum(r) for r in lens))
    h, n_aux_h = store.hidden_size, store.hidden_size * int(store.meta["n_aux"])
    states = dequant_dtype if store.scaled else store.dtype
    out = Batch(
        input_ids=torch.zeros(b, t, dtype=torch.int64), aux=torch.zeros(b, t, n_aux_h, dtype=states),
        final=torch.zeros(b, t, h, dtype=states), loss_mask=torch.zeros(b, t, dtype=torch.bool),
        seq_ids=torch.full((b, t), -1, dtype=torch.int64), position_ids=torch.zeros(b, t, dtype=torch.int64),
        tokens=sum(map(sum, lens)), counted=torch.zeros(ttt_steps, dtype=torch.int64),
    )
    for r, (samples, idxs) in enumerate(zip(rows, bins)):
        start = 0
        for slot, (s, n, idx) in enumerate(zip(samples, lens[r], idxs)):
            ids = s["input_ids"][:n]
            if n and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
                raise TrainError(f"sample {idx} of store {store.path}: token id {int(ids.max())} outside the "
                                 f"verifier vocabulary [0, {vocab_size})")
            sl = slice(start, start + n)
            out.input_ids[r, sl] = ids
            for key, dest in (("aux_hidden_states", out.aux), ("final_hidden_state", out.final)):
                if store.scaled:  # dest[r, sl]: [n, width], contiguous, written in place
                    dequantize_states(s[key][:n], s[key + SCALE_SUFFIX][:n], out=dest[r, sl])
                else:
                    dest[r, sl] = s[key][:n]
            out.loss_mask[r, sl] = s["loss_mask"][:n].bool()
            out.seq_ids[r, sl] = slot
            out.position_ids[r, sl] = torch.arange(n)
            start += n
    for k in range(ttt_steps):
        out.counted[k] = ttt_counted(out.loss_mask, out.seq_ids, k).sum()
    return out




@dataclass(frozen=True)
class BatchPlan:
    """Which packed rows form each optimizer step: a seeded permutation of the rows per epoch, cut into global
    batches of ``batch_size`` rows, each split over ``grad_accum_steps`` micro-batches x ``world`` processes.
    Plain data, so DataLoader workers compute the same steps as the trainer."""

    rows: list[list[int]]  # packed training rows: sample indices per row
    seed: int
    batch_size: int  # rows per optimizer step, all processes and micro-batches
    grad_accum_steps: int
    world: int
    rank: int

    @property
    def micro(self) -> int:
        return self.batch_size // (self.world * self.grad_accum_steps)

    def epoch_order(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return [self.rows[i] for i in torch.randperm(len(self.rows), generator=g).tolist()]

    def micro_bins(self, epoch: int, step: int) -> list[list[list[int]]]:
        """This process's micro-batches (lists of rows) of optimizer step ``step`` of ``epoch``."""
        glob = self.epoch_order(epoch)[step * self.batch_size:(step + 1) * self.batch_size]
        mb, w, r = self.micro, self.world, self.rank
        return [glob[(m * w + r) * mb:(m * w + r + 1) * mb] for m in range(self.grad_accum_steps)]


class _StepBatches(torch.utils.data.Dataset):
    """Item (epoch, step) = this process's micro-batches of that optimizer step, collated. Indexed by the step
    itself, so one loader (one set of worker processes) serves the whole run, resumed runs included. Pickles as
    the store's path (a worker re-opens the store instead of receiving its whole manifest)."""

    def __init__(self, store: HiddenStateStore, plan: BatchPlan, max_seq_len: int, ttt_steps: int, vocab_size: int,
                 dequant_dtype: torch.dtype = torch.float32):
        self.store, self.plan = store, plan
        self.max_seq_len, self.ttt_steps, self.vocab_size = max_seq_len, ttt_steps, vocab_size
        self.dequant_dtype = dequant_dtype

    def __getstate__(self) -> dict:
        return {**self.__dict__, "store": str(self.store.path)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.store = HiddenStateStore(state["store"])

    def __getitem__(self, key: tuple[int, int]) -> list[Batch]:
        epoch, step = key
        return [collate(self.store, bins, self.max_seq_len, self.ttt_steps, self.vocab_size, self.dequant_dtype)
                for bins in self.plan.micro_bins(epoch, step)]


class StepLoader:
    """The trainer's input pipeline: a torch DataLoader over the run's remaining (epoch, step) pairs, yielding each
    optimizer step's micro-batches (``list[Batch]``). ``workers`` processes (spawned: the trainer's own process runs
    threads that fork must not copy) read the store and collate ahead of the model, 2 steps per worker in flight;
    0 = load in this process. Pinned memory when training on CUDA. ``dequant_dtype``: see ``collate``."""

    def __init__(self, store: HiddenStateStore, plan: BatchPlan, steps: Iterable[tuple[int, int]], max_seq_len: int,
                 ttt_steps: int, vocab_size: int, workers: int, pin_memory: bool = False,
                 dequant_dtype: torch.dtype = torch.float32):
        dataset = _StepBatches(store, plan, max_seq_len, ttt_steps, vocab_size, dequant_dtype)
        self.loader = torch.utils.data.DataLoader(
            dataset, sampler=list(steps), batch_size=None, collate_fn=_as_is, num_workers=workers,
            pin_memory=pin_memory, prefetch_factor=2 if workers else None,
            multiprocessing_context="spawn" if workers else None)
        self._iter: Iterator[list[Batch]] | None = None
    def __iter__(self) -> Iterator[list[Batch]]:
        self._iter = iter(self.loader)
        return self._iter

    def close(self) -> None:
        """Stop the worker processes (a run that stopped early leaves steps unread)."""
        shutdown = getattr(self._iter, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iter = None


def _as_is(item: list[Batch]) -> list[Batch]:
    return item
