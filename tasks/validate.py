"""Stage 5 task: validate a draft checkpoint (its recorded hash, the vLLM contract, vLLM speculative decoding,
offline parity) and report.

``validate_checkpoint_task`` validates any checkpoint folder; ``validate_draft_task`` is the pipeline's stage (cached
by content, output in ``<run_dir>/validate-draft-<key>``), taking the train stage's artifact.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3.chat.encoder import ChatSettings
from eagle3.chat.sources import DataSources
from eagle3.config import HostConfig
from eagle3.regenerate.stage import RegeneratedData
from eagle3.support.display import NOT_MEASURED, measured, sig
from eagle3.train.stage import DraftCheckpoint
from eagle3.validate.config import ValidateConfig
from eagle3.validate.report import ACCEPTANCE_IMAGE, concurrency_label, speed_spread
from eagle3.validate.stage import ValidationReport, validate_draft
from eagle3.validate.verdict import PER_STEP
from tasks import artifacts
from tasks.common import gpu_guard, stage_dir, stage_task
from tasks.logs import logs_from_all_threads


def acceptance_rows(report: ValidationReport) -> list[dict]:
    """The validation-acceptance table: the verdict's outcome counts and the acceptance figures, in short cells and
    few rows (a table cell does not wrap in the UI, and it shows 10 rows a page). The criteria that were not met are
    named in the table's description; each criterion's requirement and measured value are in the report."""
    counts: dict[str, int] = {}
    for c in report.criteria:
        counts[c.result] = counts.get(c.result, 0) + 1
    outcomes = ", ".join(f"{n} {result}" for result, n in counts.items())
    rows = [{"figure": "verdict", "value": f"{report.verdict.upper()} ({outcomes})" if outcomes else
             report.verdict.upper()}]
    if report.mean_acceptance_length is not None:
        rows += [{"figure": "mean acceptance length (vLLM)", "value": measured(report.mean_acceptance_length,
                                                                               PER_STEP)},
                 {"figure": "mean acceptance length, untrained draft", "value": measured(
                     report.untrained_mean_acceptance_length, PER_STEP)}]
        rows += [{"figure": f"acceptance at position {i + 1} (share of verifier steps)", "value": r}
                 for i, r in enumerate(report.per_position_acceptance or [])]
        speed = (report.report().get("vllm") or {}).get("speed") or {}
        levels = speed.get("levels") or ([speed] if speed else [])
        for lv in levels:
            noisy = " (not reliable: the load changed)" if speed_spread(lv) else ""
            rows.append({"figure": f"decoding speedup, {concurrency_label(lv.get('concurrency', 1))} (not gated)",
                         "value": NOT_MEASURED if lv.get("speedup") is None else f"{sig(lv['speedup'])}x{noisy}"})
        if not levels:
            rows.append({"figure": "decoding speedup (reported, not gated)", "value": NOT_MEASURED})
    return rows


def publish(report: ValidationReport) -> None:
    """The validation's UI artifacts: the acceptance table (``acceptance_rows``) and the report, whose verdict table
    gives each criterion's requirement and measured value (markdown wraps), its chart inline."""
    rows = acceptance_rows(report)
    artifacts.table("validation-acceptance", rows, description=f"EAGLE-3 draft validation: {report.verdict_line()}; "
                    f"each criterion's requirement and measured value: the validation-report artifact")
    md = Path(report.report_md).read_text()
    if report.acceptance_png:
        md = md.replace(ACCEPTANCE_IMAGE, artifacts.image_markdown(report.acceptance_png, "per-position acceptance"))
    if report.vllm_log:
        md += f"\nvLLM's whole output: `{report.vllm_log}`\n"
    artifacts.markdown("validation-report", md, description="EAGLE-3 draft validation report")


@task(name="validate-checkpoint")
def validate_checkpoint_task(cfg: ValidateConfig, draft_dir: str, verifier_path: str, prompts_path: str | None,
                             out_dir: str, host: HostConfig | None = None,
                             chat: ChatSettings | None = None) -> ValidationReport:
    """Any checkpoint folder: structural check -> vLLM check -> offline parity (if enabled) -> report files in
    ``out_dir``. ``prompts_path`` None = ``cfg.prompts_path``; ``chat`` None = the verifier's own tokenizer and
    template (pass the settings the draft's data was prepared with when they override the template)."""
    with logs_from_all_threads():
        report = validate_draft(ValidateConfig.model_validate(cfg), draft_dir, out_dir, verifier=verifier_path,
                                prompts_path=prompts_path, chat=chat, guard=gpu_guard(host))
        publish(report)
    return report


@stage_task(ValidationReport)
def validate_draft_task(cfg: ValidateConfig, checkpoint: DraftCheckpoint, prompts: DataSources, run_dir: str,
                        chat: ChatSettings | None = None, tokenizer: DataSources | None = None,
                        regenerated: RegeneratedData | None = None, host: HostConfig | None = None) -> ValidationReport:
    """The pipeline stage: the train stage's checkpoint against its verifier on the prompts of ``prompts`` (their
    content keys the cache, so edited prompts are re-validated), rendered with the chat settings prepare used
    (``chat``; ``tokenizer`` is their content identity, for the cache key); ``regenerated``: the regeneration
    whose engine session may have generated the verifier-alone baseline (eagle3.validate.baseline)."""
    out_dir = stage_dir(run_dir)
    report = validate_draft(ValidateConfig.model_validate(cfg), checkpoint, out_dir,
                            prompts_path=prompts.sources[0], chat=chat, guard=gpu_guard(host),
                            baselines_dir=regenerated.baselines_dir if regenerated is not None else None)
    publish(report)
    return report
