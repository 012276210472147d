"""End-to-end against real parts: `prefect server start` (SQLite) on loopback, the work pool and the GPU
concurrency limit made by deployments/setup_prefect.sh, `prefect deploy` from prefect.yaml, a process worker,
and `prefect deployment run ... --watch` on the bundled verifier with tiny settings. Then the artifacts are read
back through the API, and a second run must hit the cache at every stage.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time

import pytest
from helpers import BIN, REPO, start_process

from tasks.prefect_env import stop_process_group

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TINY_E2E_OVERRIDES = {  # one-setting overrides, as `prefect deployment run -p overrides=...` takes them
    "data.max_samples": 48, "train.epochs": 1, "train.ttt_steps": 2,
    # real vLLM validation, without the extra engine starts and the demo's acceptance threshold
    "validate.num_prompts": 2, "validate.max_new_tokens": 16, "validate.compare_untrained": False,
    "validate.offline_reference": False, "validate.min_mean_acceptance_length": None,
}


def _run(cmd: list[str], env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


def test_deployment_run_end_to_end_then_fully_cached(prefect_server, tmp_path):
    env, home = prefect_server
    _run(["bash", "deployments/setup_prefect.sh", "e2e-pool", "e2e-gpus", "1"], env)
    # as the README deploys: EAGLE3_REPO_DIR unset, so the worker's (the checkout) is read when each run starts
    _run([str(BIN / "prefect"), "--no-prompt", "deploy", "--name", "tiny", "--pool", "e2e-pool"],
         {k: v for k, v in env.items() if k != "EAGLE3_REPO_DIR"})
    worker = start_process([str(BIN / "prefect"), "worker", "start", "--pool", "e2e-pool", "--type", "process"],
                           env, home / "worker.log")
    try:
        # the deployment's own config (the tiny preset, on the host's GPU slots) plus one-setting overrides
        overrides = {"runs_dir": str(tmp_path / "runs"), "result_storage": str(tmp_path / "results"),
                     "host.gpu_concurrency_limit": "e2e-gpus", **TINY_E2E_OVERRIDES}
        runs = []
        for _ in range(2):
            out = _run([str(BIN / "prefect"), "deployment", "run", "eagle3-pipeline/tiny", "-p",
                        f"overrides={json.dumps(overrides)}", "--watch", "--watch-timeout", "1500"], env,
                       timeout=1600)
            runs.append(out.stdout)
    finally:
        stop_process_group(worker)
    assert all("Completed" in r for r in runs), runs[-1][-3000:] + (home / "worker.log").read_text()[-5000:]

    summary = asyncio.run(_inspect_runs(env))
    first, second = summary
    assert first["state"] == "COMPLETED" and second["state"] == "COMPLETED"
    assert first["name"] != second["name"] and first["name"].startswith("tiny-demo-"), (first["name"], second["name"])
    assert "run-summary" in second["artifact_keys"]  # a fully cached run still says where the draft is
    stages = STAGES
    assert stages <= set(first["task_states"]), first["task_states"]
    assert all(first["task_states"][s] == "Completed" for s in stages), first["task_states"]
    assert all(second["task_states"][s] == "Cached" for s in stages), second["task_states"]
    for key in ("dataset-stats", "capacity-plan", "vocab-coverage", "extract-progress", "extract-summary",
                "train-summary", "train-curves", "validation-acceptance", "validation-report"):
        assert key in first["artifact_keys"], (key, first["artifact_keys"])
    # in a worker's flow process too, every line of the flow's starts with the stage (task) or flow that wrote it;
    # before it, only Prefect's worker and engine write (submission, pull steps)
    for run in (first, second):
        assert set(run["log_tags"]) <= {"eagle3-pipeline", "describe-verifier", "describe-sources",
                                        "describe-tokenizer", "describe-prompts", *stages}, run["log_tags"]
        assert all(name.startswith("prefect.") for name in run["pre_flow_loggers"]), run["pre_flow_loggers"]


STAGES = {"prepare-data", "plan-capacity", "extract-hidden-states", "build-vocab", "train-draft", "validate-draft"}


async def _inspect_runs(env: dict) -> list[dict]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):  # this process may hold other settings
        return await _read_runs()


async def _read_runs(deadline_s: float = 60.0) -> list[dict]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    async with get_client() as client:
        # the session's server also holds other tests' runs: only this flow's
        flow_runs = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["eagle3-pipeline"])),
                                                sort=FlowRunSort.START_TIME_ASC)
        result = []
        for fr in flow_runs:
            flt = FlowRunFilter(id=FlowRunFilterId(any_=[fr.id]))
            deadline = time.monotonic() + deadline_s
            while True:  # task-run states reach the server asynchronously: wait until all are final
                task_runs = await client.read_task_runs(flow_run_filter=flt)
                names = {tr.name.rsplit("-", 1)[0] for tr in task_runs}
                if (all(tr.state and tr.state.is_final() for tr in task_runs) and STAGES <= names) \
                        or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            states = {}
            for tr in task_runs:
                states[tr.name.rsplit("-", 1)[0]] = tr.state.name  # run names are "<task name>-<suffix>"
            arts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
            logs = sorted(await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id]))),
                          key=lambda entry: entry.timestamp)
            # the worker's and the engine's lines before the flow starts (submission, deployment pull steps) come
            # before any code of ours runs in that process: the lines from the flow's first one on carry the tags
            start = next((i for i, e in enumerate(logs) if "Beginning flow run" in e.message), 0)
            result.append({"state": fr.state.type.value, "name": fr.name, "task_states": states,
                           "artifact_keys": sorted({a.key for a in arts if a.key}),
                           "log_tags": sorted({m.group(1) if (m := re.match(r"\[([\w.-]+)\] ", entry.message))
                                               else f"untagged: {entry.message[:80]}" for entry in logs[start:]}),
                           "pre_flow_loggers": sorted({entry.name for entry in logs[:start]})})
        return result
