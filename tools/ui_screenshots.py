"""Headless-Chromium screenshots of a flow run in the Prefect UI, each at the full height of its content: the run page
(task graph + task list), its Logs and Artifacts tabs, the V1 UI's run page (its graph marks every artifact), and
every artifact's own page. It refuses to report success when a page shows an error instead of the run.

    # a run on an existing server (the UI is served by the API's host):
    .venv/bin/python tools/ui_screenshots.py --api-url http://127.0.0.1:4290/api --flow-run <id> --out shots/
    # or: start a local server (temp PREFECT_HOME, free loopback port), run a small flow shaped like the pipeline
    # (stage tasks whose lines come from a thread and a subprocess, artifacts), then take the screenshots:
    .venv/bin/python tools/ui_screenshots.py --demo --out shots/

Writes <out>/flow-run-<id>-{task-runs,logs,artifacts,v1}.png and -artifact-<key>.png (one per artifact), prints each
path, and writes the text each page showed to <out>/flow-run-<id>-pages.json. Before any page it asks the server's /ui-settings where the UI in a browser will call the API: a server started
on another port than 4200 without PREFECT_UI_API_URL serves a UI that calls port 4200, and every page says "Unable to
connect". Each page is then read (its text, through the DevTools protocol) until it shows what the API says it must
(the run's name and its task runs, its first and last log lines, the artifact keys) and no error message, within a
deadline; a page that does not is an error naming what is missing and what the page showed instead.

Needs Debian's `chromium` (apt-get install -y chromium); the flags keep it off the network (other than the loopback
UI) and out of the user's profile. Chromium is driven over its DevTools websocket (the `websockets` package Prefect
already depends on), so nothing else is installed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WIDTH_PX = 1600  # viewport width; the height grows to the page's content (up to MAX_HEIGHT_PX)
MIN_HEIGHT_PX = 1100
MAX_HEIGHT_PX = 16_000  # Chromium's software compositor draws up to 16,384 px; a taller page is cut there (said so)
PAGE_DEADLINE_S = 90.0  # how long a page may take to show what it must (the UI fetches the run after it loads)
# the error messages of the V2 UI (prefect/server/ui-v2/assets/error-utils-*.js) and of a page it cannot find
ERROR_TEXTS = ("Unable to connect to Prefect server", "Prefect server error", "Configuration error",
               "Something went wrong", "Unexpected error", "Page not found")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--mute-audio", "--remote-debugging-address=127.0.0.1",
                  "--remote-debugging-port=0"]
TABS = {"task-runs": "TaskRuns", "logs": "Logs", "artifacts": "Artifacts"}  # file suffix -> the V2 UI's tab value


class UIPageError(RuntimeError):
    """A page of the UI did not show what it must (an error page, a UI that cannot reach its API, a missing run)."""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("chromium not found: apt-get install -y chromium")


# ---------------------------------------------------------------- the browser, over the DevTools protocol


class Browser:
    """One headless Chromium with a fresh profile, driven over its DevTools websocket; ``page()`` opens a tab."""

    def __init__(self, start_deadline_s: float = 60.0):
        self._profile = tempfile.TemporaryDirectory(prefix="ui-shots-profile-")
        self.proc = subprocess.Popen([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={self._profile.name}",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        found: list[str] = []
        stderr_tail: list[str] = []

        def read_stderr() -> None:  # Chromium prints the websocket address on stderr; the rest is kept for errors
            for line in self.proc.stderr:
                if not found and (m := re.search(r"DevTools listening on (ws://\S+)", line)):
                    found.append(m.group(1))
                stderr_tail[:] = (stderr_tail + [line])[-20:]

        threading.Thread(target=read_stderr, daemon=True).start()
        deadline = time.monotonic() + start_deadline_s
        while not found and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not found:
            self.close()
            raise UIPageError(f"chromium did not open its DevTools socket within {start_deadline_s:.0f} s:\n"
                              f"{''.join(stderr_tail)}")
        from websockets.sync.client import connect

        self.ws = connect(found[0], max_size=None, open_timeout=start_deadline_s)
        self._next_id = 0

    def call(self, method: str, session: str | None = None, timeout_s: float = 60.0, **params):
        """One DevTools command; events that arrive meanwhile are dropped (pages are polled, not followed)."""
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout_s
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise UIPageError(f"chromium: {method} failed: {reply['error']}")
                return reply.get("result", {})

    def page(self) -> Page:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        return Page(self, self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"])

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)  # its own session: the renderer and GPU helpers go with it
            self.proc.wait(30)
        self._profile.cleanup()

    def __enter__(self) -> Browser:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# the height a page needs so that neither the document nor any scroll container inside it hides content
_NEEDED_HEIGHT_JS = """(() => {
  let hidden = 0;
  for (const el of document.querySelectorAll('*')) {
    const oy = getComputedStyle(el).overflowY;
    if ((oy === 'auto' || oy === 'scroll') && el.clientHeight > 0)
      hidden = Math.max(hidden, el.scrollHeight - el.clientHeight);
  }
  return [document.documentElement.scrollHeight, hidden];
})()"""
_SCROLL_TO_END_JS = """for (const el of document.querySelectorAll('*')) {
  const oy = getComputedStyle(el).overflowY;
  if ((oy === 'auto' || oy === 'scroll') && el.scrollHeight > el.clientHeight) el.scrollTop = el.scrollHeight;
}"""
_SCROLL_TO_TOP_JS = _SCROLL_TO_END_JS.replace("el.scrollTop = el.scrollHeight", "el.scrollTop = 0")
# resolves after two animation frames: the layout of the last change has been painted
_PAINTED_JS = "new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))"


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session
        self.height = MIN_HEIGHT_PX
        self._viewport(self.height)

    def _viewport(self, height: int) -> None:
        self.browser.call("Emulation.setDeviceMetricsOverride", self.session, width=WIDTH_PX, height=height,
                          deviceScaleFactor=1, mobile=False)

    def eval(self, expression: str, await_promise: bool = False):
        r = self.browser.call("Runtime.evaluate", self.session, expression=expression, returnByValue=True,
                              awaitPromise=await_promise)
        return r.get("result", {}).get("value")

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def open(self, url: str, must_show: list[str], load_until: str | None = None,
             deadline_s: float = PAGE_DEADLINE_S) -> str:
        """Load ``url`` and read its text until every string of ``must_show`` is on it and the UI's requests have
        settled; returns the text. ``load_until``: a string the page shows only once it has fetched everything (the
        run's last log line): its scroll panes are scrolled to their end (the Logs tab fetches 50 lines at a time
        as its pane reaches the bottom) until it shows, then back to the top. Raises UIPageError at once when the
        page shows an error message, or at the deadline naming what is missing and what the page reads."""
        self.height = MIN_HEIGHT_PX
        self._viewport(self.height)
        self.browser.call("Page.navigate", self.session, url=url)
        deadline = time.monotonic() + deadline_s
        self._wait(url, must_show, deadline, deadline_s)
        if load_until is not None:
            self._wait(url, [load_until], deadline, deadline_s, step=_SCROLL_TO_END_JS)
            self.eval(_SCROLL_TO_TOP_JS)
        return self._wait(url, must_show, deadline, deadline_s)

    def _wait(self, url: str, must_show: list[str], deadline: float, deadline_s: float, step: str | None = None) -> str:
        last_requests = -1
        while True:
            text = self.text()
            flat = _flat(text)
            errors = [e for e in ERROR_TEXTS if e in text]
            missing = [m for m in must_show if _flat(m) not in flat]
            if errors and missing:
                raise UIPageError(f"{url} shows {errors[0]!r} instead of {missing[0]!r}; the page reads: "
                                  f"{_excerpt(text)}")
            requests = self.eval("performance.getEntriesByType('resource').length") or 0
            if not missing and requests == last_requests:  # nothing fetched since the last look: settled
                self.eval(_PAINTED_JS, await_promise=True)
                return text
            if time.monotonic() > deadline:
                what = f"{missing}" if missing else "its requests settling"
                raise UIPageError(f"{url} did not show {what} within {deadline_s:.0f} s; the page reads: "
                                  f"{_excerpt(text)}")
            if step is not None:
                self.eval(step)
            last_requests = requests
            time.sleep(0.5)

    def fit_content(self) -> bool:
        """Grow the viewport until no scroll container hides content (the UI's layout is viewport-high, with
        scrolling panes inside); False when MAX_HEIGHT_PX cut it."""
        for _ in range(12):
            doc_height, hidden = self.eval(_NEEDED_HEIGHT_JS)
            needed = max(doc_height, self.height) + max(0, hidden)
            if needed <= self.height + 1:
                return True
            if self.height >= MAX_HEIGHT_PX:
                return False
            self.height = min(MAX_HEIGHT_PX, int(needed))
            self._viewport(self.height)
            self.eval(_PAINTED_JS, await_promise=True)
        return True

    def screenshot(self, out: Path) -> Path:
        data = self.browser.call("Page.captureScreenshot", self.session, format="png", timeout_s=120)["data"]
        out.write_bytes(base64.b64decode(data))
        return out


def _flat(text: str) -> str:
    """Whitespace runs as one space: the page's text and a log line compare the same however the UI wraps them."""
    return re.sub(r"\s+", " ", text).strip()


