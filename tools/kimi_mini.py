"""kimi-mini: a trained verifier with Kimi-K2.5's text architecture and checkpoint layout, small enough for 2 CPU cores.

Where it sits: outside the pipeline proper, like the bundled tiny verifier (tools/tiny_verifier.py). The pipeline is
built for Kimi-K2.5 (a DeepseekV3-style MLA + MoE language model nested in ``KimiK25ForConditionalGeneration``); this
module builds a miniature that exercises the same code paths on a CPU:

    text config      DeepseekV3 (``model_type: kimi_k2``, as Kimi ships it) with Kimi-K2.5's MLA widths
                     (kv_lora_rank 512, q_lora_rank 1536, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128),
                     its yarn rope (factor 64, theta 50000, original 4096, mscale 1 / 1) and its routing fields
                     (noaux_tc sigmoid routing with e_score_correction_bias, routed_scaling_factor 2.827, n_group 1,
                     a dense first layer, one shared expert); fewer layers, experts, heads and a smaller hidden size
    nesting          ``KimiK25ForConditionalGeneration`` config with ``text_config`` + ``vision_config``, weights under
                     ``language_model.model.*`` / ``language_model.lm_head.weight`` with one tensor per routed expert
                     (``experts.<e>.gate_proj.weight``, as the real checkpoint), a MoonViT vision tower + projector
                     (``vision_tower.*``, ``mm_projector.proj.{0,2}``) at the smallest width vLLM builds, and
                     ``preprocessor_config.json`` (vLLM's Kimi processor reads it at engine start)
    tokenizer        the bundled byte-level BPE (vocab 8192) plus Kimi's chat and media special tokens; a Kimi-K2-style
                     chat template (``<|im_user|>user<|im_middle|>...<|im_end|>``) with ``{% generation %}`` marks
    weights          bf16 safetensors, sharded with an index (as Kimi-K2.5 ships: the pipeline must find the
                     embedding, final norm and lm_head through the index)

``build_kimi_mini`` trains it from scratch on the bundled stdlib chats (tools/build_kimi_mini.py runs it);
``save_kimi_shaped`` writes any DeepseekV3 model in this layout (tests build other Kimi-shaped verifiers with other
widths, layer counts and experts through ``random_kimi_shaped``). Nothing here imports Prefect.

Layer ids follow vLLM's convention (id k = residual stream entering decoder layer k); vLLM's default aux layers for
kimi-mini's 7 layers are (2, 7//2, 7-3) = [2, 3, 4], three as for Kimi-K2.5's [2, 30, 58].
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.support.paths import BUNDLED_DATA, BUNDLED_VERIFIER, REPO_ROOT
from eagle3.support.provenance import git_revision, versions
from tools.tiny_verifier import (
    EOS,
    TrainSettings,
    longest_run,
    quality_prompts,
    read_messages,
    train_causal_lm,
)

KIMI_MINI_DIR = REPO_ROOT / "models" / "kimi-mini"

# Kimi-K2.5's own chat and media special tokens (tokenization_kimi.py), appended after the bundled BPE's 8192 ids
IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END = "<|im_system|>", "<|im_user|>", "<|im_assistant|>", \
    "<|im_middle|>", "<|im_end|>"
MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
KIMI_SPECIAL_TOKENS = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END, *MEDIA_TOKENS)
VOCAB_SIZE = 8208  # 8192 BPE ids + 9 special tokens, padded to a multiple of 16 (Kimi pads 163840 the same way)

# Kimi-K2's chat template, without its default system prompt and tool calls; the assistant's content and its
# <|im_end|> are marked {% generation %}, so apply_chat_template(..., return_assistant_tokens_mask=True) masks them
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '<|im_system|>system<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{%- elif message['role'] == 'user' -%}{{- '<|im_user|>user<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<|im_assistant|>assistant<|im_middle|>' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else -%}{{- raise_exception('Unknown role: ' + message['role']) }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif -%}"
)

# The text config: Kimi-K2.5's field names, widths, rope and routing; small counts. Sizes in units, rope in tokens.
KIMI_MINI_TEXT: dict[str, Any] = {
    "model_type": "kimi_k2",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 192,
    "intermediate_size": 512,  # the dense first layer's MLP
    "moe_intermediate_size": 128,  # each routed / shared expert
    "num_hidden_layers": 7,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",  # vLLM needs it to build e_score_correction_bias (KeyError at load otherwise)
    "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "kv_lora_rank": 512,  # vLLM's CPU MLA kernel accepts only kv_lora_rank + qk_rope_head_dim = 576
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}

# MoonViT at the smallest width vLLM builds (one block); Kimi-K2.5: hidden 1152, 27 blocks, 16 heads
VISION_CONFIG: dict[str, Any] = {
    "model_type": "kimi_k25_vision", "patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 4,
    "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
    "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": [2, 2], "projector_ln_eps": 1e-5,
}
# vLLM's Kimi processor sizes its start-up profiling image from this: 64 patches keep that run cheap on a CPU
PREPROCESSOR_CONFIG: dict[str, Any] = {"media_proc_cfg": {
    "in_patch_limit": 64, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 16, "in_patch_limit_each_frame": 64,
    "in_patch_limit_video": None, "sample_fps": 2.0, "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff", "config_type": "kimi_k25"}}
SHARD_BYTES = 16 << 20  # bf16 bytes per safetensors shard (kimi-mini: 2 shards + model.safetensors.index.json)


@dataclass
class KimiMiniSettings(TrainSettings):
    """Training recipe of kimi-mini (TrainSettings' fields; seq_len in tokens, batch_size in sequences)."""

    steps: int = 1000
    lr: float = 2e-3
    warmup_steps: int = 40
    # Kimi's MLA widths at a hidden size of 192 make q_b_proj (fan-in q_lora_rank 1536) and kv_b_proj (fan-in
    # kv_lora_rank 512) wide expansions behind an RMSNorm: at the lr of the rest an Adam step moves their outputs
    # fan_in / hidden times as far as a Llama projection's. Scaling their lr by hidden / fan_in (muP's rule for
    # fan-in) took the training loss at step 120 of a 900-step schedule from 5.58 to 5.01 (bf16 probes, seed 0; a
    # Llama of the same shape and data: 4.70; 4 heads, routed scaling 1, all-dense layers or the default rope instead:
    # 5.57-5.81, so none of those was the cause)
    lr_scale: dict[str, float] = field(default_factory=lambda: {
        "q_b_proj": KIMI_MINI_TEXT["hidden_size"] / KIMI_MINI_TEXT["q_lora_rank"],
        "kv_b_proj": KIMI_MINI_TEXT["hidden_size"] / KIMI_MINI_TEXT["kv_lora_rank"]})


# ------------------------------------------------------------------------------------------------------ tokenizer


def kimi_tokenizer(bundled_dir: Path = BUNDLED_VERIFIER):
    """The bundled BPE with Kimi's special tokens appended (ids 8192..8200) and the Kimi-K2-style chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_dir))
    tok.add_special_tokens({"additional_special_tokens": list(KIMI_SPECIAL_TOKENS)})
    tok.eos_token = IM_END  # the end of an assistant turn; generation also stops at <|eos|> (generation_config)
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids(list(KIMI_SPECIAL_TOKENS))
    if ids != list(range(8192, 8192 + len(KIMI_SPECIAL_TOKENS))):
        raise RuntimeError(f"Kimi special tokens got ids {ids}, expected 8192.. (bundled tokenizer changed?)")
    return tok


# ---------------------------------------------------------------------------------------------------- the layout


def text_config(**overrides: Any) -> dict[str, Any]:
    """kimi-mini's text config with ``overrides`` (another Kimi-shaped verifier: other widths, layers, experts)."""
    cfg = copy.deepcopy(KIMI_MINI_TEXT)
    cfg.update(overrides)
    return cfg


def new_model(text: dict[str, Any], seed: int = 0):
    """A freshly initialised transformers DeepseekV3ForCausalLM of ``text`` (float32)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    # a deep copy: DeepseekV3Config adds rope_theta / rope_type into the rope_scaling dict it is given (which would
    # then be written into config.json, unlike Kimi-K2.5's)
    fields = {k: copy.deepcopy(v) for k, v in text.items() if k not in ("model_type", "architectures", "torch_dtype")}
    return DeepseekV3ForCausalLM(DeepseekV3Config(**fields)).float()


def checkpoint_tensors(model) -> dict[str, Any]:
    """The language model's tensors named as Kimi-K2.5 ships them: ``language_model.`` + the HF name, with
    transformers' fused expert tensors split back into one tensor per routed expert."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 * moe_inter, H]: gate rows first, then up
            base = name.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e]
                out[f"{base}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, moe_inter]
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {f"language_model.{k}": v for k, v in out.items()}


def vision_tensors(vision: dict[str, Any], text_hidden: int, seed: int = 1) -> dict[str, Any]:
    """MoonViT + projector weights (names and shapes as vLLM's kimi_k25_vit loads them), small random init: the
    pipeline never feeds images, but vLLM builds and loads the tower of the class it serves Kimi-K2.5 with."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inner, ps = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged = h * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    t = {"vision_tower.patch_embed.proj.weight": rand(h, 3, ps, ps), "vision_tower.patch_embed.proj.bias": torch.zeros(h),
         "vision_tower.patch_embed.pos_emb.weight": rand(vision["pos_emb_height"], vision["pos_emb_width"], h),
         "vision_tower.encoder.final_layernorm.weight": torch.ones(h),
         "vision_tower.encoder.final_layernorm.bias": torch.zeros(h),
         "mm_projector.pre_norm.weight": torch.ones(h), "mm_projector.pre_norm.bias": torch.zeros(h),
         "mm_projector.proj.0.weight": rand(merged, merged), "mm_projector.proj.0.bias": torch.zeros(merged),
         "mm_projector.proj.2.weight": rand(text_hidden, merged), "mm_projector.proj.2.bias": torch.zeros(text_hidden)}
    for b in range(vision["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{b}."
        t.update({p + "norm0.weight": torch.ones(h), p + "norm0.bias": torch.zeros(h),
                  p + "norm1.weight": torch.ones(h), p + "norm1.bias": torch.zeros(h),
                  p + "wqkv.weight": rand(3 * h, h), p + "wqkv.bias": torch.zeros(3 * h),
                  p + "wo.weight": rand(h, h), p + "wo.bias": torch.zeros(h),
                  p + "mlp.fc0.weight": rand(inner, h), p + "mlp.fc0.bias": torch.zeros(inner),
                  p + "mlp.fc1.weight": rand(h, inner), p + "mlp.fc1.bias": torch.zeros(h)})
    return t


def full_config(text: dict[str, Any], tokenizer) -> dict[str, Any]:
    """config.json of the KimiK25ForConditionalGeneration wrapper (Kimi-K2.5's top-level fields)."""
    media_pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {**text, "bos_token_id": tokenizer.bos_token_id,
                        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END)},
        "vision_config": VISION_CONFIG, "torch_dtype": text.get("torch_dtype", "bfloat16"),
        "tie_word_embeddings": False, "media_placeholder_token_id": media_pad, "image_token_id": media_pad,
        "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "projection_hidden_size": VISION_CONFIG["hidden_size"], "use_unified_vision_chunk": True,
    }


