"""Prefect task for the capacity stage: size the hidden-state store and refuse before extraction if it won't fit."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3.capacity import CapacityConfig, plan_capacity


@task
def plan_capacity_task(
    cfg: CapacityConfig,
    verifier_path: str | Path,
    aux_layer_ids: list[int],
    dataset_dir: str | Path,
    dest: str,
    max_seq_len: int,
    out_dir: str | Path,
) -> dict:
    """aux_layer_ids in vLLM's convention; ``dest`` = where the store will be written; ``max_seq_len`` in tokens.

    -> the plan as a dict plus ``plan_path`` (``<out_dir>/plan.json``). Raises CapacityError when it does not fit
    and ``cfg.on_insufficient == "fail"``.
    """
    cfg = CapacityConfig.model_validate(cfg)
    plan = plan_capacity(verifier_path, aux_layer_ids, Path(dataset_dir), dest, cfg, max_seq_len=max_seq_len)
    return {**plan.model_dump(mode="json"), "plan_path": str(plan.save_plan(out_dir))}
