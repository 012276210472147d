"""The validation verdict: every criterion, what it requires and what was measured, decided in one place.

``judge(report, cfg, recorded_weights_sha256)`` reads the figures ``validate_draft`` collected (report.json's
content) and returns the criteria, each with its requirement (or "no threshold set", "not required", "reported, not
gated"), the value measured and whether it was met, plus the reasons of a failure (one line each with a [code], the
lines report.json has always carried). The verdict is "fail" exactly when a reason was found. The report, its UI
artifacts and the run summary all show the same criteria (report.json key ``criteria``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from eagle3.support.display import NOT_MEASURED, measured, percent, sig, signed
from eagle3.validate.config import ValidateConfig
from eagle3.validate.report import speed_spread, speed_summary_text

MET, NOT_MET, NOT_GATED, NOT_CHECKED = "met", "NOT met", "not gated", "not checked"
PER_STEP = "tokens per verifier step"


class Criterion(BaseModel):
    """One line of the verdict: what is checked, what passes, what was measured, and the outcome."""

    name: str = Field(description="What is checked.")
    required: str = Field(description="What passes, with the setting that asks for it; or why it is not gated.")
    measured: str = Field(description="The value measured, rounded for people, with its unit.")
    result: Literal["met", "NOT met", "not gated", "not checked"] = Field(
        description="met / NOT met (the verdict fails) / not gated (reported only) / not checked (did not run).")


def judge(report: dict[str, Any], cfg: ValidateConfig, weights_path: str,
          recorded_weights_sha256: str | None) -> tuple[list[Criterion], list[str]]:
    """-> (criteria, reasons). ``report``: what validate_draft collected (keys ``weights_sha256``, ``structural``,
    ``vllm``, ``offline``); ``recorded_weights_sha256``: the hash the train stage recorded (None: a plain folder)."""
    criteria: list[Criterion] = []
    reasons: list[str] = []

    def add(name: str, required: str, value: str, result: str, reason: str | None = None) -> None:
        criteria.append(Criterion(name=name, required=required, measured=value, result=result))
        if reason:
            reasons.append(reason)

    now = report.get("weights_sha256")
    if recorded_weights_sha256 is None:
        add("weights are the ones trained", "the sha256 recorded at training (none: a plain checkpoint folder)",
            f"sha256 {str(now)[:12]}...", NOT_CHECKED)
    elif now == recorded_weights_sha256:
        add("weights are the ones trained", "the sha256 recorded at training", f"matches ({now[:12]}...)", MET)
    else:
        add("weights are the ones trained", "the sha256 recorded at training",
            f"differs: recorded {recorded_weights_sha256[:12]}..., now {str(now)[:12]}...", NOT_MET,
            f"[weights_modified] {weights_path} does not match the sha256 recorded when it was trained "
            f"({recorded_weights_sha256[:12]}..., now {str(now)[:12]}...): the file was changed or damaged since; "
            f"retrain or restore it")

    s = report.get("structural") or {}
    failures, warnings = s.get("failures", []), s.get("warnings", [])
    text = "ok" if s.get("ok") else f"{len(failures)} failed: {', '.join(f['code'] for f in failures)}"
    if warnings:
        text += f" ({len(warnings)} warning{'s' if len(warnings) > 1 else ''}: {', '.join(w['code'] for w in warnings)})"
    add("checkpoint files match vLLM's contract", "no failure (config keys, tensor names and shapes, d2t/t2d)",
        text, MET if s.get("ok") else NOT_MET)
    reasons += [f"[{f['code']}] {f['message']}" for f in failures]

    v = report.get("vllm") or {}
    acc = v.get("acceptance")
    ran = "vLLM loads the draft and runs speculative steps"
    if "skipped" in v:
        add("vLLM speculative decoding", ran, f"not run: {v['skipped']}", NOT_CHECKED)
    elif "error" in v:
        add("vLLM speculative decoding", ran, f"failed: {v['error'].splitlines()[0][:300]}", NOT_MET,
            f"[vllm_failed] {v['error']}")
    elif acc is not None:
        drafts = acc["num_drafts"]
        add("vLLM speculative decoding", ran, f"{drafts:,} verifier steps with drafts on {v.get('num_prompts')} prompts",
            MET if drafts else NOT_MET,
            None if drafts else "[no_drafts] vLLM ran no speculative steps (no spec-decode metrics)")
    if acc is not None:
        _judge_acceptance(add, v, acc, cfg)

    off = report.get("offline") or {}
    tolerance = f"{100 * cfg.parity_tolerance:g}%"  # a setting: as it was set, not rounded
    if not cfg.offline_reference:
        add("offline reference agrees with vLLM", "not run (validate.offline_reference is off)", NOT_MEASURED,
            NOT_CHECKED)
    elif "acceptance" not in off:
        add("offline reference agrees with vLLM", f"within {tolerance}",
            f"{NOT_MEASURED}: the checkpoint failed an earlier check", NOT_CHECKED)
    elif "relative_difference" not in off:
        add("offline reference agrees with vLLM", f"within {tolerance}",
            f"offline {measured(off['acceptance']['mean_acceptance_length'], PER_STEP)}; vLLM's figure "
            f"{NOT_MEASURED}", NOT_CHECKED)
    else:
        rel, off_mal, mal = (off["relative_difference"], off["acceptance"]["mean_acceptance_length"],
                             acc["mean_acceptance_length"])
        ok = rel <= cfg.parity_tolerance
        add("offline reference agrees with vLLM",
            f"mean acceptance lengths within {tolerance} (validate.parity_tolerance)",
            f"{percent(rel)} apart (offline {sig(off_mal)}, vLLM {sig(mal)})", MET if ok else NOT_MET,
            None if ok else f"[parity] offline mean acceptance length {off_mal:.3f} vs vLLM {mal:.3f}: {rel:.1%} "
            f"apart (> {cfg.parity_tolerance:.0%})")
    return criteria, reasons


def _judge_acceptance(add, v: dict[str, Any], acc: dict[str, Any], cfg: ValidateConfig) -> None:
    """Losslessness, acceptance length (threshold and gain over the untrained draft), decoding speed."""
    n, mismatches = v.get("num_prompts"), v.get("mismatches") or []
    if v.get("lossless"):
        text = f"yes: all {n} outputs identical to plain greedy decoding"
    else:
        text = f"NO: {len(mismatches)} of {n} outputs differ from plain greedy decoding"
    first = mismatches[0] if mismatches else {}
    if cfg.require_lossless:
        add("lossless at temperature 0", "identical outputs (validate.require_lossless)", text,
            MET if v.get("lossless") else NOT_MET,
            None if v.get("lossless") else f"[not_lossless] speculative and plain greedy outputs differ on "
            f"{len(mismatches)} of {n} prompts (first: prompt {first.get('prompt')} at token "
            f"{first.get('first_difference_at_token')})")
    else:
        add("lossless at temperature 0", "not required (validate.require_lossless is off)", text, NOT_GATED)

    mal, threshold = acc["mean_acceptance_length"], cfg.min_mean_acceptance_length
    if threshold is None:
        add("mean acceptance length (vLLM)", "no threshold set (validate.min_mean_acceptance_length)",
            measured(mal, PER_STEP), NOT_GATED)
    else:
        ok = mal >= threshold
        add("mean acceptance length (vLLM)", f"at least {threshold:g} (validate.min_mean_acceptance_length)",
            measured(mal, PER_STEP), MET if ok else NOT_MET,
            None if ok else f"[below_threshold] vLLM mean acceptance length {mal:.3f} < min_mean_acceptance_length "
            f"{threshold}")

    untrained = ((v.get("untrained") or {}).get("acceptance") or {}).get("mean_acceptance_length")
    if not cfg.compare_untrained or untrained is None:
        add("gain over the untrained draft", "not compared (validate.compare_untrained is off)", NOT_MEASURED,
            NOT_CHECKED)
    else:
        gain = mal - untrained
        add("gain over the untrained draft", "above 0 (validate.compare_untrained)",
            f"{signed(gain)} ({sig(mal)} trained vs {sig(untrained)} untrained)", MET if gain > 0 else NOT_MET,
            None if gain > 0 else f"[no_gain] trained draft's mean acceptance length {mal:.3f} is not above the "
            f"untrained draft's {untrained:.3f}")

    sp = v.get("speed") or {}
    if sp.get("speedup") is None:
        add("decoding speedup", "reported, not gated", f"{NOT_MEASURED} (validate.speed_repeats is 0)", NOT_GATED)
    else:
        text = f"{speed_summary_text(sp)} (medians of the timed decodes, engine sessions {sp.get('schedule', 'AB')})"
        noisy = [f"at {lv.get('concurrency', 1)} in flight the repeats ranged {spread}"
                 for lv in sp.get("levels") or [sp] if (spread := speed_spread(lv)) is not None]
        if noisy:
            text += f"; not reliable: {'; '.join(noisy)}"
        add("decoding speedup", "reported, not gated (on CPU a draft pays off only at a high acceptance length)",
            text, NOT_GATED)
