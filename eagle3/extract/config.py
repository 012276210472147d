"""Settings of the extraction stage (one pydantic model; every field says its unit)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from eagle3.engine.settings import EngineSettings
from eagle3.support.dtypes import describe_compute_dtype, device_type, resolve_store_dtype
from eagle3.support.settings import INLINE, RESUMABLE, RUNTIME, SETTINGS_MODEL
from eagle3.support.verifier import VerifierSpec


class ExtractConfig(BaseModel):
    model_config = SETTINGS_MODEL

    verifier: str = Field(description="Path of the verifier's Hugging Face model folder (config.json + safetensors).",
                          json_schema_extra=RUNTIME)  # keyed by content: the verifier identity
    aux_layer_ids: list[int] | None = Field(
        default=None,
        description="Aux layers to store, vLLM convention (id k = residual stream ENTERING decoder layer k = HF "
        "output_hidden_states[k]). None = vLLM's default (2, L//2, L-3); Kimi-K2.5: [2, 30, 58].",
    )
    backend: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description="'transformers': in-process PyTorch forward (one device or device_map); 'vllm': a subprocess "
        "in the vLLM environment with tensor parallelism (verifiers too big for one GPU, e.g. Kimi-K2.5).",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="Compute dtype of the verifier; 'auto' = the checkpoint's own dtype on a GPU, and "
        "on a CPU float32 unless the CPU multiplies that dtype natively (bf16 there is ~20x slower).",
    )
    device: str = Field(
        default="auto", description="Torch device for the transformers backend ('cpu', 'cuda', 'cuda:1'); 'auto' = "
        "cuda:0 when available, else cpu. Ignored when device_map is set.", json_schema_extra=RUNTIME,
    )
    device_map: str | dict[str, str | int] | None = Field(
        default=None, description="transformers device_map to spread the verifier over several GPUs (e.g. 'auto').",
        json_schema_extra=RUNTIME,
    )
    store_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "model"] = Field(
        default="bfloat16", description="Dtype of stored states; 'model' = the compute dtype (resolved, see dtype). "
        "float8_e4m3fn: 1 byte per value plus a float32 scale per token and state (about half of bfloat16's "
        "bytes; within 2**-4 relative error per value), dequantized by the trainer's loader.",
    )
    max_tokens_per_batch: int = Field(
        default=16384, ge=1,
        description="Token budget of one forward, in PADDED tokens (samples x longest sample in the batch).",
        json_schema_extra=RUNTIME,
    )
    max_samples_per_batch: int = Field(default=64, ge=1, description="Cap on samples per forward (samples).",
        json_schema_extra=RUNTIME)
    min_tokens_per_batch: int = Field(
        default=256, ge=1,
        description="OOM floor, in padded tokens: halving the budget below this stops; the sample is then "
        "handled per on_unfittable_sample.", json_schema_extra=RUNTIME,
    )
    on_unfittable_sample: Literal["skip", "fail"] = Field(
        default="skip",
        description="A sample that runs out of memory alone at the floor: 'skip' names it in the log and the "
        "result, 'fail' raises OutOfMemoryAfterRetries.", json_schema_extra=RESUMABLE,
    )
    min_free_gpu_memory_fraction: float = Field(
        default=0.8, ge=0.0, le=1.0,
        description="CUDA preflight: fail when a GPU has less than this fraction of its memory free (0 = no check).",
        json_schema_extra=RUNTIME,
    )
    log_every_samples: int = Field(default=500, ge=0, description="Progress line every N samples (0 = off).",
        json_schema_extra=RUNTIME)
    log_every_seconds: float = Field(default=30.0, ge=0.0, description="Progress line every S seconds (0 = off).",
        json_schema_extra=RUNTIME)
    shard_start: int = Field(default=0, ge=0, description="First dataset index (sample) this job extracts.",
        json_schema_extra=RESUMABLE)
    shard_end: int | None = Field(
        default=None, ge=0, description="One past the last dataset index (sample) this job extracts; None = end.",
        json_schema_extra=RESUMABLE,
    )
    group_size: int = Field(default=2000, ge=1, description="Samples per rows_A-B/ folder of the store.")
    resume_check: Literal["sha256", "size"] = Field(
        default="sha256",
        description="How a rerun checks finished samples before skipping them: 'sha256' re-hashes each file "
        "(safe), 'size' compares byte counts and headers (fast for multi-TB stores).", json_schema_extra=RUNTIME,
    )
    write_queue_batches: int = Field(
        default=2, ge=1,
        description="Batches of states waiting for the writer thread (bounds host memory: batches).",
        json_schema_extra=RUNTIME,
    )
    engine: EngineSettings = Field(
        default_factory=EngineSettings, description="How the verifier runs: the vLLM backend's engine (the "
        "pipeline's engine settings); trust_remote_code also for the transformers backend.", json_schema_extra=INLINE)
    selfcheck: bool = Field(
        default=True,
        description="Extraction self-check (eagle3/extract/selfcheck.py): one sample extracted inside a batch of "
        "several is extracted again alone, and every stored state (each aux layer and the final one) must agree "
        "within the compute dtype's tolerance, else the stage fails naming the sample and the layer. Costs one "
        "extra forward of one sample per extraction run.", json_schema_extra=RUNTIME,
    )
    selfcheck_tolerance: float | None = Field(
        default=None, gt=0,
        description="Largest relative L2 error (fraction) between a sample's states extracted alone and in a batch; "
        "None = by compute dtype (float32 1e-3, bfloat16 / float16 3e-2).", json_schema_extra=RUNTIME,
    )

    def with_smaller_batches(self, scale: float) -> ExtractConfig:
        """The same extraction at ``scale`` (1/2, 1/4, ...) of the token budget, floored at min_tokens_per_batch (an
        out-of-memory retry of the whole job; batching is a runtime setting: same store, same folder)."""
        if scale >= 1.0:
            return self
        budget = max(self.min_tokens_per_batch, int(self.max_tokens_per_batch * scale))
        return self.model_copy(update={"max_tokens_per_batch": budget})

    def device_type(self) -> str:
        """"cuda" or "cpu": where the verifier runs (vLLM backend: on the GPUs when there are any)."""
        if self.backend == "vllm" or self.device_map is not None:
            return device_type("auto")
        return device_type(self.device)

    def resolved_dtypes(self, spec: VerifierSpec) -> tuple[str, str]:
        """(compute dtype, store dtype) of this extraction: THE rule capacity planning and extraction both use."""
        compute = describe_compute_dtype(self.dtype, spec.dtype, self.device_type())
        return compute, resolve_store_dtype(self.store_dtype, compute)

    @model_validator(mode="after")
    def _check(self) -> ExtractConfig:
        if self.shard_end is not None and self.shard_end < self.shard_start:
            raise ValueError(f"shard_end ({self.shard_end}) < shard_start ({self.shard_start}) (sample indices)")
        if self.min_tokens_per_batch > self.max_tokens_per_batch:
            raise ValueError(f"min_tokens_per_batch ({self.min_tokens_per_batch} tokens) > max_tokens_per_batch "
                             f"({self.max_tokens_per_batch} tokens)")
        return self
