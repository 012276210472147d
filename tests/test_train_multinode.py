"""Multi-node training against real parts: `prefect server start` on loopback (tests/conftest.py), `prefect deploy`
from prefect.yaml, two process workers on two work queues standing for two hosts (each with its own lock folder, its
own GPU concurrency limit), `prefect deployment run eagle3-pipeline/tiny-2nodes` as a user runs it, torch elastic's
c10d rendezvous on a loopback port and gloo between the nodes' training processes.

* 2 nodes x 1 process train the same draft as 1 node x 2 processes and as 1 process (metrics and weights);
* kill -9 of node 1's training process mid-epoch: torch elastic restarts both nodes' workers, they resume from the
  last resume state (time-based interval) and finish with the uninterrupted run's metrics;
* a node whose work queue has no worker: the run fails with one sentence naming it, and the other node's run is
  cancelled;
plus the parts without a server: settings, the failure sentence, the rendezvous timeout of a lonely node 0.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import BIN, REPO, prefect_client, start_process, wait_for
from safetensors.torch import load_file

from eagle3.train.config import TrainConfig
from tasks.prefect_env import stop_process_group

POOL = "gpu-host"  # prefect.yaml's work pool (deployments/setup_prefect.sh makes it on a real server)
HOSTS = ("gpu-host-a", "gpu-host-b")  # the work queues of prefect.yaml's tiny-2nodes deployment
NOBODY = "mn-nobody"  # a work queue no worker polls
FREEZE_HOOK = REPO / "tests" / "freeze_hook"  # test-only: stops a training worker at a chosen step
TOL = 1e-5  # the DDP test's tolerance (tests/test_train.py test_two_gloo_processes_equal_one)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    assert not check or out.returncode == 0, f"{' '.join(cmd)} ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def two_hosts(prefect_server, tmp_path_factory):
    """The node deployment and the CPU smoke-test deployment registered from prefect.yaml in pool mn-pool, each
    "host" a process worker on its own work queue with its own lock folder and a one-slot GPU concurrency limit.
    Host b's processes load tests/freeze_hook (the kill -9 test freezes its training worker at a chosen step).
    Yields (env for the CLI, {queue: lock folder}, the freeze hook's spec file)."""
    env, home = prefect_server
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with prefect_client(env) as client:
        with contextlib.suppress(ObjectAlreadyExists):  # another test of the session made it
            client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
        client.create_work_queue(name=NOBODY, work_pool_name=POOL)
        for queue in HOSTS:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=f"{queue}-gpus", limit=1))
    # as the README deploys: EAGLE3_REPO_DIR unset, each worker's own checkout is read when a run starts
    _run([str(BIN / "prefect"), "--no-prompt", "deploy", "--name", "tiny-2nodes", "--name", "train-node"],
         {k: v for k, v in env.items() if k != "EAGLE3_REPO_DIR"})
    root = tmp_path_factory.mktemp("hosts")
    locks, workers = {}, []
    for queue in HOSTS:
        locks[queue] = str(root / f"locks-{queue}")
        worker_env = {**env, "EAGLE3_LOCK_DIR": locks[queue], "PREFECT_WORKER_QUERY_SECONDS": "1",
                      "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
        if queue == HOSTS[1]:  # host b's training processes can be frozen at a step (tests/freeze_hook)
            worker_env.update(EAGLE3_TEST_FREEZE=str(root / "freeze.json"), PYTHONPATH=str(FREEZE_HOOK))
        workers.append(start_process([str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--work-queue", queue,
                                      "--type", "process"], worker_env, home / f"worker-{queue}.log"))
    yield env, locks, root / "freeze.json"
    for worker in workers:
        stop_process_group(worker)


def _overrides(tmp_path: Path, verifier: Path, run_name: str, hosts=HOSTS, **extra) -> dict:
    """The tiny-2nodes preset made small: the random tiny Llama, 64 chats (2 epochs of 8 steps), two hosts on
    loopback, validation without vLLM. ``extra``: runtime settings only, so every run here trains the same draft."""
    return {"run_name": run_name, "runs_dir": str(tmp_path / "runs"), "result_storage": str(tmp_path / "results"),
            "verifier_path": str(verifier), "data.max_samples": 64, "vocab.draft_vocab_size": 256,
            "train.epochs": 2, "train.batch_size": 2, "train.log_every_steps": 1,
            "train.rdzv_endpoint": f"127.0.0.1:{_free_port()}", "train.join_timeout_seconds": 120,
            "placement.poll_seconds": 0.5,
            "placement.hosts": [{"work_queue": q, "gpu_concurrency_limit": f"{q}-gpus" if q in HOSTS else None,
                                 "address": "127.0.0.1"} for q in hosts],
            "validate.run_vllm": False, "validate.compare_untrained": False, "validate.offline_reference": False,
            "validate.min_mean_acceptance_length": None, **extra}


def _deployment_run(env: dict, overrides: dict) -> subprocess.CompletedProcess:
    """`prefect deployment run eagle3-pipeline/tiny-2nodes -p overrides=... --watch`, as a user starts it."""
    return _run([str(BIN / "prefect"), "deployment", "run", "eagle3-pipeline/tiny-2nodes", "-p",
                 f"overrides={json.dumps(overrides)}", "--watch", "--watch-timeout", "900"], env, timeout=950,
                check=False)


def _local_run(env: dict, overrides: dict, log: Path) -> subprocess.Popen:
    """The coordinating flow run from a shell against the server: `python -m flows.eagle3_pipeline --preset
    tiny-2nodes --set KEY=VALUE ...` with PREFECT_API_URL set (the nodes still run on the workers)."""
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    with open(log, "wb") as out:
        return subprocess.Popen([str(BIN / "python"), "-m", "flows.eagle3_pipeline", "--preset", "tiny-2nodes", *sets],
                                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _max_diffs(a: list[dict], b: list[dict]) -> dict[str, float]:
    """Max |difference| of the records' losses and simulated acceptance (same records, same token counts)."""
    assert [(r["event"], r["global_step"]) for r in a] == [(r["event"], r["global_step"]) for r in b]
    assert all(x["counted_per_step"] == y["counted_per_step"] for x, y in zip(a, b))
    return {"loss": max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)),
            "loss_per_step": max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x["loss_per_step"], y["loss_per_step"])),
            "sim_accept_len": max(abs(x["sim_accept_len"] - y["sim_accept_len"]) for x, y in zip(a, b))}


