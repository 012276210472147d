"""Stage 4 task: train the EAGLE-3 draft on the hidden-state store (eagle3.train) -> vLLM-ready checkpoints.

The output folder is keyed by what changes the trained weights (settings, store, vocab), not by logging, process
count or accumulation split (eagle3.support.settings flags them), so a rerun after a crash or an OOM resumes from
``latest/``. An OOM retry doubles ``grad_accum_steps`` (half the micro-batch, the same global batch: the same
run, resumed).

With ``train.nodes > 1`` the stage places one flow run per node on its host's work queue (tasks/nodes.py, the
``placement`` setting) instead of training here; the folder, the key and the artifact are the same as on one host,
so one host and several hosts resume each other's runs. ``train_node_task`` is one node's part (flow
``eagle3-train-node``).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3.config import HostConfig, NodePlacement
from eagle3.extract.stage import HiddenStates
from eagle3.train.config import TrainConfig
from eagle3.train.stage import DraftCheckpoint, train_draft
from eagle3.vocab import VocabMapping
from tasks import artifacts
from tasks.common import attempt_batch_scale, gpu_guard, stage_dir, stage_task
from tasks.logs import logs_from_all_threads
from tasks.nodes import train_on_nodes


@stage_task(DraftCheckpoint, oom_retries=2)
def train_draft_task(cfg: TrainConfig, store: HiddenStates, vocab: VocabMapping, run_dir: str,
                     host: HostConfig | None = None, placement: NodePlacement | None = None) -> DraftCheckpoint:
    """-> DraftCheckpoint: the best epoch's checkpoint + the sha256 of its weights, metrics and curves."""
    cfg = TrainConfig.model_validate(cfg)
    out_dir = stage_dir(run_dir)
    cfg = cfg.with_smaller_micro_batches(attempt_batch_scale())  # an OOM retry: same run, smaller micro-batches
    if cfg.nodes > 1:
        r = train_on_nodes(cfg, store, vocab, out_dir, NodePlacement.model_validate(placement or {}), host)
    else:
        progress = artifacts.ProgressArtifact("train-progress", "draft training")
        r = train_draft(cfg, store, vocab, out_dir, guard=gpu_guard(host), on_progress=progress)
    final, untrained = r.final_val or {}, r.untrained_val or {}
    artifacts.table("train-summary", [
        {"metric": "validation simulated acceptance length, untrained (tokens)",
         "value": untrained.get("sim_accept_len")},
        {"metric": "validation simulated acceptance length, final (tokens)", "value": final.get("sim_accept_len")},
        {"metric": "validation chain acceptance length, final (tokens)", "value": final.get("chain_accept_len")},
        *({"metric": f"validation accuracy, TTT step {k} (share of tokens)", "value": a}
          for k, a in enumerate(final.get("acc_per_step", []))),
        {"metric": "best epoch", "value": r.best_epoch},
        {"metric": "optimizer steps", "value": r.global_step},
        {"metric": "tokens seen", "value": r.tokens_seen},
        {"metric": "packing efficiency (real tokens / slots)", "value": r.packing_efficiency},
    ], description=f"Draft training in {out_dir}")
    if r.plots:
        artifacts.markdown("train-curves", "\n\n".join(artifacts.image_markdown(p, Path(p).stem) for p in r.plots),
                           description="Training loss / accuracy / acceptance curves")
    return r


@task(name="train-node")
def train_node_task(cfg: TrainConfig, store: HiddenStates, vocab: VocabMapping, out_dir: str, node_rank: int,
                    host: HostConfig | None = None, address: str | None = None) -> dict:
    """One node of a multi-node training, on this host: its inputs checked, its GPU guard held, the elastic launcher
    run with its node rank. Never cached (the train stage that started it is). -> what this node did."""
    with logs_from_all_threads():  # the rank-0 log follower thread's lines too
        r = train_draft(cfg, store, vocab, out_dir, guard=gpu_guard(host), node_rank=node_rank, local_addr=address)
    return {"node_rank": node_rank, "out_dir": out_dir, "checkpoint_dir": r.checkpoint_dir if r else None,
            "global_step": r.global_step if r else None}
