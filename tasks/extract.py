"""Stage 2 task: the verifier's hidden states for every prepared sample -> the hidden-state store (eagle3.extract).

The store folder is keyed by what changes the stored states (verifier, aux layers, dtypes, backend, data), not by
batching, locking, logging or the shard range (eagle3.support.settings flags them): extraction shards of one
dataset (one flow run per GPU host) fill one store, and a rerun with other batch settings (e.g. the smaller budget
of an OOM retry) resumes into it.
"""

from __future__ import annotations

from eagle3.capacity import CapacityPlan
from eagle3.config import HostConfig
from eagle3.extract.config import ExtractConfig
from eagle3.extract.stage import HiddenStates, extract_hidden_states
from eagle3.prepare import PreparedData
from eagle3.support.display import size
from eagle3.support.verifier import VerifierIdentity
from tasks import artifacts
from tasks.common import attempt_batch_scale, gpu_guard, stage_dir, stage_task


@stage_task(HiddenStates, oom_retries=2)
def extract_hidden_states_task(cfg: ExtractConfig, verifier: VerifierIdentity, prepared: PreparedData,
                               plan: CapacityPlan, run_dir: str, host: HostConfig | None = None) -> HiddenStates:
    """-> HiddenStates. ``plan`` (the capacity plan) only keys the cache.

    An OOM retry of this task (after the in-job halvings were not enough) starts at half the token budget and
    resumes from the store's manifest.
    """
    cfg = ExtractConfig.model_validate(cfg)
    out_dir = stage_dir(run_dir)
    cfg = cfg.with_smaller_batches(attempt_batch_scale())  # an OOM retry resumes at half the token budget
    progress = artifacts.ProgressArtifact("extract-progress", "hidden-state extraction")
    r = extract_hidden_states(cfg, prepared, out_dir / "store", verifier=verifier, guard=gpu_guard(host),
                              on_progress=progress)
    artifacts.table("extract-summary", [
        {"metric": "samples written (this run)", "value": r.samples_written},
        {"metric": "samples resumed (already stored)", "value": r.samples_resumed},
        {"metric": "samples skipped (do not fit in memory)", "value": r.samples_unfittable_count},
        {"metric": "tokens written (this run)", "value": r.tokens_written},
        {"metric": "store samples / tokens", "value": f"{r.samples_stored:,} / {r.store_tokens:,}"},
        {"metric": "store size on disk", "value": size(r.bytes_on_disk)},
        {"metric": "tokens per second", "value": r.tokens_per_second},
        {"metric": "token budget history (padded tokens per batch)", "value": str(r.token_budget_history)},
    ], description=f"Hidden states of shard {r.shard} into {r.store_path}"
       + "".join(f"; vLLM's whole output: {path}" for path in r.vllm_logs))
    return r
