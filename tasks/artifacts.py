"""Prefect UI artifacts (keys are stable so the UI shows each one's history across runs).

Artifacts are published only inside a Prefect flow/task run; ``task.fn(...)`` in unit tests skips them. What people
read is rounded here (eagle3.support.display: 3 significant digits, "not measured" for a missing value); the stage
files keep the full values.
"""

from __future__ import annotations

import base64
import logging
import time
from pathlib import Path

from eagle3.support.display import measured, sig

log = logging.getLogger("eagle3")


def _in_run() -> bool:
    try:
        from prefect.context import get_run_context

        get_run_context()
        return True
    except Exception:  # noqa: BLE001 - no run context: not inside a flow/task run
        return False


def for_people(rows: list[dict]) -> list[dict]:
    """A table's cells as people read them: numbers rounded (``sig``), None as "not measured", text unchanged."""
    return [{k: sig(v) for k, v in row.items()} for row in rows]


# about the longest cell the UI's artifact table showed whole in 1600 px wide screenshots (its cells do not wrap;
# validation-acceptance's 70-90 character cells were cut off)
TABLE_CELL_CHARS = 60


def table(key: str, rows: list[dict], description: str) -> None:
    """A table artifact of short cells. The UI cuts a long cell off at the table's width (it does not wrap it): what
    is long belongs in the description or a markdown artifact; a long cell is logged as a warning."""
    if not _in_run() or not rows:
        return
    from prefect.artifacts import create_table_artifact

    rows = for_people(rows)
    for row in rows:
        for name, cell in row.items():
            if len(cell) > TABLE_CELL_CHARS:
                log.warning("artifact %s: its %s cell %r has %d characters; the UI cuts it off at %d", key, name,
                            cell[:80], len(cell), TABLE_CELL_CHARS)
    create_table_artifact(key=key, table=rows, description=description)


def markdown(key: str, text: str, description: str) -> None:
    if not _in_run():
        return
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(key=key, markdown=text, description=description)


def image_markdown(png: str | Path, alt: str) -> str:
    """Inline a PNG into markdown (the UI renders data URIs; no file server needed)."""
    data = base64.b64encode(Path(png).read_bytes()).decode()
    return f"![{alt}](data:image/png;base64,{data})"


class ProgressArtifact:
    """Mirror of eagle3.support.progress.Progress into a Prefect progress artifact, updated at most every few seconds."""

    def __init__(self, key: str, description: str, min_interval_s: float = 2.0):
        self.key, self.description, self.min_interval_s = key, description, min_interval_s
        self.artifact_id = None
        self._last = 0.0
        if _in_run():
            from prefect.artifacts import create_progress_artifact

            self.artifact_id = create_progress_artifact(progress=0.0, key=key, description=description)

    def __call__(self, done: int, total: int, line: str = "") -> None:
        if self.artifact_id is None:
            return
        now = time.monotonic()
        if done < total and now - self._last < self.min_interval_s:
            return
        self._last = now
        from prefect.artifacts import update_progress_artifact

        try:
            update_progress_artifact(artifact_id=self.artifact_id, progress=100.0 * done / max(1, total),
                                     description=f"{self.description}: {line}"[:1000])
        except Exception as exc:  # noqa: BLE001 - the UI mirror must never fail the stage
            log.warning("progress artifact update failed: %s", exc)


def run_summary(summary: dict, checkpoint, report, problem: str | None = None) -> None:
    """Publish the run's summary (on every run, a fully cached one too): ``run_summary_markdown``."""
    markdown("run-summary", run_summary_markdown(summary, checkpoint, report, problem),
             description="The verdict, and where this run's draft and report are")


def run_summary_markdown(summary: dict, checkpoint, report, problem: str | None = None) -> str:
    """The verdict with its criteria, where the checkpoint and the report are, and which flow runs produced them.
    ``problem``: why the checkpoint must not be served although its cached validation passed (e.g. its weights
    changed since training). ``checkpoint``, ``report``: the train and validate stages' artifacts."""
    from eagle3.validate.report import criteria_markdown
    from eagle3.validate.verdict import PER_STEP

    ready = summary["verdict"] == "pass" and problem is None
    settings = report.report().get("settings", {})
    threshold = settings.get("min_mean_acceptance_length")
    untrained = summary["untrained_mean_acceptance_length"]
    why_not = "validate.compare_untrained is off" if not settings.get("compare_untrained") else "vLLM did not run"
    lines = [f"# EAGLE-3 run: {'PASS' if ready else 'FAIL'}", "",
             *([f"**{problem}**", ""] if problem else []),
             f"**Validation: {report.verdict_line()}**", "",
             "| | |", "|---|---|",
             f"| draft checkpoint ({'vLLM-ready' if ready else 'NOT ready to serve'}) | `{summary['checkpoint']}` |",
             f"| weights sha256 (recorded at training) | `{summary['weights_sha256']}` |",
             f"| validation report | `{summary['report']}` |",
             (f"| mean acceptance length (vLLM) | {measured(summary['mean_acceptance_length'], PER_STEP)}; "
              f"{'no threshold set' if threshold is None else f'threshold: at least {threshold:g}'} |"),
             f"| untrained draft | {measured(untrained, PER_STEP, absent=f'not measured ({why_not})')} |",
             f"| checkpoint produced by | {checkpoint.producer or 'this run'} |",
             f"| report produced by | {report.producer or 'this run'} |",
             f"| run folder | `{summary['run_dir']}` |", ""]
    if report.criteria:
        lines += ["## Verdict criteria", "", *criteria_markdown([c.model_dump() for c in report.criteria])]
    return "\n".join(lines) + "\n"
