"""Settings of the validate stage (structural check, vLLM run, offline parity, verdict)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from eagle3.engine.settings import VALIDATE_TIMEOUT_S, EngineSettings
from eagle3.support.settings import INLINE, RUNTIME, SETTINGS_MODEL


class ValidateConfig(BaseModel):
    """Settings of the validation stage (structural check, vLLM run, offline parity, verdict)."""

    model_config = SETTINGS_MODEL

    prompts_path: str = Field(
        "data/stdlib-chat/eval.openai.jsonl", description="Held-out chat conversations (OpenAI or ShareGPT jsonl); "
        "the first user turn of each (after its system message) is the prompt. Relative paths: to the checkout.",
        json_schema_extra=RUNTIME)  # keyed by content: the prompts' identity
    num_prompts: int = Field(8, gt=0, description="Prompts to generate on, in conversations (the first N of the file).")
    max_new_tokens: int = Field(64, gt=0, description="Generation budget per prompt, in tokens.")
    num_speculative_tokens: int = Field(
        3, gt=0, description="Draft tokens proposed per verifier step (vLLM num_speculative_tokens), in tokens.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype vLLM runs the verifier and draft in: float32 (the default: exact parity with the "
        "offline reference on CPU), bfloat16 on GPUs (the kimi-k2.5 preset), or auto (vLLM's choice).")
    max_model_len: int | None = Field(
        None, gt=0, description="vLLM max_model_len in tokens (None: the verifier's max_position_embeddings).")
    engine_in_process: bool = Field(
        True, description="On a CPU host, run vLLM's engine core in the check's own process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0): one interpreter start less, ~10 s, and faster decoding one request at a "
        "time on 2 cores. Never on GPUs (vLLM's own process, as it serves) nor for a nested multimodal verifier "
        "(Kimi-K2.5: vLLM 0.32's CPU worker then fails at start). A regeneration session that also times "
        "validation's verifier-alone baseline runs its engine core where validation's run (eagle3.engine.job."
        "engine_core_in_process).", json_schema_extra=RUNTIME)
    engine: EngineSettings = Field(
        default_factory=lambda: EngineSettings(timeout_s=VALIDATE_TIMEOUT_S), description="The vLLM engine (the "
        f"pipeline's engine settings; its engine jobs time out after {VALIDATE_TIMEOUT_S:.0f} s unless set).",
        json_schema_extra=INLINE)
    run_vllm: bool = Field(True, description="Run the vLLM check (false: structural check only; verdict then says so).")
    require_lossless: bool = Field(True, description="Fail when speculative and plain greedy outputs differ.")
    min_mean_acceptance_length: float | None = Field(
        None, ge=1, description="Fail below this vLLM mean acceptance length (tokens per verifier step); None: no "
        "threshold.")
    compare_untrained: bool = Field(
        False, description="Also run an UNTRAINED draft (same config, vocab mapping and init as the trainer's step 0) "
        "in the same vLLM process and report its acceptance beside the trained one's; fails the verdict when "
        "training gained nothing. Costs one more engine start (a verifier load: ~22 min for Kimi-K2.5).")
    offline_reference: bool = Field(
        False, description="Also run the offline reference (transformers verifier + our draft, eagle3.validate.specdec) on "
        "the same prompts and compare. Needs the verifier to fit in this process: tiny verifiers only.")
    speed_repeats: int = Field(
        3, ge=0, description="Timed decodes of the held-out prompts per concurrency level in each engine session of "
        "speed_schedule, with and without the draft; decoding speedup = median output tokens/s with the draft / "
        "without, per level. 0 = speed not measured (then only the two engines the acceptance and losslessness "
        "checks need start). Reported, never gated.")
    speed_concurrency: list[int] = Field(
        [1, 4, 16], min_length=1, description="Requests in flight at which the decoding speed is measured, one level "
        "each (a new request starts when one finishes; max(num_prompts, 2 x level) requests per level, the prompts "
        "repeated). The first level is the headline: 1 = one request at a time, the latency setting speculative "
        "decoding is used in.")
    speed_schedule: str = Field(
        "AB", description="Order of the engine sessions of the timed decodes, one letter "
        "per engine start: A = verifier + draft, B = verifier alone, one engine alive at a time (two live CPU engines "
        "slow each other). The first A and the first B also run the acceptance and losslessness pass. 'AB': no extra "
        "verifier load; 'ABA' (1 extra) and 'ABBA' (2 extra) cancel a machine load that drifts linearly during the "
        "measurement. Only used when speed_repeats > 0.")

    @field_validator("speed_concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v) or len(set(v)) != len(v):
            raise ValueError(f"speed_concurrency {v}: positive request counts, each once")
        return v

    @field_validator("speed_schedule")
    @classmethod
    def _schedule(cls, v: str) -> str:
        if set(v) != {"A", "B"}:
            raise ValueError(f"speed_schedule {v!r}: letters A (verifier + draft) and B (verifier alone) only, at "
                             f"least one of each")
        return v

    parity_tolerance: float = Field(
        0.10, gt=0, description="Largest relative difference between offline and vLLM mean acceptance length "
        "(fraction, 0.10 = 10%).")

    def engine_sessions(self, baseline_shared: bool = False) -> str:
        """The vLLM engine sessions of the check, one letter per engine start (= verifier load), in order: A =
        verifier + trained draft, B = verifier alone, U = verifier + untrained draft (compare_untrained). The
        schedule (``speed_schedule`` when speed is measured, else A then B), with no B when the verifier-alone
        baseline came from regeneration's engine session (``baseline_shared``: then one A). '' when vLLM is not
        run. The one rule the check runs and the capacity plan counts."""
        if not self.run_vllm:
            return ""
        schedule = "A" if baseline_shared else self.speed_schedule if self.speed_repeats > 0 else "AB"
        return schedule + ("U" if self.compare_untrained else "")
