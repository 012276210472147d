"""tools/ui_screenshots.py against a real `prefect server start` with its UI and a real headless Chromium: the run
page (task graph + task list), the Logs tab and every artifact page at full height, every log line with its stage;
and a refusal, not a success, when the UI cannot reach its API (the README's steps on another port than 4200 without
PREFECT_UI_API_URL: every page said "Unable to connect", and the old script captured those pages).

Chromium is Debian's `chromium`; `.ci/run` installs it, so under CI a missing Chromium fails this test instead of
skipping it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
from helpers import REPO

from tasks.prefect_env import start_local_server, stop_process_group

pytestmark = [pytest.mark.slow, pytest.mark.ui]

SCRIPT = REPO / "tools" / "ui_screenshots.py"


@pytest.fixture(scope="module")
def chromium():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it")
    return path


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def _script(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_demo_run_page_logs_and_artifacts_at_full_height(chromium, tmp_path):
    out = _script("--demo", "--out", str(tmp_path / "shots"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the rendered Logs page shows every line with its stage" in out.stdout, out.stdout[-3000:]
    (pages_json,) = (tmp_path / "shots").glob("flow-run-*-pages.json")
    pages = json.loads(pages_json.read_text())
    assert set(pages) == {"run page (task-runs)", "run page (logs)", "run page (artifacts)",
                          "run page, V1 UI (graph with artifact markers, logs)", "artifact demo-summary",
                          "artifact demo-table"}, set(pages)
    for what, page in pages.items():
        width, height = _png_size(page["path"])
        assert (width, height) == (1600, page["height"]) and page["whole"], (what, width, height, page)
        assert not any(e in page["text"] for e in ("Unable to connect", "Something went wrong")), (what, page["text"])
    runs = pages["run page (task-runs)"]["text"]
    assert "demo-extract" in runs and "demo-report" in runs and "2 Task runs" in runs, runs
    logs = pages["run page (logs)"]["text"]
    rows = [line for line in logs.splitlines() if "Finished in state" in line or "line from a" in line]
    assert len(rows) == 5 and all(line.startswith("[") for line in rows), rows  # each with its stage
    assert "marker" in pages["artifact demo-summary"]["text"]
    assert "1.10 tokens" in pages["artifact demo-table"]["text"]


def test_a_ui_that_cannot_reach_its_api_is_refused(chromium, tmp_path):
    """A server whose UI calls an API where nothing listens (port 4200's case): the script stops before any
    screenshot, naming PREFECT_UI_API_URL; and a page of that UI, read anyway, is refused for its error message."""
    from tools.ui_screenshots import Browser, UIPageError, run_page

    dead_api = "http://127.0.0.1:9/api"  # the discard port: nothing answers HTTP there
    (tmp_path / "home").mkdir()
    server, env = start_local_server(tmp_path / "home", ui=True, ui_api_url=dead_api)
    try:
        ui = env["PREFECT_API_URL"].removesuffix("/api")
        out = _script("--api-url", env["PREFECT_API_URL"], "--flow-run", "00000000-0000-0000-0000-000000000000",
                      "--out", str(tmp_path / "shots"), env=env)
        assert out.returncode != 0 and not list((tmp_path / "shots").glob("*.png")), out.stdout + out.stderr
        assert f"calls the API at {dead_api}" in out.stderr and "PREFECT_UI_API_URL" in out.stderr, out.stderr
        with Browser() as browser, pytest.raises(UIPageError, match="Unable to connect to Prefect server"):
            browser.page().open(run_page(ui, "00000000-0000-0000-0000-000000000000", "Logs"), ["never shown"])
    finally:
        stop_process_group(server)
