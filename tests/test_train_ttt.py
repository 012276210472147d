"""Training-time test on handcrafted tensors: index shifts, masks, metrics, the serving chain, frozen parts, packing.

No store and no training run here (tests/test_train.py has those).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import vocab_tables
from torch import nn

from eagle3.draft.config import DraftArchitecture, DraftConfig
from eagle3.draft.model import Eagle3Draft, KVCache
from eagle3.support.verifier import VerifierSpec
from eagle3.train.config import TrainConfig
from eagle3.train.data import Batch, pack_samples, packing_efficiency, split_indices
from eagle3.train.schedule import lr_at
from eagle3.train.ttt import (
    GatheredKL,
    TrainingTimeTest,
    context_mask,
    shift_left,
    summarize,
    ttt_counted,
    ttt_kept,
)

H, D, K = 8, 50, 4


def _batch(layout: list[list[int]], t: int, seed: int = 0, token_base: int = 1000, h: int = H) -> Batch:
    """Packed rows from sample lengths per row; token id = token_base + row position (so a fake draft can tell
    which row position its input token comes from); loss mask 1 except every 4th token."""
    g = torch.Generator().manual_seed(seed)
    b = len(layout)
    seq = torch.full((b, t), -1)
    pos = torch.zeros(b, t, dtype=torch.int64)
    for r, lens in enumerate(layout):
        start = 0
        for s, n in enumerate(lens):
            seq[r, start:start + n] = s
            pos[r, start:start + n] = torch.arange(n)
            start += n
    mask = (torch.arange(t) % 4 != 3).expand(b, t) & (seq >= 0)
    counted = torch.stack([ttt_counted(mask, seq, k).sum() for k in range(K)])
    return Batch(input_ids=token_base + torch.arange(t).expand(b, t).clone(), aux=torch.randn(b, t, 3 * h, generator=g),
                 final=torch.randn(b, t, h, generator=g), loss_mask=mask, seq_ids=seq, position_ids=pos,
                 tokens=int((seq >= 0).sum()), counted=counted)


def _ttt(draft: nn.Module, seed: int = 0, h: int = H) -> TrainingTimeTest:
    g = torch.Generator().manual_seed(seed)
    return TrainingTimeTest(draft, 1 + 0.1 * torch.randn(h, generator=g), torch.randn(D, h, generator=g), 1e-6, K, 0.8)


class OracleDraft(nn.Module):
    """Returns, for the entry whose input token sits at row position j, the teacher logits of position j (f_j: the
    verifier's distribution of the token after x_j); ``shift`` = -1 returns f_{j-1} instead (an off-by-one)."""

    def __init__(self, batch: Batch, teacher: torch.Tensor, shift: int = 0):
        super().__init__()
        self.batch, self.teacher, self.shift = batch, teacher, shift  # teacher: [B, T, D]
        self.w = nn.Parameter(torch.zeros(()))
        self.steps = 0

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        return aux[..., :H] * 0 + self.w

    def step_features(self, ids, hidden, pos, mask, cache, rows=None):
        """(hidden, the logits themselves as the head's input): ``head`` is the identity. With ``rows``, both at
        those entries (as Eagle3Draft.step_features)."""
        t = ids.shape[1]
        j = (ids - 1000).clamp(0, t - 1)  # row position of the input token
        # the position the draft sees is its entry's position + k, i.e. (position of x_j) - 1
        real = (ids >= 1000) & (self.batch.seq_ids.gather(1, j) == self.batch.seq_ids) & (self.batch.seq_ids >= 0)
        assert torch.equal(pos[real], self.batch.position_ids.gather(1, j)[real] - 1)
        self.steps += 1
        src = (j + self.shift).clamp(0, t - 1)
        logits = self.teacher.gather(1, src[..., None].expand(-1, -1, self.teacher.shape[-1])) + self.w
        if rows is None:
            return hidden, logits
        return (hidden if hidden.dim() == 2 else rows.gather(hidden)), rows.gather(logits)

    def head(self, x):
        return x


def test_counted_entries_by_hand():
    # one row: sample 0 = positions 0..3, sample 1 = 4..6, padding at 7
    seq = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    # step k, entry i counts iff the guessed token x_{i+2+k} is in i's sample and loss-masked
    assert ttt_counted(mask, seq, 0).int().tolist() == [[1, 1, 0, 0, 1, 0, 0, 0]]
    assert ttt_counted(mask, seq, 1).int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0]]
    assert ttt_counted(mask, seq, 2).int().tolist() == [[0, 0, 0, 0, 0, 0, 0, 0]]
    m = context_mask(seq)[0, 0].int()
    assert m[2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0] and m[5].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    assert m[7].tolist() == [0, 0, 0, 0, 0, 0, 0, 1]  # padding never sees a sample


