"""The trainer's input: split the store's samples, pack them into rows of max_seq_len tokens, collate rows into
micro-batches, and serve the run's optimizer steps (loader threads read and collate while the model computes;
pinned memory on CUDA). Every sample is checked against its manifest sha256 on its first read of a run, in the
loader, before it is collated (``verify_bins``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from eagle3.store import SCALE_SUFFIX, HiddenStateStore, StoreError, dequantize_states
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
    aux: torch.Tensor  # [B, T, n_aux * H] store dtype, or a scaled store's dequantized to collate's dequant_dtype
    final: torch.Tensor  # [B, T, H] same dtype, last layer output BEFORE the verifier's final norm
    loss_mask: torch.Tensor  # [B, T] bool
    seq_ids: torch.Tensor  # [B, T] int64 sample slot within its row, -1 = padding
    position_ids: torch.Tensor  # [B, T] int64 position inside its own sample
    tokens: int  # real tokens in the batch
    counted: torch.Tensor  # [K] int64 entries counted per TTT step
    # a scaled store's states still quantized (collate(dequantize=False)): aux/final hold the stored float8 values,
    # these their float32 scales; ``to`` dequantizes on the device into dequant_dtype
    aux_scale: torch.Tensor | None = None  # [B, T, n_aux]
    final_scale: torch.Tensor | None = None  # [B, T, 1]
    dequant_dtype: torch.dtype | None = None

    def _map(self, fn) -> Batch:
        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return Batch(fn(self.input_ids), fn(self.aux), fn(self.final), fn(self.loss_mask), fn(self.seq_ids),
                     fn(self.position_ids), self.tokens, self.counted, opt(self.aux_scale), opt(self.final_scale),
                     self.dequant_dtype)

    def to(self, device: torch.device) -> Batch:
        """On ``device``; quantized states are dequantized there (after the copy: half the bytes cross the bus)."""
        out = self._map(lambda t: t.to(device=device, non_blocking=True))
        if out.aux_scale is not None:
            out.aux = _dequantize_rows(out.aux, out.aux_scale, out.dequant_dtype)
            out.final = _dequantize_rows(out.final, out.final_scale, out.dequant_dtype)
            out.aux_scale = out.final_scale = None
        return out

    def pin_memory(self) -> Batch:
        """Page-locked copies, so ``to(cuda, non_blocking=True)`` overlaps the copy (the loader threads call this)."""
        return self._map(torch.Tensor.pin_memory)


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q: [B, T, n * H] float8, scale: [B, T, n] -> [B, T, n * H] ``dtype`` on q's device."""
    b, t, width = q.shape
    return dequantize_states(q.reshape(b * t, width), scale.reshape(b * t, -1), dtype=dtype).view(b, t, width)


def noised_aux(aux: torch.Tensor, amplitude: float, seed: int) -> torch.Tensor:
    """``aux`` [B, T, n_aux * H] in float32 plus uniform noise U(-amplitude, amplitude) drawn from a generator seeded
    with ``seed`` on aux's device (``train.feature_noise``): the same seed gives the same noise, so a resumed run adds
    what an uninterrupted one did. Float32 because the draft's fc reads float32 anyway, and bf16 would round most of
    a small noise away."""
    g = torch.Generator(device=aux.device).manual_seed(seed)
    noise = torch.rand(aux.shape, generator=g, device=aux.device, dtype=torch.float32)
    return noise.mul_(2 * amplitude).sub_(amplitude).add_(aux.float())


def noise_seed(seed: int, global_step: int, rank: int, micro: int) -> int:
    """The noise seed of one micro-batch: distinct per (run seed, optimizer step, process, micro-batch)."""
    return (((seed * 1_000_003 + global_step) * 65_537 + rank) * 257 + micro) & (2**63 - 1)


