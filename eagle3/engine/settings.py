"""The vLLM engine's settings: one model, set once on the pipeline config (``engine``, beside ``verifier_path``) and
inherited by every stage that starts an engine (regeneration, extraction's vLLM backend, validation); a stage section
overrides only what truly differs (``EngineOverrides``: validation's job timeout by default).

What is NOT here, because it differs by what a stage does with the engine: the compute dtype (extraction's ``dtype``
is the features' precision and regeneration inherits it; validation's ``dtype`` is the serving precision),
``max_model_len`` (the longest sample, the longest conversation, the prompts + generation), batching.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field, create_model

from eagle3.support.settings import RUNTIME, SETTINGS_MODEL

# vLLM's CPU worker reserves gpu_memory_utilization x the host's memory and refuses to start when that much is not
# free, unless the KV cache's size is given (vllm/v1/worker/cpu_worker.py): every engine here gets one,
# VLLM_CPU_KVCACHE_SPACE (whole GiB; CPU_KV_CACHE_GIB, set by eagle3.support.paths, or cpu_kv_cache_gib for a stage
# that sizes it to its batch), which must then be free at start. A quarter of the host is what a CPU engine asks for
# without it, so a busy host or several engines do not fail at start.
CPU_MEMORY_FRACTION = 0.25
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_CACHE_GIB = 1  # an engine that caches few sequences at once (extraction, validation's decodes)
# A KV cache sized to a stage's batch takes at most this share of the host's available memory at the job's start.
# Regeneration's batch of rows runs at once only when its KV fits: SmolLM2 float32, 256 rows x 160 new tokens, 251
# output tok/s with 1 GiB against 302 with 4 (bench/smollm2_vllm_generate.py, AVX2-only EPYC, 2 cores).
CPU_KV_CACHE_MAX_SHARE = 0.25
# An MLA verifier (DeepseekV3 / Kimi-K2.5) on a CPU: vLLM's CPU build picks its AMX_MLA kernel wherever the CPU has AMX
# tiles (Intel Xeon 4th gen on), and that kernel takes bf16 / fp16 / int8 weights only: a float32 engine fails at load
# ("expect weight to be bfloat16, float16, int8, ..."). CPU_MLA serves every dtype on every x86 CPU, so extraction and
# validation compute the same features on any machine (every CPU figure of the kimi-mini preset was taken with it).
# Validation hands the same pin to the MLA draft (eagle3.validate.vllm_check: vLLM auto-selects a draft's backend).
CPU_MLA_BACKEND = "CPU_MLA"
# vLLM's CPU build keeps one core per worker for its scheduler process (VLLM_CPU_NUM_OF_RESERVED_CPU, unset: the
# worker count) and binds an own-process engine's worker threads to the rest: on a 2-core host the model computed on
# 1 core (regeneration's batches: 163 against 264 output tok/s with no core reserved, bench/smollm2_vllm_generate.py
# --cases 128x96, AVX2 EPYC). On hosts up to this many cores none is reserved; a larger host keeps vLLM's rule.
# (An engine core in the driver's process is not bound: its worker keeps torch's threads, one per physical core,
# since vLLM's CPU worker turns torch.set_num_threads into a no-op before vLLM would cut it to 1.)
SMALL_CPU_HOST_CORES = 4


def cpu_engine_env(cores: int | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment defaults for a vLLM engine on a CPU host (``cores``: the CPUs this process may use, by default
    its scheduling affinity), so that an engine core in its own process computes on every core: no core reserved for
    vLLM's scheduler process on a host of at most SMALL_CPU_HOST_CORES cores. A variable already in ``environ``
    (default: this process's environment) is the user's and wins: it is left out. On GPUs none of this applies."""
    n = len(os.sched_getaffinity(0)) if cores is None else cores
    defaults = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} if n <= SMALL_CPU_HOST_CORES else {}
    environ = os.environ if environ is None else environ
    return {k: v for k, v in defaults.items() if k not in environ}


