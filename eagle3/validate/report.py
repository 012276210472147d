"""The validation report: report.json, report.md (markdown tables) and acceptance.png."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from eagle3.support.display import percent, sig
from eagle3.support.io import atomic_write_json, atomic_write_text

ACCEPTANCE_IMAGE = "![per-position acceptance](acceptance.png)"  # report.md's chart (the UI inlines it)


def verdict_line(report: dict[str, Any]) -> str:
    """The verdict in one sentence, from report.json's ``criteria``: which were met, which were not, which were
    only reported or did not run."""
    criteria = report.get("criteria")
    if criteria is None:  # a report written before the criteria were recorded
        return f"{report['verdict'].upper()} ({len(report.get('reasons', []))} reasons; criteria not recorded)"
    by: dict[str, list[str]] = {}
    for c in criteria:
        by.setdefault(c["result"], []).append(c["name"])
    parts = []
    if by.get("NOT met"):
        parts.append(f"not met: {', '.join(by['NOT met'])}")
    if by.get("met"):
        parts.append(f"{len(by['met'])} criteria met")
    if by.get("not gated"):
        parts.append(f"reported without a threshold: {', '.join(by['not gated'])}")
    if by.get("not checked"):
        parts.append(f"not checked: {', '.join(by['not checked'])}")
    return f"{report['verdict'].upper()}: {'; '.join(parts)}"


def criteria_markdown(criteria: list[dict[str, Any]]) -> list[str]:
    """The verdict's criteria as a markdown table (report.md, the validation-report and run-summary artifacts)."""
    def cell(text: str) -> str:
        return str(text).replace("|", "/").replace("\n", " ")

    lines = ["| criterion | required | measured | result |", "|---|---|---|---|"]
    for c in criteria:
        result = f"**{c['result']}**" if c["result"] == "NOT met" else c["result"]
        lines.append(f"| {cell(c['name'])} | {cell(c['required'])} | {cell(c['measured'])} | {result} |")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    s = report.get("structural", {})
    lines = [f"# EAGLE-3 draft validation: **{report['verdict'].upper()}**", "", f"**{verdict_line(report)}**", ""]
    if report.get("criteria") is not None:
        lines += ["## Verdict", "", *criteria_markdown(report["criteria"]), ""]
    lines += [f"- draft: `{report['draft_dir']}`", f"- verifier: `{report['verifier_path']}`",
              f"- prompts: `{report.get('prompts_path')}`", ""]
    if report["reasons"]:
        lines += ["## Reasons", ""] + [f"- {r}" for r in report["reasons"]] + [""]
    lines += ["## Checkpoint contract", "", "| check | result |", "|---|---|",
              f"| structural | {'ok' if s.get('ok') else 'FAILED (' + str(len(s.get('failures', []))) + ')'} |"]

    for key in ("aux_layer_ids", "hidden_size", "vocab_size", "draft_vocab_size", "dtype", "num_parameters",
                "embed_tokens_in_checkpoint"):
        if key in s.get("summary", {}):
            value = s["summary"][key]
            lines.append(f"| {key} | {value if isinstance(value, (list, dict)) else sig(value)} |")
    for f in s.get("failures", []):
        lines.append(f"| `{f['code']}` | {f['message'].replace('|', '/')} |")
    for f in s.get("warnings", []):
        lines.append(f"| warning `{f['code']}` | {f['message'].replace('|', '/')} |")
    lines.append("")
    v = report.get("vllm", {})
    acc = v.get("acceptance")
    off = (report.get("offline") or {}).get("acceptance")
    unt = (v.get("untrained") or {}).get("acceptance")
    if acc:
        st = report["settings"]
        cols = [("vLLM", acc)] + ([("vLLM, untrained draft", unt)] if unt else []) + (
            [("offline reference", off)] if off else [])
        lines += ["## Speculative decoding", "",
                  (f"{v.get('num_prompts')} prompts, {st['max_new_tokens']} new tokens max, "
                   f"{st['num_speculative_tokens']} speculative tokens, temperature 0, vLLM {v.get('vllm_version')}."),
                  "", "| figure | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---|" * len(cols)]

        def row(name: str, get) -> str:
            return f"| {name} | " + " | ".join(sig(get(a)) for _, a in cols) + " |"

        lines.append(row("mean acceptance length", lambda a: a["mean_acceptance_length"]))
        for i in range(len(acc["per_position_acceptance"])):
            lines.append(row(f"acceptance at position {i + 1}", lambda a, i=i: a["per_position_acceptance"][i]))
        lines.append(row("drafts (verifier steps)", lambda a: a["num_drafts"]))
        lines.append(row("accepted / draft tokens",
                         lambda a: f"{a['num_accepted_tokens']:,} / {a['num_draft_tokens']:,}"))
        lossless = "yes" if v.get("lossless") else "NO"
        lines += ["", f"- lossless (speculative output identical to plain greedy): {lossless}"]
        if off:
            lines.append(f"- offline vs vLLM mean acceptance length: "
                         f"{percent(report['offline'].get('relative_difference'))} apart")
        lines += ["", ACCEPTANCE_IMAGE]
        lines += speed_markdown(v.get("speed") or {}, v.get("engine_starts")) + [""]
    elif v:
        lines += ["## Speculative decoding", "", f"not run: {v.get('skipped') or v.get('error', '')[:2000]}", ""]
    return "\n".join(lines)