def save_kimi_shaped(model, tokenizer, out: Path, text: dict[str, Any], dtype: str = "bfloat16",
                     shard_bytes: int = SHARD_BYTES) -> Path:
    """Write ``model`` (a transformers DeepseekV3ForCausalLM) in Kimi-K2.5's layout: nested config, ``language_model.``
    weights with per-expert tensors, a vision tower, sharded safetensors + index, tokenizer, chat template,
    preprocessor and generation configs."""
    from safetensors.torch import save_file

    from eagle3.support.dtypes import torch_dtype

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    text = {**text, "torch_dtype": dtype}
    tensors = {**checkpoint_tensors(model), **vision_tensors(VISION_CONFIG, int(text["hidden_size"]))}
    tensors = {k: v.detach().to(torch_dtype(dtype)).contiguous() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(full_config(text, tokenizer), indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    stops = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(EOS)]
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": stops, "pad_token_id": tokenizer.pad_token_id,
         "do_sample": False, "max_new_tokens": 256}, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
    return out


def random_kimi_shaped(out: Path, seed: int = 0, **text_overrides: Any) -> Path:
    """An untrained Kimi-shaped verifier (tests: other widths, layer counts and experts than kimi-mini)."""
    text = text_config(**text_overrides)
    return save_kimi_shaped(new_model(text, seed), kimi_tokenizer(), out, text)