def _weights_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)


def _stage(run_dir: Path, stage: str) -> Path:
    (folder,) = run_dir.glob(f"{stage}-*")
    return folder


def _reference(train_dir: Path, store: Path, vocab: Path, verifier: Path, out: Path, **update):
    """The same run trained by the library on this machine, with other placement (runtime) settings."""
    from eagle3.train.stage import train_draft

    run = json.loads((train_dir / "checkpoints" / "best" / "eagle3_run.json").read_text())["run_config"]
    cfg = TrainConfig.model_validate({**run, "nodes": 1, "rdzv_endpoint": None, "rdzv_id": None, "max_restarts": 0,
                                      **update})
    return train_draft(cfg, store, vocab, out, verifier=verifier)


@pytest.fixture(scope="module")
def uninterrupted(two_hosts, tiny_llama_verifier, tmp_path_factory):
    """One 2-node training through `prefect deployment run` (the user's path): -> (its run folder, the train stage
    folder, its overrides)."""
    env = two_hosts[0]
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    overrides = _overrides(tmp_path, tiny_llama_verifier, "mn-equal")
    out = _deployment_run(env, overrides)
    assert out.returncode == 0 and "Completed" in out.stdout, out.stdout[-5000:] + out.stderr[-3000:]
    run_dir = tmp_path / "runs" / "mn-equal"
    return run_dir, _stage(run_dir, "train-draft"), overrides


