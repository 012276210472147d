"""Train the EAGLE-3 draft on stored verifier states with the training-time test (TTT).

Pipeline position: store + vocab -> **train** -> checkpoints -> validate.

Lifecycle (``Trainer``): setup (check inputs, split, pack, build draft/teacher/optimizer, resume) -> train (epochs of
optimizer steps; validation, vLLM-ready checkpoint, trainer state and plots after each epoch) -> cleanup.
``train_draft`` runs it in this process, or launches ``torch.distributed.run`` workers (eagle3.train.launch) when
``nproc > 1``.

Training-time test: K unrolled draft steps over every context position of a packed row at once
-------------------------------------------------------------------------------------------------
One packed sample of T tokens (i = position inside the sample; a_i / f_i = the verifier's aux / final states after
reading x_0 .. x_i, so f_i gives the verifier's distribution of x_{i+1})::

    i                  :  0      1      2      3      4      5
    input_ids          :  x0     x1     x2     x3     x4     x5
    verifier states    :  a0,f0  a1,f1  a2,f2  a3,f3  a4,f4  a5,f5

    step 0, entry i    :  token x_{i+1}, hidden fc(a_i), position i                 (vLLM's first pass)
      token            :  x1     x2     x3     x4     x5     .
      teacher          :  f1     f2     f3     f4     f5     .         guesses x_{i+2}
      counted if       :  i+2 < T and loss_mask[i+2]                    (i = 0 .. 3 here)
    step 1, entry i    :  token x_{i+2}, hidden g0_i (step-0 PRE-norm output, same entry), position i+1
      token            :  x2     x3     x4     x5     .      .
      teacher          :  f2     f3     f4     f5     .      .         guesses x_{i+3}  (i = 0 .. 2)
    step k, entry i    :  token x_{i+1+k}, hidden g{k-1}_i, position i+k, teacher f_{i+1+k}, guesses x_{i+2+k},
                          counted if i+2+k < T and loss_mask[i+2+k] (the guessed token is an assistant token)

Attention of step k, entry i: the step-0 entries 0 .. i of the SAME packed sample (the context, fc(aux) features, as
vLLM's KV cache holds them) plus its own entries at steps 1 .. k (the diagonal: the chain's earlier draft steps).
So entry i of step k is vLLM's draft step k of a chain whose first pass ended at position i (eagle3.draft.model docstring),
except that step k reads the data token x_{i+1+k} where serving reads its own guess (equal whenever the chain is
still accepted under greedy verification).

Teacher: the verifier's final norm + lm_head rows of the draft vocabulary applied to the stored final state,
softmax over the draft vocabulary (the verifier distribution restricted to the draft vocab). Loss per step: forward
KL(teacher || draft), averaged over counted entries of the whole optimizer step (all micro-batches, all ranks);
total = sum_k step_weight_decay**k * loss_k.

Metrics per step k: accuracy = P(draft argmax == teacher argmax) over counted entries; conditional accuracy = the
same among entries whose steps 0 .. k-1 were all right (a chain still alive). Simulated acceptance length, on vLLM's
scale (vLLM's mean acceptance length = 1 + accepted / drafts, the 1 being the verifier's bonus token):
``sim_accept_len = 1 + sum_k prod_{j<=k} acc_j`` (the issue's definition, product of marginal accuracies) and
``chain_accept_len = 1 + sum_k prod_{j<=k} cond_acc_j`` (expected accepted length of a greedy chain).
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from eagle3.draft import checkpoint as ckpt
from eagle3.draft.model import DraftArchitecture, DraftConfig, Eagle3Draft
from eagle3.extract.store import HiddenStateStore, StoreError
from eagle3.support.io import atomic_write_json, atomic_write_text, sha256_file
from eagle3.support.progress import Progress, fmt_duration
from eagle3.support.verifier import VerifierSpec, load_verifier_head, verifier_fingerprint
from eagle3.train.schedule import lr_at
from eagle3.vocab import load_mapping

log = logging.getLogger("eagle3")

METRICS = "metrics.jsonl"
RESULT = "train_result.json"
N_STATS = 5  # per TTT step: kl_sum, counted, correct, alive (chain still right before this step), alive_correct
# settings that do not change what the run computes: a resumed run may change them
RESUME_FREE = frozenset({"log_every_steps", "stop_after_steps", "save_state_every_steps", "device", "nproc",
                         "parallel", "prefetch", "keep_last_n", "grad_accum_steps"})


class TrainError(ValueError):
    """Bad training input (store, vocab mapping, verifier, settings); the message names the file / field."""


class TrainConfig(BaseModel):
    """Draft training settings (EAGLE-3 / SpecForge defaults where they exist)."""

    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(10, gt=0, description="Passes over the training split.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW), per optimizer step.")
    schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="Learning-rate schedule after warmup: cosine decay to min_lr_ratio * lr, or constant.")
    warmup_ratio: float = Field(0.015, ge=0, lt=1, description="Linear warmup length as a fraction of all "
                                "optimizer steps of the run.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate of the cosine, as a fraction "
                                "of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay (per step, times lr).")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    max_grad_norm: float = Field(0.5, gt=0, description="Gradient clipping: max global L2 norm.")
    batch_size: int = Field(8, gt=0, description="Packed sequences per optimizer step, over all processes and "
                            "accumulation micro-steps (the global batch). Must be a multiple of "
                            "nproc * grad_accum_steps.")
    grad_accum_steps: int = Field(1, gt=0, description="Micro-batches per process per optimizer step.")
    max_seq_len: int = Field(2048, gt=2, description="Packed sequence length in tokens; longer samples are "
                             "truncated to it.")
    ttt_steps: int = Field(7, gt=0, description="Training-time-test unroll depth K in draft steps (EAGLE-3: 7; "
                           "vLLM serving often drafts 3).")
    step_weight_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of TTT step k is this ** k.")
    val_ratio: float = Field(0.05, ge=0, lt=1, description="Fraction of samples held out for validation "
                             "(deterministic in seed).")
    seed: int = Field(0, description="Seed of the draft init, split and per-epoch batch order.")
    keep_last_n: int = Field(2, ge=0, description="Epoch checkpoints kept besides `best` (0 = keep all).")
    save_state_every_steps: int = Field(0, ge=0, description="Also write the resume state every this many "
                                        "optimizer steps inside an epoch (0 = only at epoch ends).")
    stop_after_steps: int | None = Field(None, gt=0, description="End this invocation once the run has made this "
                                         "many optimizer steps in total, saving the resume state (time-boxed "
                                         "jobs); the schedule still spans all epochs. None = run to the end.")
    eval_before_training: bool = Field(True, description="Validate the untrained draft first (epoch 0 in the "
                                       "metrics) as a baseline.")
    log_every_steps: int = Field(10, gt=0, description="One progress line + one metrics.jsonl line every this "
                                 "many optimizer steps.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu. "
                                                   "bf16 autocast on cuda, float32 on cpu.")
    nproc: int = Field(1, gt=0, description="Training processes (torchrun workers; one per GPU on cuda).")
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description="With nproc > 1: ddp replicates the draft; fsdp "
                                             "shards it (drafts too big for one GPU).")
    draft: DraftArchitecture = Field(default_factory=DraftArchitecture, description="Draft architecture options.")
    checkpoint_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="dtype of the saved draft weights (None: the verifier's dtype).")
    save_embedding: bool = Field(False, description="Also save embed_tokens.weight in model.safetensors (vLLM "
                                 "shares the verifier's embedding when it is absent; Kimi: 2.3 GB saved).")
    prefetch: bool = Field(True, description="Load the next optimizer step's batches in a background thread.")


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


def shift_left(x: torch.Tensor, n: int, fill: float | bool) -> torch.Tensor:
    """x: [B, T, ...] -> y with y[:, i] = x[:, i + n] (i + n < T), ``fill`` beyond the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1) if n < x.shape[1] else torch.full_like(x, fill)


