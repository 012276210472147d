"""vLLM backend (production, tensor parallel): run ``eagle3.extract.vllm_worker`` in the vLLM environment.

The parent (this module, pipeline env) holds the host GPU lock, writes the samples to do into a work file
(safetensors: index, offsets, input_ids, loss_mask, because the vLLM env has no pyarrow/datasets) and runs the driver
as an engine job (``eagle3.engine.job.run_engine_job``: its own process group holding the lock, its log file, the
timeout), following the store's manifest for progress lines. The driver writes the same store format and manifest
as the transformers backend.

Out of memory: vLLM sizes its KV cache at start-up and a failed allocation kills the engine, so recovery here means
a restart (the model loads again) with the token budget (``max_num_batched_tokens``) halved, resuming from the
manifest; samples already written are not redone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.engine.job import on_gpu, run_engine_job
from eagle3.engine.oom import HalvingBudget
from eagle3.extract import selfcheck
from eagle3.extract.config import ExtractConfig
from eagle3.store import MANIFEST
from eagle3.support.follow import LineTail
from eagle3.support.gpu import OutOfMemoryAfterRetries
from eagle3.support.io import save_safetensors
from eagle3.support.verifier import VerifierSpec

log = logging.getLogger("eagle3.extract")

WORK_DIR = ".vllm-work"  # inside the store; dot-folders are ignored by readers and fingerprints
_CHUNK_SAMPLES = 4096  # prompts per LLM.generate call in the driver (bounds its host memory)


class VllmExtractionError(RuntimeError):
    """The vLLM driver failed; the message carries the tail of its log and the log's path."""


def write_work_file(path: Path, ds, indices: list[int]) -> None:
    """Samples to do as flat tensors: index [N], offsets [N+1], input_ids [sum T] int32, loss_mask [sum T] uint8."""
    ids_parts, mask_parts, offsets = [], [], [0]
    for a in range(0, len(indices), 4096):
        rows = ds[indices[a : a + 4096]]
        for ids, mask in zip(rows["input_ids"], rows["loss_mask"]):
            ids_parts.append(torch.as_tensor(ids, dtype=torch.int32))
            mask_parts.append(torch.as_tensor(mask, dtype=torch.uint8))
            offsets.append(offsets[-1] + len(ids))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors({"index": torch.as_tensor(indices, dtype=torch.long), "offsets": torch.as_tensor(offsets),
                      "input_ids": torch.cat(ids_parts), "loss_mask": torch.cat(mask_parts)}, path)