@pytest.mark.slow
def test_two_nodes_train_the_same_draft_as_one_node(two_hosts, uninterrupted, tiny_llama_verifier, tmp_path):
    env, locks, _ = two_hosts
    run_dir, train_dir, _ = uninterrupted
    store, vocab = _stage(run_dir, "extract-hidden-states") / "store", _stage(run_dir, "build-vocab")
    artifact = json.loads((train_dir / "artifact.json").read_text())
    assert (artifact["nodes"], artifact["nproc"]) == (2, 2)
    assert "draft wrapped in DDP over 2 process(es) (gloo)" in (train_dir / "train-rank0.log").read_text()
    assert sorted(p.name for p in (train_dir / "torchrun-logs").iterdir()) == ["node-0", "node-1"]
    with prefect_client(env) as client:  # one flow run per node, each on its host's work queue, under its host's lock
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId

        nodes = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["eagle3-train-node"])))
        mine = sorted((fr for fr in nodes if fr.parameters.get("out_dir") == str(train_dir)), key=lambda f: f.name)
        logs = {fr.name: " ".join(r.message for r in client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))) for fr in mine}
    assert [(fr.name.rsplit("-", 1)[1], fr.work_queue_name, fr.state.type.value) for fr in mine] == [
        ("node0", HOSTS[0], "COMPLETED"), ("node1", HOSTS[1], "COMPLETED")]
    for fr, queue in zip(mine, HOSTS):
        assert f"holding host-cpu (lock dir {locks[queue]})" in logs[fr.name], logs[fr.name][-2000:]

    two = _metrics(train_dir)
    one_by_two = _reference(train_dir, store, vocab / "mapping.safetensors", tiny_llama_verifier, tmp_path / "1x2",
                            nproc=2)
    one = _reference(train_dir, store, vocab / "mapping.safetensors", tiny_llama_verifier, tmp_path / "1x1",
                     nproc=1, grad_accum_steps=2)  # the same micro-batches, accumulated
    diffs = {"2x1 vs 1x2": _max_diffs(two, _metrics(tmp_path / "1x2")),
             "2x1 vs 1x1": _max_diffs(two, _metrics(tmp_path / "1x1"))}
    weights = {"2x1 vs 1x2": _weights_diff(train_dir / "checkpoints" / "best", Path(one_by_two.checkpoint_dir)),
               "2x1 vs 1x1": _weights_diff(train_dir / "checkpoints" / "best", Path(one.checkpoint_dir))}
    print(f"\nmulti-node equality over {len(two)} metrics records: {diffs}; weights max |diff| {weights}")
    assert all(v <= TOL for d in diffs.values() for v in d.values()), diffs
    assert all(v <= TOL for v in weights.values()), weights


def _training_worker(lock_dir: str) -> psutil.Process | None:
    """The torch elastic worker of the node whose host has ``lock_dir`` (its environment says both)."""
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            e = p.environ()
            if e.get("EAGLE3_LOCK_DIR") == lock_dir and "TORCHELASTIC_RUN_ID" in e and "LOCAL_RANK" in e:
                return p
    return None


def _state(train_dir: Path) -> dict:
    """The progress counters of the resume state in ``latest/``."""
    from eagle3.draft import checkpoint as ckpt

    return ckpt.load_trainer_state(train_dir / "latest")["progress"]


