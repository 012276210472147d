"""Multi-process training through torch's elastic launch API (``torch.distributed.launcher.elastic_launch``).

Pipeline position: part of **train** (eagle3.train.stage calls ``launch`` when ``nproc > 1`` or ``nodes > 1``).

``launch`` starts ``nproc`` worker processes on this machine, each running ``_worker``: it joins the process group
(gloo on CPU, nccl on CUDA) and runs the same ``Trainer`` as a single process; the global batch is split over the
workers, so the run computes the same losses as one process with the same ``batch_size``. Rank 0's outcome comes
back as its return value (no job or result files); a rank that meets bad input raises, the agent stops the others,
and its message comes back through torch elastic's own failure record as a TrainError.

One host: a c10d rendezvous on a free local port. Several hosts (``nodes > 1``): every host calls ``launch`` with its
``node_rank`` (the pipeline starts one Prefect flow run per host, tasks/nodes.py); the agents meet in torch's c10d
rendezvous at ``rdzv_endpoint``, which node 0's agent hosts (``is_host``), or at an etcd server. Torch numbers the
nodes by host name and process id; the workers take global rank ``node_rank * nproc + local_rank`` (torchrun's
static layout) before they join the process group, so node 0 always holds rank 0: the rank that writes the
checkpoints, metrics and resume state, and whose outcome ``launch`` returns on node 0. With ``max_restarts`` the
agents restart every node's workers after one dies (torch elastic's policy: the agent of the failed worker starts
a new rendezvous round and the others follow it, their restart count unchanged); workers always resume from
``latest/`` (a fresh start clears it before the launch). Each round's workers
join the process group on a store of that round: torch 2.13 by default hands the workers the agents' own rendezvous
store, which outlives a restart, and a restarted gloo group then read the previous attempt's peer addresses from it
(measured: "connectFullMesh failed ... Connection refused", on one host too). The launcher turns that sharing off
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``): torch's rank-0 agent then picks a free port per round (MASTER_ADDR /
MASTER_PORT) and torch's rank-0 worker serves a fresh store there (``_join_group``).

Logs: rank 0 writes its log records to ``<out_dir>/train-rank0.log`` and node 0's launcher follows that file into
the ``eagle3`` logger (so progress lines reach the stage's logs); every worker's raw stdout/stderr lands under
``<out_dir>/torchrun-logs/`` (``node-<rank>/`` with several nodes; tracebacks of a crashed worker are in the raised
ChildFailedError too). Workers die with this process: each asks the kernel for SIGKILL when its parent goes
(PR_SET_PDEATHSIG), so a cancelled or killed flow leaves no worker holding a GPU; and at once on SIGTERM (``_worker``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import shutil
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("eagle3")

RANK0_LOG = "train-rank0.log"
_PR_SET_PDEATHSIG = 1


def launch(cfg, store_dir: str | Path, vocab_path: str | Path, verifier_path: str | Path, out_dir: str | Path,
           resume: bool = True, node_rank: int = 0, local_addr: str | None = None) -> dict[str, Any]:
    """Run ``cfg.nproc`` workers on this machine as node ``node_rank`` of ``cfg.nodes``; return local rank 0's
    outcome (on node 0: rank 0's ``Trainer._result`` plus ``wall_s``). ``local_addr``: the address other hosts
    reach this one at (default: its FQDN). Raises TrainError with a worker's message when a rank met bad input,
    NodesNotJoined when the rendezvous did not form."""
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    from eagle3.support.gpu import is_oom_text
    from eagle3.train.config import TrainError
    from eagle3.train.trainer import LATEST

    if not 0 <= node_rank < cfg.nodes:
        raise TrainError(f"node_rank {node_rank} is not a node of this run (train.nodes {cfg.nodes}: 0 to "
                         f"{cfg.nodes - 1})")
    if cfg.nodes > 1 and not cfg.rdzv_id:
        raise TrainError("train.rdzv_id is required with nodes > 1: every node of one launch joins the same "
                         "rendezvous id (the pipeline makes one per launch)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank0_log = out_dir / RANK0_LOG
    if node_rank == 0:  # node 0 holds rank 0 (_rank_by_node), the only writer of the run folder
        rank0_log.write_text("")
        if not resume:  # a fresh start: without a resume state the trainer starts over (and clears the rest)
            shutil.rmtree(out_dir / LATEST, ignore_errors=True)
    config = launch_config(cfg, out_dir, node_rank, local_addr)
    job = {"cfg": cfg.model_dump(mode="json"), "store_dir": str(store_dir), "vocab_path": str(vocab_path),
           "verifier_path": str(verifier_path), "out_dir": str(out_dir),
           "node_rank": node_rank if cfg.nodes > 1 else None,
           "threads": max(1, (os.cpu_count() or 1) // cfg.nproc), "rank0_log": str(rank0_log)}
    where = (f"node {node_rank} of {cfg.nodes}, rendezvous {cfg.rdzv_id} at {cfg.rdzv_endpoint} "
             f"({cfg.rdzv_backend})" if cfg.nodes > 1 else "one node")
    log.info("[train] launching %d workers (%s, %s, torch elastic launch, max_restarts %d); %s %s", cfg.nproc,
             cfg.parallel, where, cfg.max_restarts, "rank 0 log" if node_rank == 0 else "worker logs",
             rank0_log if node_rank == 0 else config.logs_specs.root_log_dir)
    with _follow(rank0_log) if node_rank == 0 else contextlib.nullcontext(), _fresh_store_per_round():
        try:
            results = elastic_launch(config, _worker)(job)
        except ChildFailedError as e:
            texts = [f.message.get("message", "") if isinstance(f.message, dict) else str(f.message)
                     for f in e.failures.values()]
            for text in texts:  # the rank that met bad input, whichever failed first
                if text.startswith(f"{WorkerBadInput.__name__}: "):
                    raise TrainError(text.removeprefix(f"{WorkerBadInput.__name__}: ")) from None
            oom = next((t for t in texts if is_oom_text(t)), None)
            if oom is not None:  # an allocator failure on a rank: the OOM-only retry (half the micro-batch) applies
                raise torch.OutOfMemoryError(f"a training worker ran out of memory: {oom}") from e
            raise
        except RendezvousTimeoutError:
            raise NodesNotJoined(
                f"node {node_rank}: the rendezvous {cfg.rdzv_id} at {cfg.rdzv_endpoint} did not gather all "
                f"{cfg.nodes} nodes within {cfg.join_timeout_seconds:g} s (train.join_timeout_seconds)") from None
        except RendezvousConnectionError as e:
            raise NodesNotJoined(
                f"node {node_rank} cannot reach the rendezvous at {cfg.rdzv_endpoint} ({cfg.rdzv_backend}) within "
                f"{cfg.join_timeout_seconds:g} s: is node 0 up, and the port open to this host? ({e.__cause__ or e})"
            ) from None
    return results[min(results)]  # keyed by torch's global ranks: this node's local rank 0


def launch_config(cfg, out_dir: Path, node_rank: int = 0, local_addr: str | None = None):
    """torch elastic's ``LaunchConfig`` for this node: one host on a free local port, or node ``node_rank`` of
    ``cfg.nodes`` at ``cfg.rdzv_endpoint`` (node 0 hosts a c10d rendezvous)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    common = {"nproc_per_node": cfg.nproc, "max_restarts": cfg.max_restarts, "monitor_interval": 0.2,
              "start_method": "spawn"}  # never fork a process that runs Prefect's and torch's threads
    logs = out_dir / "torchrun-logs"
    if cfg.nodes == 1:
        return LaunchConfig(min_nodes=1, max_nodes=1, run_id=cfg.rdzv_id or f"eagle3-{uuid.uuid4().hex[:8]}",
                            rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                            logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL), **common)
    join_s = math.ceil(cfg.join_timeout_seconds)  # torch reads whole seconds
    rdzv = {"join_timeout": join_s}
    if cfg.rdzv_backend == "c10d":  # node 0 serves the store; the others wait up to join_s for it to come up
        rdzv.update(is_host=node_rank == 0, read_timeout=join_s)
    return LaunchConfig(min_nodes=cfg.nodes, max_nodes=cfg.nodes, run_id=cfg.rdzv_id, rdzv_backend=cfg.rdzv_backend,
                        rdzv_endpoint=cfg.rdzv_endpoint, rdzv_configs=rdzv, local_addr=local_addr,
                        logs_specs=DefaultLogsSpecs(log_dir=str(logs / f"node-{node_rank}"), redirects=Std.ALL),
                        **common)


