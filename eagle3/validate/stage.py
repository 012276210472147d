"""Checkpoint validation: the vLLM contract on files, real vLLM speculative decoding, an offline parity check.

Pipeline position: train -> checkpoint -> **validate** -> serve.

1. ``validate_checkpoint(draft_dir, verifier_path)`` reads config.json and the safetensors HEADER (then each float
   tensor once, for NaN/Inf) and checks them against the verifier and ../shared/EAGLE3_FACTS.md. Every failure is
   one ``Finding`` with a stable ``code`` and a message that names the field or tensor; the report lists them all.
2. ``run_vllm_check`` runs ``eagle3.validate.vllm_check`` in the vLLM interpreter (its own process group, killed on timeout or
   cancellation, see eagle3.support.subproc): vLLM loads the verifier with the draft as its EAGLE-3 speculator, greedy-
   generates on held-out chat prompts, reports acceptance from ``llm.get_metrics()``, and generates again without
   speculation: the token ids must be identical (temperature 0 is lossless).
3. ``eagle3.validate.specdec.offline_acceptance`` (optional, ``offline_reference``) computes the same figures with a
   transformers verifier and our draft; they must agree with vLLM's within ``parity_tolerance``.
4. ``eagle3.validate.verdict.judge`` decides: every criterion with its requirement and the value measured.
5. ``write_report`` writes report.json, report.md (markdown tables) and acceptance.png (per-position acceptance).

``validate_draft`` runs 1 -> 5; ``tasks/validate.py`` wraps it for Prefect.
Layer ids are in vLLM's convention everywhere: id k = residual stream ENTERING decoder layer k = HF hidden_states[k].
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from eagle3.chat.encoder import ChatSettings
from eagle3.draft.checkpoint import WEIGHTS, check_weights
from eagle3.engine.job import engine_core_in_process, run_engine_job
from eagle3.support.artifacts import Artifact, file_problem
from eagle3.support.gpu import DeviceGuard, cuda_device_ids, file_lock_guard
from eagle3.support.io import sha256_file
from eagle3.support.paths import resolve_path, vllm_python
from eagle3.support.subproc import SubprocessFailed
from eagle3.train.stage import DraftCheckpoint
from eagle3.validate.baseline import find_baseline, request_for_validation
from eagle3.validate.config import ValidateConfig
from eagle3.validate.contract import validate_checkpoint
from eagle3.validate.report import verdict_line, write_report
from eagle3.validate.verdict import Criterion, judge

log = logging.getLogger("eagle3")

VLLM_LOG = "vllm.log"  # everything vLLM printed, in <out_dir>/vllm/ (the logs carry its errors and our own lines)

# ----------------------------------------------------------------------------- 2. vLLM check


def run_vllm_check(cfg: ValidateConfig, verifier_path: str | os.PathLike, draft_dirs: list[str | os.PathLike],
                   prompts: list[list[int]], work_dir: str | os.PathLike,
                   lock_fds: tuple[int, ...] | list[int] = (), baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run eagle3.validate.vllm_check in the vLLM interpreter for each draft (one subprocess, one baseline run) on
    the prompts' token ids (``prompts``: rendered by the pipeline's chat encoder, ``ChatSettings.held_out_prompt_ids``).

    Returns its result (see eagle3.validate.vllm_check.run_check). Raises ``eagle3.support.subproc.SubprocessFailed`` when the
    subprocess fails or times out (its process group is killed), FileNotFoundError when there is no vLLM interpreter.
    """
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / "vllm_result.json"
    out.unlink(missing_ok=True)
    args = {
        "verifier": str(Path(verifier_path).resolve()), "drafts": [str(Path(d).resolve()) for d in draft_dirs],
        "prompt_token_ids": prompts, "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens, "num_speculative_tokens": cfg.num_speculative_tokens,
        "dtype": cfg.dtype, "max_model_len": cfg.max_model_len, "seed": 0, "speed_repeats": cfg.speed_repeats,
        "speed_concurrency": cfg.speed_concurrency, "out": str(out),
        # engine starts: the trained draft's and the verifier-alone sessions in order (eagle3.validate.config), then
        # one per other draft
        "schedule": cfg.engine_sessions(baseline_shared=baseline is not None).rstrip("U"),
        "baseline": baseline,  # the verifier alone, from regeneration's engine session (no engine start for it here)
    }
    run_engine_job(cfg.engine, "eagle3.validate.vllm_check", args, work_dir / "vllm_args.json",
                   log_file=work_dir / VLLM_LOG, lock_fds=lock_fds,
                   in_process=engine_core_in_process(cfg.engine_in_process, verifier_path)).check()
    if not out.is_file():
        raise SubprocessFailed(f"the vLLM check exited cleanly but wrote no result ({out}); its whole output is in "
                               f"{work_dir / VLLM_LOG}")
    return json.loads(out.read_text())