@pytest.mark.slow
def test_kill_9_of_a_node_mid_epoch_restarts_from_the_last_resume_state(two_hosts, uninterrupted, tiny_llama_verifier,
                                                                        tmp_path):
    """Node 1's training process stops itself (SIGSTOP, tests/freeze_hook) about to make step K + 1, K in the middle
    of epoch 2 (every rank then waits for it), and the test kills it with SIGKILL. Torch elastic (max_restarts 1)
    restarts both nodes' workers; they resume from the newest resume state (time-based: save_state_every_minutes)
    and the run ends with the uninterrupted run's metrics and weights. What was lost: the steps after that state,
    trained within one resume interval."""
    env, locks, freeze = two_hosts
    _, reference, _ = uninterrupted
    per_epoch = max(r["global_step"] for r in _metrics(reference)) // 2
    k = per_epoch + per_epoch // 2  # mid-epoch 2
    interval_s = 0.6  # save_state_every_minutes 0.01: a few steps here
    run_dir = tmp_path / "runs" / "mn-kill"
    freeze.write_text(json.dumps({"run_dir": str(run_dir), "step": k, "record": str(tmp_path / "frozen.json")}))
    coordinator = _local_run(env, _overrides(tmp_path, tiny_llama_verifier, "mn-kill", **{
        "train.max_restarts": 1, "train.save_state_every_minutes": interval_s / 60}), tmp_path / "coordinator.log")
    try:
        frozen = wait_for("node 1's worker frozen at the chosen step", lambda: (tmp_path / "frozen.json").is_file()
                       and json.loads((tmp_path / "frozen.json").read_text()), 600, 0.2)
        victim = psutil.Process(frozen["pid"])
        wait_for("node 1's worker stopped", lambda: victim.status() == psutil.STATUS_STOPPED, 30, 0.1)
        assert victim.environ()["EAGLE3_LOCK_DIR"] == locks[HOSTS[1]]  # host b's training process
        train_dir = next(run_dir.glob("train-draft-*"))
        state = _state(train_dir)  # what a restart can resume from, as it stands at the freeze
        since_save_s = frozen["time"] - (train_dir / "latest" / "trainer_state.json").stat().st_mtime
        victim.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        resumed = wait_for("the restarted workers resume", lambda: re.search(
            r"resumed from .* global step (\d+)", (train_dir / "train-rank0.log").read_text()), 600, 0.2)
        recovery_s = time.monotonic() - t_kill
        assert coordinator.wait(900) == 0, (tmp_path / "coordinator.log").read_text()[-5000:]
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    before = (train_dir / "train-rank0.log").read_text().split("[train] resumed from", 1)[0]
    saves = [int(x) for x in re.findall(r"resume state saved at global step (\d+)", before)]
    start = int(resumed.group(1))
    assert frozen["global_step"] == k and start == state["global_step"] == saves[-1] <= k  # the newest state
    # torch elastic restarted node 1's process (a restart counted there: attempt_1) and node 0's, which resumed above
    # (node 0 follows the new round; torch counts that restart only when its own process failed first)
    attempts = {n: {p.name for p in (train_dir / "torchrun-logs" / n).glob("*/attempt_*")} for n in ("node-0", "node-1")}
    assert attempts["node-1"] == {"attempt_0", "attempt_1"} and attempts["node-0"] <= {"attempt_0", "attempt_1"}
    lost_steps = k - start
    # the work lost is what was trained since that state: under one interval (plus the save's own duration)
    assert lost_steps == 0 or since_save_s <= interval_s + 2.0, (since_save_s, saves)
    print(f"\nkill -9 of node 1 after global step {k} of {2 * per_epoch} (mid-epoch 2), {since_save_s:.2f} s after "
          f"the resume state of step {start} (save_state_every_minutes = {interval_s:.1f} s; saves at steps "
          f"{saves}): {lost_steps} step(s) redone; training resumed {recovery_s:.1f} s after the kill")
    # the uninterrupted 2-node run: the same metrics (the restart redid the lost steps exactly), the same weights
    drop = ("tokens_per_s",)  # wall clock
    a = [{key: v for key, v in r.items() if key not in drop} for r in _metrics(train_dir)]
    b = [{key: v for key, v in r.items() if key not in drop} for r in _metrics(reference)]
    diffs = _max_diffs(a, b)
    assert all(v <= TOL for v in diffs.values()), diffs
    assert _weights_diff(train_dir / "checkpoints" / "best", reference / "checkpoints" / "best") <= TOL


