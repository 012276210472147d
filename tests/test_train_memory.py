"""The training memory plan: parameter counts of the real draft, activations equal to what autograd keeps (CPU), the
trainer logging the plan and refusing before it allocates when the plan cannot fit. (Measured peak RSS against the
plan: bench/train_memory.py.)"""

from __future__ import annotations

import logging

import pytest
import torch
from test_train import TINY, random_store  # noqa: F401 - the module-scoped store fixture

from eagle3.draft.model import DraftArchitecture, DraftConfig, Eagle3Draft
from eagle3.support.verifier import VerifierSpec
from eagle3.train.config import TrainConfig
from eagle3.train.data import Batch
from eagle3.train.memory import TrainMemoryError, check_memory, parameter_counts, plan_training_memory
from eagle3.train.stage import train_draft
from eagle3.train.ttt import TrainingTimeTest


@pytest.mark.parametrize("kv_heads", [2, 4])  # GQA (keys repeated for SDPA) and plain multi-head attention
def test_parameter_counts_equal_the_draft_module(tiny_llama_verifier, kimi_like_target, kv_heads):
    for verifier, vocab in ((tiny_llama_verifier, 256), (kimi_like_target, 100)):
        cfg = DraftConfig.build(VerifierSpec.from_path(verifier), vocab, [1, 2, 3],
                                DraftArchitecture(num_key_value_heads=kv_heads))
        draft = Eagle3Draft(cfg)
        trainable, frozen = parameter_counts(cfg)
        assert sum(trainable.values()) == sum(p.numel() for p in draft.parameters() if p.requires_grad)
        assert frozen == draft.embed_tokens.weight.numel() == cfg.vocab_size * cfg.hidden_size