def test_teacher_oracle_scores_one_at_every_step_and_off_by_one_does_not():
    batch = _batch([[6, 5], [12]], t=12)
    ttt = _ttt(nn.Identity())
    teacher = ttt.teacher_logits(batch.final)  # [B, T, D]
    norm = batch.counted.float()
    for shift, perfect in ((0, True), (-1, False)):
        ttt.draft = OracleDraft(batch, teacher, shift)
        loss, stats = ttt(batch, norm)
        s = summarize(stats, ttt.weights)
        assert ttt.draft.steps == K
        assert s["counted_per_step"] == batch.counted.tolist() and min(s["counted_per_step"]) > 0
        if perfect:
            assert s["acc_per_step"] == [1.0] * K and s["cond_acc_per_step"] == [1.0] * K
            assert s["sim_accept_len"] == 1.0 + K == s["chain_accept_len"]
            assert abs(float(loss.detach())) < 1e-5 and max(abs(v) for v in s["loss_per_step"]) < 1e-5
        else:
            assert max(s["acc_per_step"]) < 0.5 and float(loss.detach()) > 0.1
    loss.backward()  # the loss reaches the draft's parameters
    assert ttt.draft.w.grad is not None


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda"])
def test_lk_losses_vanish_at_the_teacher_and_reach_the_draft(loss):
    """Issue 17: the LK losses aim at the acceptance rate alpha = sum min(p, q): zero for the oracle draft (q = p,
    alpha = 1), positive off by one, differentiable; lk_lambda with lk_eta 0 is the KL itself. The metrics' loss
    stays the KL."""
    batch = _batch([[6, 5], [12]], t=12)
    norm = batch.counted.float()
    for shift in (0, -1):
        ttt = _ttt(nn.Identity())
        ttt.loss = loss
        teacher = ttt.teacher_logits(batch.final)
        ttt.draft = OracleDraft(batch, teacher, shift)
        value, stats = ttt(batch, norm)
        if shift == 0:
            assert abs(float(value.detach())) < 1e-4
        else:
            assert float(value.detach()) > 0.1
            kl = summarize(stats, ttt.weights)["loss"]
            ttt.loss, ttt.lk_eta = "lk_lambda", 0.0
            assert abs(float(ttt(batch, norm)[0].detach()) - kl) < 1e-4 * kl
            value.backward()
            assert ttt.draft.w.grad is not None
    with pytest.raises(ValueError, match="one of kl, lk_alpha, lk_lambda"):
        TrainingTimeTest(nn.Identity(), torch.ones(H), torch.randn(D, H), 1e-6, K, 0.8, loss="tv")


def test_metrics_from_counts():
    # per step: kl_sum, counted, correct, alive, alive_correct
    stats = torch.tensor([[2.0, 10, 8, 10, 8], [3.0, 10, 6, 8, 5], [0.0, 0, 0, 0, 0]], dtype=torch.float64)
    s = summarize(stats, [1.0, 0.8, 0.64])
    assert s["acc_per_step"] == [0.8, 0.6, 0.0] and s["cond_acc_per_step"] == [0.8, 0.625, 0.0]
    assert s["sim_accept_len"] == pytest.approx(1 + 0.8 + 0.8 * 0.6)
    assert s["chain_accept_len"] == pytest.approx(1 + 0.8 + 0.5)
    assert s["loss"] == pytest.approx(0.2 + 0.8 * 0.3)