def ttt_counted(loss_mask: torch.Tensor, seq_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Entries of TTT step k that enter loss and metrics: the guessed token x_{i+2+k} lies in the same packed sample
    and is loss-masked (see the diagram). loss_mask: [B, T] bool, seq_ids: [B, T] (-1 = padding) -> [B, T] bool."""
    same = shift_left(seq_ids, 2 + k, -1) == seq_ids
    return shift_left(loss_mask, 2 + k, False) & same & (seq_ids >= 0)


def ttt_in_sample(seq_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Entries whose step-k guess x_{i+2+k} is still inside their own sample (loss mask not required)."""
    return (shift_left(seq_ids, 2 + k, -1) == seq_ids) & (seq_ids >= 0)


def context_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """Step-0 attention: causal inside each packed sample. seq_ids: [B, T] -> [B, 1, T, T] bool (True = attend).
    Padding entries (-1) see the padding before them, never a sample (and no row is empty)."""
    t = seq_ids.shape[1]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]  # [B, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=seq_ids.device).tril()
    return (same & causal)[:, None]


@dataclass
class Batch:
    """Packed rows of one micro-batch (tensors on CPU until ``to``)."""

    input_ids: torch.Tensor  # [B, T] int64, target-vocab ids (0 in padding)
    aux: torch.Tensor  # [B, T, n_aux * H] store dtype
    final: torch.Tensor  # [B, T, H] store dtype, last layer output BEFORE the verifier's final norm
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


