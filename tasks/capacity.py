"""Capacity task: size the hidden-state store from config.json + sample lengths; refuse before extraction."""

from __future__ import annotations

from prefect import task

from eagle3.capacity import CapacityConfig, plan_capacity
from eagle3.extract.config import ExtractConfig
from eagle3.support.io import sha256_file
from eagle3.support.verifier import VerifierSpec
from tasks import artifacts
from tasks.common import cache_key, stage_dir


@task(name="plan-capacity", cache_key_fn=cache_key, persist_result=True, result_serializer="json")
def plan_capacity_task(cfg: CapacityConfig, extract: ExtractConfig, inputs: dict, data: dict, run_dir: str) -> dict:
    """-> the plan (bytes per token, exact and worst-case store bytes, free space, time) + plan.json.

    Raises CapacityError when the store would not fit at ``run_dir`` with the margin (cfg.on_insufficient="fail").
    """
    out_dir = stage_dir(run_dir, "plan-capacity",
                        {"cfg": cfg, "extract": extract, "inputs": inputs, "data": data, "run_dir": run_dir})
    aux = VerifierSpec.from_path(extract.verifier).resolve_aux_layer_ids(extract.aux_layer_ids)
    plan = plan_capacity(extract.verifier, aux, data["dataset_path"], run_dir, cfg, max_seq_len=data["max_seq_len"])
    path = plan.save_plan(out_dir)
    summary = plan.summary()
    artifacts.markdown("capacity-plan", f"# Capacity plan\n\n```\n{summary}\n```\n",
                       description="Hidden-state store size, free space and time estimate")
    return {"stage": "plan-capacity", "out_dir": str(out_dir), "paths": {"plan": str(path)},
            "fingerprint": sha256_file(path), "summary": summary, **plan.model_dump(mode="json")}
