"""The training memory plan: parameter counts of the real draft, activations equal to what autograd keeps (CPU), the
trainer logging the plan and refusing before it allocates when the plan cannot fit. (Measured peak RSS against the
plan: bench/train_memory.py.)"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import TINY

from eagle3.draft.config import DraftArchitecture, DraftConfig
from eagle3.draft.model import Eagle3Draft
from eagle3.support.verifier import VerifierSpec
from eagle3.train.config import TrainConfig
from eagle3.train.data import Batch, noise_seed, noised_aux
from eagle3.train.memory import (
    TrainMemoryError,
    cache_kept_by_attention,
    check_memory,
    head_rows,
    parameter_counts,
    plan_training_memory,
)
from eagle3.train.stage import train_draft
from eagle3.train.ttt import TrainingTimeTest

ARCHS = {  # the draft variants whose plan is checked against the module: GQA and plain llama, MLA with and without
    # a query latent, the EAGLE 3.1 options
    "llama-gqa": ("tiny", DraftArchitecture(num_key_value_heads=2)),
    "llama-mha": ("tiny", DraftArchitecture(num_key_value_heads=4)),
    "llama-3.1": ("tiny", DraftArchitecture(num_key_value_heads=2, norm_before_fc=True, fc_norm=True,
                                            norm_output=True)),
    "mla": ("kimi", DraftArchitecture(kind="mla")),
    "mla-no-q-latent": ("kimi-no-q", DraftArchitecture(kind="mla", fc_norm=True, norm_output=True)),
}


@pytest.fixture(scope="module")
def verifiers(tiny_llama_verifier, kimi_like_target, tmp_path_factory):
    from helpers import save_kimi_like_target

    no_q = save_kimi_like_target(tmp_path_factory.mktemp("kimi-no-q") / "target")
    cfg = json.loads((no_q / "config.json").read_text())
    cfg["text_config"]["q_lora_rank"] = None  # DeepSeek-V2-Lite style: a direct q_proj
    (no_q / "config.json").write_text(json.dumps(cfg))
    return {"tiny": tiny_llama_verifier, "kimi": kimi_like_target, "kimi-no-q": no_q}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_parameter_counts_equal_the_draft_module(verifiers, arch):
    verifier, draft_arch = ARCHS[arch]
    cfg = DraftConfig.build(VerifierSpec.from_path(verifiers[verifier]), 100, [1, 2, 3], draft_arch)
    draft = Eagle3Draft(cfg)
    trainable, frozen = parameter_counts(cfg)
    assert sum(trainable.values()) == sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert frozen == draft.embed_tokens.weight.numel() == cfg.vocab_size * cfg.hidden_size


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_optimizer_states_equal_the_plan(verifiers, arch):
    """AdamW's two moments per trainable parameter, or with optimizer muon Muon's one momentum buffer per weight
    matrix and AdamW's two for the rest (norms, lm_head): the plan's items equal the states after one step."""
    from eagle3.train.optim import build_optimizers

    verifier, draft_arch = ARCHS[arch]
    cfg = DraftConfig.build(VerifierSpec.from_path(verifiers[verifier]), 100, [1, 2, 3], draft_arch)
    draft = Eagle3Draft(cfg)
    for name in ("adamw", "muon"):
        train = TrainConfig(optimizer=name, **TINY)
        opts = build_optimizers(draft, train, "cpu")
        for p in draft.parameters():
            p.grad = torch.ones_like(p) if p.requires_grad else None
        for opt in opts:
            opt.step()
        kept: dict[str, int] = {}
        for opt in opts:
            for state in opt.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.ndim > 0:
                        kind = "Muon momentum" if key == "momentum_buffer" else "AdamW states"
                        kept[kind] = kept.get(kind, 0) + value.numel() * value.element_size()
        items = {i.name: i.bytes for i in plan_training_memory(cfg, train, device="cpu").items}
        assert {k: items[k] for k in kept} == kept
        assert ("Muon momentum" in items) == (name == "muon")


@pytest.mark.parametrize(("rows", "tokens", "steps", "arch", "loss", "noise"), [
    (2, 96, 3, "llama-gqa", "kl", 0.0), (1, 150, 5, "llama-mha", "kl", 0.0), (3, 40, 1, "llama-gqa", "kl", 0.0),
    (2, 64, 3, "llama-3.1", "kl", 0.0), (2, 96, 3, "mla", "kl", 0.0), (1, 70, 1, "mla", "kl", 0.0),
    (2, 50, 4, "mla-no-q-latent", "kl", 0.0), (2, 96, 3, "llama-gqa", "lk_alpha", 0.0),
    (2, 64, 2, "llama-3.1", "lk_lambda", 0.0), (2, 96, 3, "llama-gqa", "kl", 0.1), (2, 64, 3, "llama-3.1", "kl", 0.1)])
def test_activations_are_what_autograd_keeps_on_cpu(verifiers, rows, tokens, steps, arch, loss, noise):
    """Every tensor autograd saves in one TTT forward (unique storages, parameters and the batch excluded) against
    the plan's activations less what it counts as alive but not saved (the teacher's argmax/entropy, the last step's
    transients, the boolean context mask, the per-step K/V that SDPA does not keep). With train.feature_noise the
    forward reads the noised copy of the batch's aux states, as the trainer feeds it."""
    verifier, draft_arch = ARCHS[arch]
    cfg = DraftConfig.build(VerifierSpec.from_path(verifiers[verifier]), 256, [1, 2, 3], draft_arch)
    torch.manual_seed(0)
    ttt = TrainingTimeTest(Eagle3Draft(cfg), torch.ones(cfg.hidden_size), torch.randn(256, cfg.hidden_size), 1e-5,
                           steps, 0.8, loss=loss)
    n, h = rows * tokens, cfg.hidden_size
    batch = Batch(torch.randint(0, 256, (rows, tokens)), torch.randn(rows, tokens, 3 * h),
                  torch.randn(rows, tokens, h), torch.ones(rows, tokens, dtype=torch.bool),
                  torch.zeros(rows, tokens, dtype=torch.long), torch.arange(tokens).expand(rows, tokens).contiguous(),
                  n, torch.zeros(steps, dtype=torch.long))
    skip = {t.untyped_storage().data_ptr() for t in [*ttt.parameters(), *ttt.buffers(), batch.aux]}
    stored = batch.aux  # kept alive: a freed storage's address could come back as a saved tensor's and be skipped
    if noise:
        batch.aux = noised_aux(stored, noise, noise_seed(0, 0, 0, 0))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt(batch, torch.ones(steps))
    plan = plan_training_memory(cfg, TrainConfig(batch_size=rows, max_seq_len=tokens, ttt_steps=steps, device="cpu",
                                                 loss=loss, feature_noise=noise), 1, "cpu")
    a = plan.activations
    cache_kept = cache_kept_by_attention(cfg, rows, tokens, steps, "cpu")  # the cache the attention keeps
    # the teacher's argmax and entropy (its probabilities: kept by the KL's backward; by nothing with the LK losses)
    teacher_alive = 12 * head_rows(rows, tokens, 0) + (a["teacher probabilities"] if loss != "kl" else 0)
    # the noised aux states: the trainer's batch holds them through the step; fc saves them, a norm before fc does not
    # (no gradient flows to its input)
    noised_alive = batch.aux.numel() * 4 if noise and (cfg.norm_before_fc or cfg.fc_norm) else 0
    alive_only = (a["last-step transients"] + a["context mask"] + teacher_alive + a["k/v cache"] - cache_kept
                  + noised_alive)
    # equal up to the per-step loss bookkeeping (scalars, the LK losses' per-entry [N] values): well under 0.1%
    assert abs(plan.activation_bytes - alive_only - sum(saved.values())) <= 1e-3 * sum(saved.values())


def test_feature_noise_plans_its_float32_copy(tiny_llama_verifier):
    """train.feature_noise makes a float32 copy of the aux states (eagle3.train.data.noised_aux): planned on CUDA (beside
    autocast's bf16 cast) and on a CPU with a float32 batch; a CPU bf16 batch already pays for that float copy."""
    cfg = DraftConfig.build(VerifierSpec.from_path(tiny_llama_verifier), 256, [1, 2, 3])
    copy = 4 * 2 * 128 * 3 * cfg.target_hidden_size  # float32, 2 rows x 128 tokens x 3 aux states
    for device, batch_bytes, extra in (("cuda", 2, copy), ("cpu", 4, copy), ("cpu", 2, 0)):
        plain, noised = (plan_training_memory(cfg, TrainConfig(batch_size=2, max_seq_len=128, feature_noise=x), 1,
                                              device, batch_dtype_bytes=batch_bytes) for x in (0.0, 0.05))
        assert noised.activation_bytes - plain.activation_bytes == extra, (device, batch_bytes)


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


def test_trainer_logs_the_plan_and_refuses_before_allocating(random_store, tiny_llama_verifier, tmp_path,
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
