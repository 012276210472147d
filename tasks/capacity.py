"""Capacity task: size the hidden-state store from config.json + sample lengths (and estimate the time of extraction
and training); refuse before extraction."""

from __future__ import annotations

from eagle3.capacity import CapacityConfig, CapacityPlan, TrainingShape, plan_capacity
from eagle3.extract.config import ExtractConfig
from eagle3.prepare import PreparedData
from eagle3.regenerate.config import RegenerateConfig
from eagle3.support.verifier import VerifierIdentity
from tasks import artifacts
from tasks.common import stage_dir, stage_task


@stage_task("plan-capacity")
def plan_capacity_task(cfg: CapacityConfig, extract: ExtractConfig, verifier: VerifierIdentity,
                       prepared: PreparedData, run_dir: str, regenerate: RegenerateConfig | None = None,
                       training: TrainingShape | None = None) -> CapacityPlan:
    """-> CapacityPlan (the store's resolved layout, bytes, free space, time) + plan.json.

    Raises CapacityError when the store would not fit at ``run_dir`` with the margin (cfg.on_insufficient="fail").
    """
    out_dir = stage_dir(run_dir, "plan-capacity")
    plan = plan_capacity(cfg, extract, verifier, prepared, run_dir, out_dir, regenerate, training)
    artifacts.markdown("capacity-plan", f"# Capacity plan\n\n```\n{plan.summary}\n```\n",
                       description="Hidden-state store size, free space and time estimate")
    return plan