def make_untrained_draft(draft_dir: str | os.PathLike, verifier_path: str | os.PathLike,
                         out: str | os.PathLike, seed: int = 0) -> Path:
    """The draft before training: ``draft_dir``'s config and d2t/t2d, ``Eagle3Draft.from_verifier`` init (the
    trainer's step 0: verifier embedding, lm_head rows and final norm, a random layer seeded by the trained run's
    seed, or the verifier layer its ``init_from_layer`` names; ``seed`` where the run does not say), saved as a
    checkpoint."""
    from safetensors.torch import load_file

    from eagle3.draft.checkpoint import RUN_INFO, CheckpointError, read_config, read_run_info, save_draft
    from eagle3.draft.model import Eagle3Draft

    cfg = read_config(draft_dir)
    tables = load_file(str(Path(draft_dir) / WEIGHTS))
    run_config = read_run_info(draft_dir).get("run_config", {})
    try:
        init_layer = run_config.get("init_from_layer")
        init_layer = None if init_layer is None else int(init_layer)
        seed = int(run_config.get("seed", seed))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{Path(draft_dir) / RUN_INFO}: unreadable run_config (seed / init_from_layer: "
                              f"{e})") from None
    draft = Eagle3Draft.from_verifier(cfg, verifier_path, tables["d2t"], tables["t2d"], seed=seed,
                                      init_layer=init_layer)
    return save_draft(out, cfg, draft.state_dict(), {"verifier": str(verifier_path), "untrained": True,
                                                      "trained_from": str(draft_dir), "seed": seed,
                                                      "init_from_layer": init_layer})


# ----------------------------------------------------------------------------- 3 + 4. verdict and report


