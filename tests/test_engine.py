"""The engine layer's host rules, without an engine: the CPU environment (no core kept for vLLM's scheduler on a
small host) and where the engine core runs (the driver's process on a CPU host; never on GPUs nor for a nested
multimodal verifier). The engines themselves are tested through the stages (tests/test_regenerate.py reads vLLM's
CPU binding from its log; tests/test_vllm_check.py the baseline session's placement)."""

from __future__ import annotations

import json

from helpers import BUNDLED_VERIFIER, REPO

from eagle3.engine.job import engine_core_in_process
from eagle3.engine.settings import SMALL_CPU_HOST_CORES, cpu_engine_env


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
