"""kimi-mini (models/kimi-mini, built by tools/kimi_mini.py): Kimi-K2.5's text architecture and checkpoint layout,
trained on the bundled chats. The layout is Kimi-K2.5's (nested config, language_model. weights with one tensor per
routed expert, an index, a vision tower, Kimi's special tokens), every pipeline reader takes it, and the model
passes its quality gate: varied greedy answers that depend on the question."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import KIMI_SHAPED_SMALL
from safetensors import safe_open

from eagle3.support.verifier import VerifierSpec, find_tensor_names, load_verifier_head, weight_map
from tools import kimi_mini
from tools.kimi_mini import KIMI_MINI_DIR, KIMI_SPECIAL_TOKENS, gate_failures, quality_gate
from tools.tiny_verifier import read_messages


@pytest.fixture(scope="module")
def shipped():
    if not (KIMI_MINI_DIR / "model.safetensors.index.json").is_file():
        pytest.fail(f"kimi-mini missing at {KIMI_MINI_DIR}: run python tools/build_kimi_mini.py")
    return KIMI_MINI_DIR


def test_config_is_kimi_k25s_layout_with_kimis_widths_rope_and_routing(shipped):
    cfg = json.loads((shipped / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["media_placeholder_token_id"] == 8192 + KIMI_SPECIAL_TOKENS.index("<|media_pad|>")
    t = cfg["text_config"]
    assert t["model_type"] == "kimi_k2" and t["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (t["kv_lora_rank"], t["q_lora_rank"], t["qk_rope_head_dim"], t["qk_nope_head_dim"], t["v_head_dim"]) == (
        512, 1536, 64, 128, 128)
    assert t["rope_scaling"] == {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert t["rope_theta"] == 50000.0 and t["topk_method"] == "noaux_tc" and t["scoring_func"] == "sigmoid"
    assert (t["routed_scaling_factor"], t["n_group"], t["first_k_dense_replace"], t["n_shared_experts"]) == (
        2.827, 1, 1, 1)
    spec = VerifierSpec.from_path(shipped)
    assert spec.nested and spec.mla and spec.resolve_aux_layer_ids(None) == [2, 3, 4]  # vLLM convention, as [2, 30, 58]
    assert (shipped / "preprocessor_config.json").is_file()


def test_weights_are_named_and_sharded_as_kimi_k25_ships_them(shipped):
    wmap = weight_map(shipped)
    assert len(set(wmap.values())) >= 2  # sharded, found through model.safetensors.index.json
    assert "language_model.model.layers.1.mlp.experts.3.gate_proj.weight" in wmap  # one tensor per routed expert
    assert "language_model.model.layers.1.mlp.gate.e_score_correction_bias" in wmap
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in wmap  # the dense first layer
    assert any(k.startswith("vision_tower.encoder.blocks.0.") for k in wmap)
    assert "mm_projector.proj.0.weight" in wmap
    names = find_tensor_names(shipped)
    assert names == {"embed_tokens": "language_model.model.embed_tokens.weight",
                     "norm": "language_model.model.norm.weight", "lm_head": "language_model.lm_head.weight"}
    head = load_verifier_head(shipped, torch.arange(0, 8208, 7), with_embedding=True)
    assert head.lm_head.shape == (len(range(0, 8208, 7)), 192) and head.embed_tokens.shape == (8208, 192)
    total = sum(f.stat().st_size for f in shipped.glob("*.safetensors"))
    assert total < 31 * 2**20  # bundled in the repository
    with safe_open(str(shipped / wmap["language_model.lm_head.weight"]), "pt") as f:
        assert f.get_slice("language_model.lm_head.weight").get_dtype() == "BF16"


def test_tokenizer_has_kimis_chat_and_media_tokens_and_masks_assistant_turns(shipped):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(shipped))
    assert tok.convert_tokens_to_ids(list(KIMI_SPECIAL_TOKENS)) == list(range(8192, 8192 + len(KIMI_SPECIAL_TOKENS)))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is os.sep?"},
            {"role": "assistant", "content": "The path separator."}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>What is os.sep?"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|>The path separator.<|im_end|>")
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(masked) == "The path separator.<|im_end|>"


def test_quality_gate_varied_greedy_answers_that_depend_on_the_question(shipped, one_torch_thread):
    from transformers import AutoTokenizer

    model = kimi_mini.load_kimi_shaped(shipped)  # the pipeline's own loader (nested, per-expert tensors fused)
    tok = AutoTokenizer.from_pretrained(str(shipped))
    gate = quality_gate(model, tok, read_messages(kimi_mini.BUNDLED_DATA / "eval.openai.jsonl"))
    assert gate_failures(gate) == [], gate
    recorded = json.loads((shipped / "training.json").read_text())["evaluation"]
    assert gate["distinct_answers"] == recorded["distinct_answers"]  # the card's figures are the shipped model's


def test_builder_writes_other_kimi_shapes_in_the_same_layout(tmp_path):
    """Another Kimi-shaped verifier (other hidden size, layers, experts): the same layout, read by the same code."""
    out = kimi_mini.random_kimi_shaped(tmp_path / "other", **{**KIMI_SHAPED_SMALL, "num_hidden_layers": 9,
                                                             "n_routed_experts": 6, "num_attention_heads": 4})
    spec = VerifierSpec.from_path(out)
    assert (spec.hidden_size, spec.num_hidden_layers, spec.resolve_aux_layer_ids(None)) == (64, 9, [2, 4, 6])
    model = kimi_mini.load_kimi_shaped(out)
    written = kimi_mini.checkpoint_tensors(model)  # loading fused the experts; writing splits them back: round trip
    wmap = weight_map(out)
    assert set(written) == {k for k in wmap if k.startswith("language_model.")}
    assert "language_model.model.layers.8.mlp.experts.5.down_proj.weight" in written


def test_training_scales_the_lr_of_the_mla_expansions_by_hidden_over_fan_in(one_torch_thread):
    """kimi-mini's recipe: q_b_proj and kv_b_proj (fan-in 1536 / 512 at hidden 192) train at hidden / fan_in times the
    lr; the shared loop applies a name's multiplier to that parameter alone (a multiplier of 0 freezes it)."""
    from tools.tiny_verifier import train_causal_lm

    assert kimi_mini.KimiMiniSettings().lr_scale == {"q_b_proj": 192 / 1536, "kv_b_proj": 192 / 512}
    model = kimi_mini.new_model(kimi_mini.text_config(**KIMI_SHAPED_SMALL), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    docs = [[(7 * i + j) % 8000 for j in range(40)] for i in range(8)]
    settings = kimi_mini.KimiMiniSettings(steps=2, batch_size=2, seq_len=32, warmup_steps=1, log_every=1,
                                          threads=1, lr_scale={"q_b_proj": 0.0})
    train_causal_lm(model, docs, settings, log=lambda _: None)
    after = dict(model.named_parameters())
    frozen = [n for n in before if "q_b_proj" in n]
    assert frozen and all(torch.equal(before[n], after[n]) for n in frozen)
    assert not torch.equal(before["model.layers.0.self_attn.kv_b_proj.weight"],
                           after["model.layers.0.self_attn.kv_b_proj.weight"])


def test_engines_pin_vllms_cpu_mla_backend_for_an_mla_verifier_on_a_cpu(shipped):
    """vLLM's CPU build would pick its AMX MLA kernel on CPUs with AMX tiles, which refuses float32 weights: every
    engine job of an MLA verifier on a CPU asks for CPU_MLA (the pin is read from the job's verifier)."""
    from eagle3.engine.settings import CPU_MLA_BACKEND, EngineSettings

    engine = EngineSettings()
    assert VerifierSpec.from_path(shipped).mla and CPU_MLA_BACKEND == "CPU_MLA"
    assert engine.llm_kwargs(on_gpu=False, mla=True)["attention_backend"] == CPU_MLA_BACKEND
    assert "attention_backend" not in engine.llm_kwargs(on_gpu=True, mla=True)  # GPUs: vLLM's own choice
    assert "attention_backend" not in engine.llm_kwargs(on_gpu=False, mla=False)