def collate(store: HiddenStateStore, bins: list[list[int]], max_seq_len: int, ttt_steps: int,
            vocab_size: int) -> Batch:
    """Load the samples of ``bins`` (one packed row each) into padded tensors (length = longest row)."""
    rows = [[store.load(i) for i in b] for b in bins]
    lens = [[min(int(s["input_ids"].shape[0]), max_seq_len) for s in r] for r in rows]
    b, t = len(bins), max(1, max(sum(r) for r in lens))
    h, n_aux_h = store.hidden_size, store.hidden_size * int(store.meta["n_aux"])
    out = Batch(
        input_ids=torch.zeros(b, t, dtype=torch.int64), aux=torch.zeros(b, t, n_aux_h, dtype=store.dtype),
        final=torch.zeros(b, t, h, dtype=store.dtype), loss_mask=torch.zeros(b, t, dtype=torch.bool),
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
            out.aux[r, sl] = s["aux_hidden_states"][:n]
            out.final[r, sl] = s["final_hidden_state"][:n]
            out.loss_mask[r, sl] = s["loss_mask"][:n].bool()
            out.seq_ids[r, sl] = slot
            out.position_ids[r, sl] = torch.arange(n)
            start += n
    for k in range(ttt_steps):
        out.counted[k] = ttt_counted(out.loss_mask, out.seq_ids, k).sum()
    return out


# ----------------------------------------------------------------------------- the training-time test


class TrainingTimeTest(nn.Module):
    """Draft + frozen teacher head; ``forward`` unrolls K draft steps and returns (loss, stats [K, 5]).

    Wrapping this whole module (not the draft) in DDP/FSDP keeps every draft call inside one ``forward``.
    """

    def __init__(self, draft: nn.Module, teacher_norm: torch.Tensor, teacher_lm_head: torch.Tensor, eps: float,
                 ttt_steps: int, step_weight_decay: float, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.draft = draft
        self.register_buffer("teacher_norm", teacher_norm, persistent=False)  # [H]
        self.register_buffer("teacher_lm_head", teacher_lm_head, persistent=False)  # [draft_vocab, H]
        self.eps, self.ttt_steps, self.autocast_dtype = eps, ttt_steps, autocast_dtype
        self.weights = [step_weight_decay**k for k in range(ttt_steps)]

    def teacher_logits(self, final: torch.Tensor) -> torch.Tensor:
        """final: [B, T, H] (BEFORE the verifier's final norm) -> [B, T, draft_vocab]: verifier norm + lm_head rows."""
        with torch.autocast(final.device.type, enabled=False):  # the teacher stays float32 under bf16 autocast
            h = final.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.teacher_norm.float()
            return h @ self.teacher_lm_head.float().T

    def forward(self, batch: Batch, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """norm: [K] float, the divisor of step k's KL sum (entries counted in the whole optimizer step, divided by the
        number of processes because DDP averages gradients). Returns (weighted loss, stats [K, 5] float64)."""
        device = batch.input_ids.device
        enabled = self.autocast_dtype is not None
        with torch.autocast(device.type, dtype=self.autocast_dtype or torch.bfloat16, enabled=enabled):
            with torch.no_grad():
                t_logp = torch.log_softmax(self.teacher_logits(batch.final).float(), dim=-1)  # [B, T, D]
                t_arg = t_logp.argmax(-1)  # [B, T]
                t_p = t_logp.exp()  # [B, T, D] teacher probabilities, once: every TTT step slices this storage
                t_ent = -(t_p * t_logp).sum(-1)  # [B, T] entropy of the teacher
            mask = context_mask(batch.seq_ids)  # [B, 1, T, T]
            hidden = self.draft.project_aux(batch.aux.float())  # [B, T, H]; bf16 under autocast on cuda
            return self._unroll(batch, hidden, mask, t_p, t_arg, t_ent, norm)

    def _unroll(self, batch: Batch, hidden: torch.Tensor, mask: torch.Tensor, t_p: torch.Tensor,
                t_arg: torch.Tensor, t_ent: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from eagle3.draft.model import KVCache

        t = batch.input_ids.shape[1]
        cache = KVCache()
        alive = torch.ones_like(batch.loss_mask)  # [B, T] chain right at every earlier step
        loss = hidden.new_zeros((), dtype=torch.float32)
        stats = torch.zeros(self.ttt_steps, N_STATS, dtype=torch.float64, device=hidden.device)
        for k in range(self.ttt_steps):
            ids = shift_left(batch.input_ids, 1 + k, 0)  # [B, T] token x_{i+1+k}
            hidden, logits = self.draft.step(ids, hidden, batch.position_ids + k, mask, cache)
            n = t - 1 - k  # entries 0 .. n-1 have a teacher f_{i+1+k}
            if n <= 0:
                continue
            counted = ttt_counted(batch.loss_mask, batch.seq_ids, k)[:, :n]  # [B, n]
            logq = torch.log_softmax(logits[:, :n].float(), dim=-1)  # [B, n, D]
            tp = t_p[:, 1 + k:]  # [B, n, D] teacher f_{i+1+k} (a view: no per-step copy kept for backward)
            # forward KL(p || q) = cross-entropy(p, q) - entropy(p)
            kl = -(tp * logq).sum(-1) - t_ent[:, 1 + k:]  # [B, n]
            kl_sum = (kl * counted).sum()
            loss = loss + self.weights[k] * kl_sum / norm[k]
            with torch.no_grad():
                right = logq.argmax(-1) == t_arg[:, 1 + k:]  # [B, n]
                live = alive[:, :n]
                stats[k, 0] = kl_sum.detach().double()
                stats[k, 1] = counted.sum()
                stats[k, 2] = (right & counted).sum()
                stats[k, 3] = (live & counted).sum()
                stats[k, 4] = (live & right & counted).sum()
                alive[:, :n] &= right & ttt_in_sample(batch.seq_ids, k)[:, :n]
                alive[:, n:] = False
        return loss, stats


def summarize(stats: torch.Tensor, weights: list[float]) -> dict[str, Any]:
    """stats: [K, 5] sums -> per-step loss / acc / cond_acc, weighted loss and simulated acceptance lengths."""
    s = stats.double().cpu()
    counted = s[:, 1].clamp(min=1)
    loss_k = (s[:, 0] / counted).tolist()
    acc = (s[:, 2] / counted).tolist()
    cond = (s[:, 4] / s[:, 3].clamp(min=1)).tolist()
    prod_acc, prod_cond, sim, chain = 1.0, 1.0, 1.0, 1.0
    for a, c in zip(acc, cond):
        prod_acc *= a
        prod_cond *= c
        sim += prod_acc
        chain += prod_cond
    return {
        "loss": sum(w * v for w, v in zip(weights, loss_k)), "loss_per_step": loss_k, "acc_per_step": acc,
        "cond_acc_per_step": cond, "sim_accept_len": sim, "chain_accept_len": chain,
        "counted_per_step": [int(v) for v in s[:, 1].tolist()],
    }


# ----------------------------------------------------------------------------- distributed plumbing


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Dist:
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                   int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


# ----------------------------------------------------------------------------- the trainer


def _jsonable(x: Any) -> Any:
    return x.model_dump(mode="json") if isinstance(x, BaseModel) else x


class Trainer:
    """setup -> train -> cleanup; see the module docstring. Rank 0 writes every file."""

    def __init__(self, cfg: TrainConfig, store_dir: str | Path, vocab_path: str | Path, verifier_path: str | Path,
                 out_dir: str | Path, resume: bool = True, dist: Dist | None = None,
                 on_progress: Callable[[int, int, str], None] | None = None):
        self.cfg, self.resume, self.on_progress = cfg, resume, on_progress
        self.store_dir, self.vocab_path = Path(store_dir), Path(vocab_path)
        self.verifier_path, self.out_dir = Path(verifier_path), Path(out_dir)
        self.dist = dist or Dist()
        self.ckpt_dir, self.latest_dir = self.out_dir / "checkpoints", self.out_dir / "latest"
        self.metrics_path = self.out_dir / METRICS
        self._pool: ThreadPoolExecutor | None = None

    # --- setup ------------------------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, d = self.cfg, self.dist
        if cfg.batch_size % (d.world * cfg.grad_accum_steps):
            raise TrainError(f"batch_size {cfg.batch_size} (packed sequences per optimizer step) is not a multiple "
                             f"of nproc {d.world} x grad_accum_steps {cfg.grad_accum_steps}")
        self.micro = cfg.batch_size // (d.world * cfg.grad_accum_steps)
        self.device = self._device()
        self.autocast = torch.bfloat16 if self.device.type == "cuda" else None
        spec = VerifierSpec.from_path(self.verifier_path)
        try:
            self.store = HiddenStateStore(self.store_dir)
        except StoreError as e:
            raise TrainError(str(e)) from None
        self._check_inputs(spec)
        d2t, t2d = load_mapping(self.vocab_path)
        if len(d2t) > spec.vocab_size:
            raise TrainError(f"vocab mapping {self.vocab_path}: draft vocab {len(d2t)} is larger than the verifier's "
                             f"vocabulary ({spec.vocab_size} tokens, {self.verifier_path / 'config.json'})")
        if len(t2d) != spec.vocab_size:
            raise TrainError(f"vocab mapping {self.vocab_path}: t2d covers {len(t2d)} target tokens, the verifier "
                             f"{self.verifier_path} has vocab_size {spec.vocab_size}")
        self.draft_cfg = DraftConfig.build(spec, len(d2t), self.store.aux_layer_ids, cfg.draft,
                                           torch_dtype=cfg.checkpoint_dtype)
        self.draft = Eagle3Draft.from_verifier(self.draft_cfg, self.verifier_path, d2t, t2d, seed=cfg.seed)
        head = load_verifier_head(self.verifier_path, torch.arange(len(d2t)) + d2t, with_embedding=False)

        lengths = {i: min(self.store.tokens(i), cfg.max_seq_len) for i in self.store.indices()}
        self.truncated = sum(1 for i in lengths if self.store.tokens(i) > cfg.max_seq_len)
        train_idx, val_idx = split_indices(self.store.indices(), cfg.val_ratio, cfg.seed)
        self.train_bins = pack_samples({i: lengths[i] for i in train_idx}, cfg.max_seq_len)
        self.val_bins = pack_samples({i: lengths[i] for i in val_idx}, cfg.max_seq_len)
        self.packing = packing_efficiency(self.train_bins, lengths, cfg.max_seq_len)
        self.steps_per_epoch = len(self.train_bins) // cfg.batch_size
        if self.steps_per_epoch == 0:
            raise TrainError(f"store {self.store_dir}: {len(train_idx)} training samples pack into "
                             f"{len(self.train_bins)} rows of {cfg.max_seq_len} tokens, fewer than one batch "
                             f"(batch_size {cfg.batch_size}); lower batch_size or max_seq_len")
        self.total_steps = self.steps_per_epoch * cfg.epochs

        self.draft.to(self.device)
        self.ttt = TrainingTimeTest(self.draft, head.norm_weight, head.lm_head, head.rms_norm_eps, cfg.ttt_steps,
                                    cfg.step_weight_decay, self.autocast).to(self.device)
        self.model = self._wrap(self.ttt)
        params = [p for p in self.draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)
        self.epoch, self.step_in_epoch, self.global_step, self.tokens_seen = 0, 0, 0, 0
        self.best: dict[str, Any] = {"epoch": None, "sim_accept_len": -1.0}
        self.history: list[dict[str, Any]] = []
        if self.dist.main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.resume and (self.latest_dir / ckpt.STATE_JSON).is_file():
            self._load_state()
        elif self.dist.main:
            for p in (self.metrics_path, self.out_dir / RESULT, self.ckpt_dir / "best"):
                p.unlink(missing_ok=True)
            for p in [*ckpt.list_epoch_dirs(self.ckpt_dir), self.latest_dir]:
                shutil.rmtree(p, ignore_errors=True)
        self.dist.barrier()
        if self.dist.main:
            log.info("[train] config: %s", cfg.model_dump_json())
            log.info("[train] draft: %s", self.draft_cfg.model_dump_json())
            log.info("[train] %d train samples -> %d rows of %d tokens (packing efficiency %.4f, %d truncated), "
                     "%d val samples -> %d rows; %d steps/epoch x %d epochs, micro-batch %d x %d accum x %d procs, "
                     "device %s", len(train_idx), len(self.train_bins), cfg.max_seq_len, self.packing,
                     self.truncated, len(val_idx), len(self.val_bins), self.steps_per_epoch, cfg.epochs, self.micro,
                     cfg.grad_accum_steps, d.world, self.device)
        if cfg.prefetch:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3-prefetch")

    def _device(self) -> torch.device:
        want = self.cfg.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want == "cuda":
            if not torch.cuda.is_available():
                raise TrainError("device 'cuda' requested but CUDA is not available")
            torch.cuda.set_device(self.dist.local_rank)
            return torch.device("cuda", self.dist.local_rank)
        return torch.device("cpu")

    def _check_inputs(self, spec: VerifierSpec) -> None:
        meta_file = self.store_dir / "store.json"
        if len(self.store) == 0:
            raise TrainError(f"store {self.store_dir} is empty: no finished samples in its manifest")
        if self.store.hidden_size != spec.hidden_size:
            raise TrainError(f"store {meta_file} has hidden_size {self.store.hidden_size} but the verifier "
                             f"{self.verifier_path / 'config.json'} has hidden_size {spec.hidden_size}")
        try:
            spec.resolve_aux_layer_ids(self.store.aux_layer_ids)
        except ValueError as e:
            raise TrainError(f"store {meta_file}: {e}") from None
        want = self.store.meta.get("verifier_fingerprint")
        have = verifier_fingerprint(self.verifier_path)
        if want != have:
            raise TrainError(f"store {meta_file} was extracted from another verifier (fingerprint {str(want)[:12]}) "
                             f"than {self.verifier_path} ({have[:12]}): the teacher would not match the states")

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.dist.world == 1:
            return module
        if self.cfg.parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # the root is the whole TTT module: its forward gathers fc / embedding / norm / lm_head shards, the
            # midlayer gathers its own (draft.step / project_aux are plain methods, not module calls)
            fully_shard(module.draft.midlayer)
            fully_shard(module)
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, forward_sync_buffers=False)  # buffers are constants

    # --- batches ----------------------------------------------------------------------------------------------

    def _epoch_order(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
        return [self.train_bins[i] for i in torch.randperm(len(self.train_bins), generator=g).tolist()]

    def _step_bins(self, order: list[list[int]], step: int) -> list[list[list[int]]]:
        """This process's micro-batches (lists of bins) of optimizer step ``step`` of the epoch."""
        cfg, d, mb = self.cfg, self.dist, self.micro
        glob = order[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        return [glob[(m * d.world + d.rank) * mb:(m * d.world + d.rank + 1) * mb] for m in range(cfg.grad_accum_steps)]

    def _load(self, micro_bins: list[list[list[int]]]) -> list[Batch]:
        cfg = self.cfg
        return [collate(self.store, b, cfg.max_seq_len, cfg.ttt_steps, self.draft_cfg.vocab_size) for b in micro_bins]

    # --- train ------------------------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.epoch == 0 and self.step_in_epoch == 0 and self.global_step == 0 and cfg.eval_before_training \
                and not any(h.get("event") == "val" for h in self.history):
            self._validate(epoch=0)
        remaining = self.total_steps - self.global_step
        progress = Progress("train", remaining, unit="steps", every_n=cfg.log_every_steps, every_s=0,
                            logger=log if self.dist.main else logging.getLogger("eagle3.rank"),
                            on_update=self.on_progress if self.dist.main else None)
        stopped = False
        while self.epoch < cfg.epochs and not stopped:
            order = self._epoch_order(self.epoch)
            window = torch.zeros(cfg.ttt_steps, N_STATS, dtype=torch.float64)
            pending = None
            for step in range(self.step_in_epoch, self.steps_per_epoch):
                micro_bins = self._step_bins(order, step)
                batches = pending.result() if pending is not None else self._load(micro_bins)
                pending = None
                if self._pool is not None and step + 1 < self.steps_per_epoch:
                    pending = self._pool.submit(self._load, self._step_bins(order, step + 1))
                stats, tokens = self._optimizer_step(batches)
                window += stats
                self.step_in_epoch, self.global_step = step + 1, self.global_step + 1
                self.tokens_seen += tokens
                done = progress.done + 1
                due = done % cfg.log_every_steps == 0 or done >= remaining
                extra = self._log_train(window, progress, tokens) if due else ""
                if due:
                    window.zero_()
                progress.update(1, tokens=tokens, extra=extra)
                if cfg.stop_after_steps and self.global_step >= cfg.stop_after_steps:
                    stopped = True
                    break
                if cfg.save_state_every_steps and self.global_step % cfg.save_state_every_steps == 0 \
                        and self.step_in_epoch < self.steps_per_epoch:
                    self._save_state()
            if pending is not None:
                pending.result()
            if stopped and self.step_in_epoch < self.steps_per_epoch:
                self._save_state()
                break
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
            val = self._validate(self.epoch)
            self._save_epoch(self.epoch, val)
            self._save_state()
            if self.dist.main:
                self._plots()
            stopped = stopped or bool(cfg.stop_after_steps and self.global_step >= cfg.stop_after_steps)
        return self._result(stopped and self.epoch < cfg.epochs)

    def _optimizer_step(self, batches: list[Batch]) -> tuple[torch.Tensor, int]:
        cfg = self.cfg
        # [K] entries counted per TTT step over the whole global batch (all micro-batches, all processes)
        counted = self.dist.all_reduce(sum(b.counted for b in batches).to(self.device, torch.float64))
        norm = (counted.clamp(min=1) / self.dist.world).float()
        lr = lr_at(self.global_step, self.total_steps, cfg.lr, round(cfg.warmup_ratio * self.total_steps), cfg.schedule,
                   cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        stats = torch.zeros(cfg.ttt_steps, N_STATS, dtype=torch.float64, device=self.device)
        tokens = 0
        self.model.train()
        for m, batch in enumerate(batches):
            last = m == len(batches) - 1
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP: reduce-scatter on the last micro-batch
                self.model.set_requires_gradient_sync(last)
            sync = self.model.no_sync() if (hasattr(self.model, "no_sync") and not last) else _null()  # DDP
            with sync:
                loss, s = self.model(batch.to(self.device), norm)
                loss.backward()
            stats += s
            tokens += batch.tokens
        torch.nn.utils.clip_grad_norm_([p for p in self.draft.parameters() if p.requires_grad], cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.dist.all_reduce(stats)
        tok = self.dist.all_reduce(torch.tensor([tokens], dtype=torch.float64, device=self.device))
        self.lr = lr
        return stats.cpu(), int(tok.item())

    def _log_train(self, window: torch.Tensor, progress: Progress, tokens: int) -> str:
        s = summarize(window, self.ttt.weights)
        if self.dist.main:
            elapsed = time.monotonic() - progress.start
            rec = {"event": "train", "epoch": self.epoch + 1, "step": self.step_in_epoch,
                   "global_step": self.global_step, "lr": self.lr, "tokens_seen": self.tokens_seen,
                   "tokens_per_s": (progress.tokens + tokens) / elapsed if elapsed > 0 else None, **s}
            self._append_metrics(rec)
        accs = " ".join(f"{a:.2f}" for a in s["acc_per_step"])
        losses = " ".join(f"{v:.3f}" for v in s["loss_per_step"])
        return (f"epoch {self.epoch + 1}/{self.cfg.epochs} step {self.step_in_epoch}/{self.steps_per_epoch} "
                f"(global {self.global_step}/{self.total_steps}) | loss {s['loss']:.4f} [{losses}] | acc [{accs}] | "
                f"sim accept {s['sim_accept_len']:.2f} | lr {self.lr:.2e}")

    @torch.no_grad()
    def _validate(self, epoch: int) -> dict[str, Any]:
        cfg, d = self.cfg, self.dist
        stats = torch.zeros(cfg.ttt_steps, N_STATS, dtype=torch.float64, device=self.device)
        self.model.eval()
        one = torch.ones(cfg.ttt_steps, device=self.device)
        # every process runs the same number of forwards (FSDP gathers weights collectively); a process without
        # bins left repeats the first bin and drops its stats
        per_round = d.world * self.micro
        for j in range(math.ceil(len(self.val_bins) / per_round)):
            bins = self.val_bins[j * per_round + d.rank * self.micro:j * per_round + (d.rank + 1) * self.micro]
            batch = collate(self.store, bins or self.val_bins[:1], cfg.max_seq_len, cfg.ttt_steps,
                            self.draft_cfg.vocab_size)
            _, s = self.ttt(batch.to(self.device), one)
            if bins:
                stats += s
        d.all_reduce(stats)
        s = summarize(stats.cpu(), self.ttt.weights)
        rec = {"event": "val", "epoch": epoch, "global_step": self.global_step, "samples": sum(map(len, self.val_bins)),
               **s}
        if d.main:
            self._append_metrics(rec)
            if self.val_bins:
                log.info("[train] validation after epoch %d: loss %.4f | acc [%s] | cond acc [%s] | sim accept %.3f | "
                         "chain accept %.3f", epoch, s["loss"], " ".join(f"{a:.3f}" for a in s["acc_per_step"]),
                         " ".join(f"{a:.3f}" for a in s["cond_acc_per_step"]), s["sim_accept_len"],
                         s["chain_accept_len"])
        return rec

    # --- checkpoints ------------------------------------------------------------------------------------------

    def _full_draft_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _optim_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.draft, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _run_info(self, epoch: int, val: dict[str, Any] | None) -> dict[str, Any]:
        return {"run_config": self.cfg.model_dump(mode="json"), "draft_config": self.draft_cfg.model_dump(mode="json"),
                "verifier": str(self.verifier_path.resolve()), "store": str(self.store_dir.resolve()),
                "vocab": str(self.vocab_path.resolve()), "epoch": epoch, "global_step": self.global_step,
                "tokens_seen": self.tokens_seen, "val_metrics": val, "aux_layer_ids_convention":
                "vLLM: id k = residual stream entering decoder layer k"}

    def _save_epoch(self, epoch: int, val: dict[str, Any]) -> None:
        state = self._full_draft_state()
        if self.dist.main:
            folder = self.ckpt_dir / ckpt.epoch_dir_name(epoch)
            ckpt.save_draft(folder, self.draft_cfg, state, self._run_info(epoch, val), self.cfg.save_embedding)
            score = val["sim_accept_len"] if self.val_bins else float(epoch)  # no val split: the newest is best
            if score > self.best["sim_accept_len"]:
                self.best = {"epoch": epoch, "sim_accept_len": score}
                ckpt.set_best(self.ckpt_dir, folder)
            ckpt.prune_epochs(self.ckpt_dir, self.cfg.keep_last_n)
            log.info("[train] saved %s (best: epoch %s, sim accept %.3f)", folder, self.best["epoch"],
                     self.best["sim_accept_len"])
        self.dist.barrier()

    def _save_state(self) -> None:
        full = self._full_draft_state()
        optim = self._optim_state()
        if self.dist.main:
            trainable = {n for n, p in self.draft.named_parameters() if p.requires_grad}
            state = {
                "model": {k: v for k, v in full.items() if k in trainable},
                "optimizer": optim,
                "progress": {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                             "global_step": self.global_step, "tokens_seen": self.tokens_seen},
                "best": self.best,
                "config": self.cfg.model_dump(mode="json"),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            }
            ckpt.save_trainer_state(self.latest_dir, state)
        self.dist.barrier()

    def _load_state(self) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = ckpt.load_trainer_state(self.latest_dir)
        old = state["config"]
        now = self.cfg.model_dump(mode="json")
        free = RESUME_FREE | {"epochs"}
        diff = sorted(k for k in now if k not in free and _norm_json(old.get(k)) != _norm_json(now[k]))
        if diff:
            raise TrainError(f"cannot resume from {self.latest_dir}: settings {diff} differ from the saved run; "
                             f"use another out_dir or resume=False")
        if old.get("epochs") != now["epochs"] and state["progress"]["global_step"] > 0:
            raise TrainError(f"cannot resume from {self.latest_dir}: epochs changed {old.get('epochs')} -> "
                             f"{now['epochs']}, which changes the learning-rate schedule")
        set_model_state_dict(self.draft, state["model"], options=StateDictOptions(full_state_dict=True, strict=False))
        set_optimizer_state_dict(self.draft, self.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        p = state["progress"]
        self.epoch, self.step_in_epoch = int(p["epoch"]), int(p["step_in_epoch"])
        self.global_step, self.tokens_seen = int(p["global_step"]), int(p["tokens_seen"])
        self.best = dict(state["best"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.history = _read_metrics(self.metrics_path)
        # drop metrics logged after the saved state (a crash between the two): the resumed run logs them again
        keep = [r for r in self.history if r.get("global_step", 0) < self.global_step
                or (r.get("global_step") == self.global_step and (r["event"] != "val" or r["epoch"] <= self.epoch))]
        self.history = keep
        if self.dist.main:
            import json

            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
            log.info("[train] resumed from %s: epoch %d, step %d/%d of the epoch, global step %d", self.latest_dir,
                     self.epoch, self.step_in_epoch, self.steps_per_epoch, self.global_step)

    def _append_metrics(self, rec: dict[str, Any]) -> None:
        import json

        self.history.append(rec)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _plots(self) -> None:
        from eagle3.support.plot import line_chart

        train = [r for r in self.history if r["event"] == "train"]
        val = [r for r in self.history if r["event"] == "val" and r["counted_per_step"][0] > 0]
        k = range(self.cfg.ttt_steps)
        loss = {f"step {j}": [(r["global_step"], r["loss_per_step"][j]) for r in train] for j in k}
        loss["val (weighted)"] = [(r["global_step"], r["loss"]) for r in val]
        loss["train (weighted)"] = [(r["global_step"], r["loss"]) for r in train]
        acc = {f"step {j}": [(r["global_step"], r["acc_per_step"][j]) for r in train] for j in k}
        for j in k:
            acc[f"val step {j}"] = [(r["global_step"], r["acc_per_step"][j]) for r in val]
        line_chart(self.out_dir / "loss.png", {n: s for n, s in loss.items() if s}, "Draft training loss (KL)",
                   "optimizer step", "KL (nats)")
        line_chart(self.out_dir / "accuracy.png", {n: s for n, s in acc.items() if s},
                   "Draft top-1 accuracy per TTT step", "optimizer step", "accuracy")
        if val:
            line_chart(self.out_dir / "acceptance.png",
                       {"sim accept": [(r["global_step"], r["sim_accept_len"]) for r in val],
                        "chain accept": [(r["global_step"], r["chain_accept_len"]) for r in val]},
                       "Validation simulated acceptance length", "optimizer step", "tokens per verifier step")

    def _result(self, stopped_early: bool) -> dict[str, Any]:
        best = ckpt.best_dir(self.ckpt_dir)
        vals = [r for r in self.history if r["event"] == "val"]
        weights = best / ckpt.WEIGHTS if best else None
        return {
            "out_dir": str(self.out_dir), "checkpoints": [str(p) for p in ckpt.list_epoch_dirs(self.ckpt_dir)],
            "best": str(best) if best else None, "best_epoch": self.best["epoch"],
            "best_sim_accept_len": self.best["sim_accept_len"] if best else None,
            "best_sha256": sha256_file(weights) if weights else None,
            "latest_state": str(self.latest_dir), "metrics_path": str(self.metrics_path),
            "plots": [str(p) for p in sorted(self.out_dir.glob("*.png"))],
            "final_val": vals[-1] if vals else None, "untrained_val": next((r for r in vals if r["epoch"] == 0), None),
            "epochs_done": self.epoch, "global_step": self.global_step, "total_steps": self.total_steps,
            "tokens_seen": self.tokens_seen, "packing_efficiency": self.packing,
            "train_rows": len(self.train_bins), "val_rows": len(self.val_bins), "truncated_samples": self.truncated,
            "stopped_early": stopped_early, "nproc": self.dist.world,
        }

    def cleanup(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _norm_json(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from a crash
    return out


# ----------------------------------------------------------------------------- entry points


def run_local(cfg: TrainConfig, store_dir: str | Path, vocab_path: str | Path, verifier_path: str | Path,
              out_dir: str | Path, resume: bool = True, dist: Dist | None = None,
              on_progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Run the trainer in this process (one rank of a torchrun job when ``dist`` says so)."""
    torch.manual_seed(cfg.seed)
    trainer = Trainer(cfg, store_dir, vocab_path, verifier_path, out_dir, resume=resume, dist=dist,
                      on_progress=on_progress)
    try:
        trainer.setup()
        start = time.monotonic()
        result = trainer.train()
        result["wall_s"] = round(time.monotonic() - start, 3)
        if trainer.dist.main:
            atomic_write_json(Path(out_dir) / RESULT, result)
            log.info("[train] done in %s: best %s (sim accept %s)", fmt_duration(result["wall_s"]), result["best"],
                     result["best_sim_accept_len"])
        return result
    finally:
        trainer.cleanup()


def train_draft(cfg: TrainConfig, store_dir: str | Path, vocab_path: str | Path, verifier_path: str | Path,
                out_dir: str | Path, resume: bool = True,
                on_progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Train a draft into ``out_dir``; returns the manifest (checkpoint paths, best path + sha256 of its weights,
    validation metrics before and after training, packing efficiency, ...).

    ``resume`` continues from ``out_dir/latest`` when it exists (a finished run returns at once); ``nproc > 1``
    launches ``python -m torch.distributed.run`` workers (gloo on cpu, nccl on cuda) and waits for them
    (``on_progress`` then stays silent: progress reaches the log through the workers' output).
    """
    if cfg.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        from eagle3.train.launch import launch

        return launch(cfg, store_dir, vocab_path, verifier_path, out_dir, resume)
    return run_local(cfg, store_dir, vocab_path, verifier_path, out_dir, resume, Dist.from_env(), on_progress)
