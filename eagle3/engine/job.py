"""One vLLM engine job: a driver module run in the vLLM interpreter (``python -m <module> <job.json>``).

The runner writes the job file (the stage's keys + ``engine``: the ``vllm.LLM`` arguments of the pipeline's engine
settings), starts the driver in its own process group with the GPU guard's lock descriptors held by the group
(``pass_fds``: the host lock is released only when the last process is gone, vLLM's engine core included), sends
vLLM's whole output to the job's log file and the pipeline's own lines (``[regenerate] ...``, errors) to the log,
follows the driver's progress file on a thread (``follow``), and kills the whole group on timeout, error or
cancellation. The result tells how the driver ended, out of memory included (``oom``: the exit code ``EXIT_OOM``
the drivers use at their floor, or vLLM's own out-of-memory text in the log's tail when vLLM died of it).

Drivers: eagle3.regenerate.vllm_worker, eagle3.extract.vllm_worker, eagle3.validate.vllm_check.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.engine.exits import EXIT_INCOMPLETE, EXIT_OOM, EXIT_SELFCHECK
from eagle3.engine.settings import EngineSettings, cpu_engine_env
from eagle3.support.gpu import is_oom_text
from eagle3.support.io import atomic_write_json
from eagle3.support.paths import REPO_ROOT, vllm_python, vllm_subprocess_env
from eagle3.support.subproc import SubprocessFailed, SubprocessResult, run_subprocess
from eagle3.support.verifier import VerifierSpec

log = logging.getLogger("eagle3")



def on_gpu() -> bool:
    """Whether this host's engines run on GPUs (the parent decides for its driver: vLLM's CPU build on a CPU)."""
    import torch

    return torch.cuda.is_available()


@dataclass
class EngineJobResult:
    """How one driver run ended."""

    returncode: int
    timed_out: bool
    killed_pids: list[int]
    log_file: Path
    output_tail: str  # the last lines of its output (all of it is in log_file)
    subprocess: SubprocessResult

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def oom(self) -> bool:
        """Out of memory: at the driver's floor (EXIT_OOM), or vLLM died of it (its text in the output's tail)."""
        return not self.timed_out and (self.returncode == EXIT_OOM or
                                       (self.returncode != 0 and is_oom_text(self.output_tail)))

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output_tail.splitlines()[-lines:])

    def check(self) -> EngineJobResult:
        """Raise SubprocessFailed (the command, the log file, the output's tail) unless the driver succeeded."""
        self.subprocess.check()
        return self


def engine_core_in_process(wanted: bool, verifier_path: str | os.PathLike, gpu: bool | None = None) -> bool:
    """Whether vLLM's engine core runs in the driver's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): ``wanted``
    on a CPU host (``gpu`` None: this host), unless the verifier is a nested multimodal one (Kimi-K2.5): its
    processor imports numba, and vLLM 0.32's CPU worker then fails at start while rebinding its kernels
    (AttributeError: '_lib_fn_wrapper' object has no attribute 'get', from llvmlite's library proxy); in its own
    engine process the worker starts before numba. On GPUs never: vLLM serves from an engine core in its own process
    (scheduling overlaps the model's steps), and that is what a GPU host's figures should measure.
    The placement changes the speed: on 2 cores an engine core in its own process decoded one request at a time at
    21.4 against 24.6 tok/s (bench/vllm_cpu_speed.py, mp-reserve0 against default), so engines timed against each
    other run in the same placement (eagle3.validate.baseline)."""
    if gpu is None:
        gpu = on_gpu()
    return wanted and not gpu and not VerifierSpec.from_path(verifier_path).nested


def run_engine_job(engine: EngineSettings, module: str, job: dict[str, Any], job_file: str | os.PathLike, *,
                   log_file: str | os.PathLike, lock_fds: Sequence[int] = (), env: dict[str, str] | None = None,
                   in_process: bool = False, follow: Callable[[], None] | None = None,
                   follow_every_s: float = 0.5, timeout_s: float | None = None) -> EngineJobResult:
    """Run ``python -m module job_file`` in the vLLM interpreter of ``engine`` with ``job`` (+ ``"engine"``: the
    ``vllm.LLM`` arguments of ``engine`` on this host) written to ``job_file``; ``follow()`` is called every
    ``follow_every_s`` s while it runs and once after. ``timeout_s`` None = ``engine.timeout_s`` (0: none).
    ``in_process``: vLLM's engine core in the driver's process (decide with engine_core_in_process), else in its
    own (vLLM's default).

    Raises FileNotFoundError when there is no vLLM interpreter (before anything starts); every other ending is in
    the result (``ok``, ``oom``, ``timed_out``, ``returncode``).
    """
    from eagle3.support.follow import following

    python = vllm_python(engine.vllm_python)
    verifier = job.get("verifier")  # a job without a local verifier folder gets no CPU MLA backend pin
    mla = bool(verifier) and (Path(verifier) / "config.json").is_file() and VerifierSpec.from_path(verifier).mla
    gpu = on_gpu()
    job_file = atomic_write_json(job_file, {**job, "engine": engine.llm_kwargs(gpu, mla=mla)})
    # the stage's env and the placement override the user's environment; the CPU defaults do not
    env = {**(env or {}), **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {})}
    if not gpu:  # every core computes (cpu_engine_env)
        env = {**cpu_engine_env(), **env}
        log.info("vLLM on this CPU: engine core in %s%s", "the driver's process" if in_process else "its own process",
                 "".join(f", {k}={v}" for k, v in env.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"))
    log_file = Path(log_file)
    limit = engine.timeout_s if timeout_s is None else timeout_s
    log.info("vLLM engine job: %s -m %s %s (tensor_parallel_size %d%s); its whole output: %s", python, module,
             job_file, engine.tensor_parallel_size, f", killed after {limit:.0f} s" if limit else "", log_file)
    with following(follow, follow_every_s, name=f"eagle3-follow-{module.rsplit('.', 1)[-1]}"):
        result = run_subprocess([python, "-m", module, str(job_file)], env=vllm_subprocess_env(env),
                                timeout_s=limit or None, log_prefix="[vllm] ", cwd=REPO_ROOT, log_file=log_file,
                                pass_fds=lock_fds, grace_s=10.0)
    return EngineJobResult(result.returncode, result.timed_out, list(result.killed_pids), log_file, result.stdout,
                           result)


__all__ = ["EXIT_INCOMPLETE", "EXIT_OOM", "EXIT_SELFCHECK", "EngineJobResult", "SubprocessFailed",
           "engine_core_in_process", "on_gpu", "run_engine_job"]
