"""Multi-node training through Prefect: one flow run per node on its host's work queue, watched until all finish.

Pipeline position: the train stage (tasks/train.py) when ``train.nodes > 1``. Prefect places the nodes: one run of
``placement.deployment`` (flow ``eagle3-train-node``) per host of ``placement.hosts``, node 0 first, each on its
host's work queue with its host's GPU slots. Torch elastic's rendezvous joins them into one process group
(eagle3/train/launch.py); nothing here talks to the nodes but Prefect's API. Each node's flow run checks the inputs
it sees, takes its own host's GPU guard and runs the elastic launcher with its node rank; node 0 writes the run
folder (checkpoints, metrics, resume state, artifact.json), which the stage then reads back.

``train_on_nodes`` starts the node runs, reads their states every ``placement.poll_seconds``, and returns once all
completed. When one fails (or crashes, or is cancelled), or one has not started within
``train.join_timeout_seconds`` after a worker took the first node's run (no worker took it), it cancels the others and raises
``NodeFailed``: one sentence that names the node, its work queue, its flow run and where its logs are.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import HostConfig, NodePlacement
from eagle3.extract.stage import HiddenStates
from eagle3.train.config import TrainConfig
from eagle3.train.stage import DraftCheckpoint
from eagle3.vocab import VocabMapping

log = logging.getLogger("eagle3")


class NodeFailed(RuntimeError):
    """A node of a multi-node training failed or never started; the message names it and its logs."""


@dataclass
class NodeRun:
    """What the stage knows of one node's flow run (read from the API)."""

    rank: int
    work_queue: str
    flow_run_id: str
    name: str
    created_at: float  # time.monotonic() when the run was created
    work_pool: str | None = None
    state: str = "SCHEDULED"  # StateType value
    message: str = ""
    state_at: float = 0.0  # the state's timestamp (seconds since the epoch): which failure came first
    taken_at: float | None = None  # time.monotonic() when a worker was first seen to have taken the run (Pending or
    # later: the flow process may take a while to start on a loaded host)

    @property
    def taken(self) -> bool:
        return self.taken_at is not None

    @property
    def final(self) -> bool:
        return self.state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")

    def logs(self, out_dir: str | Path) -> str:
        return (f"`prefect flow-run logs {self.flow_run_id}` and {Path(out_dir) / 'torchrun-logs' / f'node-{self.rank}'}"
                f"{'/ (and train-rank0.log)' if self.rank == 0 else '/'}")


def failure(runs: list[NodeRun], join_timeout_s: float, out_dir: str | Path, now: float) -> str | None:
    """The one-sentence reason the multi-node training cannot go on (None while it can). Nodes whose run no worker
    took are the cause before any failure they led to: a run still waiting on its work queue ``join_timeout_s`` after
    a worker took the first node's run (that node then waits for it at the rendezvous), or after the runs were created
    when no worker took any, or when another node already failed. Otherwise the node that failed first."""
    failed = sorted((r for r in runs if r.final and r.state != "COMPLETED"), key=lambda r: r.state_at)
    since = min((r.taken_at for r in runs if r.taken_at is not None), default=min(r.created_at for r in runs))
    missing = [r for r in runs if not r.taken and r.state != "COMPLETED" and (failed or now - since > join_timeout_s)]
    if missing:
        who = " and ".join(str(r.rank) for r in missing)
        runs_text = ", ".join(f"'{r.name}' from work queue '{r.work_queue}'" for r in missing)
        cause = next((r for r in failed if r not in missing), None)
        gave_up = f"; node {cause.rank} gave up: {_short(cause.message) or cause.state}" if cause else ""
        queues = " / ".join(f"deployments/start_worker.sh {r.work_pool} {r.work_queue}" for r in missing)
        if len(missing) > 1:
            nodes, their, where = "nodes", "their flow runs", "those queues on their hosts"
        else:
            nodes, their, where = "node", "its flow run", "that queue on the node's host"
        return (f"{nodes} {who} of {len(runs)} never started: no worker took {their} {runs_text} (pool "
                f"'{missing[0].work_pool}') within {join_timeout_s:g} s (train.join_timeout_seconds){gave_up}. Start "
                f"a worker on {where} ({queues})")
    if failed:
        r = failed[0]
        return (f"node {r.rank} of {len(runs)} (work queue '{r.work_queue}', flow run '{r.name}') ended "
                f"{r.state}: {_short(r.message) or 'no message'}; its logs: {r.logs(out_dir)}")
    return None


