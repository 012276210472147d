"""deployments/ against `prefect server start` (tests/conftest.py): the setup script run exactly as the README shows
(from the checkout, the venv NOT on PATH), what `prefect deploy` stores for the pull step's EAGLE3_REPO_DIR, and
crash detection: a flow run killed with kill -9 is marked Crashed by the automation when its heartbeats stop,
while a live run next to it stays Running."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from helpers import BIN, REPO, prefect_client, start_process, wait_for

from tasks.crash_detection import AUTOMATION_NAME, DEFAULT_WINDOW_SECONDS, ensure_zombie_automation


def _without_venv(env: dict) -> dict:
    """The environment of a shell where the pipeline's venv is not activated."""
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != os.path.realpath(BIN)]
    env = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PREFECT", "PYTHONPATH")}
    return {**env, "PATH": os.pathsep.join(path or ["/usr/bin", "/bin"])}


@pytest.mark.slow
def test_setup_script_as_the_readme_shows(prefect_server, tmp_path):
    env, _ = prefect_server
    shell = _without_venv(env)
    assert subprocess.run(["bash", "-c", "command -v prefect"], env=shell, capture_output=True, check=False).returncode != 0
    readme = (REPO / "deployments" / "README.md").read_text()
    assert "deployments/setup_prefect.sh gpu-host gpu-host-gpus 8" in readme
    out = subprocess.run(["deployments/setup_prefect.sh", "gpu-host", "gpu-host-gpus", "8"], cwd=REPO, env=shell,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    # again, from another folder, with fewer GPUs: nothing duplicated, the limit follows
    out = subprocess.run([str(REPO / "deployments" / "setup_prefect.sh"), "gpu-host", "gpu-host-gpus", "4"],
                         cwd=tmp_path, env=shell, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "unchanged" in out.stdout
    with prefect_client(env) as client:
        assert client.read_work_pool("gpu-host").type == "process"
        assert client.read_global_concurrency_limit_by_name("gpu-host-gpus").limit == 4
        (automation,) = client.read_automations_by_name(AUTOMATION_NAME)
    assert automation.enabled and automation.trigger.within.total_seconds() == DEFAULT_WINDOW_SECONDS
    assert automation.trigger.after == {"prefect.flow-run.heartbeat"}
    assert [a.type for a in automation.actions] == ["change-flow-run-state"]
    assert automation.actions[0].state.value == "CRASHED"


def test_setup_script_names_the_missing_cli(prefect_server, tmp_path):
    env, _ = prefect_server
    out = subprocess.run([str(REPO / "deployments" / "setup_prefect.sh")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=False, env={**_without_venv(env), "PREFECT": str(tmp_path / "no-prefect")})
    assert out.returncode == 1 and f"prefect CLI not found at '{tmp_path / 'no-prefect'}'" in out.stderr


_RUN_PULL_STEPS = """
import asyncio, json, os, sys
from prefect.deployments.steps.core import run_steps
asyncio.run(run_steps(json.loads(sys.argv[1]), print_function=lambda *a: None))
print(os.getcwd())
"""


def _deploy_tiny(env: dict, pool: str) -> list[dict]:
    subprocess.run([str(BIN / "prefect"), "work-pool", "create", pool, "--type", "process"], env=env, cwd=REPO,
                   capture_output=True, timeout=120, check=True)
    out = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--name", "tiny", "--pool", pool], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    with prefect_client(env) as client:
        return client.read_deployment_by_name("eagle3-pipeline/tiny").pull_steps


@pytest.mark.slow
def test_repo_dir_is_baked_in_when_set_at_deploy_time_else_read_by_each_worker(prefect_server, tmp_path):
    """prefect.yaml's pull step reads "{{ $EAGLE3_REPO_DIR }}". Set in the shell that runs `prefect deploy`, it is
    stored as a literal path; unset there, the placeholder is stored and the flow process (the worker's
    environment) fills it in when the run starts. deployments/README.md says so."""
    env, _ = prefect_server
    baked = _deploy_tiny({**env, "EAGLE3_REPO_DIR": "/checkout/of/the/deploying/machine"}, "baked-pool")
    assert baked == [{"prefect.deployments.steps.set_working_directory": {
        "directory": "/checkout/of/the/deploying/machine"}}]

    late = _deploy_tiny({k: v for k, v in env.items() if k != "EAGLE3_REPO_DIR"}, "late-pool")
    assert late == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $EAGLE3_REPO_DIR }}"}}]
    worker_checkout = tmp_path / "worker-checkout"
    worker_checkout.mkdir()
    out = subprocess.run([sys.executable, "-c", _RUN_PULL_STEPS, json.dumps(late)], cwd=tmp_path, text=True,
                         env={**env, "EAGLE3_REPO_DIR": str(worker_checkout)}, capture_output=True, timeout=120,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == str(worker_checkout)


_FLOW = """
import sys, time
sys.path.insert(0, {repo!r})
from tasks.prefect_env import apply_prefect_env_defaults
apply_prefect_env_defaults()
from prefect import flow
from prefect.runtime import flow_run

@flow(name="heartbeat-probe")
def probe():
    with open({marker!r}, "w") as f:
        f.write(str(flow_run.id))
    time.sleep(900)

probe()
"""


def _heartbeat_seen(client, flow_run_id: str) -> bool:
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    page = client.read_events(filter=EventFilter(event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                                                 resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"])),
                             limit=10)  # the client's default (100) is over the server's maximum (50)
    return bool(page.events)


@pytest.mark.slow
def test_kill_9_flow_run_is_marked_crashed_and_a_live_one_is_not(prefect_server, tmp_path):
    env, _ = prefect_server
    heartbeat_s, window_s = 30, 45  # Prefect's minimum heartbeat interval; a window above it
    name = f"test-crash-detection-{uuid.uuid4().hex[:8]}"
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        assert ensure_zombie_automation(window_s, name) == "created"
        assert ensure_zombie_automation(window_s, name) == "unchanged"
    flow_env = {**env, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(heartbeat_s)}
    procs = {}
    try:
        for role in ("killed", "alive"):
            marker = tmp_path / f"{role}.id"
            script = textwrap.dedent(_FLOW.format(repo=str(REPO), marker=str(marker)))
            procs[role] = (start_process([sys.executable, "-c", script], flow_env, tmp_path / f"{role}.log"), marker)
        ids = {role: wait_for(f"{role} flow run started", lambda m=m: m.exists() and m.read_text(), 180)
               for role, (_, m) in procs.items()}
        with prefect_client(env) as client:
            wait_for("first heartbeat of the run to be killed", lambda: _heartbeat_seen(client, ids["killed"]), 120)
            os.killpg(procs["killed"][0].pid, signal.SIGKILL)
            procs["killed"][0].wait(30)
            killed_at = time.monotonic()

            def crashed():
                state = client.read_flow_run(ids["killed"]).state
                return state if state.type.value == "CRASHED" else None

            state = wait_for("kill -9'ed run marked Crashed", crashed, window_s + 90)
            assert name in (state.message or ""), state
            assert time.monotonic() - killed_at >= window_s - heartbeat_s - 5  # not before the window could end
            alive = client.read_flow_run(ids["alive"]).state
            assert procs["alive"][0].poll() is None and alive.type.value == "RUNNING", alive
    finally:
        for proc, _ in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        with prefect_client(env) as client:
            for automation in client.read_automations_by_name(name):
                client.delete_automation(automation.id)
