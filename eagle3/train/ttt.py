"""The training-time test (TTT): the EAGLE-3 loss and metrics over K unrolled draft steps.

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
KL(teacher || draft) (or an LK loss, TrainConfig.loss), averaged over counted entries of the whole optimizer step (all
micro-batches, all ranks); total = sum_k step_weight_decay**k * loss_k. The metrics' loss is the KL whatever the
training loss.

Where the layer and the heads run: only at the entries of step k that the loss or the chain metrics read
(``ttt_kept``: counted at step k or later; each step's are a subset of the step before's), on their rows gathered
(eagle3.draft.model.Rows): the layer's projections, o_proj and MLP, the draft's lm_head, the softmaxes and the KL.
Step 0 also computes keys and values at every entry (the context every later entry attends to); an entry outside
step k's kept set is read by no one (the diagram: a step-k entry attends to the step-0 context and to its own
earlier steps only). The teacher runs only at the row positions the kept entries read (``teacher_rows``). Padding,
prompt tokens and each sample's last tokens skip all of that work; the loss and its gradients are the dense
unroll's (tests/test_train_ttt.py). The KL keeps q's log-probabilities for backward and gathers the teacher rows
again there (``GatheredKL``).

Metrics per step k: accuracy = P(draft argmax == teacher argmax) over counted entries; conditional accuracy = the
same among entries whose steps 0 .. k-1 were all right (a chain still alive). Simulated acceptance length, on vLLM's
scale (vLLM's mean acceptance length = 1 + accepted / drafts, the 1 being the verifier's bonus token):
``sim_accept_len = 1 + sum_k prod_{j<=k} acc_j`` (the issue's definition, product of marginal accuracies) and
``chain_accept_len = 1 + sum_k prod_{j<=k} cond_acc_j`` (expected accepted length of a greedy chain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagle3.draft.model import KVCache, Rows
from eagle3.support.verifier import teacher_logits

if TYPE_CHECKING:
    from eagle3.train.data import Batch

N_STATS = 5  # per TTT step: kl_sum, counted, correct, alive (chain still right before this step), alive_correct
HEAD_ROWS_BUCKET = 64  # the heads run on a multiple of this many rows (padded_rows); eagle3.train.memory plans it


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


def ttt_kept(counted: list[torch.Tensor]) -> list[torch.Tensor]:
    """counted: per TTT step k, ``ttt_counted(.., k)`` -> per step k, the entries whose logits the loss or the metrics
    read: counted at step k or at a later step (a chain counted at step j > k is alive only if it was right at step
    k). [B, T] bool each; keep[k + 1] is a subset of keep[k], and every kept entry has i + 2 + k < T."""
    keep = [counted[-1]]
    for step in reversed(counted[:-1]):
        keep.append(keep[-1] | step)
    return keep[::-1]


def teacher_rows(keep: list[torch.Tensor]) -> torch.Tensor:
    """The row positions whose teacher distribution some kept entry reads (entry i of step k reads f_{i+1+k}):
    [B, T] bool."""
    need = torch.zeros_like(keep[0])
    t = need.shape[1]
    for k, kept in enumerate(keep):
        if k >= t - 1:  # no entry of a row this short reaches step k
            break
        need[:, 1 + k:] |= kept[:, :t - 1 - k]
    return need


def padded_rows(index: torch.Tensor) -> torch.Tensor:
    """``index`` [N] padded to a multiple of HEAD_ROWS_BUCKET by repeating its first entry; the first N are
    the real ones. The heads' shapes then repeat from step to step (a CPU's oneDNN builds and caches one kernel per
    matmul shape: with a new row count every step, building them cost more than the skipped rows saved)."""
    pad = -index.numel() % HEAD_ROWS_BUCKET
    return torch.cat([index, index[:1].expand(pad)]) if pad else index


def context_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """Step-0 attention: causal inside each packed sample. seq_ids: [B, T] -> [B, 1, T, T] bool (True = attend).
    Padding entries (-1) see the padding before them, never a sample (and no row is empty)."""
    t = seq_ids.shape[1]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]  # [B, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=seq_ids.device).tril()
    return (same & causal)[:, None]


class GatheredKL(torch.autograd.Function):
    """Forward KL(p || q) per entry, p = the teacher rows ``rows`` of ``t_p`` and q = softmax(logits), keeping only q's
    log-probabilities for backward (the gradient is (q - p) times the entry's weight, as p sums to 1): the teacher rows
    are gathered again in backward, never kept per step. logits [N, D] (any float dtype), t_p [M, D] float32, t_ent [M]
    (the teacher's entropies), rows [N] int64 -> (kl [N] float32, logq [N, D] float32 without grad)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, t_p: torch.Tensor, t_ent: torch.Tensor, rows: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(logits.device.type, enabled=False):  # float32 throughout (bmm would autocast)
            logq = torch.log_softmax(logits.float(), dim=-1)
            cross = torch.bmm(t_p[rows].unsqueeze(1), logq.unsqueeze(2)).view(-1)  # [N] sum_d p log q
        kl = -cross - t_ent[rows]  # cross-entropy(p, q) - entropy(p)
        ctx.save_for_backward(logq, t_p, rows)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(logq)
        return kl, logq

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_kl: torch.Tensor, _grad_logq: torch.Tensor | None
                 ) -> tuple[torch.Tensor, None, None, None]:
        logq, t_p, rows = ctx.saved_tensors
        grad = logq.exp().sub_(t_p[rows]).mul_(grad_kl[:, None])  # in place: one [N, D] buffer besides the gather
        return grad.to(ctx.logits_dtype), None, None, None


# ----------------------------------------------------------------------------- the training-time test


class TrainingTimeTest(nn.Module):
    """Draft + frozen teacher head; ``forward`` unrolls K draft steps and returns (loss, stats [K, 5]).

    Wrapping this whole module (not the draft) in DDP/FSDP keeps every draft call inside one ``forward``.
    """

    def __init__(self, draft: nn.Module, teacher_norm: torch.Tensor, teacher_lm_head: torch.Tensor, eps: float,
                 ttt_steps: int, step_weight_decay: float, autocast_dtype: torch.dtype | None = None,
                 loss: str = "kl", lk_eta: float = 3.0):
        super().__init__()
        if loss not in ("kl", "lk_alpha", "lk_lambda"):
            raise ValueError(f"loss {loss!r}: one of kl, lk_alpha, lk_lambda")
        self.loss, self.lk_eta = loss, lk_eta
        self.draft = draft
        self.register_buffer("teacher_norm", teacher_norm, persistent=False)  # [H]
        self.register_buffer("teacher_lm_head", teacher_lm_head, persistent=False)  # [draft_vocab, H]
        self.eps, self.ttt_steps, self.autocast_dtype = eps, ttt_steps, autocast_dtype
        self.weights = [step_weight_decay**k for k in range(ttt_steps)]

    def teacher_logits(self, final: torch.Tensor) -> torch.Tensor:
        """final: [..., H] (BEFORE the verifier's final norm) -> [..., draft_vocab]: verifier norm + lm_head rows."""
        with torch.autocast(final.device.type, enabled=False):  # the teacher stays float32 under bf16 autocast
            return teacher_logits(final, self.teacher_norm, self.eps, self.teacher_lm_head)

    def forward(self, batch: Batch, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """norm: [K] float, the divisor of step k's KL sum (entries counted in the whole optimizer step, divided by the
        number of processes because DDP averages gradients). Returns (weighted loss, stats [K, 5] float64).

        The layer and the heads (the draft's lm_head, the teacher's) run only where the loss or the metrics read
        them: at the entries ``ttt_kept`` names (padding, prompt tokens and the row's tail are skipped), on their rows
        gathered; step 0's keys and values at every entry."""
        device = batch.input_ids.device
        enabled = self.autocast_dtype is not None
        with torch.autocast(device.type, dtype=self.autocast_dtype or torch.bfloat16, enabled=enabled):
            with torch.no_grad():
                counted = [ttt_counted(batch.loss_mask, batch.seq_ids, k) for k in range(self.ttt_steps)]
                keep = ttt_kept(counted)  # K x [B, T] bool
                # every step's entries up front: on CUDA each nonzero() waits for the queue, empty here
                sels = [kept.flatten().nonzero().squeeze(1) for kept in keep]  # flat b * T + i, i + 2 + k < T
                need = teacher_rows(keep)  # [B, T] bool
                row_of = torch.full(need.shape, -1, dtype=torch.int64, device=device)  # [B, T] -> teacher row
                needed = need.flatten().nonzero().squeeze(1)  # [M] flat row positions, ascending
                row_of.view(-1)[needed] = torch.arange(needed.numel(), device=device)
                final = batch.final.flatten(0, 1)[padded_rows(needed)]
                t_logp = torch.log_softmax(self.teacher_logits(final).float(), dim=-1)  # [M (padded), D]
                t_arg = t_logp.argmax(-1)  # [M]
                t_p = t_logp.exp()  # [M, D] teacher probabilities, once
                t_ent = -(t_p * t_logp).sum(-1)  # [M] entropy of the teacher
                del t_logp
            mask = context_mask(batch.seq_ids)  # [B, 1, T, T]
            hidden = self.draft.project_aux(batch.aux.float())  # [B, T, H]; bf16 under autocast on cuda
            return self._unroll(batch, hidden, mask, [c.flatten() for c in counted], sels, row_of.flatten(),
                                (t_p, t_arg, t_ent), norm)

    def _unroll(self, batch: Batch, hidden: torch.Tensor, mask: torch.Tensor, counted_steps: list[torch.Tensor],
                sels: list[torch.Tensor], row_of: torch.Tensor,
                teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor], norm: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        t_p, t_arg, t_ent = teacher
        cache = KVCache()
        alive = torch.ones(batch.loss_mask.numel(), dtype=torch.bool, device=hidden.device)  # [B*T] chain right so far
        loss = hidden.new_zeros((), dtype=torch.float32)
        stats = torch.zeros(self.ttt_steps, N_STATS, dtype=torch.float64, device=hidden.device)
        b, t = batch.input_ids.shape
        slot = torch.full((b * t,), -1, dtype=torch.int64, device=hidden.device)  # flat entry -> row of `hidden`
        for k in range(self.ttt_steps):
            ids = shift_left(batch.input_ids, 1 + k, 0)  # [B, T] token x_{i+1+k}
            real = sels[k].numel()
            sel = padded_rows(sels[k])  # [N (padded)]: the copies beyond `real` are never counted
            if k:  # step k's entries are entries of step k - 1: their hidden inputs are that step's outputs
                hidden = hidden[slot[sel]]  # [N, H]
            # the layer and the heads at the kept entries only (step 0: keys/values at every context entry);
            # N may be 0: they still run (on no rows), so every parameter gets its (zero) gradient, as DDP expects
            hidden, normed = self.draft.step_features(ids, hidden, batch.position_ids + k, mask, cache,
                                                      Rows(sel, real, b, t))
            slot[sels[k]] = torch.arange(real, device=slot.device)  # hidden's row of each kept entry
            logits = self.draft.head(normed)  # [N, D]
            rows = row_of[sel + 1 + k]  # [N] teacher f_{i+1+k}: the same packed row (i + 1 + k < T)
            counted = counted_steps[k][sel]  # [N]
            counted[real:] = False
            if self.loss == "kl":
                kl, logq = GatheredKL.apply(logits, t_p, t_ent, rows)  # [N], [N, D] (logq without grad)
                token_loss = kl
            else:
                logq = torch.log_softmax(logits.float(), dim=-1)  # [N, D]
                tp = t_p[rows]  # [N, D]
                kl = -(tp * logq).sum(-1) - t_ent[rows]  # [N] forward KL(p || q) = cross-entropy(p, q) - entropy(p)
                token_loss = self._token_loss(kl, tp, logq)
            loss = loss + self.weights[k] * (token_loss * counted).sum() / norm[k]
            with torch.no_grad():
                right = logq.argmax(-1) == t_arg[rows]  # [N]
                live = alive[sel]
                stats[k, 0] = (kl * counted).sum().double()
                stats[k, 1] = counted.sum()
                stats[k, 2] = (right & counted).sum()
                stats[k, 3] = (live & counted).sum()
                stats[k, 4] = (live & right & counted).sum()
                # entries outside keep[k] are counted at no later step: their chain no longer matters
                alive = torch.zeros_like(alive)
                alive[sel[:real]] = (live & right)[:real]
        return loss, stats

    def _token_loss(self, kl: torch.Tensor, tp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
        """kl: [N] forward KL per entry; tp / logq: [N, D] teacher probabilities / draft log-probabilities ->
        [N] the configured loss per entry (TrainConfig.loss)."""
        if self.loss == "kl":
            return kl
        alpha = torch.minimum(tp, logq.exp()).sum(-1)  # [N] acceptance rate of sampling q against p: 1 - TV(p, q)
        if self.loss == "lk_alpha":
            return -torch.log(alpha.clamp_min(1e-6))
        lam = torch.exp(-self.lk_eta * alpha.detach())  # [N]: the KL's share, falling as the draft improves
        return lam * kl + (1 - lam) * (1 - alpha)


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