def _short(message: str, limit: int = 600) -> str:
    """A node run's state message on one line, cut to ``limit`` characters (a worker's failure record spans many
    lines; its logs hold the whole)."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def train_on_nodes(cfg: TrainConfig, store: HiddenStates, vocab: VocabMapping, out_dir: str | Path,
                   placement: NodePlacement, host: HostConfig | None) -> DraftCheckpoint:
    """Train on ``cfg.nodes`` hosts: one flow run per node, all waited for; -> the checkpoint node 0 wrote into
    ``out_dir``. Raises NodeFailed (after cancelling the other node runs) when a node fails or never starts."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL

    host = HostConfig.model_validate(host or {})
    cfg = cfg.model_copy(update={"rdzv_id": cfg.rdzv_id or f"eagle3-{uuid.uuid4().hex[:12]}"})
    parent = flow_run.name or "eagle3"
    runs: list[NodeRun] = []
    reason = "the multi-node training stopped before this node finished"
    try:
        for rank, node in enumerate(placement.hosts):
            node_host = host.model_copy(update={"gpu_concurrency_limit": node.gpu_concurrency_limit
                                                or host.gpu_concurrency_limit})
            params = {"cfg": cfg.model_dump(mode="json"), "store": store.model_dump(mode="json"),
                      "vocab": vocab.model_dump(mode="json"), "out_dir": str(out_dir), "node_rank": rank,
                      "host": node_host.model_dump(mode="json"), "address": node.address}
            try:
                fr = run_deployment(placement.deployment, parameters=params, work_queue_name=node.work_queue,
                                    timeout=0, flow_run_name=f"{parent}-node{rank}",
                                    idempotency_key=f"{cfg.rdzv_id}-node{rank}")
            except ObjectNotFound:
                raise NodeFailed(f"placement.deployment '{placement.deployment}' is not registered on the Prefect "
                                 f"server at {PREFECT_API_URL.value() or '(none: a temporary local API)'}: a "
                                 f"multi-node training needs a server, `prefect deploy --name train-node` from the "
                                 f"checkout, and a worker on each host's work queue (deployments/README.md)") from None
            runs.append(NodeRun(rank, node.work_queue, str(fr.id), fr.name, time.monotonic(), fr.work_pool_name))
            log.info("[train] node %d of %d: flow run %s (%s) on work queue %s", rank, cfg.nodes, fr.name, fr.id,
                     node.work_queue)
        with get_client(sync_client=True) as client:
            while True:
                for r in runs:
                    _update(r, client.read_flow_run(r.flow_run_id))
                if all(r.state == "COMPLETED" for r in runs):
                    break
                if problem := failure(runs, cfg.join_timeout_seconds, out_dir, time.monotonic()):
                    reason = f"cancelled: {problem}"
                    raise NodeFailed(problem)
                time.sleep(placement.poll_seconds)
    finally:
        if runs and not all(r.state == "COMPLETED" for r in runs):
            _cancel(runs, reason)
    log.info("[train] all %d nodes completed: %s", cfg.nodes, ", ".join(r.name for r in runs))
    return DraftCheckpoint.load(out_dir)


def _update(run: NodeRun, fr) -> None:
    """Record the node run's latest state (logged when it changes)."""
    state = fr.state
    kind = state.type.value if state else "SCHEDULED"
    if kind != run.state:
        log.info("[train] node %d (%s): %s%s", run.rank, run.name, state.name if state else kind,
                 f": {state.message}" if state and state.message and kind != "RUNNING" else "")
    run.state, run.message = kind, (state.message or "") if state else ""
    run.state_at = state.timestamp.timestamp() if state and state.timestamp else time.time()
    if run.taken_at is None and kind not in ("SCHEDULED", "CANCELLED"):  # Pending or later: a worker has it
        run.taken_at = time.monotonic()
    run.work_pool = fr.work_pool_name or run.work_pool


def _cancel(runs: list[NodeRun], reason: str) -> None:
    """Cancel every node run not finished yet: a scheduled one at once, a pending or running one through its worker
    (which ends the flow process; the launcher's workers die with it)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling

    with get_client(sync_client=True) as client:
        for r in runs:
            try:
                state = client.read_flow_run(r.flow_run_id).state
                if state is None or state.is_final():
                    continue
                new = Cancelled(message=reason) if state.is_scheduled() else Cancelling(message=reason)
                client.set_flow_run_state(r.flow_run_id, new, force=True)
                log.warning("[train] node %d (%s) %s: %s", r.rank, r.name, new.name.lower(), reason)
            except Exception as e:  # noqa: BLE001 - one node's API error must not keep the others running
                log.warning("[train] could not cancel node %d (%s): %s", r.rank, r.name, e)