def _relative_difference(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else float("inf")


class ValidationReport(Artifact):
    """The validate stage's output: the verdict, its reasons and the figures behind it (report.json has all)."""

    stage: ClassVar[str] = "validate-draft"

    report_json: str = Field(description="report.json: every check and figure.")
    report_md: str = Field(description="report.md: the same as markdown tables.")
    acceptance_png: str | None = Field(description="Per-position acceptance chart (when vLLM measured it).")
    vllm_log: str | None = Field(description="vLLM's whole output (when vLLM ran).")
    checkpoint_dir: str = Field(description="The draft checkpoint validated.")
    weights_sha256: str | None = Field(description="sha256 of its model.safetensors, as validated.")
    verdict: Literal["pass", "fail"] = Field(description="'pass' when no reason was found to fail.")
    reasons: list[str] = Field(description="Why it failed, one line each with a [code].")
    criteria: list[Criterion] = Field(default_factory=list, description="Every criterion of the verdict: what it "
                                      "requires, the value measured and whether it was met (eagle3.validate.verdict).")
    structural_ok: bool = Field(description="The checkpoint passed the vLLM contract check.")
    failure_codes: list[str] = Field(description="Codes of the contract check's failures.")
    lossless: bool | None = Field(description="Speculative output identical to plain greedy (None: not run).")
    mean_acceptance_length: float | None = Field(description="vLLM: 1 + accepted / drafts, tokens per verifier "
                                                 "step, pooled over all steps.")
    per_position_acceptance: list[float] | None = Field(description="vLLM: share of steps whose draft token i was "
                                                        "accepted.")
    untrained_mean_acceptance_length: float | None = Field(description="The same for the untrained draft.")
    offline_mean_acceptance_length: float | None = Field(description="The offline reference loop's figure.")
    offline_relative_difference: float | None = Field(description="|offline - vLLM| / vLLM.")
    decode_speedup: float | None = Field(description="vLLM output tokens/s with the draft / without at the first "
                                         "speed_concurrency level (1: one request at a time), medians of the timed "
                                         "decodes; reported, not gated.")

    def outputs(self) -> list[str]:
        return [self.report_json, self.report_md]

    def problems(self) -> list[str]:
        """Reuse check: report.json's sha256 is the fingerprint (a few KB)."""
        return super().problems() or [p for p in [file_problem(self.report_json, sha256=self.fingerprint)] if p]

    def report(self) -> dict[str, Any]:
        """The content of report.json."""
        return json.loads(Path(self.report_json).read_text())

    def verdict_line(self) -> str:
        """The verdict in one sentence (which criteria were met, not met, only reported, not checked)."""
        return verdict_line({"verdict": self.verdict, "reasons": self.reasons,
                             "criteria": [c.model_dump() for c in self.criteria] if self.criteria else None})


def validate_draft(cfg: ValidateConfig, checkpoint: DraftCheckpoint | str | os.PathLike, out_dir: str | os.PathLike,
                   *, verifier: str | os.PathLike | None = None, prompts_path: str | os.PathLike | None = None,
                   chat: ChatSettings | None = None, guard: DeviceGuard | None = None,
                   baselines_dir: str | os.PathLike | None = None) -> ValidationReport:
    """The validate stage: integrity -> structural check -> vLLM check -> offline parity (if enabled) -> verdict ->
    report files in ``out_dir``.

    ``checkpoint``: the train stage's artifact (its recorded weights hash is compared first) or a checkpoint
    folder (then ``verifier`` is required); ``prompts_path`` defaults to ``cfg.prompts_path``; ``chat`` renders them
    (the pipeline's chat settings; default: the verifier's own tokenizer and template); ``guard`` holds the devices
    while vLLM runs (default: the host file lock alone); ``baselines_dir``: where the regeneration's engine session
    left verifier-alone baselines (eagle3.validate.baseline): the one for these prompts and settings, when there,
    replaces the baseline engine start.
    """
    out_dir = Path(out_dir)
    if isinstance(checkpoint, DraftCheckpoint):
        if checkpoint.checkpoint_dir is None:
            raise ValueError(f"the train stage produced no checkpoint to validate (stopped_early="
                             f"{checkpoint.stopped_early}, out_dir={checkpoint.out_dir})")
        draft_dir, recorded_sha = Path(checkpoint.checkpoint_dir), checkpoint.weights_sha256
        verifier_path = verifier or checkpoint.verifier.path
    else:
        if verifier is None:
            raise ValueError("validate_draft: pass the verifier path with a plain checkpoint folder")
        draft_dir, recorded_sha, verifier_path = Path(checkpoint), None, verifier
    prompts_path = Path(resolve_path(prompts_path or cfg.prompts_path))
    chat = chat or ChatSettings(tokenizer_path=str(verifier_path), trust_remote_code=cfg.engine.trust_remote_code)
    report: dict[str, Any] = {"format": "eagle3-validation/1", "draft_dir": str(draft_dir),
                              "verifier_path": str(verifier_path), "prompts_path": str(prompts_path),
                              "settings": cfg.model_dump(mode="json")}
    weights = check_weights(draft_dir, recorded_sha)
    if weights.sha256 is not None:
        report["weights_sha256"] = weights.sha256
    trusted = weights.problem is None
    if not trusted:
        log.error("[validate] %s", weights.problem)
    structural = validate_checkpoint(draft_dir, verifier_path)
    report["structural"] = structural.to_dict()
    for f in structural.warnings:
        log.warning("[validate] %s: %s", f.code, f.message)

    vllm_acc = None
    if not cfg.run_vllm:
        report["vllm"] = {"skipped": "run_vllm is false"}
    elif not trusted:
        report["vllm"] = {"skipped": "the checkpoint's weights are not the ones trained"}
    elif not structural.ok:
        report["vllm"] = {"skipped": "the checkpoint failed the structural check"}
    else:
        # bad settings are errors, not verdicts: no vLLM interpreter, an unusable prompts file
        vllm_python(cfg.engine.vllm_python)
        prompts = chat.held_out_prompt_ids(prompts_path, cfg.num_prompts)
        drafts = [draft_dir]
        if cfg.compare_untrained:
            drafts.append(make_untrained_draft(draft_dir, verifier_path, out_dir / "untrained-draft"))
        try:
            with (guard or file_lock_guard(logger=log))(cuda_device_ids(count=cfg.engine.tensor_parallel_size)) as fds:
                result = run_vllm_check(cfg, verifier_path, drafts, prompts, out_dir / "vllm", lock_fds=fds,
                                        baseline=find_baseline(baselines_dir,
                                                               request_for_validation(cfg, prompts, verifier_path)))
        except SubprocessFailed as e:  # a draft vLLM cannot load (or run in time) is a verdict, not a crash
            report["vllm"] = {"error": str(e)}
        else:
            d = result["drafts"][0]
            vllm_acc = d["acceptance"]
            report["vllm"] = {
                "vllm_version": result["vllm_version"], "acceptance": vllm_acc, "lossless": d["lossless"],
                "mismatches": d["mismatches"], "engine_start_seconds": d["engine_start_seconds"],
                "generate_seconds": d["generate_seconds"], "generated_tokens": d["generated_tokens"],
                "baseline_generate_seconds": result["baseline"]["generate_seconds"],
                "num_prompts": len(result["prompt_token_ids"]), "samples": [
                    {"prompt": i, "text": t[:300]} for i, t in enumerate(d["texts"][:3])],
                "engine_starts": result["engine_starts"], "baseline_source": result.get("baseline_source"),
                "speed": {"repeats": cfg.speed_repeats, **result["speed"]} if result.get("speed") else None,
            }
            if cfg.compare_untrained:
                u = result["drafts"][1]
                report["vllm"]["untrained"] = {"draft_dir": str(drafts[1]), "acceptance": u["acceptance"],
                                               "lossless": u["lossless"]}
                gain = vllm_acc["mean_acceptance_length"] - u["acceptance"]["mean_acceptance_length"]
                report["vllm"]["gain_over_untrained"] = gain

    if cfg.offline_reference and structural.ok and trusted:
        from eagle3.validate.specdec import offline_acceptance

        log.info("[validate] offline reference: transformers verifier + this draft on %d prompts", cfg.num_prompts)
        off = offline_acceptance(verifier_path, draft_dir, chat.held_out_prompt_ids(prompts_path, cfg.num_prompts),
                                 cfg.num_speculative_tokens, cfg.max_new_tokens, cfg.engine.trust_remote_code)
        report["offline"] = {"acceptance": off.acceptance.to_dict(), "seconds": off.seconds}
        if vllm_acc is not None:
            rel = _relative_difference(off.acceptance.mean_acceptance_length, vllm_acc["mean_acceptance_length"])
            report["offline"]["relative_difference"] = rel

    criteria, reasons = judge(report, cfg, str(weights), recorded_sha)
    report["verdict"] = "fail" if reasons else "pass"
    report["reasons"] = reasons
    report["criteria"] = [c.model_dump() for c in criteria]
    paths = report["paths"] = write_report(out_dir, report)
    log.info("[validate] %s", verdict_line(report))
    for c in criteria:
        log.info("[validate]   %s | %s: %s | required: %s", c.result, c.name, c.measured, c.required)
    for r in reasons:
        log.info("[validate]   reason: %s", r)
    vllm = report.get("vllm") or {}
    acc, untrained = vllm.get("acceptance") or {}, (vllm.get("untrained") or {}).get("acceptance") or {}
    offline = report.get("offline") or {}
    artifact = ValidationReport(
        out_dir=str(out_dir), fingerprint=sha256_file(paths["report_json"]), report_json=paths["report_json"],
        report_md=paths["report_md"], acceptance_png=paths.get("acceptance_png"),
        vllm_log=str(out_dir / "vllm" / VLLM_LOG) if (out_dir / "vllm" / VLLM_LOG).is_file() else None,
        checkpoint_dir=str(draft_dir),
        weights_sha256=report.get("weights_sha256"), verdict=report["verdict"], reasons=reasons, criteria=criteria,
        structural_ok=structural.ok, failure_codes=structural.codes, lossless=vllm.get("lossless"),
        mean_acceptance_length=acc.get("mean_acceptance_length"),
        per_position_acceptance=acc.get("per_position_acceptance"),
        untrained_mean_acceptance_length=untrained.get("mean_acceptance_length"),
        offline_mean_acceptance_length=(offline.get("acceptance") or {}).get("mean_acceptance_length"),
        offline_relative_difference=offline.get("relative_difference"),
        decode_speedup=(vllm.get("speed") or {}).get("speedup"))
    artifact.save()
    return artifact