@contextlib.contextmanager
def _fresh_store_per_round() -> Iterator[None]:
    """Torch elastic's agents, while the block runs, give each rendezvous round's workers a store of their own (read
    by the rendezvous handler when a round forms) instead of sharing theirs across restarts; see the module
    docstring."""
    name = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class NodesNotJoined(RuntimeError):
    """The nodes of a multi-node launch did not meet at the rendezvous; the message names the node, the endpoint and
    the timeout."""


class WorkerBadInput(Exception):
    """Raised by a worker for bad input (a ValueError of the trainer); the launcher turns it into a TrainError."""


@contextlib.contextmanager
def _follow(path: Path, poll_s: float = 0.5) -> Iterator[None]:
    """Re-log every complete line appended to ``path`` while the block runs (and the rest when it ends)."""
    stop = threading.Event()

    def run() -> None:
        with open(path, encoding="utf-8", errors="replace") as f:
            buf = ""
            while True:
                chunk = f.read()
                buf += chunk
                *lines, buf = buf.split("\n")
                for line in lines:
                    if line:
                        log.info("%s", line)
                if stop.is_set() and not chunk:
                    return
                if not chunk:
                    stop.wait(poll_s)

    t = threading.Thread(target=run, name="eagle3-rank0-log", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=10)


def _die_with_parent() -> None:
    """SIGKILL this worker when the launching process dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the request: nobody waits for us
            os._exit(1)


def _rank_by_node(node_rank: int, nproc: int, nodes: int) -> None:
    """Set this worker's global rank to ``node_rank * nproc + LOCAL_RANK`` (before the process group is joined):
    torch's c10d rendezvous orders the nodes by host name and process id, and node 0 must hold rank 0."""
    world, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if world != nodes * nproc or local_world != nproc:
        raise WorkerBadInput(f"node {node_rank}: the rendezvous formed a world of {world} processes, {local_world} "
                             f"on this node, not nodes {nodes} x nproc {nproc}: every node must run with the same "
                             f"train.nodes and train.nproc")
    os.environ["RANK"] = str(node_rank * nproc + int(os.environ["LOCAL_RANK"]))
    os.environ["GROUP_RANK"] = str(node_rank)