def load_kimi_shaped(path: Path, dtype: str = "float32"):
    """The language model of a Kimi-shaped folder as a transformers causal LM, through the pipeline's own loader
    (``eagle3.extract.hf_backend``: nested config, ``language_model.`` prefix stripped, per-expert tensors fused)."""
    from eagle3.extract.hf_backend import load_hf_model
    from eagle3.support.dtypes import torch_dtype
    from eagle3.support.verifier import VerifierSpec

    return load_hf_model(VerifierSpec.from_path(path), torch_dtype(dtype), "cpu")


# ------------------------------------------------------------------------------------------ training and evaluation


def conversation_docs(tokenizer, conversations: Sequence[list[dict[str, str]]]) -> list[list[int]]:
    """Chat-template token ids of each conversation followed by <|eos|> (the document separator when packing)."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in conversations]
    return [ids + [eos] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def greedy_answers(model, tokenizer, prompts: Sequence[list[dict[str, str]]], max_new_tokens: int = 64,
                   ignore_eos: bool = False) -> list[list[int]]:
    """Greedy continuation of each prompt (rendered with the generation prompt); new token ids only."""
    import torch

    stops = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(EOS)]
    answers = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        x = torch.tensor([ids["input_ids"]])  # [1, prompt]
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens if ignore_eos else None, do_sample=False,
                                 eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
        answers.append(out[0, x.shape[1]:].tolist())
    return answers


def quality_gate(model, tokenizer, eval_messages: Sequence[list[dict[str, str]]], n: int = 8) -> dict[str, Any]:
    """The figures of kimi-mini's quality gate on the first ``n`` held-out prompts, 64 greedy tokens each with the
    end of turn ignored: distinct tokens and the longest single-token run per answer (as the tiny verifier's gate),
    and how many answers are distinct from every other one (answers that depend on the question)."""
    prompts = quality_prompts(eval_messages, n)
    answers = greedy_answers(model, tokenizer, prompts, ignore_eos=True)
    return {"distinct_tokens": [len(set(a)) for a in answers], "longest_run": [longest_run(a) for a in answers],
            "distinct_answers": len({tuple(a) for a in answers}), "prompts": len(answers)}


def gate_failures(gate: dict[str, Any]) -> list[str]:
    """Why the gate fails (empty when it passes): >= 20 distinct tokens and runs under 8 in every answer, and at
    most one repeated answer among the prompts."""
    bad = []
    if min(gate["distinct_tokens"]) < 20:
        bad.append(f"an answer has only {min(gate['distinct_tokens'])} distinct tokens (gate: >= 20)")
    if max(gate["longest_run"]) >= 8:
        bad.append(f"an answer repeats one token {max(gate['longest_run'])} times in a row (gate: < 8)")
    if gate["distinct_answers"] < gate["prompts"] - 1:
        bad.append(f"only {gate['distinct_answers']} of {gate['prompts']} answers differ (gate: >= "
                   f"{gate['prompts'] - 1}): the answers do not depend on the question")
    return bad


def eval_loss(model, tokenizer, conversations: Sequence[list[dict[str, str]]]) -> dict[str, float]:
    """Held-out perplexity per conversation: all tokens and assistant tokens."""
    import torch
    import torch.nn.functional as F

    sums = {"all": [0.0, 0], "assistant": [0.0, 0]}
    with torch.no_grad():
        for messages in conversations:
            enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            ids = torch.tensor(enc["input_ids"][:2048])[None]  # [1, T]
            mask = torch.tensor(enc["assistant_masks"][:2048], dtype=torch.bool)[1:]  # [T-1]: target t+1
            nll = F.cross_entropy(model(input_ids=ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
            sums["all"][0] += nll.sum().item()
            sums["all"][1] += nll.numel()
            sums["assistant"][0] += nll[mask].sum().item()
            sums["assistant"][1] += int(mask.sum())
    return {f"{k}_perplexity": round(math.exp(s / max(n, 1)), 3) for k, (s, n) in sums.items()}


def build_kimi_mini(out: Path = KIMI_MINI_DIR, settings: KimiMiniSettings | None = None,
                    data_dir: Path = BUNDLED_DATA, command: str = "python tools/build_kimi_mini.py",
                    log=print, continue_from: Path | None = None) -> dict[str, Any]:
    """Train kimi-mini from scratch on the bundled training chats (or, with ``continue_from``, go on training a
    built kimi-mini from its shipped weights, with a new warmup + cosine schedule), write it in Kimi-K2.5's layout,
    evaluate the shipped (bf16) weights and write the model card; raises when the quality gate fails."""
    settings = settings or KimiMiniSettings()
    revision = git_revision() or "unknown"
    tokenizer = kimi_tokenizer()
    train = read_messages(Path(data_dir) / "train.openai.jsonl")
    held = read_messages(Path(data_dir) / "eval.openai.jsonl")
    earlier = None
    if continue_from is not None:
        record_file = Path(continue_from) / "training.json"
        if not record_file.is_file():
            raise SystemExit(f"--continue-from {continue_from}: no training.json there (not a kimi-mini build)")
        earlier = json.loads(record_file.read_text())
        model = load_kimi_shaped(Path(continue_from)).train().requires_grad_(True)
    else:
        model = new_model(KIMI_MINI_TEXT, settings.seed)
    model, history = train_causal_lm(model, conversation_docs(tokenizer, train), settings, log)
    if earlier is not None:  # the steps of every phase, from scratch on
        history["total_steps"] = earlier["history"].get("total_steps", earlier["settings"]["steps"]) + settings.steps
        history["wall_seconds_all_phases"] = round(earlier["history"].get(
            "wall_seconds_all_phases", earlier["history"]["wall_seconds"]) + history["wall_seconds"], 1)
    save_kimi_shaped(model, tokenizer, out, KIMI_MINI_TEXT)
    shipped = load_kimi_shaped(out)  # the bf16 weights as written, through the pipeline's loader
    evaluation = {**eval_loss(shipped, tokenizer, held), **quality_gate(shipped, tokenizer, held)}
    samples = [(p[-1]["content"], tokenizer.decode(a)) for p, a in
               zip(quality_prompts(held, 5), greedy_answers(shipped, tokenizer, quality_prompts(held, 5)))]
    log(f"[eval] {evaluation}")
    record = {"settings": settings.__dict__, "history": history, "evaluation": evaluation, "versions": versions(),
              "git_revision": revision, "command": command, "text_config": KIMI_MINI_TEXT,
              "continued_from": earlier,  # the record of the build this one went on training (None: from scratch)
              "commands": [*(earlier["commands"] if earlier else []), command]}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    write_model_card(out, settings, history, evaluation, samples, "\n".join(record["commands"]))
    if bad := gate_failures(evaluation):
        raise RuntimeError(f"kimi-mini failed its quality gate: {'; '.join(bad)}")
    return record


def write_model_card(out: Path, settings: KimiMiniSettings, history: dict, evaluation: dict,
                     samples: Sequence[tuple[str, str]], command: str) -> None:
    params = history["parameters"]
    t = KIMI_MINI_TEXT
    phases = "" if "total_steps" not in history else (
        f" This phase went on training an earlier build from its shipped weights (its record: `continued_from` in "
        f"training.json): {history['total_steps']} steps and {history['wall_seconds_all_phases'] / 60:.1f} minutes "
        f"in all.")
    lr_scale = ""
    if settings.lr_scale:  # the MLA expansions' lr (KimiMiniSettings says why)
        lr_scale = f" ({', '.join(f'`{k}` x{v:g}' for k, v in settings.lr_scale.items())}: hidden / fan-in)"
    sample_md = "\n\n".join(f"**Prompt:** {q}\n\n```text\n{a}\n```" for q, a in samples)
    curve = ", ".join(f"{s}: {v:.2f}" for s, v in history["loss_curve"][:: max(1, len(history["loss_curve"]) // 10)])
    (out / "README.md").write_text(f"""# kimi-mini

A {params / 1e6:.1f}M-parameter miniature of Kimi-K2.5's text model, trained from scratch on the bundled stdlib chats,
in Kimi-K2.5's own checkpoint layout. It is the verifier of the `kimi-mini` preset (`make demo-kimi`): every stage
of the pipeline runs on it as it would on Kimi-K2.5 (vLLM serves it through `KimiK25ForConditionalGeneration`),
on 2 CPU cores. Built by `tools/kimi_mini.py`.

## Architecture (as Kimi-K2.5, smaller counts)
- `KimiK25ForConditionalGeneration` config: `text_config` (`model_type: kimi_k2`, DeepseekV3), `vision_config`
  (MoonViT: {VISION_CONFIG["num_hidden_layers"]} block, hidden {VISION_CONFIG["hidden_size"]}; never fed an image), `media_placeholder_token_id`.
- MLA with Kimi's widths: kv_lora_rank {t["kv_lora_rank"]}, q_lora_rank {t["q_lora_rank"]}, qk_rope_head_dim
  {t["qk_rope_head_dim"]}, qk_nope_head_dim {t["qk_nope_head_dim"]}, v_head_dim {t["v_head_dim"]};
  {t["num_attention_heads"]} heads (Kimi: 64); hidden {t["hidden_size"]} (Kimi: 7168); {t["num_hidden_layers"]} layers (Kimi: 61).
- Yarn rope as Kimi: factor 64, theta 50000, original_max_position_embeddings 4096, mscale 1 / mscale_all_dim 1.
- MoE as Kimi: first layer dense (intermediate {t["intermediate_size"]}), then {t["n_routed_experts"]} routed experts
  (Kimi: 384) + {t["n_shared_experts"]} shared, top-{t["num_experts_per_tok"]}, moe_intermediate {t["moe_intermediate_size"]},
  noaux_tc sigmoid routing with e_score_correction_bias, routed_scaling_factor {t["routed_scaling_factor"]}.
- Weights: bf16, `language_model.model.*` / `language_model.lm_head.weight`, one tensor per routed expert,
  `vision_tower.*` / `mm_projector.*`, sharded with `model.safetensors.index.json`.
- vLLM's default aux layers for {t["num_hidden_layers"]} layers: [2, 3, 4] (vLLM convention: id k = residual stream
  entering layer k), three as Kimi-K2.5's [2, 30, 58].

