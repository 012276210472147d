"""Stage 1 task: conversations -> verifier tokens + assistant loss mask (eagle3.prepare)."""

from __future__ import annotations

from prefect import task

from eagle3.prepare import PrepareConfig, prepare_data
from eagle3.support.io import fingerprint_paths, sha256_file, sha256_json
from tasks import artifacts
from tasks.common import cache_key, stage_dir


@task(name="prepare-data", cache_key_fn=cache_key, persist_result=True, result_serializer="json")
def prepare_data(cfg: PrepareConfig, inputs: dict, run_dir: str) -> dict:
    """-> manifest: the Arrow dataset + stats.json, their content fingerprint, counts.

    ``inputs`` is describe_inputs' manifest (dataset and verifier fingerprints): it keys the cache.
    """
    out_dir = stage_dir(run_dir, "prepare-data", {"cfg": cfg, "inputs": inputs, "run_dir": run_dir})
    result = prepare_data(PrepareConfig.model_validate(cfg), out_dir)
    stats = result.stats
    stats_sha256 = sha256_file(result.stats_path)
    dataset_fingerprint = fingerprint_paths([result.dataset_path])
    artifacts.table("dataset-stats", [
        {"metric": "samples read", "value": stats["samples_read"]},
        {"metric": "samples kept", "value": stats["samples_kept"]},
        *({"metric": f"skipped: {reason}", "value": v["count"]} for reason, v in stats["skipped"].items()),
        {"metric": "samples truncated", "value": stats["truncated"]},
        {"metric": "total tokens", "value": stats["total_tokens"]},
        {"metric": "assistant tokens (loss mask = 1)", "value": stats["assistant_tokens"]},
        *({"metric": f"length {b['min_tokens']}-{b['max_tokens']} tokens", "value": b["count"]}
          for b in stats.get("length_histogram", [])),
    ], description=f"Prepared dataset from {', '.join(cfg.sources)}")
    return {
        "stage": "prepare-data",
        "out_dir": str(out_dir),
        "dataset_path": result.dataset_path,
        "paths": {"dataset": result.dataset_path, "stats": result.stats_path},
        "fingerprint": sha256_json([stats_sha256, dataset_fingerprint]),
        "samples_read": stats["samples_read"],
        "samples_kept": stats["samples_kept"],
        "samples_skipped": stats["samples_skipped"],
        "skipped_by_reason": {k: v["count"] for k, v in stats["skipped"].items()},
        "total_tokens": stats["total_tokens"],
        "assistant_tokens": stats["assistant_tokens"],
        "max_seq_len": cfg.max_seq_len,
        "elapsed_s": result.elapsed_s,
    }