NOISY_SPREAD = 2.0  # fastest / slowest repeat of one engine above which the decoding speedup is flagged unreliable
# (the tiny demo at load ~1 gave 649-993 tok/s, 1.53x, for one engine's 3 repeats; at load 4, 30-660 tok/s)


def speed_spread(speed: dict[str, Any]) -> str | None:
    """The repeats' ranges ("a-b tok/s with the draft, c-d without") when an engine's fastest repeat is more than
    ``NOISY_SPREAD`` times its slowest (or its slowest measured nothing), else None. Each engine decodes the same
    prompts greedily in every repeat, so a wider spread than a quiet machine's comes from the load changing.
    ``speed``: one concurrency level (report.json's ``speed.levels[i]``) or the headline (``speed`` itself)."""
    runs = {"with the draft": speed.get("draft_output_tokens_per_second") or [],
            "without": speed.get("baseline_output_tokens_per_second") or []}
    if not any(min(r) <= 0 or max(r) / min(r) > NOISY_SPREAD for r in runs.values() if r):
        return None
    return ", ".join(f"{min(r):.0f}-{max(r):.0f} tok/s {who}" for who, r in runs.items() if r)


def concurrency_label(c: int) -> str:
    return "one request at a time" if c == 1 else f"{c} concurrent requests"


def speed_summary_text(speed: dict[str, Any]) -> str:
    """The decoding speedup in one line: the headline level's figures, then the other levels' speedups."""
    med = statistics.median
    text = (f"{sig(speed['speedup'])}x at {concurrency_label(speed.get('concurrency', 1))}: "
            f"{sig(med(speed['draft_output_tokens_per_second']))} output tokens/s with the draft vs "
            f"{sig(med(speed['baseline_output_tokens_per_second']))} without")
    others = [lv for lv in speed.get("levels", [])[1:] if lv.get("speedup") is not None]
    if others:
        text += "; " + ", ".join(f"{sig(lv['speedup'])}x at {lv['concurrency']}" for lv in others)
    return text


def speed_markdown(speed: dict[str, Any], engine_starts: int | None) -> list[str]:
    """report.md's decoding-speed lines: how it was timed, one table row per concurrency level, reliability."""
    if speed.get("speedup") is None:
        return []
    levels = speed.get("levels") or [{**speed, "concurrency": speed.get("concurrency", 1)}]
    loads = [x for lv in levels for x in (lv.get("load_1min") or [])]
    lines = ["", "### Decoding speed (reported, not gated)", "",
             f"Output tokens/s of greedy decodes of the prompts with the draft (A) and without (B), one engine alive "
             f"at a time, engine sessions in the order {speed.get('schedule', 'AB')} "
             f"({engine_starts if engine_starts is not None else '?'} engine starts in all), {speed['repeats']} timed "
             f"decode(s) per level and session; speedup = median with / median without"
             + (f"; machine load (1 min) {min(loads):.1f}-{max(loads):.1f} during the decodes." if loads else "."),
             "", "| requests in flight | requests | with the draft (tok/s) | without (tok/s) | speedup |",
             "|---|---|---|---|---|"]
    for i, lv in enumerate(levels):
        a = ", ".join(sig(x) for x in lv["draft_output_tokens_per_second"])
        b = ", ".join(sig(x) for x in lv["baseline_output_tokens_per_second"])
        x = f"{sig(lv['speedup'])}x" if lv.get("speedup") is not None else "-"
        lines.append(f"| {lv['concurrency']} | {lv.get('requests', '-')} | {a} | {b} | {f'**{x}**' if i == 0 else x} |")
    noisy = [(lv, spread) for lv in levels if (spread := speed_spread(lv)) is not None]
    lines += [""] if noisy else []
    for lv, spread in noisy:
        lines.append(f"- at {lv['concurrency']} in flight the repeats ranged {spread}: the machine's load "
                     f"changed during the measurement, so that speedup is not reliable")
    return lines


def write_report(out_dir: str | os.PathLike, report: dict[str, Any]) -> dict[str, str]:
    """report.json + report.md + acceptance.png (when vLLM measured acceptance) in ``out_dir``; returns the paths."""
    from eagle3.support.plot import bar_chart

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"report_json": str(out_dir / "report.json"), "report_md": str(out_dir / "report.md")}
    acc = (report.get("vllm") or {}).get("acceptance")
    if acc:
        k = len(acc["per_position_acceptance"])
        bar_chart(out_dir / "acceptance.png", [f"pos {i + 1}" for i in range(k)],
                  [float(r) for r in acc["per_position_acceptance"]],
                  title=f"vLLM acceptance per draft position (mean length {sig(acc['mean_acceptance_length'])})",
                  ylabel="acceptance rate")
        paths["acceptance_png"] = str(out_dir / "acceptance.png")
    report = {**report, "paths": paths}
    atomic_write_text(out_dir / "report.md", render_markdown(report) + "\n")
    atomic_write_json(out_dir / "report.json", report)
    return paths
