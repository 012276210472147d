"""tasks.prefect_env: the setting names are Prefect 3.9's own (a fresh interpreter that sets them before importing
Prefect sees them in its settings), user values win, and prefect.yaml's job env carries what a deployed flow
process needs."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml
from helpers import REPO

from tasks.prefect_env import (
    EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    FLOW_RUN_ENV,
    HEARTBEAT_SECONDS,
    LOCAL_ENV,
    apply_prefect_env_defaults,
)

_PROBE = """
import json, logging, os
for name in list(os.environ):
    if name.startswith("PREFECT_") or name == "DO_NOT_TRACK":
        del os.environ[name]
from tasks.prefect_env import apply_prefect_env_defaults
apply_prefect_env_defaults()
from prefect import flow  # noqa: F401 - loads prefect.main, which sets up logging
from prefect.logging.handlers import APILogHandler
from prefect.settings import get_current_settings
s = get_current_settings()
print(json.dumps({
    "startup_timeout": s.server.ephemeral.startup_timeout_seconds,
    "analytics": s.server.analytics_enabled,
    "heartbeat": s.flows.heartbeat_frequency,
    "eagle3_to_api": any(isinstance(h, APILogHandler) for h in logging.getLogger("eagle3").handlers),
}))
"""


def test_defaults_reach_prefects_settings_when_set_before_import():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=300,
                         check=True)
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen == {"startup_timeout": EPHEMERAL_STARTUP_TIMEOUT_SECONDS, "analytics": False,
                    "heartbeat": HEARTBEAT_SECONDS, "eagle3_to_api": True}


def test_user_values_win():
    env = apply_prefect_env_defaults({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "300"})
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "300"
    assert {k: v for k, v in env.items() if k != "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"} == {
        k: v for k, v in LOCAL_ENV.items() if k != "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"}


def test_prefect_yaml_job_env_carries_the_flow_run_env():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    job_env = spec["definitions"]["work_pool"]["job_variables"]["env"]
    assert {k: str(job_env.get(k)) for k in FLOW_RUN_ENV} == FLOW_RUN_ENV
    for dep in spec["deployments"]:  # every deployment uses that work pool block
        assert dep["work_pool"]["job_variables"]["env"] == job_env, dep["name"]