def collate(store: HiddenStateStore, bins: list[list[int]], max_seq_len: int, ttt_steps: int,
            vocab_size: int, dequant_dtype: torch.dtype = torch.float32, dequantize: bool = True) -> Batch:
    """Load the samples of ``bins`` (one packed row each) into padded tensors (length = longest row).

    States keep the store dtype. A scaled store's (float8_e4m3fn) are dequantized here into ``dequant_dtype`` (the
    training compute dtype; the loader workers then do it, CPU training), or with ``dequantize=False`` stay
    quantized with their scales until ``Batch.to`` dequantizes them on the device (CUDA training: half the bytes
    to copy, and no CPU conversion, which runs at ~7k tokens/s per core at Kimi-K2.5's width)."""
    store.prefetch([i for b in bins for i in b])  # the kernel reads every file of the batch while we copy
    rows = [[store.load(i) for i in b] for b in bins]
    lens = [[min(int(s["input_ids"].shape[0]), max_seq_len) for s in r] for r in rows]
    b, t = len(bins), max(1, max(sum(r) for r in lens))
    h, n_aux = store.hidden_size, int(store.meta["n_aux"])
    quantized = store.scaled and not dequantize
    states = dequant_dtype if store.scaled and dequantize else store.dtype
    out = Batch(
        input_ids=torch.zeros(b, t, dtype=torch.int64), aux=torch.empty(b, t, n_aux * h, dtype=states),
        final=torch.empty(b, t, h, dtype=states), loss_mask=torch.zeros(b, t, dtype=torch.bool),
        seq_ids=torch.full((b, t), -1, dtype=torch.int64), position_ids=torch.zeros(b, t, dtype=torch.int64),
        tokens=sum(map(sum, lens)), counted=torch.zeros(ttt_steps, dtype=torch.int64),
        aux_scale=torch.empty(b, t, n_aux, dtype=torch.float32) if quantized else None,
        final_scale=torch.empty(b, t, 1, dtype=torch.float32) if quantized else None,
        dequant_dtype=dequant_dtype if quantized else None,
    )
    big = [(out.aux, "aux_hidden_states"), (out.final, "final_hidden_state")]
    if quantized:
        big += [(out.aux_scale, "aux_hidden_states" + SCALE_SUFFIX),
                (out.final_scale, "final_hidden_state" + SCALE_SUFFIX)]
    for r, (samples, idxs) in enumerate(zip(rows, bins)):
        start = 0
        for slot, (s, n, idx) in enumerate(zip(samples, lens[r], idxs)):
            ids = s["input_ids"][:n]
            if n and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
                raise TrainError(f"sample {idx} of store {store.path}: token id {int(ids.max())} outside the "
                                 f"verifier vocabulary [0, {vocab_size})")
            sl = slice(start, start + n)
            out.input_ids[r, sl] = ids
            for dest, key in big:
                if store.scaled and not quantized and not key.endswith(SCALE_SUFFIX):
                    # dest[r, sl]: [n, width], contiguous, written in place
                    dequantize_states(s[key][:n], s[key + SCALE_SUFFIX][:n], out=dest[r, sl])
                else:
                    dest[r, sl] = s[key][:n]
            out.loss_mask[r, sl] = s["loss_mask"][:n].bool()
            out.seq_ids[r, sl] = slot
            out.position_ids[r, sl] = torch.arange(n)
            start += n
        for dest, _ in big:  # the buffers are uninitialised: zero the row's padding only
            dest[r, start:].zero_()
    for k in range(ttt_steps):
        out.counted[k] = ttt_counted(out.loss_mask, out.seq_ids, k).sum()
    return out


@dataclass(frozen=True)
class DamagedSample:
    """What the loader hands back instead of a step's batches when one of its samples failed verification (the
    trainer raises it as one TrainError naming the sample)."""

    message: str


def verify_bins(store: HiddenStateStore, bins: list[list[int]]) -> DamagedSample | None:
    """Verify every sample of ``bins`` (rows of sample indices) before any is collated: each is hashed on its first
    read by this store object (``HiddenStateStore.verify_sample``; a damaged one is quarantined), so no step is
    trained on a damaged sample. In a loader thread the hashing overlaps the model's compute."""
    for row in bins:
        for i in row:
            try:
                store.verify_sample(i)
            except StoreError as e:
                return DamagedSample(str(e))
    return None


@dataclass(frozen=True)
class BatchPlan:
    """Which packed rows form each optimizer step: a seeded permutation of the rows per epoch, cut into global
    batches of ``batch_size`` rows, each split over ``grad_accum_steps`` micro-batches x ``world`` processes.
    Plain data: the loader computes the same steps as the trainer."""

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
        """The rows in the seeded order of ``epoch`` (computed once per epoch per process)."""
        cache = self.__dict__.setdefault("_order", {})
        if epoch not in cache:
            cache.clear()
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            cache[epoch] = [self.rows[i] for i in torch.randperm(len(self.rows), generator=g).tolist()]
        return cache[epoch]

    def micro_bins(self, epoch: int, step: int) -> list[list[list[int]]]:
        """This process's micro-batches (lists of rows) of optimizer step ``step`` of ``epoch``."""
        glob = self.epoch_order(epoch)[step * self.batch_size:(step + 1) * self.batch_size]
        mb, w, r = self.micro, self.world, self.rank
        return [glob[(m * w + r) * mb:(m * w + r + 1) * mb] for m in range(self.grad_accum_steps)]