@pytest.mark.slow
def test_node_without_a_worker_fails_the_run_naming_it_and_cancels_the_other(two_hosts, uninterrupted, tmp_path):
    """Node 1's work queue has no worker: join_timeout_seconds after host a's worker took node 0's run the train stage
    fails with one sentence naming node 1, its flow run and its work queue, node 1's run is cancelled before it ever
    starts, and node 0's run is cancelled through its worker, which leaves no training process behind."""
    env, locks, _ = two_hosts
    # the uninterrupted run's folder and cache (its data stages are cache hits) with another seed: a new train stage
    nobody = {"placement.hosts": [{"work_queue": q, "address": "127.0.0.1"} for q in (HOSTS[0], NOBODY)]}
    coordinator = _local_run(env, {**uninterrupted[2], "train.seed": 1, "train.join_timeout_seconds": 10,
                                   "train.rdzv_endpoint": f"127.0.0.1:{_free_port()}", **nobody},
                             tmp_path / "coordinator.log")
    assert coordinator.wait(600) != 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    with prefect_client(env) as client:
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterName

        (run,) = [fr for fr in client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["eagle3-pipeline"])),
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="mn-equal-"))) if fr.state.is_failed()]
        node_runs = sorted(client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(like_=f"{run.name}-node"))), key=lambda f: f.name)
        assert [fr.name for fr in node_runs] == [f"{run.name}-node0", f"{run.name}-node1"]
        assert re.fullmatch(
            rf"Flow run encountered an exception: NodeFailed: node 1 of 2 never started: no worker took its flow run "
            rf"'{run.name}-node1' from work queue '{NOBODY}' \(pool '{POOL}'\) within 10 s "
            rf"\(train.join_timeout_seconds\)(; node 0 gave up: .*)?\. Start a worker on that queue on the node's host "
            rf"\(deployments/start_worker.sh {POOL} {NOBODY}\)", run.state.message), run.state.message
        assert node_runs[1].state.type.value == "CANCELLED"
        # never pending or running: Scheduled (and Late, a SCHEDULED-type state Prefect's late-runs service sets once
        # the run is 15 s past its start time on a slow machine), then Cancelled
        history = [(st.type.value, st.name) for st in client.read_flow_run_states(node_runs[1].id)]
        assert [t for t, _ in history] == ["SCHEDULED"] * (len(history) - 1) + ["CANCELLED"], history
        assert {name for t, name in history if t == "SCHEDULED"} <= {"Scheduled", "Late"}, history
        wait_for("node 0's run ended by its worker", lambda: client.read_flow_run(node_runs[0].id).state.type.value
              in ("CANCELLED", "FAILED", "CRASHED"), 120, 0.5)
    wait_for("node 0's training processes gone", lambda: _training_worker(locks[HOSTS[0]]) is None, 60, 0.5)


# ---------------------------------------------------------------- without a server


def test_multi_node_settings_are_runtime_and_checked():
    from eagle3.config import ConfigError, load_config
    from eagle3.support.settings import output_view
    from tasks.common import stage_key

    one = load_config("kimi-k2.5").train_config()
    two = load_config("kimi-k2.5-2nodes").train_config()
    assert (one.nodes, two.nodes, two.world_size) == (1, 2, 16)
    # the placement is runtime: the 2-node preset is the one-host run with a doubled global batch, and a one-host run
    # of its settings (grad_accum_steps 2) has the same training folder and cache key
    assert output_view(two, keep_resumable=True) == {**output_view(one, keep_resumable=True), "batch_size": 16}
    local = two.model_copy(update={"nodes": 1, "rdzv_endpoint": None, "grad_accum_steps": 2})
    placement = load_config("kimi-k2.5-2nodes").placement
    assert stage_key("train-draft", {"cfg": two, "placement": placement}) == stage_key("train-draft", {"cfg": local})
    with pytest.raises(ValueError, match="rdzv_endpoint is required with nodes 2 > 1"):
        TrainConfig(nodes=2)
    with pytest.raises(ValueError, match="rdzv_endpoint 'gpu-host-a': expected host:port"):
        TrainConfig(nodes=2, rdzv_endpoint="gpu-host-a")
    with pytest.raises(ConfigError, match=r"placement.hosts lists 1 host\(s\) but train.nodes is 2"):
        load_config("kimi-k2.5-2nodes", {"placement.hosts": [{"work_queue": "a"}]})
    with pytest.raises(ConfigError, match=r"train.batch_size 8 .* not a multiple of nodes 2 x nproc 8 x "
                                          r"grad_accum_steps 1"):
        load_config("kimi-k2.5-2nodes", {"train.batch_size": 8})
    assert two.with_smaller_micro_batches(0.5).grad_accum_steps == 1  # 1 row per process: nothing to halve


