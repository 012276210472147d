"""Prefect UI artifacts (keys are stable so the UI shows each one's history across runs).

Artifacts are published only inside a Prefect flow/task run; ``task.fn(...)`` in unit tests skips them.
"""

from __future__ import annotations

import base64
import logging
import time
from pathlib import Path

log = logging.getLogger("eagle3")


def _in_run() -> bool:
    try:
        from prefect.context import get_run_context

        get_run_context()
        return True
    except Exception:  # noqa: BLE001 - no run context: not inside a flow/task run
        return False


def table(key: str, rows: list[dict], description: str) -> None:
    if not _in_run() or not rows:
        return
    from prefect.artifacts import create_table_artifact

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
    """The run's summary (published on every run, a fully cached one too): where the checkpoint and the report
    are, the verdict and acceptance, and which flow runs produced them. ``problem``: why the checkpoint must not be
    served although its cached validation passed (e.g. its weights changed since training)."""
    ready = summary["verdict"] == "pass" and problem is None
    lines = [f"# EAGLE-3 run: {'PASS' if ready else 'FAIL'}", "",
             *([f"**{problem}**", ""] if problem else []),
             "| | |", "|---|---|",
             f"| draft checkpoint ({'vLLM-ready' if ready else 'NOT ready to serve'}) | `{summary['checkpoint']}` |",
             f"| weights sha256 (recorded at training) | `{summary['weights_sha256']}` |",
             f"| validation report | `{summary['report']}` |",
             f"| mean acceptance length (vLLM) | {summary['mean_acceptance_length']} |",
             f"| untrained draft | {summary['untrained_mean_acceptance_length']} |",
             f"| checkpoint produced by | {checkpoint.producer or 'this run'} |",
             f"| report produced by | {report.producer or 'this run'} |",
             f"| run folder | `{summary['run_dir']}` |"]
    markdown("run-summary", "\n".join(lines) + "\n", description="Where this run's draft and report are")
