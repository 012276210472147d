"""Validation's verifier-alone reference, taken in the regeneration's engine session: one verifier load less.

Validation needs the verifier WITHOUT a draft twice over: its greedy outputs on the held-out prompts (speculative
decoding at temperature 0 must give the same token ids) and its decoding speed (the speedup's denominator). On its
own that is an engine start of its own (a verifier load: ~22 minutes for Kimi-K2.5). The regeneration stage already
has that engine loaded, before training: when the two engines are the same (same dtype as vLLM gets it, same
tensor parallel size and eager mode: the pipeline's engine settings; the engine core in the same process placement,
regeneration's engine following validation's), the regeneration driver also generates the
held-out prompts and times their decoding once its conversations are done, and writes the result to
``<regenerate folder>/baselines/<key>.json``; validation finds it by the same key and starts only the engines with
a draft. Any difference (regeneration off or cached from a run without this request, another dtype, other prompts
or generation length) and validation starts its own baseline engine, as before.

The request is not part of the regeneration's cache key: asking for a baseline never regenerates the data.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from eagle3.engine.job import engine_core_in_process
from eagle3.engine.settings import EngineSettings
from eagle3.support.io import sha256_json

log = logging.getLogger("eagle3")

BASELINES = "baselines"  # folder inside the regenerate stage's folder


class BaselineRequest(BaseModel):
    """What validation will need from a verifier-alone engine."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[list[int]] = Field(description="The held-out prompts, rendered by the chat encoder.")
    max_new_tokens: int = Field(description="Greedy generation budget per prompt, tokens.")
    dtype: str = Field(description="The dtype vLLM runs the verifier in (as vLLM gets it).")
    speed_levels: list[int] = Field(description="Concurrency levels timed ([]: speed not measured).")
    speed_repeats: int = Field(description="Timed decodes per level.")
    tensor_parallel_size: int
    enforce_eager: bool
    engine_in_process: bool = Field(description="vLLM's engine core in the driver's process "
                                    "(eagle3.engine.job.engine_core_in_process): it changes the speed, so the "
                                    "baseline engine runs where validation's engines run.")

    def key(self) -> str:
        return sha256_json(self.model_dump())[:16]


def request_for_validation(cfg, prompts: list[list[int]], verifier_path: str | os.PathLike) -> BaselineRequest:
    """The request validation's settings (``eagle3.validate.config.ValidateConfig``) make for these prompts and this
    verifier."""
    speed = cfg.speed_repeats > 0
    return BaselineRequest(prompt_token_ids=prompts, max_new_tokens=cfg.max_new_tokens, dtype=cfg.dtype,
                           speed_levels=list(cfg.speed_concurrency) if speed else [],
                           speed_repeats=cfg.speed_repeats if speed else 0,
                           tensor_parallel_size=cfg.engine.tensor_parallel_size,
                           enforce_eager=cfg.engine.enforce_eager,
                           engine_in_process=engine_core_in_process(cfg.engine_in_process, verifier_path))


def reuse_problem(validate, regen_enabled: bool, regen_dtype: str, regen_engine: EngineSettings,
                  regen_max_model_len: int | None = None, request: BaselineRequest | None = None) -> str | None:
    """Why regeneration's engine session cannot serve as validation's baseline engine (None: it can).
    ``regen_dtype``: the dtype regeneration gives vLLM (resolved)."""
    if not validate.run_vllm:
        return "validation does not run vLLM"
    if not regen_enabled:
        return "regeneration is off (no engine session before training)"
    if validate.speed_repeats > 0 and validate.speed_schedule != "AB":
        return (f"speed_schedule {validate.speed_schedule!r} asks for verifier-alone sessions timed between the "
                f"draft's")
    if validate.dtype != regen_dtype:
        return f"validation serves in {validate.dtype}, regeneration generates in {regen_dtype}"
    for name in ("tensor_parallel_size", "enforce_eager"):
        a, b = getattr(validate.engine, name), getattr(regen_engine, name)
        if a != b:
            return f"engine.{name} differs ({b} in regeneration, {a} in validation)"
    if request is not None and regen_max_model_len is not None:
        longest = max(map(len, request.prompt_token_ids)) + request.max_new_tokens
        if longest > regen_max_model_len:
            return (f"a held-out prompt + {request.max_new_tokens} new tokens ({longest} tokens) exceeds "
                    f"regeneration's max_model_len ({regen_max_model_len} tokens)")
    return None


def baseline_path(baselines_dir: str | os.PathLike, request: BaselineRequest) -> Path:
    return Path(baselines_dir) / f"{request.key()}.json"


def find_baseline(baselines_dir: str | os.PathLike | None, request: BaselineRequest) -> dict[str, Any] | None:
    """The baseline regeneration wrote for this request, if any (its file must hold the request it answers)."""
    if baselines_dir is None:
        return None
    path = baseline_path(baselines_dir, request)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if data.get("request") != request.model_dump():
        return None
    log.info("[validate] the verifier-alone baseline comes from the regeneration's engine session (%s): no "
             "baseline engine start", path)
    return data
