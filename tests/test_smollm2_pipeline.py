"""The whole pipeline on a real instruct LLM (SmolLM2-135M-Instruct), with small settings, under a real Prefect
server and real vLLM: the verifier regenerates the answers itself, the draft trains on its states, and vLLM
measures acceptance (above a floor measured from real runs), losslessness and the decoding speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# vLLM, 3 draft tokens, 4 prompts x 32 tokens, the untrained draft 1.000 (0 of 372). 2026-12-01 (2 shared cores):
# 4 optimizer steps on 64 regenerated chats gave 1.115. 2026-12-08 (an AVX512-BF16 CPU, the preset with
# init_from_layer): 4 steps gave 1.042, under this floor, with the answers and features in bf16 and in float32
# alike; 8 steps (batch 4, below), everything in float32, gave 1.148. Everything is pinned to float32 so that the
# answers, features and training are the same computation on CPUs with and without native bf16.
MIN_MEAN_ACCEPTANCE_LENGTH = 1.05


def test_smollm2_pipeline_regenerates_trains_and_beats_the_untrained_floor(prefect_harness, smollm2, tmp_path):
    from flows.eagle3_pipeline import eagle3_pipeline

    overrides = {
        "runs_dir": str(tmp_path / "runs"), "data.max_samples": 64, "max_seq_len": 512,
        "regenerate.max_new_tokens": 64, "train.epochs": 2, "validate.num_prompts": 4,
        "validate.max_new_tokens": 32, "validate.speed_repeats": 1, "validate.speed_concurrency": [1, 2],
        "validate.speed_schedule": "ABA", "validate.compare_untrained": False,
        "validate.min_mean_acceptance_length": MIN_MEAN_ACCEPTANCE_LENGTH,
        "train.cpu_dtype": "float32",  # the floor was measured in float32; the preset's auto differs by CPU
        "train.batch_size": 4,  # 8 optimizer steps (the preset's batch 2 makes twice the steps)
        "train.optimizer": "adamw",  # AdamW (Muon's Newton-Schulz dtype differs by CPU too)
        "extract.dtype": "float32",  # regeneration follows it: the same answers on CPUs with and without native bf16
    }
    state = eagle3_pipeline(load_config("smollm2"), overrides=overrides, return_state=True)
    assert state.is_completed(), state
    result = state.result()
    report = json.loads(Path(result["report"]).with_name("report.json").read_text())
    vllm = report["vllm"]
    print(json.dumps({"trained": vllm["acceptance"], "speed": vllm["speed"]}, indent=1))
    assert result["verdict"] == "pass" and vllm["lossless"]  # the verdict enforces the floor
    assert vllm["acceptance"]["mean_acceptance_length"] >= MIN_MEAN_ACCEPTANCE_LENGTH
    speed = vllm["speed"]  # ABA: the draft's engine twice, one timed decode per level in each session
    assert vllm["engine_starts"] == 3 and speed["schedule"] == "ABA"
    assert [lv["concurrency"] for lv in speed["levels"]] == [1, 2] and speed["speedup"] > 0
    assert len(speed["draft_output_tokens_per_second"]) == 2 and len(speed["baseline_output_tokens_per_second"]) == 1
    regen = json.loads(next(Path(result["run_dir"]).glob("regenerate-*/stats.json")).read_text())
    assert regen["rows_in"] == 64 and regen["rows_written"] + regen["rows_dropped"] == 64
    assert regen["sampling"]["max_new_tokens"] == 64 and regen["tokens_generated"] > 0
