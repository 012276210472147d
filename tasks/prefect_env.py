"""The Prefect settings this project relies on, in one place; environment defaults set BEFORE Prefect is imported;
and the local ``prefect server start`` that tests and tools/ui_screenshots.py run against.

Prefect reads most of these once, when it is imported (the logging setup attaches the API handler to
PREFECT_LOGGING_EXTRA_LOGGERS then; the SDK's analytics start then), so ``apply_prefect_env_defaults()`` must run
before the first ``import prefect``: at the top of the flow's entrypoint module and of tests/conftest.py. It only
fills in what the environment does not set, so a user's own value always wins.

A deployment's flow process is started by the worker as ``python -m prefect.engine``, which imports Prefect before
our code: there ``FLOW_RUN_ENV`` arrives through prefect.yaml's work-pool ``job_variables.env`` (a test keeps the
two equal).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, MutableMapping
from pathlib import Path

# Flow-run heartbeats (seconds between two "prefect.flow-run.heartbeat" events; Prefect's minimum is 30). The
# crash-detection automation (tasks/crash_detection.py) marks a Running flow run Crashed after
# ZOMBIE_AFTER_MISSED_HEARTBEATS intervals without a heartbeat: a kill -9'ed run shows Crashed within ~5 minutes.
HEARTBEAT_SECONDS = 60
ZOMBIE_AFTER_MISSED_HEARTBEATS = 5

# The temporary (ephemeral) server of `make demo` and of the tests' harness: seconds it may take to answer /health.
# Prefect's default is 20 s. bench/prefect_server_start.py measured ~8 s on an idle 2-core machine, 16-27 s with
# two busy Python loops (load ~3-4), 58-65 s with eight (load ~10). 180 s holds ~3x the worst of those; it is only
# waited out when the server really fails to start.
EPHEMERAL_STARTUP_TIMEOUT_SECONDS = 180

# what every flow process needs, deployed or local
FLOW_RUN_ENV = {
    "PREFECT_LOGGING_EXTRA_LOGGERS": "eagle3",  # the library's logger reaches the run's logs in the UI
    "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_SECONDS),
    "DO_NOT_TRACK": "1",  # Prefect's SDK analytics (read at import); this network reaches no analytics service
}

# plus what only a process that may start the temporary server needs
LOCAL_ENV = {
    **FLOW_RUN_ENV,
    # the server's telemetry service posts to sens-o-matic.prefect.io every 10 minutes; offline it logs
    # "Failed to send telemetry" errors
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(EPHEMERAL_STARTUP_TIMEOUT_SECONDS),
    # the library's stage functions also run outside any flow (tests, bench/ scripts, a notebook): their lines then
    # go to the console alone, without a "no flow run id" warning per line (deployed flow runs keep the warning:
    # there it would mean a lost run context)
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}


def apply_prefect_env_defaults(environ: MutableMapping[str, str] = os.environ) -> MutableMapping[str, str]:
    """Set ``LOCAL_ENV`` in ``environ`` where it is not set yet; returns ``environ``. Call before importing Prefect."""
    for name, value in LOCAL_ENV.items():
        environ.setdefault(name, value)
    return environ


def start_local_server(home: Path, ui: bool = False, extra_env: Mapping[str, str] | None = None,
                       ui_api_url: str | None = None) -> tuple[subprocess.Popen, dict[str, str]]:
    """``prefect server start`` on a free loopback port, SQLite under ``home`` (its PREFECT_HOME), every service
    (automations included), output to ``home/server.log``; returns once /api/health answers (within
    EPHEMERAL_STARTUP_TIMEOUT_SECONDS) with the process (its own process group) and the environment that points
    CLI calls and flow processes at it. For tests and tools/ui_screenshots.py; stop it with ``stop_process_group``.
    ``ui_api_url``: where the UI in a browser calls the API (default: this server's API; another value reproduces a
    server whose UI cannot reach it).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    env = apply_prefect_env_defaults({
        **os.environ, **(extra_env or {}), "PREFECT_HOME": str(home), "PREFECT_API_URL": api,
        "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_UI_ENABLED": "true" if ui else "false",
        "PREFECT_UI_API_URL": ui_api_url or api,  # where the UI in a browser finds the API (its default: port 4200)
    })
    prefect_cli = str(Path(sys.executable).parent / "prefect")
    with open(Path(home) / "server.log", "ab") as log:
        server = subprocess.Popen([prefect_cli, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + EPHEMERAL_STARTUP_TIMEOUT_SECONDS
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                if r.status == 200:
                    return server, env
        except OSError:
            time.sleep(0.5)
    stop_process_group(server)
    raise RuntimeError(f"prefect server did not start within {EPHEMERAL_STARTUP_TIMEOUT_SECONDS} s:\n"
                       f"{(Path(home) / 'server.log').read_text(errors='replace')[-3000:]}")


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group ``proc`` leads (a server, a worker), SIGKILL after ``grace_s`` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