def run_vllm(
    cfg: ExtractConfig,
    spec: VerifierSpec,
    aux_ids: list[int],
    compute_dtype: str,
    ds,
    todo: dict[int, int],
    store_dir: Path,
    meta: dict[str, Any],
    stats: dict[str, Any],
    progress,
    lock_fds: list[int],
) -> None:
    work = store_dir / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    gpu = on_gpu()
    budget = HalvingBudget(cfg.max_tokens_per_batch, min(cfg.min_tokens_per_batch, cfg.max_tokens_per_batch),
                           "tokens per step")
    remaining = dict(todo)
    stats["extract_start"] = time.monotonic()
    attempt = 0
    try:
        while remaining:
            attempt += 1
            work_file = work / f"work-{os.getpid()}.safetensors"
            pair = selfcheck_pair(remaining) if cfg.selfcheck and "selfcheck" not in stats else None
            check = None if pair is None else pair[1]
            order = sorted(remaining)
            if pair is not None:  # the check second in line, behind its companion: the first step holds both, the
                order = [*pair, *(i for i in order if i not in pair)]  # check's tokens at an offset in it
            write_work_file(work_file, ds, order)
            longest = max(remaining.values()) + 1  # tokens: the longest prompt + the one token vLLM generates
            check_file = work / f"selfcheck-{os.getpid()}-{attempt}.json"
            job = {
                "verifier": str(spec.path), "aux_layer_ids": aux_ids, "num_hidden_layers": spec.num_hidden_layers,
                "store_dir": str(store_dir), "group_size": meta["group_size"], "store_dtype": meta["dtype"],
                "work_file": str(work_file), "dtype": compute_dtype,
                "max_num_batched_tokens": step_tokens(budget.value, longest, spec.mla, gpu),
                "max_num_seqs": cfg.max_samples_per_batch, "max_model_len": longest,
                "chunk_samples": _CHUNK_SAMPLES, "write_timeout_seconds": 300,
                "selfcheck": None if check is None else {
                    "index": check, "tolerance": cfg.selfcheck_tolerance, "result_file": str(check_file)},
            }
            log_file = work / f"vllm-{os.getpid()}-{attempt}.log"
            stats.setdefault("vllm_logs", []).append(str(log_file))
            log.info("vLLM backend: attempt %d, %d samples, budget %s padded tokens per step", attempt,
                     len(remaining), f"{budget.value:,}")
            result = run_engine_job(cfg.engine, "eagle3.extract.vllm_worker", job, work / f"job-{os.getpid()}.json",
                                    log_file=log_file, lock_fds=lock_fds,
                                    follow=_manifest_follower(store_dir, remaining, stats, progress))
            stats["model_loads"] += 1
            if check_file.is_file():  # the driver compared its sample alone and in the batch (raises on a mismatch)
                selfcheck.record(store_dir, json.loads(check_file.read_text()), stats)
            if result.timed_out:
                raise VllmExtractionError(f"vLLM extraction exceeded engine.timeout_s={cfg.engine.timeout_s:.0f}; "
                                          f"killed its process group (pids {', '.join(map(str, result.killed_pids))}); "
                                          f"log {log_file}")
            if result.ok and not remaining:
                break
            if result.oom:  # vLLM sizes its KV cache at start: recovery is a restart at half the step's tokens
                if not budget.halve():
                    raise OutOfMemoryAfterRetries(
                        f"vLLM ran out of memory at the token-budget floor ({budget.value:,} tokens per step, "
                        f"min_tokens_per_batch); log {log_file}:\n{result.tail()}")
                stats["token_budget_history"].append(budget.value)
                log.warning("vLLM ran out of memory: token budget halved %s; restarting (vLLM must reload the "
                            "model) for the %d samples left", budget.describe_halving(), len(remaining))
                continue
            raise VllmExtractionError(f"vLLM extraction driver exited with code {result.returncode} and "
                                      f"{len(remaining)} samples not written; log {log_file}, last lines:\n"
                                      f"{result.tail()}")
    finally:
        for f in work.glob(f"*-{os.getpid()}.*"):
            if f.suffix != ".log":
                f.unlink(missing_ok=True)
    stats["extract_end"] = time.monotonic()


def _manifest_follower(store_dir: Path, remaining: dict[int, int], stats: dict[str, Any], progress):
    """The driver's progress: each new manifest entry of a sample this job is doing is one sample done."""
    tail = LineTail(store_dir / MANIFEST)

    def follow() -> None:
        for e in tail.json_lines():
            if remaining.pop(int(e["index"]), None) is not None:
                if not stats["samples_written"]:
                    progress.restart()  # first sample: the model is loaded, start the tok/s clock
                stats["samples_written"] += 1
                stats["bytes_written"] += int(e.get("bytes", 0))
                progress.update(1, int(e["tokens"]))

    return follow


def selfcheck_pair(remaining: dict[int, int], window: int = 64) -> tuple[int, int] | None:
    """(companion, check): the two shortest of the first ``window`` samples to do (so the scheduler's first step
    holds both); the driver extracts the check alone and second in the first batch, behind its companion. None when
    fewer than two are left."""
    first = sorted(sorted(remaining)[:window], key=lambda i: (remaining[i], i))
    return (first[1], first[0]) if len(first) > 1 else None


def step_tokens(budget: int, longest: int, mla: bool, on_gpu: bool) -> int:
    """vLLM's max_num_batched_tokens for a token ``budget``. On a CPU vLLM 0.32 turns chunked prefill off for MLA
    models (Kimi-K2.5, DeepSeek) but keeps the scheduler's per-step cap at the requested value, so a prompt longer
    than the budget is never scheduled and the engine waits forever (measured on a Kimi-shaped verifier: a 130-token
    sample at a 128-token budget); there a step must hold the ``longest`` prompt."""
    return max(budget, longest) if mla and not on_gpu else budget
