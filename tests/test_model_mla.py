"""The MLA draft (vLLM's Eagle3DeepseekV3ForCausalLM) and the EAGLE 3.1 options, against references written from
transformers' DeepSeek-V3 parts (its yarn rotary embedding, interleaved RoPE and mscale), token by token."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import reference_draft_tail, vocab_tables

from eagle3.draft.config import DraftArchitecture, DraftConfig, DraftConfigError, serving_pair_problem
from eagle3.draft.model import Eagle3Draft
from eagle3.support.verifier import VerifierSpec


def _draft(verifier, **arch) -> Eagle3Draft:
    spec = VerifierSpec.from_path(verifier)
    cfg = DraftConfig.build(spec, 300, None, DraftArchitecture(**arch), torch_dtype="float32")
    d2t, t2d = vocab_tables(spec.vocab_size, 300)
    draft = Eagle3Draft.from_verifier(cfg, verifier, d2t, t2d, seed=0)
    with torch.no_grad():  # non-trivial norm weights so a swapped norm shows
        for name, p in draft.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")) or ".fc_norm." in name or "input_norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return draft


def _mla_reference(draft: Eagle3Draft, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
    """deepseek_eagle3's layer with DeepseekV2MLAAttention written out per token and head, RoPE and scale from
    transformers' DeepSeek-V3 code. ids, pos: [T]; hidden: [T, H] -> (prenorm [T, H], logits [T, draft_vocab])."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
        yarn_apply_mscale,
    )

    c, layer, attn = draft.config, draft.midlayer, draft.midlayer.self_attn
    rope_params = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:
        rope_params = {**{k: v for k, v in c.rope_scaling.items() if k != "type"}, "rope_type": c.rope_scaling["type"],
                       "rope_theta": c.rope_theta}
    hf = DeepseekV3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                          qk_rope_head_dim=c.qk_rope_head_dim, qk_nope_head_dim=c.qk_nope_head_dim,
                          v_head_dim=c.v_head_dim, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
                          rope_parameters=rope_params, max_position_embeddings=c.max_position_embeddings)

    def rms(w, x, eps=c.rms_norm_eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    t, nh, nope, r, vd = len(ids), c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    e = rms(layer.input_layernorm.weight, draft.embed_tokens.weight[ids])
    h_n = rms(layer.hidden_norm.weight, hidden)
    residual = h_n if c.norm_before_residual else hidden
    x = torch.cat([e, h_n], -1)  # [T, 2H]
    q = rms(attn.q_a_layernorm.weight, x @ attn.q_a_proj.weight.T) @ attn.q_b_proj.weight.T
    q = q.view(t, nh, nope + r)
    kv_a = x @ attn.kv_a_proj_with_mqa.weight.T
    latent, k_pe = kv_a[:, :c.kv_lora_rank], kv_a[:, c.kv_lora_rank:]
    kv = (rms(attn.kv_a_layernorm.weight, latent) @ attn.kv_b_proj.weight.T).view(t, nh, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    cos, sin = DeepseekV3RotaryEmbedding(hf)(x[None], pos[None])
    q_pe, k_pe = apply_rotary_pos_emb_interleave(q[None, :, :, nope:].transpose(1, 2), k_pe[None, None], cos, sin)
    q_pe, k_pe = q_pe[0].transpose(0, 1), k_pe[0, 0]  # [T, heads, r], [T, r]
    scale = yarn_apply_mscale(hf.rope_parameters, (nope + r) ** -0.5) if c.rope_scaling else (nope + r) ** -0.5
    out = torch.zeros(t, nh, vd)
    for i in range(t):
        for hh in range(nh):
            scores = torch.stack([(q[i, hh, :nope] @ k_nope[j, hh] + q_pe[i, hh] @ k_pe[j]) for j in range(i + 1)])
            out[i, hh] = torch.softmax(scores * scale, 0) @ v[: i + 1, hh]
    residual = out.reshape(t, -1) @ attn.o_proj.weight.T + residual
    return reference_draft_tail(draft, residual, rms)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@torch.no_grad()
def test_mla_forward_is_vllm_deepseek_eagle3_layer(kimi_shaped, norm_before_residual):
    draft = _draft(kimi_shaped, kind="mla", norm_before_residual=norm_before_residual)
    c = draft.config
    assert (c.kind, c.kv_lora_rank, c.q_lora_rank, c.qk_rope_head_dim, c.head_dim) == ("mla", 512, 1536, 64, 192)
    assert c.rope_scaling["type"] == "yarn" and c.rope_scaling["factor"] == 64.0  # Kimi's yarn, from the verifier
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, c.vocab_size, (7,), generator=g)
    hidden = torch.randn(7, c.hidden_size, generator=g)
    pos = torch.arange(7) + 4090  # around yarn's original 4096 positions
    pre, logits = draft(ids[None], hidden[None], pos[None])
    ref_pre, ref_logits = _mla_reference(draft, ids, hidden, pos)
    torch.testing.assert_close(pre[0], ref_pre, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_mla_without_yarn_takes_the_default_frequencies(kimi_like_target):
    draft = _draft(kimi_like_target, kind="mla")  # tiny MLA widths, default rope
    assert draft.config.rope_scaling is None and draft.config.q_lora_rank == 32
    ids, hidden, pos = torch.randint(0, 1024, (5,)), torch.randn(5, 64), torch.arange(5)
    pre, _ = draft(ids[None], hidden[None], pos[None])
    torch.testing.assert_close(pre[0], _mla_reference(draft, ids, hidden, pos)[0], atol=1e-4, rtol=1e-4)


def test_mla_parameter_names_are_vllm_deepseek_eagle3_names(kimi_shaped):
    draft = _draft(kimi_shaped, kind="mla", fc_norm=True)
    names = set(draft.state_dict())
    attn = {f"midlayer.self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                       "kv_a_layernorm", "kv_b_proj", "o_proj")}
    assert attn <= names and not any(".q_proj." in n or ".k_proj." in n for n in names)
    assert {f"fc_norm.{i}.weight" for i in range(draft.config.n_aux)} <= names and "input_norm.weight" not in names
    c = draft.config
    assert draft.midlayer.self_attn.kv_b_proj.weight.shape == (c.num_attention_heads * (128 + 128), 512)
    assert draft.midlayer.self_attn.q_a_proj.weight.shape == (1536, 2 * c.hidden_size)


def test_mla_config_maps_onto_a_config_vllm_serves_as_mla(kimi_shaped):
    cfg = _draft(kimi_shaped, kind="mla").config
    flat = cfg.to_vllm_config()
    # deepseek_v2, not deepseek_v3: vLLM rewrites a deepseek_v3 draft config into DeepSeek's MTP module
    assert flat["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and flat["model_type"] == "deepseek_v2"
    assert (flat["kv_lora_rank"], flat["q_lora_rank"], flat["qk_rope_head_dim"], flat["v_head_dim"]) == (512, 1536,
                                                                                                        64, 128)
    assert DraftConfig.from_vllm_config(flat) == cfg
    from transformers import DeepseekV2Config  # vLLM builds the draft's hf_config with it

    hf = DeepseekV2Config.from_dict(flat)
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 64.0
    assert hf.rope_parameters["mscale_all_dim"] == 1.0 and hf.rope_parameters["rope_theta"] == cfg.rope_theta


@torch.no_grad()
@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_eagle31_options_compute_what_vllm_computes(kimi_shaped, kind):
    """fc_norm (and norm_before_fc for llama) normalise the aux states before fc; norm_output feeds the normed
    output forward (vLLM's combine_hidden_states and aux_output)."""
    extra = {"norm_before_fc": True} if kind == "llama" else {}
    draft = _draft(kimi_shaped, kind=kind, fc_norm=True, norm_output=True, **extra)
    c = draft.config
    aux = torch.randn(2, 5, c.n_aux * c.target_hidden_size)

    def rms(w, x):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    a = rms(draft.input_norm.weight, aux) if kind == "llama" else aux
    a = torch.cat([rms(n.weight, x) for n, x in zip(draft.fc_norm, a.chunk(c.n_aux, -1))], -1)
    torch.testing.assert_close(draft.project_aux(aux), a @ draft.fc.weight.T)
    ids, pos = torch.randint(0, c.vocab_size, (2, 5)), torch.arange(5).expand(2, 5)
    fed, logits = draft(ids, draft.project_aux(aux), pos)
    torch.testing.assert_close(logits, fed @ draft.lm_head.weight.T)  # fed forward = norm(prenorm)
    plain = Eagle3Draft(c.model_copy(update={"norm_output": False}))
    plain.load_state_dict(draft.state_dict())
    prenorm, _ = plain(ids, draft.project_aux(aux), pos)
    torch.testing.assert_close(fed, draft.norm(prenorm))


def test_mla_draft_needs_an_mla_verifier_and_mla_takes_no_input_norm(tiny_llama_verifier, kimi_shaped):
    with pytest.raises(DraftConfigError, match="MLA verifier .* set train.draft.kind: llama"):
        DraftConfig.build(VerifierSpec.from_path(tiny_llama_verifier), 100, [1, 2, 3], DraftArchitecture(kind="mla"))
    with pytest.raises(DraftConfigError, match="norm_before_fc is a llama-draft option"):
        DraftConfig.build(VerifierSpec.from_path(kimi_shaped), 100, None,
                          DraftArchitecture(kind="mla", norm_before_fc=True))


def test_serving_pairs_vllm_refuses_on_cpu_are_named_with_the_setting():
    problem = serving_pair_problem(True, "llama", "cpu")
    assert "CPU_MLA" in problem and problem.endswith("set train.draft.kind: mla")
    assert serving_pair_problem(False, "mla", "cpu").endswith("set train.draft.kind: llama")
    assert serving_pair_problem(True, "mla", "cpu") is None and serving_pair_problem(False, "llama", "cpu") is None
    assert serving_pair_problem(True, "llama", "cuda") is None


def test_mla_draft_has_fewer_attention_parameters_than_llama_at_kimi_size():
    """Kimi-K2.5's shapes (hidden 7168, 64 heads): an MLA draft's attention is ~4x smaller than a llama draft's."""
    common = dict(hidden_size=7168, target_hidden_size=7168, intermediate_size=18432, num_attention_heads=64,  # noqa: C408
                  num_key_value_heads=64, vocab_size=163840, draft_vocab_size=32000, aux_layer_ids=[2, 30, 58])
    llama = DraftConfig(**common, head_dim=128)
    mla = DraftConfig(**common, kind="mla", head_dim=192, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128)
    assert llama.attention_params() == 2 * 7168 * 128 * 192 + 64 * 128 * 7168
    assert 3.5 < llama.attention_params() / mla.attention_params() < 4.5
    assert math.isclose(mla.attention_params() / 1e6, 116.0, rel_tol=0.02)
