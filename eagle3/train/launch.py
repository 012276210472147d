"""Multi-process training through torch's elastic launch API (``torch.distributed.launcher.elastic_launch``).

Pipeline position: part of **train** (eagle3.train.stage calls ``launch`` when ``nproc > 1``).

``launch`` starts ``nproc`` worker processes on this machine (a c10d rendezvous on a free local port, no restarts),
each running ``_worker``: it joins the process group (gloo on CPU, nccl on CUDA) and runs the same
``Trainer`` as a single process; the global batch is split over the workers, so the run computes the same losses
as one process with the same ``batch_size``. Rank 0's outcome comes back as its return value (no job or result
files); a rank that meets bad input raises, the agent stops the others, and its message comes back through torch
elastic's own failure record as a TrainError.

Logs: rank 0 writes its log records to ``<out_dir>/train-rank0.log`` and this process follows that file into the
``eagle3`` logger (so progress lines reach the stage's logs); every worker's raw stdout/stderr lands under
``<out_dir>/torchrun-logs/`` (tracebacks of a crashed worker are in the raised ChildFailedError too).
Workers die with this process: each asks the kernel for SIGKILL when its parent goes (PR_SET_PDEATHSIG), so a
cancelled or killed flow leaves no worker holding a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
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
           resume: bool = True) -> dict[str, Any]:
    """Run ``cfg.nproc`` workers on this machine; return rank 0's outcome (``Trainer._result`` plus ``wall_s``).
    Raises TrainError with a worker's message when a rank met bad input."""
    import torch
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from eagle3.support.gpu import is_oom_text
    from eagle3.train.config import TrainError

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank0_log = out_dir / RANK0_LOG
    rank0_log.write_text("")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc, run_id=f"eagle3-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2,
        start_method="spawn",  # never fork a process that runs Prefect's and torch's threads
        logs_specs=DefaultLogsSpecs(log_dir=str(out_dir / "torchrun-logs"), redirects=Std.ALL),
    )
    job = {"cfg": cfg.model_dump(mode="json"), "store_dir": str(store_dir), "vocab_path": str(vocab_path),
           "verifier_path": str(verifier_path), "out_dir": str(out_dir), "resume": resume,
           "threads": max(1, (os.cpu_count() or 1) // cfg.nproc), "rank0_log": str(rank0_log)}
    log.info("[train] launching %d workers (%s, torch elastic launch); rank 0 log %s", cfg.nproc, cfg.parallel,
             rank0_log)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with _follow(rank0_log):
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
    return results[0]


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


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    """One rank: join the process group, train, return the outcome (rank 0) or a bad-input message (any rank)."""
    _die_with_parent()
    import torch
    import torch.distributed as dist

    from eagle3.support.dtypes import device_type
    from eagle3.train.config import TrainConfig
    from eagle3.train.stage import run_local
    from eagle3.train.trainer import Dist

    d = Dist.from_env()
    root = logging.getLogger("eagle3")
    root.setLevel(logging.INFO if d.main else logging.WARNING)
    handler = logging.FileHandler(job["rank0_log"]) if d.main else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    torch.set_num_threads(job["threads"])
    cfg = TrainConfig.model_validate(job["cfg"])
    dist.init_process_group("nccl" if device_type(cfg.device) == "cuda" else "gloo")
    try:
        return run_local(cfg, job["store_dir"], job["vocab_path"], job["verifier_path"], job["out_dir"],
                         job["resume"], d)
    except ValueError as e:  # bad input (TrainError, VocabError, ...): fail this rank (the agent stops the rest)
        raise WorkerBadInput(str(e)) from None
    finally:
        dist.destroy_process_group()
        handler.flush()