def kv_cache_bytes_per_token(text_config: dict[str, Any], dtype_bytes: int) -> int:
    """Bytes of vLLM's KV cache per token of a verifier whose language-model config is ``text_config``, cached in a
    dtype of ``dtype_bytes``: per layer a key and a value per KV head, or MLA's latent (kv_lora_rank + the rope key).
    Raises ValueError naming the first field it needs and does not find."""
    def field(name: str) -> int:
        if not text_config.get(name):
            raise ValueError(f"the verifier's config has no {name!r} (needed to size vLLM's KV cache)")
        return int(text_config[name])

    if text_config.get("kv_lora_rank"):
        width = field("kv_lora_rank") + int(text_config.get("qk_rope_head_dim") or 0)
    else:
        heads = field("num_attention_heads")
        head_dim = int(text_config.get("head_dim") or field("hidden_size") // heads)
        width = 2 * int(text_config.get("num_key_value_heads") or heads) * head_dim
    return field("num_hidden_layers") * width * dtype_bytes


def cpu_kv_cache_gib(tokens: int, bytes_per_token: int, available_bytes: int) -> int:
    """Whole GiB of CPU KV cache (VLLM_CPU_KVCACHE_SPACE) for ``tokens`` cached at once: enough for all of them,
    at least CPU_KV_CACHE_GIB, at most CPU_KV_CACHE_MAX_SHARE of ``available_bytes`` (never below the default)."""
    gib = 1 << 30
    need = -(-tokens * bytes_per_token // gib)
    cap = int(available_bytes * CPU_KV_CACHE_MAX_SHARE) // gib
    return max(CPU_KV_CACHE_GIB, min(need, cap))


def sized_cpu_kv_cache_env(tokens: int, bytes_per_token: int, environ: Mapping[str, str] | None = None
                           ) -> dict[str, str]:
    """{VLLM_CPU_KVCACHE_SPACE: cpu_kv_cache_gib(..) against the host's available memory now} for an engine that
    caches ``tokens`` at once; {} when ``environ`` (default: this process's environment) already sets it (the
    user's wins)."""
    if CPU_KV_CACHE_ENV in (os.environ if environ is None else environ):
        return {}
    import psutil

    return {CPU_KV_CACHE_ENV: str(cpu_kv_cache_gib(tokens, bytes_per_token, psutil.virtual_memory().available))}


class EngineSettings(BaseModel):
    """How the verifier runs in vLLM, for every stage that starts an engine."""

    model_config = SETTINGS_MODEL

    vllm_python: str | None = Field(
        None, description="Interpreter of the vLLM environment; None = $EAGLE3_VLLM_PYTHON, else the checkout's "
        ".venv-vllm/bin/python.", json_schema_extra=RUNTIME)
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (count); Kimi-K2.5: 8.",
                                      json_schema_extra=RUNTIME)
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="On GPUs: fraction of each GPU's memory vLLM may use (weights + KV cache). "
        f"On a CPU vLLM reads it as a share of host memory to reserve: {CPU_MEMORY_FRACTION} is used there, and the "
        "KV cache is VLLM_CPU_KVCACHE_SPACE (GiB).", json_schema_extra=RUNTIME)
    enforce_eager: bool = Field(True, description="No CUDA graphs / torch.compile: a faster start (a verifier "
                                "load is ~22 minutes for Kimi-K2.5 already).", json_schema_extra=RUNTIME)
    trust_remote_code: bool = Field(
        False, description="Let transformers and vLLM run the verifier's own Python code (Kimi-K2.5's tokenizer and "
        "config need it); also the data stage's tokenizer default.")
    timeout_s: float = Field(0.0, ge=0.0, description="Kill an engine job (its whole process group) after this many "
                             "seconds, engine start included; 0 = no limit.", json_schema_extra=RUNTIME)

    def llm_kwargs(self, on_gpu: bool, mla: bool = False) -> dict[str, Any]:
        """The ``vllm.LLM`` arguments these settings fix (a driver adds its own: model, dtype, lengths, ...);
        ``mla``: the verifier uses MLA attention (on a CPU its attention backend is then pinned, CPU_MLA_BACKEND)."""
        tp = self.tensor_parallel_size
        return {
            **({"attention_backend": CPU_MLA_BACKEND} if mla and not on_gpu else {}),
            "tensor_parallel_size": tp,
            "gpu_memory_utilization": self.gpu_memory_utilization if on_gpu else CPU_MEMORY_FRACTION,
            "enforce_eager": self.enforce_eager,
            "trust_remote_code": self.trust_remote_code,
            # one device: the worker runs in the engine's own process, no extra interpreter (~10 s on CPU)
            "distributed_executor_backend": "uni" if tp == 1 else "mp",
        }

    def merged(self, overrides: BaseModel | dict[str, Any] | None) -> EngineSettings:
        """These settings with a stage's overrides (fields left None are inherited)."""
        if overrides is None:
            return self
        d = overrides.model_dump(exclude_none=True) if isinstance(overrides, BaseModel) else {
            k: v for k, v in overrides.items() if v is not None}
        return EngineSettings.model_validate({**self.model_dump(), **d}) if d else self  # validated: ranges hold


def _optional(name: str) -> tuple[Any, Any]:
    f = EngineSettings.model_fields[name]
    return f.annotation | None, Field(None, description=f"{f.description} None: the pipeline's engine.{name}.",
                                      json_schema_extra=f.json_schema_extra)


# A stage section's overrides: the same fields, each None (inherit) by default; defined by EngineSettings alone.
EngineOverrides = create_model("EngineOverrides", __config__=SETTINGS_MODEL,
                               **{n: _optional(n) for n in EngineSettings.model_fields})

VALIDATE_TIMEOUT_S = 1800.0  # validation's engine jobs by default: a draft vLLM cannot serve must not hang the run