def test_failure_names_the_node_that_never_started_before_the_one_that_gave_up():
    from tasks.nodes import NodeRun, failure

    def runs():
        return [NodeRun(0, "host-a", "id0", "run-node0", 0.0, "pool"), NodeRun(1, "host-b", "id1", "run-node1", 0.0,
                                                                            "pool")]

    r = runs()
    r[0].state, r[0].taken_at = "PENDING", 50.0  # a worker took node 0's run at 50 s: it will wait at the rendezvous
    assert failure(r, 60, "/runs/x", now=109) is None  # node 1 may still start
    assert failure(r, 60, "/runs/x", now=111) == (
        "node 1 of 2 never started: no worker took its flow run 'run-node1' from work queue 'host-b' (pool 'pool') "
        "within 60 s (train.join_timeout_seconds). Start a worker on that queue on the node's host "
        "(deployments/start_worker.sh pool host-b)")
    r[0].state, r[0].message = "FAILED", "NodesNotJoined: node 0: the rendezvous ..."
    assert "; node 0 gave up: NodesNotJoined: node 0: the rendezvous ..." in failure(r, 60, "/runs/x", now=55)
    r = runs()  # no worker on either queue: both named once the runs are join_timeout old
    assert failure(r, 60, "/runs/x", now=59) is None
    assert failure(r, 60, "/runs/x", now=61).startswith(
        "nodes 0 and 1 of 2 never started: no worker took their flow runs 'run-node0' from work queue 'host-a', "
        "'run-node1' from work queue 'host-b' (pool 'pool')")
    r = runs()
    for x in r:
        x.taken_at = 1.0
    r[0].state, r[0].message, r[0].state_at = "FAILED", "lost its peer", 20.0
    r[1].state, r[1].message, r[1].state_at = "CRASHED", "exited with -9", 10.0
    assert failure(r, 60, "/runs/x", now=5) == (
        "node 1 of 2 (work queue 'host-b', flow run 'run-node1') ended CRASHED: exited with -9; its logs: "
        "`prefect flow-run logs id1` and /runs/x/torchrun-logs/node-1/")


def test_a_node_refuses_inputs_it_does_not_see_as_recorded(tiny_llama_verifier, tmp_path):
    """A node's host must see the store and the vocab mapping the pipeline recorded (shared storage at the same
    path): a node that does not fails before its guard, naming itself and the files."""
    import socket

    from eagle3.extract.stage import HiddenStates
    from eagle3.train.config import TrainError
    from eagle3.train.stage import train_draft

    store = HiddenStates.model_construct(out_dir=str(tmp_path / "extract"), store_path=str(tmp_path / "extract" /
                                                                                           "store"))
    cfg = TrainConfig(nodes=2, rdzv_endpoint="127.0.0.1:29400", rdzv_id="x", device="cpu")
    with pytest.raises(TrainError, match=rf"node 1 \({re.escape(socket.gethostname())}\) does not see the training "
                                         rf"inputs the pipeline recorded: {re.escape(str(tmp_path))}/extract/store is "
                                         r"missing.*Every host must mount the run folder at the same path"):
        train_draft(cfg, store, tmp_path / "mapping.safetensors", tmp_path / "out", verifier=tiny_llama_verifier,
                    node_rank=1)
    assert not (tmp_path / "out").exists()


def test_a_lonely_node_0_times_out_at_the_rendezvous_naming_itself(tmp_path):
    """Node 0 waits for a node that never comes: one NodesNotJoined sentence after join_timeout_seconds."""
    from eagle3.train.launch import NodesNotJoined, launch

    cfg = TrainConfig(nodes=2, rdzv_endpoint=f"127.0.0.1:{_free_port()}", rdzv_id="lonely", join_timeout_seconds=3,
                      device="cpu")
    start = time.monotonic()
    with pytest.raises(NodesNotJoined, match=rf"node 0: the rendezvous lonely at {re.escape(cfg.rdzv_endpoint)} did "
                                            r"not gather all 2 nodes within 3 s \(train.join_timeout_seconds\)"):
        launch(cfg, tmp_path / "store", tmp_path / "vocab", tmp_path / "verifier", tmp_path / "out")
    assert time.monotonic() - start < 60
