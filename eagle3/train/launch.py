"""Multi-process training: ``train_draft`` launches ``python -m torch.distributed.run`` running this module.

Pipeline position: part of **train** (eagle3.train.trainer calls ``launch`` when ``nproc > 1``).

The parent writes the job (settings + paths) to ``<out_dir>/launch.json``, starts torchrun with ``nproc`` workers
(``--standalone``: one node, a free rendezvous port) through ``eagle3.support.subproc`` (own process group, reaped on
cancellation), mirrors their output into the log (its last lines also into ``<out_dir>/torchrun.log``)
and reads rank 0's result. Each worker joins the process group (gloo on cpu, nccl on cuda) and runs the same
``eagle3.train.trainer.run_local`` as a single process; the global batch is split over the workers, so the run computes the
same losses as one process with the same ``batch_size``. A worker's bad-input error is re-raised in the parent with
its own message.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from eagle3.support.io import atomic_write_json, atomic_write_text
from eagle3.support.paths import REPO_ROOT
from eagle3.support.subproc import run_subprocess

log = logging.getLogger("eagle3")

JOB = "launch.json"
ERROR = "launch_error.json"
LOG = "torchrun.log"


def launch(cfg, store_dir: str | Path, vocab_path: str | Path, verifier_path: str | Path, out_dir: str | Path,
           resume: bool = True) -> dict[str, Any]:
    """Run ``cfg.nproc`` torchrun workers on this machine and return rank 0's training manifest."""
    from eagle3.train.trainer import RESULT, TrainError

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (RESULT, ERROR):
        (out_dir / name).unlink(missing_ok=True)
    job = {"cfg": cfg.model_dump(mode="json"), "store_dir": str(store_dir), "vocab_path": str(vocab_path),
           "verifier_path": str(verifier_path), "out_dir": str(out_dir), "resume": resume}
    atomic_write_json(out_dir / JOB, job)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.nproc}",
           "-m", "eagle3.train.launch", str(out_dir / JOB)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    log.info("[train] launching %d workers (%s): %s", cfg.nproc, cfg.parallel, " ".join(cmd))
    # own process group under a guard: a cancelled flow (even SIGKILLed) leaves no worker holding a GPU
    result = run_subprocess(cmd, env=env, log_prefix="[torchrun] ", cwd=REPO_ROOT)
    atomic_write_text(out_dir / LOG, result.stdout)
    rc = result.returncode
    err = out_dir / ERROR
    if err.is_file():
        info = json.loads(err.read_text())
        raise TrainError(info["message"])
    if rc != 0 or not (out_dir / RESULT).is_file():
        raise RuntimeError(f"torchrun training workers failed (exit code {rc}); last output:\n"
                           + "\n".join(result.stdout.splitlines()[-40:]))
    return json.loads((out_dir / RESULT).read_text())


def main(job_path: str) -> None:
    import torch
    import torch.distributed as dist

    from eagle3.train.trainer import Dist, TrainConfig, TrainError, run_local

    job = json.loads(Path(job_path).read_text())
    d = Dist.from_env()
    logging.basicConfig(level=logging.INFO if d.main else logging.WARNING, format="%(message)s")
    cfg = TrainConfig(**job["cfg"])
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        run_local(cfg, job["store_dir"], job["vocab_path"], job["verifier_path"], job["out_dir"], job["resume"], d)
    except ValueError as e:  # bad input (TrainError, VocabError, ...): hand the message to the parent
        # any rank: the bad sample may sit in a bin only another rank loads (ranks writing at once: last one wins)
        atomic_write_json(Path(job["out_dir"]) / ERROR, {"type": type(e).__name__, "message": str(e)})
        raise SystemExit(2) from (e if not isinstance(e, TrainError) else None)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