def _excerpt(text: str, n: int = 600) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return repr(text[:n] + ("..." if len(text) > n else ""))


# ---------------------------------------------------------------- the run's pages


def check_ui_api(ui_url: str, api_url: str) -> None:
    """The UI served at ``ui_url`` must call ``api_url`` (its /ui-settings says where); else every page of it shows
    "Unable to connect" (a server started on another port than 4200 without PREFECT_UI_API_URL)."""
    try:
        with urllib.request.urlopen(f"{ui_url}/ui-settings", timeout=30) as r:
            settings = json.loads(r.read())
    except OSError as e:
        raise UIPageError(f"no Prefect UI answers at {ui_url} ({e}): is the server started with its UI on?") from None
    ui_api = urllib.parse.urljoin(ui_url + "/", settings.get("api_url") or "/api").rstrip("/")
    if ui_api != api_url.rstrip("/"):
        raise UIPageError(f"the UI at {ui_url} calls the API at {ui_api}, not at {api_url}: every page would say "
                          f"'Unable to connect'. Restart the server with PREFECT_UI_API_URL={api_url} (README, "
                          f"'Watch it in the Prefect UI')")


def run_page(ui_url: str, flow_run_id: str, tab: str) -> str:
    """The V2 UI's page of a flow run (the default UI; the V1 UI, served at the root, ignores ``?tab=``)."""
    return f"{ui_url}/v2/runs/flow-run/{flow_run_id}?tab={tab}"