@pytest.mark.parametrize(("rows", "tokens", "steps", "kv_heads"), [(2, 96, 3, 2), (1, 150, 5, 4), (3, 40, 1, 2)])
def test_activations_are_what_autograd_keeps_on_cpu(tiny_llama_verifier, rows, tokens, steps, kv_heads):
    """Every tensor autograd saves in one TTT forward (unique storages, parameters and the batch excluded) against
    the plan's activations less what it counts as alive but not saved (teacher log-probs, the last step's
    transients, the boolean context mask, the per-step K/V that SDPA does not keep)."""
    cfg = DraftConfig.build(VerifierSpec.from_path(tiny_llama_verifier), 256, [1, 2, 3],
                            DraftArchitecture(num_key_value_heads=kv_heads))
    torch.manual_seed(0)
    ttt = TrainingTimeTest(Eagle3Draft(cfg), torch.ones(cfg.hidden_size), torch.randn(256, cfg.hidden_size), 1e-5,
                           steps, 0.8)
    n, h = rows * tokens, cfg.hidden_size
    batch = Batch(torch.randint(0, 256, (rows, tokens)), torch.randn(rows, tokens, 3 * h),
                  torch.randn(rows, tokens, h), torch.ones(rows, tokens, dtype=torch.bool),
                  torch.zeros(rows, tokens, dtype=torch.long), torch.arange(tokens).expand(rows, tokens).contiguous(),
                  n, torch.zeros(steps, dtype=torch.long))
    skip = {t.untyped_storage().data_ptr() for t in [*ttt.parameters(), *ttt.buffers(), batch.aux]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt(batch, torch.ones(steps))
    plan = plan_training_memory(cfg, TrainConfig(batch_size=rows, max_seq_len=tokens, ttt_steps=steps, device="cpu"),
                                1, "cpu")
    a = plan.activations
    cache_kept = a["k/v cache"] // steps if kv_heads == cfg.num_attention_heads else 0  # step 0's, without GQA
    alive_only = (a["last-step transients"] + a["context mask"] + 4 * n * 256 + 12 * n  # teacher log-probs etc.
                  + a["k/v cache"] - cache_kept)
    # equal up to the per-step loss bookkeeping (counted masks [B, T - 1 - k] bool, scalars): well under 0.1%
    assert abs(plan.activation_bytes - alive_only - sum(saved.values())) <= 1e-3 * sum(saved.values())


def test_check_memory_fails_or_warns_with_the_itemized_plan(tiny_llama_verifier):
    cfg = DraftConfig.build(VerifierSpec.from_path(tiny_llama_verifier), 256, [1, 2, 3])
    plan = plan_training_memory(cfg, TrainConfig(batch_size=4, nproc=2, max_seq_len=256, device="cpu"), 2, "cpu")
    need = plan.peak_bytes * 11 // 10 * 2  # 10% margin, two processes on one host
    assert check_memory(plan, need + 2, "test RAM", 0.10, "fail") is None
    with pytest.raises(TrainMemoryError, match=r"per process x 2 processes .* but test RAM is") as e:
        check_memory(plan, need // 2, "test RAM", 0.10, "fail")
    assert "activations" in str(e.value) and "AdamW states" in str(e.value) and "DDP gradient buckets" in str(e.value)
    warning = check_memory(plan, need // 2, "test RAM", 0.10, "warn")
    assert warning.startswith("training would not fit") and "on_insufficient_memory: warn" in warning
    gpu = plan_training_memory(cfg, TrainConfig(batch_size=4, nproc=2, max_seq_len=256), 2, "cuda")
    assert check_memory(gpu, gpu.peak_bytes * 11 // 10 + 1, "one GPU", 0.10, "fail") is None  # per GPU, not x 2


def test_plan_counts_the_nodes(tiny_llama_verifier):
    """Nodes x nproc processes split the batch and FSDP's shards; a CPU host's RAM holds only its own nproc."""
    cfg = DraftConfig.build(VerifierSpec.from_path(tiny_llama_verifier), 256, [1, 2, 3])
    two_hosts = TrainConfig(batch_size=8, nodes=2, nproc=2, rdzv_endpoint="host-a:29400", max_seq_len=256,
                            device="cpu")
    one_host = two_hosts.model_copy(update={"nodes": 1, "rdzv_endpoint": None, "grad_accum_steps": 2})
    plan = plan_training_memory(cfg, two_hosts, device="cpu")  # the world: nodes x nproc
    assert (plan.processes, plan.processes_per_host, plan.micro_batch_rows) == (4, 2, 2)
    assert plan.peak_bytes == plan_training_memory(cfg, one_host, device="cpu").peak_bytes - (
        plan_training_memory(cfg, one_host, device="cpu").batch_bytes - plan.batch_bytes)  # only the prefetch differs
    assert "ddp, 4 process(es) on 2 hosts of 2, cpu" in plan.summary()
    need = plan.peak_bytes * 11 // 10 * 2  # 10% margin, the 2 processes of this host (not 4)
    assert check_memory(plan, need + 2, "test RAM", 0.10, "fail") is None
    fsdp = plan_training_memory(cfg, two_hosts.model_copy(update={"parallel": "fsdp"}), device="cuda")
    items = {i.name: i.bytes for i in fsdp.items}
    one = {i.name: i.bytes for i in plan_training_memory(cfg, one_host.model_copy(update={"parallel": "fsdp"}),
                                                         device="cuda").items}
    assert items["AdamW states"] < one["AdamW states"]  # sharded over 4 processes instead of 2


def test_trainer_logs_the_plan_and_refuses_before_allocating(random_store, tiny_llama_verifier, tmp_path,  # noqa: F811
                                                            caplog):
    store, mapping = random_store
    with caplog.at_level(logging.INFO, logger="eagle3"):
        train_draft(TrainConfig(**{**TINY, "epochs": 1, "stop_after_steps": 1}), store, mapping, tmp_path / "ok",
                    verifier=tiny_llama_verifier)
    assert "[train] Training memory plan per process (single, 1 process(es), cpu)" in caplog.text
    assert "peak" in caplog.text and "activations" in caplog.text
    # 10^6-token rows: the attention masks alone are terabytes
    with pytest.raises(TrainMemoryError, match=r"training would not fit: .* host available RAM \(psutil\)"):
        train_draft(TrainConfig(**{**TINY, "max_seq_len": 10**6}), store, mapping, tmp_path / "big",
                    verifier=tiny_llama_verifier)
    assert not (tmp_path / "big").exists()  # refused before anything was written
