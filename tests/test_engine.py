"""The engine layer's host rules, without an engine: the CPU environment (no core kept for vLLM's scheduler on a
small host), the CPU KV cache sized to a batch, and where the engine core runs (the driver's process on a CPU host;
never on GPUs nor for a nested multimodal verifier). The engines themselves are tested through the stages (tests/test_regenerate.py reads vLLM's
CPU binding from its log; tests/test_vllm_check.py the baseline session's placement)."""

from __future__ import annotations

import json

import pytest
from helpers import BUNDLED_VERIFIER, REPO

from eagle3.engine.job import engine_core_in_process
from eagle3.engine.settings import (
    CPU_KV_CACHE_GIB,
    SMALL_CPU_HOST_CORES,
    cpu_engine_env,
    cpu_kv_cache_gib,
    kv_cache_bytes_per_token,
    sized_cpu_kv_cache_env,
)
from eagle3.support.verifier import VerifierSpec


def test_cpu_engine_env_reserves_no_core_on_a_small_host_only():
    assert cpu_engine_env(2, environ={}) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert cpu_engine_env(SMALL_CPU_HOST_CORES + 1, environ={}) == {}  # a larger host keeps vLLM's rule
    assert cpu_engine_env(2, environ={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}) == {}  # the user's own setting wins


def test_engine_core_in_process_on_a_cpu_host_unless_nested(tmp_path):
    plain = tmp_path / "plain"
    nested = tmp_path / "nested"
    for d, src in ((plain, BUNDLED_VERIFIER), (nested, REPO / "models" / "kimi-mini")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text())))
    assert engine_core_in_process(True, plain, gpu=False)
    assert not engine_core_in_process(False, plain, gpu=False)
    assert not engine_core_in_process(True, plain, gpu=True)  # GPUs: vLLM's own process, as it serves
    assert not engine_core_in_process(True, nested, gpu=False)  # Kimi-K2.5's layout: numba breaks vLLM's CPU worker


def test_kv_cache_bytes_per_token_of_llama_and_mla_verifiers():
    """SmolLM2 (30 layers, 3 KV heads x 64): a key and a value per KV head per layer; kimi-mini (MLA): the latent
    (kv_lora_rank) and the rope key per layer, shared by every head."""
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_cache_bytes_per_token(smol, 4) == 30 * 2 * 3 * 64 * 4 == 46_080
    kimi = VerifierSpec.from_path(REPO / "models" / "kimi-mini").text_config
    assert kv_cache_bytes_per_token(kimi, 2) == (kimi["num_hidden_layers"] * (kimi["kv_lora_rank"]
                                                 + kimi["qk_rope_head_dim"]) * 2)


def test_cpu_kv_cache_fits_the_batch_within_a_share_of_free_memory():
    gib = 1 << 30
    # SmolLM2's regeneration batch: 256 rows x 512 tokens x 46,080 bytes = 5.6 GiB -> 6, on a host with 40 GiB free
    assert cpu_kv_cache_gib(256 * 512, 46_080, 40 * gib) == 6
    assert cpu_kv_cache_gib(256 * 512, 46_080, 22 * gib) == 5  # a quarter of 22 GiB, rounded down
    assert cpu_kv_cache_gib(64, 4096, 22 * gib) == CPU_KV_CACHE_GIB  # a small batch keeps the default
    assert cpu_kv_cache_gib(256 * 512, 46_080, 2 * gib) == CPU_KV_CACHE_GIB  # a small host: never below it
    assert sized_cpu_kv_cache_env(256 * 512, 46_080, environ={"VLLM_CPU_KVCACHE_SPACE": "3"}) == {}  # the user's
    sized = sized_cpu_kv_cache_env(256 * 512, 46_080, environ={})
    assert list(sized) == ["VLLM_CPU_KVCACHE_SPACE"] and int(sized["VLLM_CPU_KVCACHE_SPACE"]) >= CPU_KV_CACHE_GIB


def test_kv_cache_bytes_per_token_names_a_missing_field():
    with pytest.raises(ValueError, match="the verifier's config has no 'num_attention_heads'"):
        kv_cache_bytes_per_token({"num_hidden_layers": 30, "hidden_size": 576}, 4)
