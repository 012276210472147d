"""Capacity task: size the hidden-state store from config.json + sample lengths (and estimate the time of extraction
and training); refuse before extraction."""

from __future__ import annotations

from eagle3.capacity import CapacityConfig, CapacityPlan, TrainingShape, plan_capacity
from eagle3.extract.config import ExtractConfig
from eagle3.prepare import PreparedData
from eagle3.regenerate.config import RegenerateConfig
from eagle3.support.display import size
from eagle3.support.progress import fmt_duration
from eagle3.support.verifier import VerifierIdentity
from eagle3.validate.config import ValidateConfig
from tasks import artifacts
from tasks.common import stage_dir, stage_task


@stage_task(CapacityPlan)
def plan_capacity_task(cfg: CapacityConfig, extract: ExtractConfig, verifier: VerifierIdentity,
                       prepared: PreparedData, run_dir: str, regenerate: RegenerateConfig | None = None,
                       training: TrainingShape | None = None, validate: ValidateConfig | None = None) -> CapacityPlan:
    """-> CapacityPlan (the store's resolved layout, bytes, free space, time) + plan.json.

    Raises CapacityError when the store would not fit at ``run_dir`` with the margin (cfg.on_insufficient="fail"),
    when vLLM here cannot serve the ``draft`` kind beside the verifier, or when the draft could not start from the
    verifier layer ``training.init_from_layer`` names (checked from config.json, weight names and header shapes).
    """
    out_dir = stage_dir(run_dir)
    plan = plan_capacity(cfg, extract, verifier, prepared, run_dir, out_dir, regenerate, training, validate)
    artifacts.markdown("capacity-plan", plan_markdown(plan),
                       description="Hidden-state store size, free space and time estimate")
    return plan


def plan_markdown(plan: CapacityPlan) -> str:
    """The plan for the UI: the verdict and its figures first, then each line of the plan as a list item (prose
    wraps at the UI's width; a code block would cut its long lines off)."""
    verdict = {True: "fits", False: "DOES NOT FIT", None: "free space unknown"}[plan.fits]
    first, *rest = plan.summary.splitlines()
    return "\n".join([
        f"# Capacity plan: {verdict}", "",
        (f"**The hidden-state store needs {size(plan.required_free_bytes)} with the margin; "
         f"{size(plan.free_bytes)} free. Estimated time: {fmt_duration(plan.estimated_seconds)} (h:mm:ss).**"), "",
        first, "", *(f"- {line.strip()}" for line in rest), ""])
