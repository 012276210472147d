"""The draft model: vLLM's Eagle3LlamaForCausalLM computation, config mapping, init from the verifier."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import reference_draft_tail, vocab_tables

from eagle3.draft.config import DraftArchitecture, DraftConfig, DraftConfigError
from eagle3.draft.model import HALF_INPUT, LAYER_INIT, Eagle3Draft
from eagle3.support.verifier import VerifierSpec, load_verifier_head

_mapping = vocab_tables


def _draft(verifier, draft_vocab: int = 300, norm_before_residual: bool = False, seed: int = 0) -> Eagle3Draft:
    spec = VerifierSpec.from_path(verifier)
    cfg = DraftConfig.build(spec, draft_vocab, [1, 2, 3], DraftArchitecture(norm_before_residual=norm_before_residual),
                            torch_dtype="float32")
    d2t, t2d = _mapping(spec.vocab_size, draft_vocab)
    draft = Eagle3Draft.from_verifier(cfg, verifier, d2t, t2d, seed=seed)
    with torch.no_grad():  # non-trivial norm weights so a swapped norm shows
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return draft


def _reference(draft: Eagle3Draft, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
    """vLLM's llama_eagle3 layer written out token by token, with transformers' own RoPE and RMSNorm.

    ids, pos: [T]; hidden: [T, H]; plain causal attention. -> (prenorm [T, H], logits [T, draft_vocab])
    """
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    c = draft.config
    layer = draft.midlayer

    def rms(w, x):
        n = LlamaRMSNorm(x.shape[-1], eps=c.rms_norm_eps)
        n.weight.data.copy_(w)
        return n(x)

    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=c.num_attention_heads * c.head_dim, head_dim=c.head_dim,
                                            num_attention_heads=c.num_attention_heads,
                                            rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                                            max_position_embeddings=c.max_position_embeddings))
    e = rms(layer.input_layernorm.weight, draft.embed_tokens.weight[ids])
    h_n = rms(layer.hidden_norm.weight, hidden)
    residual = h_n if c.norm_before_residual else hidden
    x = torch.cat([e, h_n], -1)  # [T, 2H]
    t = len(ids)
    q = (x @ layer.self_attn.q_proj.weight.T).view(t, c.num_attention_heads, c.head_dim).transpose(0, 1)[None]
    k = (x @ layer.self_attn.k_proj.weight.T).view(t, c.num_key_value_heads, c.head_dim).transpose(0, 1)[None]
    v = (x @ layer.self_attn.v_proj.weight.T).view(t, c.num_key_value_heads, c.head_dim).transpose(0, 1)[None]
    cos, sin = rope(x[None], pos[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    q, k, v = q[0], k[0], v[0]  # [heads, T, hd]
    group = c.num_attention_heads // c.num_key_value_heads
    out = torch.zeros(t, c.num_attention_heads, c.head_dim)
    for i in range(t):
        for hh in range(c.num_attention_heads):
            kv = hh // group
            scores = torch.stack([q[hh, i] @ k[kv, j] for j in range(i + 1)]) / math.sqrt(c.head_dim)
            out[i, hh] = torch.softmax(scores, 0) @ v[kv, : i + 1]
    attn = out.reshape(t, -1) @ layer.self_attn.o_proj.weight.T
    residual = attn + residual
    return reference_draft_tail(draft, residual, rms)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@torch.no_grad()
def test_forward_is_vllm_eagle3_layer(tiny_llama_verifier, norm_before_residual):
    draft = _draft(tiny_llama_verifier, norm_before_residual=norm_before_residual)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (7,), generator=g)
    hidden = torch.randn(7, draft.config.hidden_size, generator=g)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6]) + 3  # positions need not start at 0
    pre, logits = draft(ids[None], hidden[None], pos[None])
    ref_pre, ref_logits = _reference(draft, ids, hidden, pos)
    torch.testing.assert_close(pre[0], ref_pre, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_norm_before_residual_changes_the_output(tiny_llama_verifier):
    a, b = _draft(tiny_llama_verifier), _draft(tiny_llama_verifier, norm_before_residual=True)
    ids, hidden = torch.randint(0, 8192, (1, 5)), 5 * torch.randn(1, 5, a.config.hidden_size)
    pos = torch.arange(5)[None]
    assert not torch.allclose(a(ids, hidden, pos)[0], b(ids, hidden, pos)[0], atol=1e-3)


@torch.no_grad()
def test_init_from_verifier_and_frozen_embedding(tiny_llama_verifier):
    draft = _draft(tiny_llama_verifier, draft_vocab=300)
    fresh = Eagle3Draft.from_verifier(draft.config, tiny_llama_verifier, draft.d2t, draft.t2d)
    draft_ids = torch.arange(300) + draft.d2t  # target ids of the draft vocab
    head = load_verifier_head(tiny_llama_verifier, draft_ids)
    assert torch.equal(fresh.lm_head.weight, head.lm_head) and torch.equal(fresh.norm.weight, head.norm_weight)
    assert torch.equal(fresh.embed_tokens.weight, head.embed_tokens)
    assert not fresh.embed_tokens.weight.requires_grad
    # so the untrained draft's head is the verifier's head restricted to the draft vocab
    h = torch.randn(4, fresh.config.hidden_size)
    torch.testing.assert_close(fresh.lm_head(fresh.norm(h)), head.logits(h), atol=1e-5, rtol=1e-5)
    # d2t is an offset table: draft id i -> target id i + d2t[i]
    assert torch.equal(fresh.draft_to_target(torch.arange(300)), draft_ids)
    assert bool(fresh.t2d[draft_ids].all()) and int(fresh.t2d.sum()) == 300
    # the same seed gives the same trainable init
    again = Eagle3Draft.from_verifier(draft.config, tiny_llama_verifier, draft.d2t, draft.t2d)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), again.parameters()))


def test_parameter_names_are_the_checkpoint_contract(tiny_llama_verifier):
    draft = _draft(tiny_llama_verifier)
    h, n_aux, d = draft.config.hidden_size, 3, 300
    c = draft.config
    want = {
        "fc.weight": (h, n_aux * h),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (c.num_attention_heads * c.head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": (c.num_key_value_heads * c.head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": (c.num_key_value_heads * c.head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, c.num_attention_heads * c.head_dim),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (c.intermediate_size, h), "midlayer.mlp.up_proj.weight": (c.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, c.intermediate_size),
        "norm.weight": (h,), "lm_head.weight": (d, h), "embed_tokens.weight": (8192, h), "d2t": (d,), "t2d": (8192,),
    }
    assert {k: tuple(v.shape) for k, v in draft.state_dict().items()} == want
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool


def test_config_maps_onto_flat_vllm_config(tiny_llama_verifier):
    cfg = _draft(tiny_llama_verifier).config
    flat = cfg.to_vllm_config()
    assert flat["architectures"] == ["LlamaForCausalLMEagle3"] and flat["num_hidden_layers"] == 1
    assert flat["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert flat["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True,
                                    "norm_before_fc": False}
    assert (flat["norm_before_residual"], flat["fc_norm"], flat["norm_output"]) == (False, False, False)
    assert flat["vocab_size"] == 8192 and flat["draft_vocab_size"] == 300 and flat["target_hidden_size"] == 64
    assert DraftConfig.from_vllm_config(flat) == cfg
    # transformers reads the same geometry from it (vLLM builds its hf_config with transformers)
    from transformers import LlamaConfig

    hf = LlamaConfig.from_dict(flat)
    assert (hf.head_dim, hf.num_key_value_heads, hf.rope_parameters["rope_theta"]) == (16, 2, cfg.rope_theta)


def test_config_from_kimi_like_nested_verifier(kimi_like_target):
    spec = VerifierSpec.from_path(kimi_like_target)
    cfg = DraftConfig.build(spec, 100, [1, 3, 4])
    # MLA verifier: heads from the verifier, head_dim = v_head_dim, Llama-style draft layer
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.vocab_size) == (64, 4, 16, 1024)
    d2t, t2d = _mapping(1024, 100)
    draft = Eagle3Draft.from_verifier(cfg, kimi_like_target, d2t, t2d)
    out = draft(torch.randint(0, 1024, (2, 6)), torch.randn(2, 6, 64), torch.arange(6).expand(2, 6))
    assert out[1].shape == (2, 6, 100)


def test_bad_draft_configs_name_the_field(tiny_llama_verifier):
    spec = VerifierSpec.from_path(tiny_llama_verifier)
    with pytest.raises(DraftConfigError, match="draft_vocab_size 9000 is larger than the target vocab_size 8192"):
        DraftConfig.build(spec, 9000, [1, 2, 3])
    with pytest.raises(DraftConfigError, match="num_key_value_heads"):
        DraftConfig.build(spec, 100, [1, 2, 3], DraftArchitecture(num_attention_heads=4, num_key_value_heads=3))
    flat = DraftConfig.build(spec, 100, [1, 2, 3]).to_vllm_config()
    with pytest.raises(DraftConfigError, match="use_parallel_drafting"):
        DraftConfig.from_vllm_config({**flat, "use_parallel_drafting": True})
    with pytest.raises(DraftConfigError, match="eagle_aux_hidden_state_layer_ids"):
        DraftConfig.from_vllm_config({k: v for k, v in flat.items() if k not in ("eagle_config",
                                                                             "eagle_aux_hidden_state_layer_ids")})


def test_vllm_config_with_missing_or_mistyped_fields_is_one_clear_error():
    from eagle3.draft.config import DraftConfig, DraftConfigError

    good = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
            "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100,
            "draft_vocab_size": 10}
    with pytest.raises(DraftConfigError, match="missing key num_attention_heads"):
        DraftConfig.from_vllm_config({k: v for k, v in good.items() if k != "num_attention_heads"})
    with pytest.raises(DraftConfigError, match="wrong type"):
        DraftConfig.from_vllm_config({**good, "num_attention_heads": [4]})
    with pytest.raises(DraftConfigError, match="expected a JSON object"):
        DraftConfig.from_vllm_config([good])


@pytest.mark.parametrize(("heads", "kv_heads", "qk", "vd"), [(4, 2, 16, 16), (4, 4, 16, 16), (4, 4, 24, 16)])
def test_cpu_attention_equals_sdpa_over_the_concatenated_steps(heads, kv_heads, qk, vd):
    """The training-time test's CPU attention (written out: the context block plus one score per entry for each
    later step) equals SDPA over all steps' keys concatenated with identity masks (the CUDA path), values and
    gradients, for GQA, plain heads and MLA's keys wider than values; on packed rows with padding."""
    from eagle3.draft.model import KVCache, _explicit_attention, _sdpa
    from eagle3.train.ttt import context_mask

    torch.manual_seed(0)
    b, t, steps = 2, 24, 3
    seq_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 17 + [-1] * 7])  # two samples; one sample + padding
    mask = context_mask(seq_ids)  # [B, 1, T, T]
    q = torch.randn(b, heads, t, qk, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(b, kv_heads, t, qk, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(b, kv_heads, t, vd, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    weights = torch.randn(b, heads, t, vd, dtype=torch.float64)
    eye = torch.eye(t, dtype=torch.bool).expand(b, 1, t, t)
    full_mask = torch.cat([mask] + [eye] * (steps - 1), dim=-1)
    want = _sdpa(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), full_mask, 0.3)
    got = _explicit_attention(q, keys, values, mask, 0.3)
    torch.testing.assert_close(got, want)
    leaves = [q, *keys, *values]
    grads_want = torch.autograd.grad((want * weights).sum(), leaves)
    grads_got = torch.autograd.grad((got * weights).sum(), leaves)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w)
    cache = KVCache()  # the cache takes the written-out path on a CPU, step after step
    for s in range(steps):
        out = cache.attend(q, keys[s], values[s], mask, 0.3)
    torch.testing.assert_close(out, want)


@torch.no_grad()
def test_init_from_layer_starts_as_that_verifier_layer(tiny_llama_verifier):
    """``init_from_layer`` k: with the embedding half of q/k/v at zero, the draft's layer computes exactly the
    verifier's decoder layer k (transformers' own LlamaDecoderLayer) on the hidden state; the embedding half and
    the rest of the draft keep the seeded init."""
    from transformers import AutoModelForCausalLM

    spec = VerifierSpec.from_path(tiny_llama_verifier)
    cfg = DraftConfig.build(spec, 300, [1, 2, 3], DraftArchitecture(), torch_dtype="float32")
    d2t, t2d = _mapping(spec.vocab_size, 300)
    plain = Eagle3Draft.from_verifier(cfg, tiny_llama_verifier, d2t, t2d, seed=0)
    layer = spec.num_hidden_layers - 1
    draft = Eagle3Draft.from_verifier(cfg, tiny_llama_verifier, d2t, t2d, seed=0, init_layer=layer)
    h = cfg.hidden_size
    for name, p in draft.named_parameters():
        if name in HALF_INPUT:
            assert torch.equal(p[:, :h], dict(plain.named_parameters())[name][:, :h]), name
        elif name not in LAYER_INIT:
            assert torch.equal(p, dict(plain.named_parameters())[name]), name  # fc, input_layernorm, head
    last = Eagle3Draft.from_verifier(cfg, tiny_llama_verifier, d2t, t2d, seed=0, init_layer=-1)  # from the last
    assert all(torch.equal(p, q) for p, q in zip(draft.parameters(), last.parameters()))
    for name in HALF_INPUT:
        dict(draft.named_parameters())[name][:, :h] = 0

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_verifier, dtype=torch.float32).eval()
    ids, pos = torch.randint(0, spec.vocab_size, (2, 9)), torch.arange(9).expand(2, 9)
    hidden = model(ids, output_hidden_states=True).hidden_states[layer]  # residual entering layer k: [2, 9, H]
    want = model.model.layers[layer](hidden, position_embeddings=model.model.rotary_emb(hidden, pos),
                                     attention_mask=None, position_ids=pos)
    want = want[0] if isinstance(want, tuple) else want
    mask = torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 1, 9, 9)
    got = draft.midlayer(draft.embed_tokens(ids), hidden, pos, mask, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain.midlayer(plain.embed_tokens(ids), hidden, pos, mask, None), want, atol=1e-2)


