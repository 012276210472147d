"""Capacity stage: store bytes from config.json alone (Kimi-K2.5 shape), free space, refusal, time estimate."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from eagle3.capacity import (
    CapacityConfig,
    CapacityError,
    plan_store,
    plan_training_time,
    regenerated_lengths,
    sample_lengths,
    store_file_bytes,
)
from eagle3.store import serialize_sample
from eagle3.support.dtypes import torch_dtype
from eagle3.support.verifier import VerifierError

KIMI_AUX = [2, 30, 58]  # vLLM convention: residual streams entering decoder layers 2, 30, 58
KIMI_HEADER_512 = 368  # safetensors header (8-byte length + padded JSON + metadata) of a 512-token store file


@pytest.fixture(scope="module")
def kimi_config(tmp_path_factory) -> Path:
    """Kimi-K2.5's config.json shape only (no weights): DeepseekV3 text model nested under text_config."""
    path = tmp_path_factory.mktemp("kimi-k25-config")
    text = {"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
            "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
    ))
    return path


def test_kimi_bytes_per_token_and_per_sample_match_a_real_store_file(kimi_config, tmp_path):
    plan = plan_store(kimi_config, KIMI_AUX, "bfloat16", [512], tmp_path, CapacityConfig(), max_seq_len=2048)
    assert plan.bytes_per_token == 57_344 == (3 + 1) * 7168 * 2
    assert plan.hidden_state_bytes == 29_360_128  # 512 tokens
    assert plan.overhead_bytes_per_token == 9
    assert plan.header_bytes == KIMI_HEADER_512
    assert plan.overhead_bytes == 512 * 9 + KIMI_HEADER_512
    # the exact size of the file the store's own writer produces for that sample
    real = serialize_sample(torch.zeros(512, 3 * 7168), torch.zeros(512, 7168), torch.zeros(512, dtype=torch.int64),
                            torch.zeros(512, dtype=torch.uint8), torch.bfloat16, index=0)
    assert plan.total_bytes == len(real) == 29_365_104


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_store_file_bytes_equal_the_store_writer_for_any_length(dtype):
    for tokens, n_aux, hidden, index in [(1, 1, 8, 0), (37, 2, 64, 9), (1000, 3, 48, 10), (3, 4, 16, 123_456_789)]:
        real = serialize_sample(torch.zeros(tokens, n_aux * hidden), torch.zeros(tokens, hidden),
                                torch.zeros(tokens, dtype=torch.int64), torch.zeros(tokens, dtype=torch.uint8),
                                torch_dtype(dtype), index=index)
        assert sum(store_file_bytes(tokens, n_aux, hidden, dtype)) == len(real), (tokens, index)


def test_dataset_total_is_the_sum_over_samples_and_worst_case(kimi_config, tmp_path):
    lengths = [512, 1, 2048, 777, 512, 1500]
    cfg = CapacityConfig(model_load_seconds=1320, extraction_tokens_per_second=2500)
    plan = plan_store(kimi_config, KIMI_AUX, "bfloat16", lengths, tmp_path, cfg, max_seq_len=2048)
    per_sample = [sum(store_file_bytes(t, 3, 7168, "bfloat16")) for t in lengths]
    assert plan.total_tokens == 5350 and plan.num_samples == 6 and plan.longest_sample_tokens == 2048
    assert plan.hidden_state_bytes == 5350 * 57_344
    assert plan.total_bytes == sum(per_sample)
    assert plan.worst_case_tokens == 6 * 2048
    assert plan.worst_case_bytes == 6 * (2048 * 57_344 + 2048 * 9 + 376) == 704_755_920
    assert plan.required_free_bytes == -(-plan.total_bytes * 11 // 10)
    assert plan.fits is True and plan.free_bytes > 0
    assert plan.estimated_seconds == pytest.approx(1320 + 5350 / 2500)
    text = plan.summary()
    assert "57,344 bytes per token" in text and "GB" in text and "GiB" in text and str(tmp_path) in text


def test_kimi_float8_store_is_half_of_bf16_scales_included_and_matches_a_real_file(kimi_config, tmp_path):
    bf16 = plan_store(kimi_config, KIMI_AUX, "bfloat16", [512, 2048], tmp_path, CapacityConfig(), 2048)
    f8 = plan_store(kimi_config, KIMI_AUX, "float8_e4m3fn", [512, 2048], tmp_path, CapacityConfig(), 2048)
    assert f8.bytes_per_token == 28_688 == (3 + 1) * 7168 * 1 + (3 + 1) * 4  # values + one float32 scale per state
    assert f8.dtype_bytes == 1 and f8.overhead_bytes_per_token == 9
    assert f8.bytes_per_token / bf16.bytes_per_token == pytest.approx(0.50028, abs=1e-5)
    assert f8.total_bytes / bf16.total_bytes < 0.501
    real = [serialize_sample(torch.zeros(t, 3 * 7168), torch.ones(t, 7168), torch.zeros(t, dtype=torch.int64),
                             torch.zeros(t, dtype=torch.uint8), torch.float8_e4m3fn, index=0) for t in (512, 2048)]
    assert f8.total_bytes == sum(map(len, real))
    assert "28,688 bytes per token" in f8.summary() and "4 float32 scales" in f8.summary()


def test_float32_store_doubles_the_hidden_state_bytes(kimi_config, tmp_path):
    plan = plan_store(kimi_config, KIMI_AUX, "float32", [512], tmp_path, CapacityConfig(), 512)
    assert plan.bytes_per_token == 114_688 and plan.hidden_state_bytes == 2 * 29_360_128


def test_lengths_are_read_from_the_prepared_dataset(kimi_config, tmp_path):
    ids = [[1] * n for n in (3, 17, 0, 250)]
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] * len(r) for r in ids]},
                               features=features).save_to_disk(str(tmp_path / "dataset"))
    assert sample_lengths(tmp_path / "dataset").tolist() == [3, 17, 0, 250]
    from_dir = plan_store(kimi_config, KIMI_AUX, "bfloat16", tmp_path / "dataset", tmp_path, CapacityConfig(), 256)
    from_list = plan_store(kimi_config, KIMI_AUX, "bfloat16", [3, 17, 0, 250], tmp_path, CapacityConfig(), 256)
    assert from_dir.total_bytes == from_list.total_bytes and from_dir.total_tokens == 270