class _StepBatches:
    """Item (epoch, step) = this process's micro-batches of that optimizer step, collated. Indexed by the step
    itself, so one loader serves the whole run, resumed runs included. Each item first asks the kernel for its own
    files (read first by ``verify_bins``; asked for already unless it is the run's first item) and for those of the
    ``lookahead`` steps after it (``HiddenStateStore.prefetch``), so disk reads run ahead of the hashing and
    copying."""

    def __init__(self, store: HiddenStateStore, plan: BatchPlan, max_seq_len: int, ttt_steps: int, vocab_size: int,
                 dequant_dtype: torch.dtype = torch.float32, dequantize: bool = True, lookahead: int = 1):
        self.store, self.plan = store, plan
        self.max_seq_len, self.ttt_steps, self.vocab_size = max_seq_len, ttt_steps, vocab_size
        self.dequant_dtype, self.dequantize, self.lookahead = dequant_dtype, dequantize, lookahead

    def __getitem__(self, key: tuple[int, int]) -> list[Batch] | DamagedSample:
        epoch, step = key
        for ahead in range(1 + self.lookahead):
            self.store.prefetch([i for m in self.plan.micro_bins(epoch, step + ahead) for b in m for i in b])
        micro = self.plan.micro_bins(epoch, step)
        if (bad := verify_bins(self.store, [row for bins in micro for row in bins])) is not None:
            return bad
        return [collate(self.store, bins, self.max_seq_len, self.ttt_steps, self.vocab_size, self.dequant_dtype,
                        self.dequantize) for bins in micro]


class StepLoader:
    """The trainer's input pipeline: each optimizer step's micro-batches (``list[Batch]``, or a ``DamagedSample``
    when a sample of the step failed its first-read hash check) for the run's remaining (epoch, step) pairs, in
    order. ``workers`` threads read the store, verify and collate ahead of the model, 2 steps per thread in flight;
    0 = load on demand in the caller's thread. Pinned memory (in the loader threads) when training on CUDA.
    ``dequant_dtype``, ``dequantize``: see ``collate``.

    Threads, not torch DataLoader worker processes (measured 2-6x the tokens/s side by side): the work is file
    reads, hashing and torch copies/conversions, which release the GIL, while a process must hand every batch over
    through shared memory, which costs more than collating it (a Kimi-K2.5 row of 2048 tokens is 146 MB in bf16:
    ~0.15-0.2 s to move through /dev/shm against ~0.07 s to collate; bench/train_loader.py). A loading error is
    raised in the training loop as itself."""

    def __init__(self, store: HiddenStateStore, plan: BatchPlan, steps: Iterable[tuple[int, int]], max_seq_len: int,
                 ttt_steps: int, vocab_size: int, workers: int, pin_memory: bool = False,
                 dequant_dtype: torch.dtype = torch.float32, dequantize: bool = True):
        self.items = _StepBatches(store, plan, max_seq_len, ttt_steps, vocab_size, dequant_dtype, dequantize,
                                  lookahead=max(1, workers))
        self.steps, self.workers, self.pin_memory = steps, workers, pin_memory
        self._pool: ThreadPoolExecutor | None = None

    def _load(self, key: tuple[int, int]) -> list[Batch] | DamagedSample:
        batches = self.items[key]
        if isinstance(batches, DamagedSample) or not self.pin_memory:
            return batches
        return [b.pin_memory() for b in batches]

    def __iter__(self) -> Iterator[list[Batch] | DamagedSample]:
        if not self.workers:
            return map(self._load, self.steps)
        self.close()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="eagle3-loader")
        return self._run(self._pool, iter(self.steps))

    def _run(self, pool: ThreadPoolExecutor, steps: Iterator[tuple[int, int]]) -> Iterator[list[Batch] | DamagedSample]:
        pending = deque(pool.submit(self._load, key) for key in itertools.islice(steps, 2 * self.workers))
        while pending:
            batches = pending.popleft().result()  # a loading error is raised here, in the training loop
            for key in itertools.islice(steps, 1):
                pending.append(pool.submit(self._load, key))
            yield batches

    def close(self) -> None:
        """Stop loading (a run that stopped early leaves steps unread): queued steps are dropped, the ones being
        collated finish."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
