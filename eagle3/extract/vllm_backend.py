"""vLLM backend (production, tensor parallel): run ``eagle3.extract.vllm_worker`` in the vLLM environment.

The parent (this module, pipeline env) holds the host GPU lock, writes the samples to do into a work file
(safetensors: index, offsets, input_ids, loss_mask, because the vLLM env has no pyarrow/datasets), starts the driver
in its own process group with the lock descriptors inherited (``pass_fds``: the lock stays held while any of them
lives) and a parent-death signal, follows the store's manifest for progress lines, and kills the whole group on
timeout, error or cancel. The driver writes the same store format and manifest as the transformers backend.

Out of memory: vLLM sizes its KV cache at start-up and a failed allocation kills the engine, so recovery here means
a restart (the model loads again) with the token budget (``max_num_batched_tokens``) halved, resuming from the
manifest; samples already written are not redone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.extract import selfcheck
from eagle3.extract.config import ExtractConfig
from eagle3.store import MANIFEST
from eagle3.support.gpu import OutOfMemoryAfterRetries, is_oom_text
from eagle3.support.io import save_safetensors
from eagle3.support.paths import vllm_python, vllm_subprocess_env
from eagle3.support.subproc import run_subprocess
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


class _ManifestTail:
    """Follows manifest.jsonl from a byte offset; yields entries of complete new lines."""

    def __init__(self, path: Path):
        self.path = path
        st = path.stat() if path.exists() else None
        self.offset, self.inode = (st.st_size, st.st_ino) if st else (0, None)

    def new_entries_pending(self) -> bool:
        """True while complete lines beyond the read offset remain (the follower drains them before it stops)."""
        if not self.path.exists():
            return False
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_ino != self.inode:
                return True  # rewritten: new_entries re-reads it
            f.seek(self.offset)
            return b"\n" in f.read()

    def new_entries(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_ino != self.inode or st.st_size < self.offset:  # rewritten (repaired by another shard job):
                self.offset, self.inode = 0, st.st_ino  # re-read it all; the caller ignores entries it already saw
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                if line.strip():
                    out.append(json.loads(line))
        return out


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
    python = vllm_python(cfg.vllm_python)
    work = store_dir / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    budget = cfg.max_tokens_per_batch
    remaining = dict(todo)
    stats["extract_start"] = time.monotonic()
    attempt = 0
    try:
        while remaining:
            attempt += 1
            work_file = work / f"work-{os.getpid()}.safetensors"
            check = selfcheck_sample(remaining) if cfg.selfcheck and "selfcheck" not in stats else None
            order = sorted(remaining)
            if check is not None:  # second in line: the first step holds it behind another sample (its tokens at an
                others = [i for i in order if i != check]  # offset in the flattened step, as most requests' are)
                order = [others[0], check, *others[1:]]
            write_work_file(work_file, ds, order)
            longest = max(remaining.values()) + 1  # tokens: the longest prompt + the one token vLLM generates
            check_file = work / f"selfcheck-{os.getpid()}-{attempt}.json"
            job = {
                "verifier": str(spec.path), "aux_layer_ids": aux_ids, "num_hidden_layers": spec.num_hidden_layers,
                "store_dir": str(store_dir), "group_size": meta["group_size"], "store_dtype": meta["dtype"],
                "work_file": str(work_file),
                "dtype": compute_dtype,
                "tensor_parallel_size": cfg.tensor_parallel_size,
                "max_num_batched_tokens": step_tokens(budget, longest, spec.mla, on_gpu),
                "max_num_seqs": cfg.max_samples_per_batch, "max_model_len": longest,
                "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization if on_gpu else 0.25,
                "enforce_eager": True, "trust_remote_code": cfg.trust_remote_code,
                "chunk_samples": _CHUNK_SAMPLES, "write_timeout_seconds": 300,
                "selfcheck": None if check is None else {
                    "index": check, "tolerance": cfg.selfcheck_tolerance, "result_file": str(check_file)},
            }
            job_file = work / f"job-{os.getpid()}.json"
            job_file.write_text(json.dumps(job, indent=2))
            log_file = work / f"vllm-{os.getpid()}-{attempt}.log"
            stats.setdefault("vllm_logs", []).append(str(log_file))
            log.info("vLLM backend: starting %s -m eagle3.extract.vllm_worker (attempt %d, %d samples, budget %s "
                     "padded tokens per step, tensor_parallel_size %d); log %s", python, attempt, len(remaining),
                     f"{budget:,}", cfg.tensor_parallel_size, log_file)
            rc = _run_driver(python, job_file, log_file, store_dir, remaining, stats, progress, lock_fds,
                             cfg.vllm_timeout_seconds)
            stats["model_loads"] += 1
            if check_file.is_file():  # the driver compared its sample alone and in the batch (raises on a mismatch)
                selfcheck.record(store_dir, json.loads(check_file.read_text()), stats)
            if rc == 0 and not remaining:
                break
            tail = _tail(log_file)
            if rc != 0 and is_oom_text(tail):
                if budget <= cfg.min_tokens_per_batch:
                    raise OutOfMemoryAfterRetries(
                        f"vLLM ran out of memory at the token-budget floor ({budget:,} tokens per step, "
                        f"min_tokens_per_batch); log {log_file}:\n{tail}")
                old, budget = budget, max(budget // 2, cfg.min_tokens_per_batch)
                stats["token_budget_history"].append(budget)
                log.warning("vLLM ran out of memory: token budget halved %s -> %s tokens per step; restarting "
                            "(vLLM must reload the model) for the %d samples left", f"{old:,}", f"{budget:,}",
                            len(remaining))
                continue
            raise VllmExtractionError(f"vLLM extraction driver exited with code {rc} and {len(remaining)} samples "
                                      f"not written; log {log_file}, last lines:\n{tail}")
    finally:
        for f in work.glob(f"*-{os.getpid()}.*"):
            if f.suffix != ".log":
                f.unlink(missing_ok=True)
    stats["extract_end"] = time.monotonic()


def selfcheck_sample(remaining: dict[int, int], window: int = 64) -> int | None:
    """The sample the driver extracts alone and in the first batch: the shortest of the first ``window`` to do (so
    the scheduler's first step has room for it beside another); None when fewer than two are left."""
    first = sorted(remaining)[:window]
    return min(first, key=lambda i: (remaining[i], i)) if len(first) > 1 else None


def step_tokens(budget: int, longest: int, mla: bool, on_gpu: bool) -> int:
    """vLLM's max_num_batched_tokens for a token ``budget``. On a CPU vLLM 0.32 turns chunked prefill off for MLA
    models (Kimi-K2.5, DeepSeek) but keeps the scheduler's per-step cap at the requested value, so a prompt longer
    than the budget is never scheduled and the engine waits forever (measured on a Kimi-shaped verifier: a 130-token
    sample at a 128-token budget); there a step must hold the ``longest`` prompt."""
    return max(budget, longest) if mla and not on_gpu else budget


def _run_driver(python: str, job_file: Path, log_file: Path, store_dir: Path, remaining: dict[int, int],
                stats: dict[str, Any], progress, lock_fds: list[int],
                timeout_seconds: float) -> int:
    """Run the driver (its own process group under the guard, which holds the lock fds as long as the group lives:
    vLLM's engine core has no parent-death check of its own); vLLM's output goes to ``log_file``, its errors and
    our own lines to the log; a thread follows the manifest for progress meanwhile."""
    tail = _ManifestTail(store_dir / MANIFEST)
    stop = threading.Event()

    def follow() -> None:
        while True:
            for e in tail.new_entries():
                if remaining.pop(int(e["index"]), None) is not None:
                    if not stats["samples_written"]:
                        progress.restart()  # first sample: the model is loaded, start the tok/s clock
                    stats["samples_written"] += 1
                    stats["bytes_written"] += int(e.get("bytes", 0))
                    progress.update(1, int(e["tokens"]))
            if stop.is_set() and not tail.new_entries_pending():  # the driver ended and every line was read
                return
            stop.wait(0.5)

    follower = threading.Thread(target=follow, name="eagle3-vllm-manifest", daemon=True)
    follower.start()
    try:
        result = run_subprocess([python, "-m", "eagle3.extract.vllm_worker", str(job_file)], env=vllm_subprocess_env(),
                                timeout_s=timeout_seconds or None, log_prefix="[vllm] ", log_file=log_file,
                                pass_fds=lock_fds, grace_s=10.0)
    finally:
        stop.set()
        follower.join(timeout=30)
    if result.timed_out:
        pids = ", ".join(map(str, result.killed_pids))
        raise VllmExtractionError(f"vLLM extraction exceeded vllm_timeout_seconds={timeout_seconds:.0f}; killed its "
                                  f"process group (pids {pids}); log {log_file}")
    return result.returncode


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
