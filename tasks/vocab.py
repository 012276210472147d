"""Stage 3 task: count assistant tokens, keep the draft vocabulary, write d2t / t2d + coverage report."""

from __future__ import annotations

from eagle3.prepare import PreparedData
from eagle3.support.display import percent
from eagle3.support.verifier import VerifierIdentity
from eagle3.vocab import VocabConfig, VocabMapping, build_vocab
from tasks import artifacts
from tasks.common import stage_dir, stage_task


@stage_task(VocabMapping)
def build_vocab_task(cfg: VocabConfig, verifier: VerifierIdentity, prepared: PreparedData,
                     run_dir: str) -> VocabMapping:
    """-> VocabMapping: mapping.safetensors (d2t, t2d) + report.json, coverage of assistant-token occurrences."""
    out_dir = stage_dir(run_dir)
    vocab = build_vocab(VocabConfig.model_validate(cfg), prepared, verifier.spec().vocab_size, out_dir)
    artifacts.table("vocab-coverage", [
        {"metric": "draft vocab size (tokens)", "value": vocab.draft_vocab_size},
        {"metric": "target vocab size (tokens)", "value": vocab.target_vocab_size},
        {"metric": "distinct assistant tokens seen", "value": vocab.distinct_tokens_seen},
        {"metric": "assistant-token occurrences", "value": vocab.assistant_token_occurrences},
        {"metric": "coverage of assistant-token occurrences", "value": percent(vocab.coverage)},
    ], description="Draft vocabulary coverage")
    return vocab
