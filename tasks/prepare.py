"""Stage 1 task: conversations -> verifier tokens + assistant loss mask (eagle3.prepare)."""

from __future__ import annotations

from eagle3.chat.sources import DataSources
from eagle3.prepare import PrepareConfig, PreparedData, prepare_data
from tasks import artifacts
from tasks.common import stage_dir, stage_task


@stage_task(PreparedData)
def prepare_data_task(cfg: PrepareConfig, sources: DataSources, tokenizer: DataSources,
                      run_dir: str) -> PreparedData:
    """-> PreparedData. ``sources`` and ``tokenizer`` (their content fingerprints) key the cache, not their paths."""
    out_dir = stage_dir(run_dir)
    prepared = prepare_data(PrepareConfig.model_validate(cfg), out_dir)
    stats = prepared.stats
    artifacts.table("dataset-stats", [
        {"metric": "rows read", "value": prepared.rows_read},
        {"metric": "samples kept", "value": prepared.samples},
        *({"metric": f"rows skipped: {reason}", "value": n} for reason, n in prepared.rows_skipped_by_reason.items()),
        {"metric": "samples truncated", "value": prepared.samples_truncated},
        {"metric": "total tokens", "value": prepared.total_tokens},
        {"metric": "assistant tokens (loss mask = 1)", "value": prepared.assistant_tokens},
        *({"metric": f"length {b['min_tokens']}-{b['max_tokens']} tokens", "value": b["count"]}
          for b in stats.get("length_histogram", [])),
    ], description=f"Prepared dataset from {', '.join(cfg.sources)}")
    return prepared
