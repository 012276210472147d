"""Stage 3 task: count assistant tokens, keep the draft vocabulary, write d2t / t2d + coverage report."""

from __future__ import annotations

from prefect import task

from eagle3.support.io import sha256_file
from eagle3.support.verifier import VerifierSpec
from eagle3.vocab import VocabConfig, build_vocab
from tasks import artifacts
from tasks.common import cache_key, stage_dir


@task(name="build-vocab", cache_key_fn=cache_key, persist_result=True, result_serializer="json")
def build_vocab_task(cfg: VocabConfig, inputs: dict, data: dict, run_dir: str) -> dict:
    """-> mapping.safetensors (d2t, t2d) + report.json, coverage of assistant-token occurrences."""
    out_dir = stage_dir(run_dir, "build-vocab", {"cfg": cfg, "inputs": inputs, "data": data, "run_dir": run_dir})
    target_vocab = VerifierSpec.from_path(inputs["verifier_path"]).vocab_size
    r = build_vocab(VocabConfig.model_validate(cfg), data["dataset_path"], target_vocab, out_dir)
    artifacts.table("vocab-coverage", [
        {"metric": "draft vocab size (tokens)", "value": r["draft_vocab_size"]},
        {"metric": "target vocab size (tokens)", "value": r["target_vocab_size"]},
        {"metric": "distinct assistant tokens seen", "value": r["distinct_tokens_seen"]},
        {"metric": "assistant-token occurrences", "value": r["assistant_token_occurrences"]},
        {"metric": "coverage of occurrences", "value": round(r["coverage"], 6)},
    ], description="Draft vocabulary coverage")
    return {"stage": "build-vocab", "out_dir": str(out_dir),
            "paths": {"mapping": r["mapping_path"], "report": r["report_path"]},
            "mapping_path": r["mapping_path"], "fingerprint": sha256_file(r["mapping_path"]),
            "coverage": r["coverage"], "distinct_tokens_seen": r["distinct_tokens_seen"],
            "draft_vocab_size": r["draft_vocab_size"], "target_vocab_size": r["target_vocab_size"]}