def _first_line(message: str, n: int = 60) -> str:
    """What the Logs page shows of a message, for the text check: its first line, at most ``n`` characters."""
    return message.strip().splitlines()[0][:n] if message.strip() else ""


LOG_LINES_CHECKED = 200  # the API's largest page; the Logs screenshot must reach this line (~300 rows fit in 16,000 px)


def _run_facts(flow_run_id: str) -> dict:
    """What the API says the run's pages must show: its name, how many task runs it has and its newest one (the list
    shows 10 a page, newest first), its first log line and the last of its first LOG_LINES_CHECKED, its artifacts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.client.schemas.sorting import LogSort, TaskRunSort

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])),
                                      sort=TaskRunSort.EXPECTED_START_TIME_DESC)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])),
                                sort=LogSort.TIMESTAMP_ASC, limit=LOG_LINES_CHECKED)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    lines = [m for m in (_first_line(entry.message) for entry in logs) if m]
    unique = [m for m in lines if sum(_flat(m) in _flat(other) for other in lines) == 1]
    if len(logs) == LOG_LINES_CHECKED:
        print(f"the run may have more than {LOG_LINES_CHECKED} log lines: the Logs screenshot is checked up to the "
              f"{LOG_LINES_CHECKED}th", flush=True)
    task_list = [f"{len(tasks)} Task run", *(t.name for t in tasks[:1])] if tasks else []
    return {"name": run.name, "tasks": task_list, "first_log": lines[:1], "last_log": unique[-1] if unique else None,
            "artifacts": [(a.key or str(a.id), str(a.id)) for a in artifacts]}


class Shot(NamedTuple):
    path: Path  # the PNG
    text: str  # the page's text as shown in the screenshot (the whole grown page)
    height: int  # pixels
    whole: bool  # False when MAX_HEIGHT_PX cut the page


def shoot_flow_run(ui_url: str, api_url: str, flow_run_id: str, out_dir: Path) -> dict[str, Shot]:
    """The run page (graph + Task Runs), its Logs and Artifacts tabs, then each artifact's own page (where tables,
    markdown and images render), each at full height. Returns {what: Shot}; raises UIPageError."""
    check_ui_api(ui_url, api_url)
    facts = _run_facts(flow_run_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    expect = {"task-runs": [facts["name"], *facts["tasks"]],
              "logs": [facts["name"], *facts["first_log"]],
              "artifacts": [facts["name"], *(key for key, _ in facts["artifacts"])]}
    pages = [(f"run page ({suffix})", run_page(ui_url, flow_run_id, tab), expect[suffix],
              facts["last_log"] if suffix == "logs" else None, suffix) for suffix, tab in TABS.items()]
    # the V1 UI's run page: its graph draws the tasks' artifact badges legibly and a marker for the flow's own
    # artifacts (run-summary), which the V2 graph does not; its Logs tab names each line's task run
    pages.append(("run page, V1 UI (graph with artifact markers, logs)", f"{ui_url}/runs/flow-run/{flow_run_id}",
                  [facts["name"]], None, "v1"))
    pages += [(f"artifact {key}", f"{ui_url}/v2/artifacts/artifact/{aid}", [key], None, f"artifact-{key}")
              for key, aid in facts["artifacts"]]
    shots: dict[str, Shot] = {}
    with Browser() as browser:
        page = browser.page()
        for what, url, must_show, load_until, suffix in pages:
            page.open(url, must_show, load_until)
            whole = page.fit_content()
            text = page.text()  # the grown page: a virtualized list now shows every row
            if whole and (missing := [m for m in must_show + [load_until or ""] if _flat(m) not in _flat(text)]):
                raise UIPageError(f"{url} no longer shows {missing} once grown to {page.height} px")
            path = page.screenshot(out_dir / f"flow-run-{flow_run_id}-{suffix}.png")
            shots[what] = Shot(path, text, page.height, whole)
            print(f"{what}: {path} ({WIDTH_PX}x{page.height} px{'' if whole else f', cut at {MAX_HEIGHT_PX} px'})",
                  flush=True)
    pages_json = out_dir / f"flow-run-{flow_run_id}-pages.json"  # what each screenshot shows, as text
    pages_json.write_text(json.dumps({what: {**shot._asdict(), "path": str(shot.path)} for what, shot in
                                      shots.items()}, indent=1))
    print(f"the pages' text: {pages_json}", flush=True)
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
    """A flow run shaped like the pipeline: two stage tasks (tasks.common.stage_task's log routing), the first
    logging from a plain thread and streaming a subprocess, each publishing an artifact. Returns its id."""
    import logging
    import threading

    from prefect import flow

    from eagle3.support.subproc import run_subprocess
    from tasks import artifacts
    from tasks.logs import logs_from_all_threads, tag_run_logs

    logging.getLogger("eagle3").setLevel(logging.INFO)
    tag_run_logs()
    log = logging.getLogger("eagle3.extract")

    @flow(name="ui-screenshots-demo")
    def demo() -> None:
        from prefect import task

        @task(name="demo-extract")
        def demo_extract() -> None:
            with logs_from_all_threads():
                t = threading.Thread(target=log.info, args=(f"[extract] {marker} line from a writer thread",))
                t.start()
                t.join()
                run_subprocess([sys.executable, "-c", f"print('[vllm_check] {marker} line from a subprocess')"],
                               log_prefix="[vllm] ", timeout_s=60).check()
            artifacts.markdown("demo-summary", f"# demo artifact\n\nmarker `{marker}`",
                               description="the demo stage's summary")

        @task(name="demo-report")
        def demo_report() -> None:
            log.info("holding host-cpu (a library line without a tag of its own)")
            artifacts.table("demo-table", [{"figure": "mean acceptance length", "value": "1.10 tokens"}],
                            description="a table artifact")

        demo_extract()
        demo_report()

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


def demo(out_dir: Path) -> dict[str, Shot]:
    import uuid

    from tasks.prefect_env import apply_prefect_env_defaults, start_local_server, stop_process_group

    with tempfile.TemporaryDirectory(prefix="ui-shots-home-") as home:
        server, env = start_local_server(Path(home), ui=True)
        try:
            os.environ.update({"PREFECT_HOME": home, "PREFECT_API_URL": env["PREFECT_API_URL"]})
            apply_prefect_env_defaults()  # before this process imports Prefect
            api = env["PREFECT_API_URL"]
            marker = uuid.uuid4().hex[:8]
            flow_run_id = _demo_run(marker)
            _wait_for_logs(flow_run_id, [f"{marker} line from a writer thread", f"{marker} line from a subprocess"])
            shots = shoot_flow_run(api.removesuffix("/api"), api, flow_run_id, out_dir)
            logs = _flat(shots["run page (logs)"].text)
            want = [f"[demo-extract] {marker} line from a writer thread",
                    f"[demo-extract] [vllm] [vllm_check] {marker} line from a subprocess",
                    "[demo-report] holding host-cpu", "[demo-extract] Finished in state Completed()",
                    "[demo-report] Finished in state Completed()", "[ui-screenshots-demo] Finished in state Completed()"]
            if missing := [w for w in want if w not in logs]:
                raise UIPageError(f"the rendered Logs page lacks {missing}: {_excerpt(logs, 3000)}")
            print("the rendered Logs page shows every line with its stage, the thread's and the subprocess's too",
                  flush=True)
            return shots
        finally:
            stop_process_group(server)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", action="store_true", help="start a local server and shoot a small demo run")
    ap.add_argument("--api-url", default=os.environ.get("PREFECT_API_URL"), help="the server (default "
                    "$PREFECT_API_URL); the UI is taken to be served at the same host without /api")
    ap.add_argument("--flow-run", help="flow run id (default: the latest run on the server)")
    ap.add_argument("--out", type=Path, default=Path("ui-screenshots"), help="folder for the PNG files")
    args = ap.parse_args(argv)
    try:
        if args.demo:
            demo(args.out)
            return
        if not args.api_url:
            raise SystemExit("pass --api-url (or set PREFECT_API_URL), or use --demo")
        os.environ["PREFECT_API_URL"] = args.api_url
        api = args.api_url.rstrip("/")
        shoot_flow_run(api.removesuffix("/api"), api, args.flow_run or _latest_flow_run_id(), args.out)
    except UIPageError as e:
        raise SystemExit(f"FAILED: {e}") from None


if __name__ == "__main__":
    main()