def test_init_from_layer_refuses_what_it_cannot_copy(tiny_llama_verifier, kimi_shaped, tmp_path):
    """One error naming the field, before any weight is copied: a layer the verifier lacks, draft widths other than
    the verifier's, the MLA kind, a verifier layer that is not a plain silu Llama layer (biases, MLA attention)."""
    from helpers import save_tiny_llama

    from eagle3.train.config import TrainConfig

    def build(verifier, arch=None, kind="llama"):
        spec = VerifierSpec.from_path(verifier)
        d2t, t2d = _mapping(spec.vocab_size, 64)
        cfg = DraftConfig.build(spec, 64, [1], arch or DraftArchitecture(kind=kind), torch_dtype="float32")
        return cfg, d2t, t2d, spec

    cfg, d2t, t2d, spec = build(tiny_llama_verifier)
    with pytest.raises(DraftConfigError, match=rf"init_from_layer: {spec.num_hidden_layers} is not a decoder layer"):
        Eagle3Draft.from_verifier(cfg, tiny_llama_verifier, d2t, t2d, init_layer=spec.num_hidden_layers)
    with pytest.raises(DraftConfigError, match=r"init_from_layer: -\d+ is not a decoder layer"):
        Eagle3Draft.from_verifier(cfg, tiny_llama_verifier, d2t, t2d, init_layer=-spec.num_hidden_layers - 1)
    narrow = build(tiny_llama_verifier, DraftArchitecture(intermediate_size=16))
    with pytest.raises(DraftConfigError, match=r"init_from_layer: the draft's intermediate_size 16 \(verifier "):
        Eagle3Draft.from_verifier(narrow[0], tiny_llama_verifier, narrow[1], narrow[2], init_layer=0)
    other_rope = build(tiny_llama_verifier, DraftArchitecture(rope_theta=1234.0))
    with pytest.raises(DraftConfigError, match=r"init_from_layer: the draft's rope_theta 1234.0 \(verifier "):
        Eagle3Draft.from_verifier(other_rope[0], tiny_llama_verifier, other_rope[1], other_rope[2], init_layer=0)
    mla = build(kimi_shaped, kind="mla")
    with pytest.raises(DraftConfigError, match=r"init_from_layer: .*llama draft kind, not 'mla'"):
        Eagle3Draft.from_verifier(mla[0], kimi_shaped, mla[1], mla[2], init_layer=0)
    with pytest.raises(ValueError, match=r"init_from_layer 0 with draft.kind 'mla'"):
        TrainConfig(init_from_layer=0, draft=DraftArchitecture(kind="mla"))
    llama_on_mla = build(kimi_shaped)  # a llama draft beside Kimi's attention: nothing of its layer fits
    with pytest.raises(DraftConfigError, match=r"init_from_layer: the verifier's layer 1 is not a plain Llama layer "
                                               r"the draft can start from \(it also has .*; "
                                               r"it lacks .*self_attn.k_proj.weight"):
        Eagle3Draft.from_verifier(llama_on_mla[0], kimi_shaped, llama_on_mla[1], llama_on_mla[2], init_layer=1)
    biased = save_tiny_llama(tmp_path / "biased", attention_bias=True)
    b = build(biased)
    with pytest.raises(DraftConfigError, match=r"not a plain Llama layer .*it also has self_attn.k_proj.bias"):
        Eagle3Draft.from_verifier(b[0], biased, b[1], b[2], init_layer=-1)
    gelu = save_tiny_llama(tmp_path / "gelu", hidden_act="gelu")
    g = build(gelu)
    with pytest.raises(DraftConfigError, match=r"init_from_layer: the verifier's MLP uses 'gelu'"):
        Eagle3Draft.from_verifier(g[0], gelu, g[1], g[2], init_layer=-1)


