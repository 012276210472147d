"""Kimi-K2.5's architecture end to end in real vLLM (CPU build): the kimi-mini preset pointed at ANOTHER Kimi-shaped
verifier (other hidden size, layer count, heads and experts than kimi-mini) runs every stage (regeneration and
extraction in vLLM through KimiK25ForConditionalGeneration, the extraction self-check, an MLA draft trained with the
TTT loop, validation in vLLM speculative decoding with losslessness and offline parity) to a vLLM verdict, with no
setting of the preset changed but the budgets. Then the stored features of a Kimi-shaped verifier equal across both
extraction backends, and the self-check catches vLLM 0.32's CPU rope bug (MLA with the default rope)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import KIMI_SHAPED_SMALL, make_dataset

from eagle3.config import load_config
from eagle3.extract.selfcheck import BatchInvarianceError
from eagle3.extract.stage import extract_hidden_states
from eagle3.store import HiddenStateStore
from tools.kimi_mini import random_kimi_shaped

pytestmark = [pytest.mark.vllm]

OTHER_SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=9,  # noqa: C408
                   num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=3)
BUDGETS = {  # sizes only: the preset's stage choices (regeneration, vLLM extraction, MLA draft, dtypes) stay
    "data.max_samples": 24, "regenerate.max_new_tokens": 48, "train.epochs": 1,
    "train.batch_size": 2,  # 24 short samples pack into ~5 rows of 512 tokens: 2 per step
    "validate.num_prompts": 3, "validate.max_new_tokens": 24, "validate.compare_untrained": False,
    "validate.speed_repeats": 0,  # the verdict, not the speed (timed per level in test_smollm2_pipeline)
    "validate.min_mean_acceptance_length": None}


@pytest.mark.slow
def test_kimi_mini_preset_runs_another_kimi_shaped_verifier_to_a_vllm_verdict(prefect_harness, tmp_path):
    from flows.eagle3_pipeline import eagle3_pipeline

    verifier = random_kimi_shaped(tmp_path / "other-kimi", seed=3, **OTHER_SHAPE)
    config = load_config("kimi-mini", {"verifier_path": str(verifier), "runs_dir": str(tmp_path / "runs"), **BUDGETS})
    state = eagle3_pipeline(config, return_state=True)
    assert state.is_completed(), state.message
    report = json.loads(Path(state.result()["report"]).with_name("report.json").read_text())
    assert report["verdict"] == "pass", report["reasons"]
    vllm = report["vllm"]
    assert vllm["lossless"] and vllm["acceptance"]["num_drafts"] > 0
    assert report["offline"]["relative_difference"] <= 0.02  # the MLA draft computes what vLLM serves
    draft = json.loads((Path(state.result()["checkpoint"]) / "config.json").read_text())
    assert draft["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and draft["hidden_size"] == 128
    assert draft["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # vLLM's rule for 9 layers, vLLM convention
    store = json.loads(next((tmp_path / "runs").glob("*/extract-hidden-states-*/store/selfcheck.json")).read_text())
    assert store["ran"] and store["passed"] and store["backend"] == "vllm"


def _cfg(verifier, **kw) -> dict:
    return {"verifier": str(verifier), "dtype": "float32", "store_dtype": "float32", "max_tokens_per_batch": 128,
            "max_samples_per_batch": 4, "min_tokens_per_batch": 16, "log_every_seconds": 0, "log_every_samples": 0,
            **kw}


def test_kimi_shaped_states_equal_across_backends_and_vllm_passes_the_selfcheck(kimi_shaped, tmp_path):
    """Training features = serving features for the DeepseekV3/Kimi architecture: the vLLM backend's store (what the
    serving engine computes, through KimiK25ForConditionalGeneration) equals the transformers backend's."""
    ds = make_dataset(tmp_path / "ds", [48, 7, 130, 33], 8192, seed=7)
    hf = extract_hidden_states(_cfg(kimi_shaped), ds, tmp_path / "hf")
    vl = extract_hidden_states(_cfg(kimi_shaped, backend="vllm"), ds, tmp_path / "vllm")  # 130 > the 128 budget
    assert hf.selfcheck["passed"] and vl.selfcheck["passed"] and vl.selfcheck["backend"] == "vllm"
    # the batch copy shared its first forward step and came second in it (the engine's scheduler was paused while the
    # chunk's requests were added): the 7-token check behind the next shortest sample (33 tokens + template)
    assert vl.selfcheck["batch_samples"] >= 2 and vl.selfcheck["tokens_ahead"] > 0, vl.selfcheck
    a, b = HiddenStateStore(tmp_path / "hf"), HiddenStateStore(tmp_path / "vllm")
    assert a.aux_layer_ids == b.aux_layer_ids == [1, 2]  # vLLM's rule for 4 layers
    for i in range(4):
        x, y = a.load(i), b.load(i)
        assert torch.equal(x["input_ids"], y["input_ids"])
        for key in ("aux_hidden_states", "final_hidden_state"):
            # float32 on both sides; vLLM's CPU MLA (latent-space attention, oneDNN GEMMs) differs from
            # transformers' expanded form by ~3e-4 (measured 1.9e-4 - 4e-4 per token), the rope bug by 1.5-4%
            rel = float((x[key] - y[key]).norm() / x[key].norm())
            assert rel < 1e-3, (i, key, rel)


def test_selfcheck_catches_vllms_cpu_rope_bug_on_mla_with_the_default_rope(tmp_path):
    """vLLM 0.32's CPU rotary kernel mis-rotates MLA's strided q/k views with the default rope: the states depend on
    which requests share the step. The self-check fails the stage, naming the sample and the layer."""
    verifier = random_kimi_shaped(tmp_path / "default-rope", rope_scaling=None, **KIMI_SHAPED_SMALL)
    ds = make_dataset(tmp_path / "ds", [48, 7, 130, 33], 8192, seed=7)
    with pytest.raises(BatchInvarianceError, match=r"sample \d+ extracted alone differs .* at its aux layer 1: "
                                                   r"relative L2 error 0\.0\d+ > 0\.001"):
        extract_hidden_states(_cfg(verifier, backend="vllm"), ds, tmp_path / "store")
