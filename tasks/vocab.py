"""Prefect task for the vocab stage: count assistant tokens, keep the draft vocabulary, write d2t / t2d."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3.io import sha256_file
from eagle3.verifier import VerifierSpec
from eagle3.vocab import VocabConfig, build_vocab


@task
def build_vocab_mapping_task(
    cfg: VocabConfig, dataset_dir: str | Path, verifier_path: str | Path, out_dir: str | Path
) -> dict:
    """-> {mapping_path, report_path, mapping_sha256, coverage, distinct_tokens_seen, draft/target vocab sizes}."""
    cfg = VocabConfig.model_validate(cfg)
    result = build_vocab(cfg, dataset_dir, VerifierSpec.from_path(verifier_path).vocab_size, out_dir)
    return {
        "mapping_path": result["mapping_path"],
        "report_path": result["report_path"],
        "mapping_sha256": sha256_file(result["mapping_path"]),
        "coverage": result["coverage"],
        "distinct_tokens_seen": result["distinct_tokens_seen"],
        "assistant_token_occurrences": result["assistant_token_occurrences"],
        "draft_vocab_size": result["draft_vocab_size"],
        "target_vocab_size": result["target_vocab_size"],
    }