def test_layer_tensor_names_takes_the_language_models_stack():
    """Which ``layers.<k>`` stack is the verifier's decoder layer k: the one under ``model`` / ``language_model``
    (Kimi-K2.5: language_model.model.layers.N beside mtp.layers.N and a vision tower's), bare ``layers.<k>`` too, the
    first ``layers.<int>`` of a name (an expert's own layers are tail), never layer 12 for 1; two candidates raise."""
    from eagle3.support.verifier import VerifierError, layer_tensor_names

    kimi = {n: "w.safetensors" for n in (
        "language_model.model.layers.1.mlp.experts.layers.1.w", "language_model.model.layers.1.self_attn.q.weight",
        "language_model.model.layers.12.self_attn.q.weight", "mtp.layers.1.self_attn.q.weight",
        "vision_tower.encoder.layers.1.attn.weight", "language_model.lm_head.weight")}
    assert layer_tensor_names("v", 1, kimi) == {
        "mlp.experts.layers.1.w": "language_model.model.layers.1.mlp.experts.layers.1.w",
        "self_attn.q.weight": "language_model.model.layers.1.self_attn.q.weight"}
    bare = {"layers.1.mlp.up_proj.weight": "a"}
    assert layer_tensor_names("v", 1, bare) == {"mlp.up_proj.weight": "layers.1.mlp.up_proj.weight"}
    vlm = {"model.language_model.layers.0.mlp.w": "a", "model.vision_tower.blocks.layers.0.mlp.w": "a"}
    assert list(layer_tensor_names("v", 0, vlm).values()) == ["model.language_model.layers.0.mlp.w"]
    with pytest.raises(VerifierError, match="decoder layer 2 in the weights of v: no such layer"):
        layer_tensor_names("v", 2, kimi)
    with pytest.raises(VerifierError, match="several layer stacks"):
        layer_tensor_names("v", 0, {"a.model.layers.0.w": "a", "b.model.layers.0.w": "a"})