def test_regeneration_upper_bound_counts_every_answer_of_every_row():
    from eagle3.regenerate.config import RegenerateConfig

    prompt, turns = np.array([10, 300, 40]), np.array([1, 1, 2])  # tokens before the first answer, assistant turns
    one = RegenerateConfig(max_new_tokens=100)
    lengths, tokens = regenerated_lengths(prompt, turns, 256, one)
    assert lengths.tolist() == [110, 256, 240] and tokens == 100 + 0 + 200  # the long prompt leaves no room
    two = RegenerateConfig(max_new_tokens=100, answers_per_conversation=2, temperature=0.8)
    lengths, tokens = regenerated_lengths(prompt, turns, 256, two)
    assert lengths.tolist() == [110, 110, 256, 256, 240, 240] and tokens == 2 * 300


def test_refuses_when_the_store_cannot_fit(kimi_config, tmp_path):
    dest = tmp_path / "run" / "store"  # does not exist yet: measured at the nearest existing parent
    huge = [10**10] * 10**4  # 10^14 tokens * 57,344 bytes: beyond any disk
    with pytest.raises(CapacityError) as err:
        plan_store(kimi_config, KIMI_AUX, "bfloat16", huge, dest, CapacityConfig(), max_seq_len=10**10)
    message = str(err.value)
    headers = 10**4 * store_file_bytes(10**10, 3, 7168, "bfloat16")[2]
    total = 10**14 * (57_344 + 9) + headers
    assert str(dest) in message
    assert f"{total:,} bytes" in message  # needed
    assert f"{-(-total * 11 // 10):,} bytes (" in message and "with the 10% margin" in message  # exact integers
    assert "are free" in message and "GiB" in message

    warned = plan_store(kimi_config, KIMI_AUX, "bfloat16", huge, dest, CapacityConfig(on_insufficient="warn"), 10**10)
    assert warned.fits is False and any("does not fit" in w for w in warned.warnings)
    assert warned.free_space_checked_at == str(tmp_path)


def test_margin_alone_can_refuse(kimi_config, tmp_path):
    plan = plan_store(kimi_config, KIMI_AUX, "bfloat16", [512], tmp_path, CapacityConfig(), 512)
    margin = plan.free_bytes / plan.total_bytes  # margin so large that needed * (1 + margin) > free
    with pytest.raises(CapacityError, match="does not fit"):
        plan_store(kimi_config, KIMI_AUX, "bfloat16", [512], tmp_path, CapacityConfig(disk_margin_fraction=margin), 512)


def test_fsspec_destination_without_free_space_is_unknown_not_refused(kimi_config):
    plan = plan_store(kimi_config, KIMI_AUX, "bfloat16", [10**9] * 1000, "memory://run/store", CapacityConfig(), 10**9)
    assert plan.free_bytes is None and plan.fits is None
    assert any("MemoryFileSystem" in w and "free space unknown" in w for w in plan.warnings)
    assert "free unknown" in plan.summary()