def _join_group(backend: str, serves_store: bool) -> None:
    """Join the process group on this round's store at MASTER_ADDR:MASTER_PORT, a fresh one per round, which torch's
    rank-0 worker serves (``serves_store``: RANK as the agent numbered it); the group itself uses RANK as it is now
    (the node-ordered rank with several nodes, ``_rank_by_node``)."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=serves_store)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world)


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    """One rank: join the process group, train, return the outcome (rank 0) or a bad-input message (any rank)."""
    _die_with_parent()
    # SIGTERM ends a worker at once: when a peer dies, the agent SIGTERMs the survivors, which sit in a collective
    # (C++) where a Python handler never runs, and torch then waits 30 s before SIGKILL (measured). A worker has
    # nothing to clean up: every file it writes is written atomically.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import torch
    import torch.distributed as dist

    from eagle3.support.dtypes import device_type
    from eagle3.train.config import TrainConfig
    from eagle3.train.dist import Dist
    from eagle3.train.trainer import run_local

    cfg = TrainConfig.model_validate(job["cfg"])
    serves_store = int(os.environ["RANK"]) == 0  # torch's numbering, before ours
    if job["node_rank"] is not None:
        _rank_by_node(job["node_rank"], cfg.nproc, cfg.nodes)
    d = Dist.from_env()
    root = logging.getLogger("eagle3")
    root.setLevel(logging.INFO if d.main else logging.WARNING)
    handler = logging.FileHandler(job["rank0_log"]) if d.main else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    torch.set_num_threads(job["threads"])
    _join_group("nccl" if device_type(cfg.device) == "cuda" else "gloo", serves_store)
    try:  # always resume: a restarted worker (its node's restart count may be 0) continues from latest/
        return run_local(cfg, job["store_dir"], job["vocab_path"], job["verifier_path"], job["out_dir"], True, d)
    except ValueError as e:  # bad input (TrainError, VocabError, ...): fail this rank (the agent stops the rest)
        raise WorkerBadInput(str(e)) from None
    finally:
        dist.destroy_process_group()
        handler.flush()