## Tokenizer and chat template
The bundled byte-level BPE (vocab 8192) plus Kimi's special tokens {", ".join(f"`{x}`" for x in KIMI_SPECIAL_TOKENS)}
(ids 8192-8200; vocab_size {VOCAB_SIZE}). Kimi-K2's chat format: `<|im_user|>user<|im_middle|>...<|im_end|>`,
`<|im_assistant|>assistant<|im_middle|>` as the generation prompt; the assistant's content and `<|im_end|>` carry
`{{% generation %}}` marks (the loss mask). Generation stops at `<|im_end|>` or `<|eos|>`.

## Training
{'From scratch' if 'total_steps' not in history else 'Last phase'} on CPU, seed {settings.seed}, {settings.threads} threads: AdamW (betas {settings.betas}, weight decay
{settings.weight_decay} on matrices), peak lr {settings.lr}{lr_scale}, {settings.warmup_steps} warmup steps then cosine to
{settings.lr * settings.min_lr_ratio:g}, {settings.steps} steps of {settings.batch_size} x {settings.seq_len}-token
sequences packed from the {history["train_tokens"]:,} training tokens. Wall time {history["wall_seconds"] / 60:.1f} minutes.{phases}

- Final training loss (mean of the last {settings.log_every} steps): **{history["final_train_loss"]:.3f}**
- Held-out perplexity (shipped bf16 weights): **{evaluation["all_perplexity"]:.2f}** over all tokens,
  **{evaluation["assistant_perplexity"]:.2f}** over assistant tokens
- Loss curve (step: loss): {curve}

## Quality gate (tests/test_kimi_mini.py)
64 greedy tokens, end of turn ignored, on the first {evaluation["prompts"]} held-out prompts: distinct tokens per
answer {evaluation["distinct_tokens"]} (gate: >= 20), longest single-token run {evaluation["longest_run"]} (gate: < 8),
{evaluation["distinct_answers"]} distinct answers of {evaluation["prompts"]} (gate: at most one repeat).
{"Passed." if not gate_failures(evaluation) else "**Not passed**: " + "; ".join(gate_failures(evaluation)) + "."}

## Rebuild

```bash
{command}
```

## Sample greedy outputs (held-out prompts, at most 64 new tokens, stopping at `<|im_end|>`)

{sample_md}
""")


if __name__ == "__main__":  # a quick timing of one training step at the shipped size
    import torch

    m = new_model(KIMI_MINI_TEXT)
    x = torch.randint(0, 8192, (16, 256))
    for _ in range(3):
        t0 = time.time()
        m(input_ids=x, labels=x).loss.backward()
        print(f"step {time.time() - t0:.2f} s, {sum(p.numel() for p in m.parameters()) / 1e6:.2f}M parameters")