def _real_draft(tiny_llama_verifier, seed: int = 0) -> Eagle3Draft:
    spec = VerifierSpec.from_path(tiny_llama_verifier)
    cfg = DraftConfig.build(spec, D, [1, 2, 3], torch_dtype="float32")
    d2t, t2d = vocab_tables(spec.vocab_size, D, seed=None)
    draft = Eagle3Draft.from_verifier(cfg, tiny_llama_verifier, d2t, t2d, seed=seed)
    with torch.no_grad():  # larger hidden inputs so every part of the layer matters
        draft.fc.weight.mul_(4)
    return draft


class Recorder(nn.Module):
    def __init__(self, draft: Eagle3Draft, keep_graph: bool = False):
        super().__init__()
        self.draft, self.steps, self.keep_graph = draft, [], keep_graph

    def project_aux(self, aux):
        return self.draft.project_aux(aux)

    def step_features(self, ids, hidden, pos, mask, cache, rows=None):
        """Records the pre-norm output and the logits on the [B, T] grid: at the entries the TTT computes (its
        ``rows``), zeros elsewhere."""
        pre, normed = self.draft.step_features(ids, hidden, pos, mask, cache, rows)
        logits = self.draft.head(normed)
        on_grid = (lambda x: x) if rows is None else rows.scatter
        self.steps.append((on_grid(pre.detach()), on_grid(logits if self.keep_graph else logits.detach())))
        return pre, normed

    def head(self, normed):
        return self.draft.head(normed)