def test_out_of_range_aux_layer_is_a_clear_error(kimi_config, tmp_path):
    with pytest.raises(VerifierError, match=r"aux_layer_ids \[61\] out of range .* 61 layers"):
        plan_store(kimi_config, [2, 30, 61], "bfloat16", [512], tmp_path, CapacityConfig(), 512)


def test_verifier_loads_per_run_and_the_shared_baseline():
    """The plan counts every verifier load of a run. kimi-k2.5: regeneration, extraction, and validation's draft
    engine alone (its verifier-alone baseline comes from regeneration's engine session: the same bfloat16, tensor
    parallel 8): 3 loads, not 4. Any difference between the two engines, or a drift-cancelling speed schedule,
    and validation starts its own baseline engine."""
    from eagle3.capacity import loads_summary, verifier_loads
    from eagle3.config import load_config

    kimi = load_config("kimi-k2.5")
    loads, problem = verifier_loads(kimi.extract_config(), kimi.regenerate_config(), "bfloat16", kimi.validate_config)
    assert problem is None and [ld.stage for ld in loads] == ["regenerate", "extract-hidden-states", "validate-draft"]
    assert "1:06:00 (h:mm:ss) of loading" in loads_summary(loads, 1320.0, problem, True)

    cases = {  # overrides -> (loads, why validation starts its own verifier-alone engine)
        "validate.dtype": ("float32", 4, "validation serves in float32, regeneration generates in bfloat16"),
        "validate.speed_schedule": ("ABA", 5, "speed_schedule 'ABA'"),
        "regenerate.enabled": (False, 3, "regeneration is off"),
        "validate.engine.enforce_eager": (False, 4, "engine.enforce_eager differs"),
        "validate.compare_untrained": (True, 4, None),
    }
    for key, (value, n, why) in cases.items():
        c = load_config("kimi-k2.5", {key: value})
        loads, problem = verifier_loads(c.extract_config(), c.regenerate_config(), "bfloat16", c.validate_config)
        assert len(loads) == n, (key, loads)
        assert (problem is None) if why is None else (why in problem), (key, problem)

    tiny = load_config("tiny")  # transformers extraction, no regeneration, offline reference: in-process loads too
    loads, problem = verifier_loads(tiny.extract_config(), tiny.regenerate_config(), None, tiny.validate_config)
    assert [(ld.engine, ld.what) for ld in loads] == [
        ("transformers", "hidden states"), ("vLLM", "verifier + trained draft"), ("vLLM", "verifier alone (baseline)"),
        ("vLLM", "verifier + untrained draft"), ("transformers", "offline reference")]
def test_training_time_counts_the_nodes_and_the_network_between_them(tmp_path):
    """The kimi-k2.5 preset on one host reproduces the original run (1,000 samples x 10 epochs, 28 minutes on 8 GPUs);
    on two hosts the compute halves and every optimizer step adds the gradient all-reduce between the hosts."""
    from eagle3.config import load_config
    from eagle3.support.verifier import VerifierSpec

    text = {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
            "num_attention_heads": 64, "num_key_value_heads": 64, "v_head_dim": 128, "kv_lora_rank": 512,
            "vocab_size": 163840, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}  # what sizes the draft
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                      "model_type": "kimi_k25", "text_config": text}))
    spec = VerifierSpec.from_path(tmp_path)
    one = plan_training_time(load_config("kimi-k2.5").training_shape(), spec, KIMI_AUX, 1000, CapacityConfig())
    assert (one.gpus, one.nodes, one.train_samples, one.network_seconds) == (8, 1, 950, 0.0)
    assert one.seconds == pytest.approx(28 * 60, rel=0.01)
    two = plan_training_time(load_config("kimi-k2.5-2nodes").training_shape(), spec, KIMI_AUX, 1000, CapacityConfig())
    assert two.gpus == 16 and two.compute_seconds == pytest.approx(one.compute_seconds / 2)
    assert two.optimizer_steps == 10 * 60  # ceil(950 / 16) steps per epoch
    assert two.trainable_parameters == 1_190_948_864  # docs/DESIGN.md's memory plan counts the same draft
    assert two.allreduce_bytes_per_step == 4 * two.trainable_parameters  # 2 (n - 1) / n = 1 for two hosts
    assert two.network_seconds == pytest.approx(600 * two.allreduce_bytes_per_step / 50e9)
    slow = plan_training_time(load_config("kimi-k2.5-2nodes").training_shape(), spec, KIMI_AUX, 1000,
                              CapacityConfig(internode_bytes_per_second=12.5e9))  # one 100 Gb/s link
    assert slow.network_seconds == pytest.approx(4 * two.network_seconds)
    assert "on 2 hosts x 8 GPUs" in two.summary(10) and "gradient all-reduce between hosts" in two.summary(10)
