"""Stage 4 task: train the EAGLE-3 draft on the hidden-state store (eagle3.train.trainer) -> vLLM-ready checkpoints.

The output folder is keyed by what changes the trained weights (settings, store, vocab, verifier), not by logging,
process count or accumulation split, so a rerun after a crash or an OOM resumes from ``latest/``. An OOM retry
doubles ``grad_accum_steps`` (half the micro-batch, the same global batch: the same run, resumed).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3.config import HostConfig
from eagle3.support.io import sha256_file, sha256_json
from eagle3.train.trainer import RESUME_FREE, TrainConfig, train_draft
from tasks import artifacts
from tasks.common import attempt_batch_scale, cache_key, gpu_slots, retry_on_oom_only, stage_dir


@task(name="train-draft", cache_key_fn=cache_key, persist_result=True, result_serializer="json",
      retries=2, retry_condition_fn=retry_on_oom_only)
def train_draft_task(cfg: TrainConfig, inputs: dict, store: dict, vocab: dict, run_dir: str,
                     host: HostConfig | None = None) -> dict:
    """-> manifest: epoch checkpoints, ``best_dir`` (best validation simulated acceptance) + sha256 of its
    model.safetensors, validation metrics before / after training, metrics.jsonl and the PNG curves."""
    cfg = TrainConfig.model_validate(cfg)
    out_dir = stage_dir(run_dir, "train-draft", {"cfg": cfg, "inputs": inputs, "store": store, "vocab": vocab,
                                                 "run_dir": run_dir}, tuple(RESUME_FREE))
    scale = attempt_batch_scale()
    per_step = cfg.batch_size // cfg.nproc  # packed sequences per process per optimizer step
    accum = cfg.grad_accum_steps
    while accum < cfg.grad_accum_steps / scale and per_step % (accum * 2) == 0:  # keep it a divisor of per_step
        accum *= 2
    cfg = cfg.model_copy(update={"grad_accum_steps": accum})
    host = HostConfig.model_validate(host or {})
    progress = artifacts.ProgressArtifact("train-progress", "draft training")
    gpus = host.training_gpus if cfg.device != "cpu" else 0
    with gpu_slots(host.gpu_concurrency_limit, gpus, host.strict):
        r = train_draft(cfg, store["store_path"], vocab["mapping_path"], inputs["verifier_path"], out_dir,
                        resume=True, on_progress=progress)
    final, untrained = r["final_val"] or {}, r["untrained_val"] or {}
    artifacts.table("train-summary", [
        {"metric": "validation simulated acceptance length, untrained (tokens)",
         "value": untrained.get("sim_accept_len")},
        {"metric": "validation simulated acceptance length, final (tokens)", "value": final.get("sim_accept_len")},
        {"metric": "validation chain acceptance length, final (tokens)", "value": final.get("chain_accept_len")},
        *({"metric": f"validation accuracy, TTT step {k}", "value": round(a, 4)}
          for k, a in enumerate(final.get("acc_per_step", []))),
        {"metric": "best epoch", "value": r["best_epoch"]},
        {"metric": "optimizer steps", "value": r["global_step"]},
        {"metric": "tokens seen", "value": r["tokens_seen"]},
        {"metric": "packing efficiency (real tokens / slots)", "value": round(r["packing_efficiency"], 4)},
    ], description=f"Draft training in {out_dir}")
    if r["plots"]:
        artifacts.markdown("train-curves", "\n\n".join(artifacts.image_markdown(p, Path(p).stem) for p in r["plots"]),
                           description="Training loss / accuracy / acceptance curves")
    config_sha = sha256_file(Path(r["best"]) / "config.json") if r["best"] else None
    return {
        "stage": "train-draft",
        "out_dir": str(out_dir),
        "paths": {"best": r["best"], "metrics": r["metrics_path"], "latest": r["latest_state"]}
        if r["best"] else {"metrics": r["metrics_path"], "latest": r["latest_state"]},
        "best_dir": r["best"],
        "best_epoch": r["best_epoch"],
        "best_sha256": r["best_sha256"],
        "fingerprint": sha256_json([r["best_sha256"], config_sha]),
        "checkpoints": r["checkpoints"],
        "plots": r["plots"],
        "final_metrics": {k: final.get(k) for k in ("loss", "sim_accept_len", "chain_accept_len", "acc_per_step",
                                                     "cond_acc_per_step")},
        "untrained_sim_accept_len": untrained.get("sim_accept_len"),
        "epochs_done": r["epochs_done"],
        "global_step": r["global_step"],
        "tokens_seen": r["tokens_seen"],
        "packing_efficiency": r["packing_efficiency"],
        "stopped_early": r["stopped_early"],
        "wall_s": r.get("wall_s"),
    }
