"""Headless-Chromium screenshots of a flow run's Logs and Artifacts pages in the Prefect UI, to check them by eye.

    # a run on an existing server (the UI is served by the API's host):
    .venv/bin/python scripts/ui_screenshots.py --api-url http://127.0.0.1:4200/api --flow-run <id> --out shots/
    # or: start a local server (temp PREFECT_HOME, free loopback port), run a small flow whose task logs from a
    # thread and streams a subprocess (tasks/logs.py), then take the screenshots:
    .venv/bin/python scripts/ui_screenshots.py --demo --out shots/

Writes <out>/flow-run-<id>-logs.png, -artifacts.png and -artifact-<key>.png (one per artifact), and prints, for --demo, whether the thread's and the
subprocess's lines are in the rendered Logs page (Chromium's --dump-dom of the same page). Needs Debian's
`chromium` (apt-get install -y chromium); the flags keep it off the network and out of the user's profile.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1600,1100"]
RENDER_BUDGET_MS = 20_000  # virtual time the single-page UI gets to fetch the run and render before the shot


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("chromium not found: apt-get install -y chromium")


def _chromium(args: list[str], timeout_s: float = 180) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="ui-shots-profile-") as profile:  # a fresh profile every time
        return subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                               f"--virtual-time-budget={RENDER_BUDGET_MS}", *args],
                              capture_output=True, text=True, timeout=timeout_s, check=False)


def screenshot(url: str, out: Path) -> Path:
    result = _chromium([f"--screenshot={out}", url])
    if not out.is_file():
        raise SystemExit(f"chromium wrote no screenshot of {url}:\n{result.stderr[-2000:]}")
    return out


def rendered_text(url: str) -> str:
    return _chromium(["--dump-dom", url]).stdout


def run_page(ui_url: str, flow_run_id: str, tab: str) -> str:
    """The V2 UI's page of a flow run (the V1 UI, served at the root, ignores ``?tab=``)."""
    return f"{ui_url}/v2/runs/flow-run/{flow_run_id}?tab={tab}"


def shoot_flow_run(ui_url: str, flow_run_id: str, out_dir: Path) -> dict[str, Path]:
    """The Logs and Artifacts tabs of the run, then each of its artifacts' own page (where tables, markdown and
    links render)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    out_dir.mkdir(parents=True, exist_ok=True)
    shots = {}
    for tab in ("Logs", "Artifacts"):
        shots[tab] = screenshot(run_page(ui_url, flow_run_id, tab), out_dir / f"flow-run-{flow_run_id}-{tab.lower()}.png")
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    for a in artifacts:
        name = a.key or str(a.id)
        shots[f"artifact {name}"] = screenshot(f"{ui_url}/v2/artifacts/artifact/{a.id}",
                                               out_dir / f"flow-run-{flow_run_id}-artifact-{name}.png")
    for what, path in shots.items():
        print(f"{what}: {path}", flush=True)
    return shots


def _latest_flow_run_id() -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
    if not runs:
        raise SystemExit("the server has no flow run: pass --flow-run or use --demo")
    return str(runs[0].id)


# ---------------------------------------------------------------- --demo


def _demo_run(marker: str) -> str:
    """A flow run shaped like a stage: a task whose lines come from a plain thread and from a subprocess, plus
    one markdown artifact. Returns its id."""
    import logging
    import threading

    from prefect import flow, task
    from prefect.artifacts import create_markdown_artifact

    from eagle3.support.subproc import run_subprocess
    from tasks.logs import logs_from_all_threads

    logging.getLogger("eagle3").setLevel(logging.INFO)
    log = logging.getLogger("eagle3.extract")

    @task(name="demo-stage")
    def demo_stage() -> None:
        with logs_from_all_threads():
            t = threading.Thread(target=log.info, args=(f"[extract] {marker} line from a writer thread",))
            t.start()
            t.join()
            run_subprocess([sys.executable, "-c", f"print('[vllm_check] {marker} line from a subprocess')"],
                           log_prefix="[vllm] ", timeout_s=60).check()
        create_markdown_artifact(f"# demo artifact\n\nmarker `{marker}`", key="demo-summary",
                                 description="the demo stage's summary")

    @flow(name="ui-screenshots-demo")
    def demo() -> None:
        demo_stage()

    state = demo(return_state=True)
    return str(state.state_details.flow_run_id)


def _wait_for_logs(flow_run_id: str, want: list[str], deadline_s: float = 60) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + deadline_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            if all(any(w in entry.message for entry in logs) for w in want):
                return
            time.sleep(0.5)
    raise SystemExit(f"the API did not return the demo's lines {want} within {deadline_s:.0f} s")


def demo(out_dir: Path) -> None:
    import uuid

    from tasks.prefect_env import apply_prefect_env_defaults, start_local_server, stop_process_group

    with tempfile.TemporaryDirectory(prefix="ui-shots-home-") as home:
        server, env = start_local_server(Path(home), ui=True)
        try:
            os.environ.update({"PREFECT_HOME": home, "PREFECT_API_URL": env["PREFECT_API_URL"]})
            apply_prefect_env_defaults()  # before this process imports Prefect
            base = env["PREFECT_API_URL"].removesuffix("/api")
            marker = uuid.uuid4().hex[:8]
            flow_run_id = _demo_run(marker)
            want = [f"{marker} line from a writer thread", f"{marker} line from a subprocess"]
            _wait_for_logs(flow_run_id, want)
            shoot_flow_run(base, flow_run_id, out_dir)
            page = rendered_text(run_page(base, flow_run_id, "Logs"))
            for line in want:
                print(f"in the rendered Logs page: {'yes' if line in page else 'NO '}  {line!r}", flush=True)
        finally:
            stop_process_group(server)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", action="store_true", help="start a local server and shoot a small demo run")
    ap.add_argument("--api-url", default=os.environ.get("PREFECT_API_URL"), help="the server (default "
                    "$PREFECT_API_URL); the UI is taken to be served at the same host without /api")
    ap.add_argument("--flow-run", help="flow run id (default: the latest run on the server)")
    ap.add_argument("--out", type=Path, default=Path("ui-screenshots"), help="folder for the PNG files")
    args = ap.parse_args()
    if args.demo:
        demo(args.out)
        return
    if not args.api_url:
        raise SystemExit("pass --api-url (or set PREFECT_API_URL), or use --demo")
    os.environ["PREFECT_API_URL"] = args.api_url
    shoot_flow_run(args.api_url.rstrip("/").removesuffix("/api"), args.flow_run or _latest_flow_run_id(), args.out)


if __name__ == "__main__":
    main()