@torch.no_grad()
def test_ttt_step_k_is_the_serving_chain(tiny_llama_verifier):
    """Entry i of TTT step k == a plain causal forward over vLLM's chain: context positions 0..i of i's sample
    (tokens x_{o+1}..x_{i+1}, hidden fc(a)), then the draft steps 1..k (tokens x_{i+2}.., hidden = the previous
    step's PRE-norm output at entry i), positions counted from the sample start."""
    batch = _batch([[7, 6, 3], [16]], t=16, token_base=0, h=64)
    batch.input_ids = torch.randint(0, 8192, batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
    draft = _real_draft(tiny_llama_verifier)
    rec = Recorder(draft)
    _ttt(rec, h=64)(batch, batch.counted.float().clamp(min=1))
    keep = ttt_kept([ttt_counted(batch.loss_mask, batch.seq_ids, k) for k in range(K)])  # what the TTT computes
    checked = 0
    for r, o, n in ((0, 0, 7), (0, 7, 6), (0, 13, 3), (1, 0, 16)):  # (row, sample start, sample length)
        for i in range(o, o + n):
            for k in range(K):
                if not keep[k][r, i]:  # read by no loss, so not computed (nor at any later step: keep[k + 1] <= keep[k])
                    break
                ids = torch.cat([batch.input_ids[r, o + 1:i + 2], batch.input_ids[r, i + 2:i + 2 + k]])
                ctx = draft.project_aux(batch.aux[r, o:i + 1])
                prev = [rec.steps[j][0][r, i] for j in range(k)]
                hidden = torch.cat([ctx, *[p[None] for p in prev]]) if prev else ctx
                pos = torch.arange(len(ids))
                pre, logits = draft(ids[None], hidden[None], pos[None])
                torch.testing.assert_close(logits[0, -1], rec.steps[k][1][r, i], atol=2e-5, rtol=1e-4)
                torch.testing.assert_close(pre[0, -1], rec.steps[k][0][r, i], atol=2e-5, rtol=1e-4)
                checked += 1
    assert checked == sum(int(kept.sum()) for kept in keep) and checked > 30


def test_heads_at_kept_entries_give_the_dense_loss_and_metrics():
    """The heads run only at the entries the loss or the chain metrics read (ttt_kept); loss and every statistic
    equal the dense computation over all entries (KL of every counted entry, chains followed entry by entry), on
    rows with several samples, padding and a sparse loss mask. The draft is the teacher's oracle except at every
    third row position, so chains both live and break (an entry counted only at a later step still needs its
    earlier guesses)."""
    batch = _batch([[7, 6, 3], [11]], t=16)
    batch.loss_mask &= torch.arange(16) % 5 != 1  # prompt-like gaps besides every 4th token
    batch.counted = torch.stack([ttt_counted(batch.loss_mask, batch.seq_ids, k).sum() for k in range(K)])
    ttt = _ttt(nn.Identity())
    teacher = ttt.teacher_logits(batch.final)  # [B, T, D]
    noisy = teacher.clone()
    noisy[:, ::3] = torch.randn(noisy[:, ::3].shape, generator=torch.Generator().manual_seed(1))
    rec = Recorder(OracleDraft(batch, noisy))
    ttt.draft = rec
    norm = batch.counted.float().clamp(min=1)
    loss, stats = ttt(batch, norm)
    t_logp = torch.log_softmax(ttt.teacher_logits(batch.final), -1)  # [B, T, D]
    alive = torch.ones_like(batch.loss_mask)
    dense, expect = 0.0, torch.zeros_like(stats)
    for k in range(K):
        n = 16 - 1 - k
        logq = torch.log_softmax(rec.steps[k][1][:, :n], -1)  # [B, n, D]
        tl = t_logp[:, 1 + k:]
        kl = (tl.exp() * (tl - logq)).sum(-1)  # [B, n]
        counted = ttt_counted(batch.loss_mask, batch.seq_ids, k)[:, :n]
        right = logq.argmax(-1) == tl.argmax(-1)
        live = alive[:, :n]
        dense += ttt.weights[k] * float((kl * counted).sum()) / float(norm[k])
        expect[k] = torch.tensor([float((kl * counted).sum()), float(counted.sum()), float((right & counted).sum()),
                                  float((live & counted).sum()), float((live & right & counted).sum())])
        in_sample = torch.roll(batch.seq_ids, -(2 + k), 1)[:, :n] == batch.seq_ids[:, :n]
        alive = torch.zeros_like(alive)
        alive[:, :n] = live & right & in_sample
    assert 0 < float(stats[1:, 3].sum()) < float(stats[1:, 1].sum())  # chains live and break
    assert float(loss.detach()) == pytest.approx(dense, rel=1e-5)
    torch.testing.assert_close(stats, expect, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_kl_value_and_gradient_equal_autograd(dtype):
    """GatheredKL keeps only q's log-probabilities and gathers the teacher rows again in backward; its KL and its
    gradient equal plain autograd through log_softmax and the gathered rows (bf16 logits as under autocast)."""
    g = torch.Generator().manual_seed(0)
    t_p = torch.softmax(3 * torch.randn(9, D, generator=g), -1)
    t_ent = -(t_p * t_p.log()).sum(-1)
    rows = torch.tensor([4, 0, 4, 8, 2, 7])
    logits = (2 * torch.randn(6, D, generator=g)).to(dtype).requires_grad_()
    weight = torch.rand(6, generator=g)
    kl, logq = GatheredKL.apply(logits, t_p, t_ent, rows)
    (kl * weight).sum().backward()
    mine, logits.grad = logits.grad, None
    ref_logq = torch.log_softmax(logits.float(), -1)
    ref = (t_p[rows] * (t_p[rows].log() - ref_logq)).sum(-1)
    (ref * weight).sum().backward()
    torch.testing.assert_close(kl, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logq, ref_logq.detach())
    assert mine.dtype == dtype and not logq.requires_grad
    torch.testing.assert_close(mine.float(), logits.grad.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-6)


def _dense_unroll_loss(draft: Eagle3Draft, ttt: TrainingTimeTest, batch: Batch, norm: torch.Tensor) -> torch.Tensor:
    """The training-time test written out over EVERY entry of every step: the layer and the heads at all B x T
    entries (the draft's serving computation, ``step_features`` without rows), the KL of every counted entry."""
    t = batch.input_ids.shape[1]
    t_logp = torch.log_softmax(ttt.teacher_logits(batch.final), -1)  # [B, T, D]
    mask, cache = context_mask(batch.seq_ids), KVCache()
    hidden, loss = draft.project_aux(batch.aux), 0.0
    for k in range(ttt.ttt_steps):
        ids = shift_left(batch.input_ids, 1 + k, 0)
        hidden, normed = draft.step_features(ids, hidden, batch.position_ids + k, mask, cache)
        n = t - 1 - k
        tl, logq = t_logp[:, 1 + k:], torch.log_softmax(draft.head(normed)[:, :n], -1)
        kl = (tl.exp() * (tl - logq)).sum(-1)
        loss = loss + ttt.weights[k] * (kl * ttt_counted(batch.loss_mask, batch.seq_ids, k)[:, :n]).sum() / norm[k]
    return loss


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_layer_and_heads_at_kept_entries_give_the_dense_loss_and_gradients(kind, tiny_llama_verifier, kimi_shaped):
    """The TTT runs the layer and the heads only at the entries some loss reads (eagle3.draft.model.Rows: step 0's
    keys and values at every entry, the rest at the kept ones); its loss and every trainable parameter's gradient
    equal the unroll over all entries, on rows with several samples, padding and prompt-like gaps in the loss mask,
    for both attention kinds. The draft's layer is scaled up so that every part of it matters."""
    batch = _batch([[7, 6, 3], [11]], t=16, token_base=0, h=64)
    batch.loss_mask &= torch.arange(16) % 5 != 1
    batch.counted = torch.stack([ttt_counted(batch.loss_mask, batch.seq_ids, k).sum() for k in range(K)])
    if kind == "llama":
        draft = _real_draft(tiny_llama_verifier)
    else:
        spec = VerifierSpec.from_path(kimi_shaped)
        cfg = DraftConfig.build(spec, D, [1, 2, 3], DraftArchitecture(kind="mla"), torch_dtype="float32")
        d2t, t2d = vocab_tables(spec.vocab_size, D, seed=None)
        draft = Eagle3Draft.from_verifier(cfg, kimi_shaped, d2t, t2d)
        batch.aux = torch.randn(2, 16, 3 * spec.hidden_size, generator=torch.Generator().manual_seed(2))
        batch.final = torch.randn(2, 16, spec.hidden_size, generator=torch.Generator().manual_seed(3))
        batch.input_ids %= spec.vocab_size
    with torch.no_grad():
        draft.fc.weight.mul_(4)
    ttt = _ttt(draft, h=draft.config.hidden_size if kind == "llama" else spec.hidden_size)
    norm = batch.counted.float().clamp(min=1)
    loss, stats = ttt(batch, norm)
    dense = _dense_unroll_loss(draft, ttt, batch, norm)
    assert 0 < int(stats[:, 1].sum()) < 2 * 16 * K  # prompt-like gaps: some entries are skipped
    params = [p for p in draft.parameters() if p.requires_grad]
    mine = torch.autograd.grad(loss, params)
    ref = torch.autograd.grad(dense, params)
    torch.testing.assert_close(loss, dense, rtol=1e-5, atol=1e-6)
    for (name, _), a, b in zip([(n, p) for n, p in draft.named_parameters() if p.requires_grad], mine, ref):
        assert float(b.abs().max()) > 0, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_rows_shorter_than_the_unroll():
    """Rows of 4 tokens under 7 TTT steps: steps 2 .. 6 read nothing (no guess inside the row), the loss and the
    statistics come from steps 0 and 1."""
    batch = _batch([[4], [3]], t=4)
    ttt = TrainingTimeTest(nn.Identity(), torch.ones(H), torch.randn(D, H), 1e-6, 7, 0.8)
    ttt.draft = OracleDraft(batch, ttt.teacher_logits(batch.final), shift=-1)
    loss, stats = ttt(batch, torch.ones(7))
    counted = [ttt_counted(batch.loss_mask, batch.seq_ids, k).sum() for k in range(7)]
    assert stats[:, 1].tolist() == [float(c) for c in counted] and counted[0] > 0 and sum(counted[2:]) == 0
    assert float(loss.detach()) > 0


def test_a_micro_batch_without_counted_entries_still_reaches_every_parameter(tiny_llama_verifier):
    """No loss-masked token at all: the heads read nothing, the loss is 0, and every trainable parameter still gets
    a (zero) gradient, as DDP's reduction expects of each process."""
    batch = _batch([[9, 7]], t=16, token_base=0, h=64)
    batch.loss_mask[:] = False
    batch.counted = torch.zeros(K, dtype=torch.long)
    draft = _real_draft(tiny_llama_verifier)
    loss, stats = _ttt(draft, h=64)(batch, torch.ones(K))
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(stats.abs().sum()) == 0.0
    assert all(p.grad is not None for p in draft.parameters() if p.requires_grad)


def test_embedding_and_verifier_head_stay_frozen(tiny_llama_verifier):
    batch = _batch([[9, 7]], t=16, token_base=0, h=64)
    draft = _real_draft(tiny_llama_verifier)
    ttt = _ttt(draft, h=64)
    embed, head, norm = draft.embed_tokens.weight.clone(), ttt.teacher_lm_head.clone(), ttt.teacher_norm.clone()
    trainable = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    loss, _ = ttt(batch, batch.counted.float().clamp(min=1))
    loss.backward()
    assert draft.embed_tokens.weight.grad is None
    assert not ttt.teacher_lm_head.requires_grad and not ttt.teacher_norm.requires_grad
    names = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in names and len(names) == 13
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in trainable)
    opt.step()
    assert torch.equal(draft.embed_tokens.weight, embed)
    assert torch.equal(ttt.teacher_lm_head, head) and torch.equal(ttt.teacher_norm, norm)


def test_packing_is_complete_bounded_and_dense():
    g = torch.Generator().manual_seed(0)
    lengths = {i: int(n) for i, n in enumerate(torch.randint(20, 600, (500,), generator=g))}
    bins = pack_samples(lengths, 2048)
    assert sorted(i for b in bins for i in b) == sorted(lengths)
    assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
    assert packing_efficiency(bins, lengths, 2048) > 0.97
    assert pack_samples(lengths, 2048) == bins  # deterministic
    assert pack_samples({0: 2048, 1: 2048, 2: 1}, 2048) == [[0], [1], [2]]


def test_split_is_deterministic_disjoint_and_sized():
    idx = list(range(0, 300, 3))
    train, val = split_indices(idx, 0.05, seed=1)
    assert (train, val) == split_indices(idx, 0.05, seed=1) and len(val) == 5
    assert sorted(train + val) == idx and not set(train) & set(val)
    assert split_indices(idx, 0.05, seed=2)[1] != val
    assert split_indices([4, 9], 0.05, 0)[1] in ([4], [9]) and split_indices([4], 0.5, 0) == ([4], [])
    assert split_indices(idx, 0.0, 0) == (idx, [])


def test_lr_schedule_warmup_then_cosine():
    lrs = [lr_at(s, 100, 1e-3, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:])) and lrs[-1] == pytest.approx(1e-4, rel=0.01)
    assert lr_at(50, 100, 1e-3, warmup_steps=0, schedule="constant") == 1e-3


def test_oom_retry_halves_micro_batches_keeping_the_global_batch():
    cfg = TrainConfig(batch_size=8, grad_accum_steps=1)
    assert [cfg.with_smaller_micro_batches(s).grad_accum_steps for s in (1.0, 0.5, 0.25, 0.125, 0.0625)] == \
        [1, 2, 4, 8, 8]  # 8 sequences per step: at most 8 micro-batches of one
    assert TrainConfig(batch_size=6).with_smaller_micro_batches(0.25).grad_accum_steps == 2  # stays a divisor of 6
    assert TrainConfig(batch_size=8, nproc=2).with_smaller_micro_batches(0.25).grad_accum_steps == 4
