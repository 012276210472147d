"""Stage 5 task: validate a draft checkpoint (contract on files, vLLM speculative decoding, offline parity) and report.

``validate_checkpoint_task`` validates any checkpoint folder; ``validate_draft_task`` is the pipeline's stage (cached
by content, output in ``<run_dir>/validate-draft-<key>``), taking the train stage's manifest.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3.support.io import sha256_file, sha256_json
from eagle3.validate.stage import ValidateConfig, validate_draft
from tasks import artifacts
from tasks.common import cache_key, stage_dir


def _manifest(report: dict, out_dir: str | Path) -> dict:
    vllm = report.get("vllm") or {}
    acc = vllm.get("acceptance") or {}
    untrained = (vllm.get("untrained") or {}).get("acceptance") or {}
    offline = report.get("offline") or {}
    return {
        "stage": "validate-draft",
        "out_dir": str(out_dir),
        "paths": report["paths"],
        "fingerprint": sha256_file(report["paths"]["report_json"]),
        "verdict": report["verdict"],
        "reasons": report["reasons"],
        "structural_ok": report["structural"]["ok"],
        "failure_codes": [f["code"] for f in report["structural"]["failures"]],
        "weights_sha256": report.get("weights_sha256"),
        "lossless": vllm.get("lossless"),
        "mean_acceptance_length": acc.get("mean_acceptance_length"),
        "per_position_acceptance": acc.get("per_position_acceptance"),
        "untrained_mean_acceptance_length": untrained.get("mean_acceptance_length"),
        "offline_mean_acceptance_length": (offline.get("acceptance") or {}).get("mean_acceptance_length"),
        "offline_relative_difference": offline.get("relative_difference"),
    }


def _publish(report: dict) -> None:
    acc = (report.get("vllm") or {}).get("acceptance")
    rows = [{"figure": "verdict", "value": report["verdict"]}]
    if acc:
        rows += [{"figure": "mean acceptance length (tokens per verifier step)",
                  "value": round(acc["mean_acceptance_length"], 4)}]
        rows += [{"figure": f"acceptance at position {i + 1}", "value": round(r, 4)}
                 for i, r in enumerate(acc["per_position_acceptance"])]
        rows += [{"figure": "lossless", "value": report["vllm"]["lossless"]}]
    rows += [{"figure": "reason", "value": r} for r in report["reasons"]]
    artifacts.table("validation-acceptance", rows, description=f"EAGLE-3 draft validation: {report['verdict']}")
    md = Path(report["paths"]["report_md"]).read_text()
    if "acceptance_png" in report["paths"]:
        md = md.replace("![per-position acceptance](acceptance.png)",
                        artifacts.image_markdown(report["paths"]["acceptance_png"], "per-position acceptance"))
    artifacts.markdown("validation-report", md, description="EAGLE-3 draft validation report")


@task(name="validate-checkpoint")
def validate_checkpoint_task(cfg: ValidateConfig, draft_dir: str, verifier_path: str, prompts_path: str | None,
                             out_dir: str) -> dict:
    """Structural check -> vLLM check -> offline parity (if enabled) -> report.json / report.md / acceptance.png
    in ``out_dir``. ``prompts_path`` None = ``cfg.prompts_path``. -> small manifest with the verdict."""
    report = validate_draft(ValidateConfig.model_validate(cfg), draft_dir, verifier_path, prompts_path, out_dir)
    _publish(report)
    return _manifest(report, out_dir)


@task(name="validate-draft", cache_key_fn=cache_key, persist_result=True, result_serializer="json")
def validate_draft_task(cfg: ValidateConfig, inputs: dict, checkpoint: dict, prompts: dict, run_dir: str) -> dict:
    """The pipeline stage: the train manifest's ``best_dir`` against ``inputs["verifier_path"]`` on the prompts of
    ``describe_file(<prompts path>)`` (its fingerprint keys the cache, so edited prompts are re-validated)."""
    out_dir = stage_dir(run_dir, "validate-draft", {"cfg": cfg, "inputs": inputs, "checkpoint": checkpoint,
                                                    "prompts": prompts, "run_dir": run_dir})
    if not checkpoint.get("best_dir"):
        raise ValueError(f"the train stage produced no checkpoint to validate (stopped_early="
                         f"{checkpoint.get('stopped_early')}, out_dir={checkpoint.get('out_dir')})")
    manifest = validate_checkpoint_task.fn(ValidateConfig.model_validate(cfg), checkpoint["best_dir"],
                                           inputs["verifier_path"], prompts["path"], str(out_dir))
    return {**manifest, "fingerprint": sha256_json([manifest["fingerprint"], checkpoint.get("fingerprint")])}
