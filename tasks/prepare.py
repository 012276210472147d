"""Prefect task for the data stage: conversations -> verifier tokens + assistant loss mask (eagle3.data)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3.data import PrepareConfig, prepare_dataset
from eagle3.io import fingerprint_paths, sha256_file, sha256_json


@task
def prepare_data(cfg: PrepareConfig | dict, out_dir: str) -> dict:
    """-> manifest: paths (dataset folder for capacity/extract/vocab, stats.json), content hashes, counts.

    ``fingerprint`` hashes stats.json + the dataset folder's content: downstream cache keys use it.
    """
    result = prepare_dataset(PrepareConfig.model_validate(cfg), out_dir)
    stats_sha256 = sha256_file(result.stats_path)
    dataset_fingerprint = fingerprint_paths([result.dataset_path])
    stats = result.stats
    return {
        "stage": "data",
        "out_dir": str(Path(out_dir)),
        "dataset_path": result.dataset_path,
        "stats_path": result.stats_path,
        "paths": {"dataset": result.dataset_path, "stats": result.stats_path},
        "stats_sha256": stats_sha256,
        "dataset_fingerprint": dataset_fingerprint,
        "fingerprint": sha256_json([stats_sha256, dataset_fingerprint]),
        "samples_read": stats["samples_read"],
        "samples_kept": stats["samples_kept"],
        "samples_skipped": stats["samples_skipped"],
        "skipped_by_reason": {k: v["count"] for k, v in stats["skipped"].items()},
        "truncated": stats["truncated"],
        "total_tokens": stats["total_tokens"],
        "assistant_tokens": stats["assistant_tokens"],
        "mask_method": stats["mask_method"],
        "chat_template_sha256": stats["chat_template_sha256"],
        "elapsed_s": result.elapsed_s,
    }
