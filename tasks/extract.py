"""Stage 2 task: the verifier's hidden states for every prepared sample -> the hidden-state store (eagle3.extract).

The store folder is keyed by what changes the stored states (verifier, aux layers, dtypes, backend, data), not by
batching, locking, logging or the shard range: extraction shards of one dataset (one flow run per GPU host) fill
one store, and a rerun with other batch settings (e.g. the smaller budget of an OOM retry) resumes into it.
"""

from __future__ import annotations

from prefect import task

from eagle3.config import HostConfig
from eagle3.extract.config import ExtractConfig
from eagle3.extract.stage import extract_hidden_states
from tasks import artifacts
from tasks.common import attempt_batch_scale, cache_key, gpu_slots, retry_on_oom_only, stage_dir

# settings that do not change the stored states: they must not split the store folder
_FOLDER_IGNORES = (
    "shard_start", "shard_end", "max_tokens_per_batch", "max_samples_per_batch", "min_tokens_per_batch",
    "on_unfittable_sample", "lock_dir", "lock_wait_seconds", "min_free_gpu_memory_fraction", "log_every_samples",
    "log_every_seconds", "resume_check", "write_queue_batches", "vllm_python", "vllm_gpu_memory_utilization",
    "vllm_timeout_seconds", "tensor_parallel_size", "device", "device_map",
)


@task(name="extract-hidden-states", cache_key_fn=cache_key, persist_result=True, result_serializer="json",
      retries=2, retry_condition_fn=retry_on_oom_only)
def extract_hidden_states_task(cfg: ExtractConfig, inputs: dict, data: dict, run_dir: str,
                               host: HostConfig | None = None, plan: dict | None = None) -> dict:
    """-> manifest of the store: path, samples written / resumed / skipped, tokens, bytes on disk, sha256 of
    manifest.jsonl, content fingerprint, tok/s. ``plan`` (the capacity plan's manifest) only keys the cache.

    An OOM retry of this task (after the in-job halvings were not enough) starts at half the token budget and
    resumes from the store's manifest.
    """
    cfg = ExtractConfig.model_validate(cfg)
    out_dir = stage_dir(run_dir, "extract-hidden-states", {"cfg": cfg, "inputs": inputs, "data": data,
                                                           "run_dir": run_dir}, _FOLDER_IGNORES)
    scale = attempt_batch_scale()
    if scale < 1.0:
        cfg = cfg.model_copy(update={"max_tokens_per_batch": max(cfg.min_tokens_per_batch,
                                                                 int(cfg.max_tokens_per_batch * scale))})
    host = HostConfig.model_validate(host or {})
    progress = artifacts.ProgressArtifact("extract-progress", "hidden-state extraction")
    with gpu_slots(host.gpu_concurrency_limit, host.extraction_gpus, host.strict):
        r = extract_hidden_states(cfg, data["dataset_path"], out_dir / "store", on_progress=progress)
    artifacts.table("extract-summary", [
        {"metric": "samples written (this run)", "value": r.samples_written},
        {"metric": "samples resumed (already stored)", "value": r.samples_resumed},
        {"metric": "samples skipped (do not fit in memory)", "value": len(r.samples_unfittable)},
        {"metric": "tokens written (this run)", "value": r.tokens_written},
        {"metric": "store samples / tokens", "value": f"{r.store_samples} / {r.store_tokens}"},
        {"metric": "bytes on disk (store)", "value": r.bytes_on_disk},
        {"metric": "tokens per second", "value": round(r.tokens_per_second, 1)},
        {"metric": "token budget history (padded tokens per batch)", "value": str(r.token_budget_history)},
    ], description=f"Hidden states of shard {r.shard} into {r.store}")
    return {
        "stage": "extract-hidden-states",
        "out_dir": str(out_dir),
        "store_path": r.store,
        "paths": {"store": r.store, "manifest": f"{r.store}/manifest.jsonl", "store_json": f"{r.store}/store.json"},
        "fingerprint": r.fingerprint,
        "manifest_sha256": r.manifest_sha256,
        "backend": r.backend,
        "shard": r.shard,
        "samples_written": r.samples_written,
        "samples_resumed": r.samples_resumed,
        "samples_skipped": r.samples_unfittable[:1000],
        "samples_skipped_count": len(r.samples_unfittable),
        "store_samples": r.store_samples,
        "tokens": r.store_tokens,
        "tokens_written": r.tokens_written,
        "bytes_on_disk": r.bytes_on_disk,
        "tokens_per_second": r.tokens_per_second,
        "token_budget_history": r.token_budget_history,
        "model_load_seconds": r.model_load_seconds,
    }
