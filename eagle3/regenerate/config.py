"""Settings of the regenerate stage (one pydantic model; every field says its unit and whether it changes the
output)."""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from eagle3.engine.settings import EngineSettings
from eagle3.support.settings import INLINE, RUNTIME, SETTINGS_MODEL


def request_seed(seed: int, *, index: int, turn: int, answer: int) -> int:
    """The sampling seed of one request: source row ``index``, assistant ``turn``, ``answer`` (of
    answers_per_conversation). Answer 0 keeps the seeds journals were written with before answers existed
    (seed + index * 1000 + turn); later answers take 31 bits of a hash of all four: vLLM seeds a torch.Generator
    per request, and torch's CPU generator (mt19937) keeps only the seed's low 32 bits (measured: a stride of 2**40
    between answers gave identical answers on CPU)."""
    if answer == 0:
        return seed + index * 1000 + turn
    digest = hashlib.sha256(f"{seed}/{index}/{turn}/{answer}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def journal_key(entry: dict) -> tuple[int, int]:
    """(source row index, answer) of a work item or journal line; lines written before answers existed are
    answer 0."""
    return int(entry["index"]), int(entry.get("answer", 0))


class RegenerateConfig(BaseModel):
    """The verifier writes the assistant turns itself (sampling settings, batching, the vLLM engine)."""

    model_config = SETTINGS_MODEL

    enabled: bool = Field(False, description="Regenerate every assistant turn with the verifier before extraction "
                          "(on-policy training data; peers treat it as required). Off: train on the dataset's own "
                          "responses.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 = greedy (what temperature-0 "
                               "serving accepts against).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (fraction).")
    max_new_tokens: int = Field(512, gt=0, description="Longest regenerated assistant turn, in tokens; turns cut "
                                "there are kept and counted.")
    seed: int = Field(0, description="Sampling seed (per request: seed + row index * 1000 + turn for the first "
                      "answer, a hash of the four for later ones: eagle3.regenerate.config.request_seed).")
    answers_per_conversation: int = Field(
        1, ge=1, description="Answers the verifier writes for each kept conversation, in conversations: each is "
        "its own training conversation (same prompts, its own seed). More than 1 multiplies the training data "
        "without new prompts and needs temperature > 0 (greedy answers would be copies). The trainer's validation "
        "split is drawn by conversation, so a prompt's answers can fall on both sides of it.")
    reasoning: Literal["keep", "strip"] = Field(
        "keep", description="Thinking models: keep the reasoning block in the regenerated turn, or strip it (the "
        "text from reasoning_start to reasoning_end).")
    reasoning_start: str = Field("<think>", description="Text that opens a reasoning block.")
    reasoning_end: str = Field("</think>", description="Text that closes a reasoning block.")
    batch_rows: int = Field(64, gt=0, description="Conversations per vLLM generate call (rows); finished rows land "
                            "on disk after each batch, so a kill loses at most one batch. An out-of-memory error "
                            "halves it (engine kept).", json_schema_extra=RUNTIME)
    min_batch_rows: int = Field(1, gt=0, description="OOM floor, in rows: halving stops here and the stage fails.",
                                json_schema_extra=RUNTIME)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Compute dtype of the verifier in vLLM; 'auto' = the checkpoint's own on GPUs, float32 "
        "on a CPU without native bf16 matmul (the same rule as extraction). The pipeline sets extraction's: the "
        "answers are written at the precision the features are taken at.")
    log_every_seconds: float = Field(30.0, ge=0.0, description="Progress line every S seconds (0 = per batch only).",
                                     json_schema_extra=RUNTIME)
    # filled by the pipeline: the longest conversation (its max_seq_len) and its engine settings
    max_model_len: int = Field(2048, gt=1, description="Longest conversation in tokens (prompt + answers): rows "
                               "whose prompt leaves no room are dropped and named.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="The vLLM engine (the pipeline's "
                                   "engine settings).", json_schema_extra=INLINE)

    @model_validator(mode="after")
    def _sampled_answers(self) -> RegenerateConfig:
        if self.answers_per_conversation > 1 and self.temperature == 0:
            raise ValueError(f"answers_per_conversation {self.answers_per_conversation} with temperature 0: greedy "
                             "answers to the same conversation are copies; set temperature > 0 (for example 0.8)")
        return self

    def with_smaller_batches(self, scale: float) -> RegenerateConfig:
        """The same regeneration at ``scale`` (1/2, 1/4, ...) of the batch of rows, floored at min_batch_rows (an
        out-of-memory retry of the whole job; batching is a runtime setting: same journal, same folder)."""
        if scale >= 1.0:
            return self
        return self.model_copy(update={"batch_rows": max(self.min_batch_rows, int(self.batch_rows * scale))})
