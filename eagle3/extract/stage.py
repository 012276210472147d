"""Extraction entry point: dataset -> hidden-state store, resumable, OOM-tolerant, one job per GPU.

Pipeline position: prepare -> capacity -> **extract** -> vocab / train. Reads the prepared dataset (Arrow folder with
``input_ids`` int32 lists and ``loss_mask`` int8 lists) and writes the store described in docs/DESIGN.md.

Order of work in ``extract_hidden_states``:
1. check the inputs (verifier folder, aux ids in vLLM's convention, dataset columns, token ids < vocab), so bad
   input fails in seconds with one clear error and before any lock or model load;
2. create or re-open the store; resume: drop temp files of this shard, rebuild the manifest lines of intact files
   it lost (deleted or torn manifest), keep finished samples whose file verifies against the manifest, repair the
   manifest (duplicates, torn lines, bad entries); a store whose every sample of the shard is in place is resumed
   without the device guard and without loading the model;
3. enter the device guard (the host GPU lock, and in the pipeline the host's Prefect concurrency slots too;
   ``eagle3.support.gpu.DeviceGuard``) BEFORE the model loads, run the CUDA preflight;
4. load the verifier ONCE and stream batches: forward -> writer thread (overlaps disk with the next forward).
   An out-of-memory error halves the token budget and retries the same samples with the model still loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field

from eagle3.chat.dataset import PreparedDataset
from eagle3.engine.oom import HalvingBudget
from eagle3.extract import hf_backend, selfcheck
from eagle3.extract.batching import Batch, TokenBudgetBatcher, pad_right
from eagle3.extract.config import ExtractConfig
from eagle3.extract.writer import AsyncStoreWriter
from eagle3.prepare import PreparedData
from eagle3.store import (
    MANIFEST,
    STORE_JSON,
    HiddenStateStore,
    StoreError,
    append_manifest_entries,
    clean_temp_files,
    ensure_store,
    entry_from_file,
    final_file,
    read_manifest,
    repair_manifest,
    store_meta,
)
from eagle3.support.artifacts import Artifact
from eagle3.support.dtypes import resolve_device, torch_dtype
from eagle3.support.gpu import (
    DeviceGuard,
    OutOfMemoryAfterRetries,
    cuda_device_ids,
    cuda_preflight,
    file_lock_guard,
    free_memory,
    is_oom_error,
)
from eagle3.support.io import sha256_file
from eagle3.support.progress import Progress
from eagle3.support.verifier import VerifierIdentity, VerifierSpec, describe_verifier

log = logging.getLogger("eagle3.extract")

# oom_injector(attempt, dataset indices of the batch, padded tokens): called before every forward attempt
# (attempts count from 0 and include retries); raise an OOM error from it to simulate one (tests only).
OomInjector = Callable[[int, list[int], int], None]


class ExtractError(ValueError):
    """Bad extraction input (dataset folder, columns, samples, settings); the message names the field / sample."""


class HiddenStates(Artifact):
    """The extraction stage's output: the hidden-state store (docs/DESIGN.md) and what this run did to it.

    ``out_dir`` is the stage folder holding ``store/``. Counts of the whole store and of this run are apart.
    """

    stage: ClassVar[str] = "extract-hidden-states"

    store_path: str = Field(description="The store folder (store.json, manifest.jsonl, rows_*/sample_*.safetensors).")
    verifier: VerifierIdentity = Field(description="The verifier the states came from.")
    aux_layer_ids: list[int] = Field(description="vLLM convention: id k = residual stream entering decoder layer k.")
    compute_dtype: str = Field(description="dtype the verifier was computed in.")
    store_dtype: str = Field(description="dtype of the stored states.")
    hidden_size: int = Field(description="Verifier hidden width (each aux state's width).")
    max_seq_len: int = Field(description="Longest sample the prepared data allows, in tokens.")
    backend: str = Field(description="'transformers' or 'vllm'.")
    num_samples: int = Field(description="Samples of the prepared dataset (the store's index range).")
    shard: list[int] = Field(description="[start, end) dataset indices this run was asked to extract.")
    samples_stored: int = Field(description="Samples in the store after this run (all shards).")
    store_tokens: int = Field(description="Tokens in the store after this run.")
    bytes_on_disk: int = Field(description="Store bytes: sample files + store.json + manifest.jsonl.")
    manifest_sha256: str = Field(description="sha256 of manifest.jsonl as this run left it.")
    samples_written: int = Field(description="Samples this run wrote.")
    samples_resumed: int = Field(description="Samples of the shard already stored and verified (skipped).")
    samples_unfittable: list[int] = Field(description="Samples skipped because they ran out of memory alone at "
                                          "the token-budget floor (first 1000 indices).")
    samples_unfittable_count: int = Field(description="How many samples were skipped as unfittable.")
    tokens_written: int = Field(description="Tokens this run wrote.")
    tokens_per_second: float = Field(description="tokens_written / extraction wall time (model load excluded).")
    extract_seconds: float = Field(description="Extraction wall time, seconds.")
    model_load_seconds: float = Field(description="Verifier load time, seconds (0 when nothing was left to do).")
    model_loads: int = Field(description="Times the verifier was loaded (vLLM restarts after an OOM count).")
    token_budget_history: list[int] = Field(description="Padded tokens per batch, after each OOM halving.")
    temp_files_removed: int = Field(0, description="Crash leftovers of this shard removed on resume.")
    manifest_entries_dropped: int = Field(0, description="Manifest entries dropped on resume (bad files).")
    manifest_entries_rebuilt: int = Field(0, description="Manifest lines rebuilt on resume from intact sample files "
                                          "the manifest had lost (deleted or torn manifest).")
    vllm_logs: list[str] = Field(default_factory=list, description="vLLM backend: the whole output of each driver "
                                 "start of this run (the logs carry vLLM's errors and the driver's own lines).")
    selfcheck: dict[str, Any] | None = Field(None, description="The extraction self-check (a sample alone vs in a "
                                             "batch, relative error per stored state; eagle3/extract/selfcheck.py) "
                                             "of the run that extracted, or why it did not run.")

    def outputs(self) -> list[str]:
        return [self.store_path]

    def problems(self) -> list[str]:
        """Reuse check (sizes, not content: docs/DESIGN.md "Caching"): store.json and manifest.jsonl in place, the
        manifest byte-identical to the one this artifact describes (sha256), and every listed sample's file in
        place with its recorded size. Content hashes are checked where the samples are read (the trainer's loader)."""
        if missing := super().problems():
            return missing
        store_dir = Path(self.store_path)
        manifest = store_dir / MANIFEST
        if not manifest.is_file():
            return [f"{manifest} is missing"]
        if sha256_file(manifest) != self.manifest_sha256:
            return [f"{manifest} changed since extraction wrote it (sha256 differs from the artifact's)"]
        try:
            return HiddenStateStore(store_dir).check_sizes()
        except StoreError as e:
            return [str(e)]


# ------------------------------------------------------------------------------------------------- input checks


def open_dataset(dataset_dir: str | Path, vocab_size: int | None = None):
    """(dataset with input_ids + loss_mask, tokens per sample as a list), every sample checked (eagle3.chat.dataset);
    raises ExtractError naming the problem."""
    ds = PreparedDataset(dataset_dir, ExtractError)
    ds.check(vocab_size)
    return ds.ds, ds.lengths.tolist()


def _gpu_ids(cfg: ExtractConfig) -> list[int]:
    """CUDA device indices this job will use (empty on CPU): the guard and the preflight cover exactly these."""
    if cfg.backend == "vllm":
        return cuda_device_ids(count=cfg.engine.tensor_parallel_size)  # vLLM takes the first tensor_parallel_size GPUs
    return cuda_device_ids(str(resolve_device(cfg.device)), cfg.device_map)


def _shard(cfg: ExtractConfig, n: int) -> tuple[int, int]:
    end = n if cfg.shard_end is None else min(cfg.shard_end, n)
    if cfg.shard_start >= n:
        raise ExtractError(f"shard_start {cfg.shard_start} is past the dataset's last sample index {n - 1}")
    return cfg.shard_start, end


# ------------------------------------------------------------------------------------------------------ resume


@dataclass
class Resumed:
    """What resuming into a store found for one shard."""

    done: set[int]  # finished indices of the shard whose file verifies
    temps_removed: int  # crash leftovers removed
    dropped: int  # manifest entries dropped (bad or missing files): extracted again
    rebuilt: int  # manifest lines rebuilt from intact files the manifest had lost


def resume_state(store_dir: Path, start: int, end: int, check: str, ds=None) -> Resumed:
    """Resume shard [start, end) of the store: remove this shard's temp files, rebuild the manifest lines of
    samples whose file is in place under its final name but unlisted (``entry_from_file``: a deleted or torn
    manifest, or a crash between the rename and the append; with the dataset ``ds``, the file must also hold that
    row's input_ids and loss_mask), check every listed sample (``check``: "sha256" or "size"; rebuilt ones were just
    hashed) and drop the bad ones from the manifest so they are extracted again."""
    removed = clean_temp_files(store_dir, start, end)
    store = HiddenStateStore(store_dir, strict=False)
    group = int(store.meta["group_size"])
    orphans = [i for i in range(start, end) if i not in store and final_file(store_dir, i, group) is not None]
    rebuilt: dict[int, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:  # hashing releases the GIL
        if orphans:
            for i, entry in zip(orphans, pool.map(lambda i: _rebuilt_entry(store_dir, i, group), orphans)):
                if entry is not None:
                    rebuilt[i] = entry
            append_manifest_entries(store_dir, (rebuilt[i] for i in sorted(rebuilt)))
            store = HiddenStateStore(store_dir, strict=False)
        mine = [i for i in store.indices() if start <= i < end]
        reasons = list(pool.map(lambda i: store.check_file(i, hash_check=check == "sha256" and i not in rebuilt),
                                mine))
    reasons = [r or (_dataset_mismatch(store, i, ds) if i in rebuilt else None) for i, r in zip(mine, reasons)]
    bad = {i for i, r in zip(mine, reasons) if r is not None}
    for i, r in zip(mine, reasons):
        if r is not None:
            log.warning("resume: sample %d will be extracted again: %s", i, r)
    repair_manifest(store_dir, drop=bad)
    if removed:
        log.info("resume: removed %d temp files left by an interrupted run", removed)
    if rebuilt:
        log.info("resume: rebuilt %d manifest lines from sample files the manifest had lost (%d of them kept)",
                 len(rebuilt), len(set(rebuilt) - bad))
    if mine:
        log.info("resume: %d of %d samples of shard [%d, %d) already in the store and verified (%s)",
                 len(mine) - len(bad), end - start, start, end, check)
    return Resumed(set(mine) - bad, removed, len(bad - set(rebuilt)), len(set(rebuilt) - bad))


def _rebuilt_entry(store_dir: Path, index: int, group_size: int) -> dict[str, Any] | None:
    try:
        return entry_from_file(store_dir, index, group_size)
    except StoreError as e:
        log.warning("resume: sample %d will be extracted again: %s", index, e)
        return None


def _dataset_mismatch(store: HiddenStateStore, index: int, ds) -> str | None:
    """Why a rebuilt sample is not dataset row ``index`` (its input_ids / loss_mask differ), or None."""
    if ds is None:
        return None
    row, t = ds[index], store.load(index)
    if t["input_ids"].tolist() != list(row["input_ids"]) or t["loss_mask"].tolist() != list(row["loss_mask"]):
        return f"file {store.file(index)} holds other tokens than dataset row {index}"
    return None


# ------------------------------------------------------------------------------------------------ the main loop


class _SafeProgress:
    """Progress shared by the writer thread (samples written) and the main thread (samples skipped)."""

    def __init__(self, progress: Progress):
        self.progress, self.lock = progress, threading.Lock()

    def update(self, n: int, tokens: int, extra: str = "") -> None:
        with self.lock:
            self.progress.update(n, tokens, extra)

    def restart(self) -> None:
        """Start the clock now (after the model load), so tok/s and ETA measure extraction only."""
        with self.lock:
            self.progress.start = self.progress._last_t = time.monotonic()

    def note(self, text: str) -> None:
        with self.lock:
            self.progress.note(text)


def _run_transformers(
    cfg: ExtractConfig,
    spec: VerifierSpec,
    aux_ids: list[int],
    compute_dtype: str,
    ds,
    todo: dict[int, int],
    store_dir: Path,
    meta: dict[str, Any],
    progress: _SafeProgress,
    oom_injector: OomInjector | None,
    stats: dict[str, Any],
) -> None:
    device = str(resolve_device(cfg.device))
    dtype = torch_dtype(compute_dtype)
    t0 = time.monotonic()
    model = hf_backend.load_hf_model(spec, dtype, device, cfg.device_map, cfg.engine.trust_remote_code)
    stats["model_loads"] += 1
    stats["model_load_seconds"] = time.monotonic() - t0
    backend = hf_backend.TransformersBackend(model, aux_ids)
    batcher = TokenBudgetBatcher(todo, cfg.max_tokens_per_batch, cfg.max_samples_per_batch)
    budget = HalvingBudget(cfg.max_tokens_per_batch, cfg.min_tokens_per_batch, "padded tokens per batch")
    writer = AsyncStoreWriter(store_dir, meta, cfg.write_queue_batches,
                              on_written=lambda e: progress.update(1, e["tokens"]))
    stats["extract_start"] = time.monotonic()
    progress.restart()
    attempt = 0
    n_batches = TokenBudgetBatcher(todo, cfg.max_tokens_per_batch, cfg.max_samples_per_batch).count()
    check_pending = cfg.selfcheck
    try:
        while (batch := batcher.next()) is not None:
            progress.note(f"batch {attempt + 1} of ~{n_batches}: {len(batch.indices)} samples, {batch.tokens:,} tokens "
                          f"({batch.padded_tokens:,} padded), started")
            rows = ds[batch.indices]  # {"input_ids": [[...]], "loss_mask": [[...]]}
            input_ids, attention_mask = pad_right(rows["input_ids"])  # [B, T_max] each
            oom_message = None
            attempt += 1
            try:
                if oom_injector is not None:
                    oom_injector(attempt - 1, list(batch.indices), batch.padded_tokens)
                aux, final = backend.capture(input_ids, attention_mask)  # [B, T_max, n_aux*H], [B, T_max, H]
            except Exception as e:  # only OOM is handled; anything else re-raises
                if not is_oom_error(e):
                    raise
                oom_message = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if oom_message is not None:  # outside the except block: the traceback (and its tensors) is gone
                free_memory(device)
                _on_oom(cfg, batcher, budget, batch, oom_message, stats, progress)
                continue
            aux, final = aux.to("cpu"), final.to("cpu")
            if check_pending and len(batch.indices) > 1:  # before anything of this batch is written
                _selfcheck_transformers(backend, batch, rows, aux, final, aux_ids, compute_dtype, cfg, store_dir,
                                        stats)
                check_pending = False
            samples = []
            for b, (idx, n) in enumerate(zip(batch.indices, batch.lengths)):  # drop the right padding
                samples.append((idx, aux[b, :n], final[b, :n],  # [T, n_aux*H], [T, H]
                                torch.as_tensor(rows["input_ids"][b], dtype=torch.long),
                                torch.as_tensor(rows["loss_mask"][b], dtype=torch.uint8)))
            del aux, final
            writer.submit(samples)
    except BaseException:
        try:
            writer.close()  # finished samples still reach the disk and the manifest (resume keeps them)
        except Exception as e:  # noqa: BLE001 - the original error matters more
            log.error("store writer also failed: %s", e)
        raise
    writer.close()
    stats["extract_end"] = time.monotonic()
    stats["samples_written"] += writer.written
    stats["bytes_written"] += writer.bytes


def _selfcheck_transformers(backend: hf_backend.TransformersBackend, batch: Batch, rows: dict, aux: torch.Tensor,
                            final: torch.Tensor, aux_ids: list[int], compute_dtype: str, cfg: ExtractConfig,
                            store_dir: Path, stats: dict[str, Any]) -> None:
    """The self-check on the batch's shortest sample (the most right padding): extracted again alone, compared with
    its row of the batch (aux: [B, T_max, n_aux * H], final: [B, T_max, H], compute dtype); raises
    BatchInvarianceError on a mismatch."""
    t0 = time.monotonic()
    b = min(range(len(batch.indices)), key=lambda j: batch.lengths[j])
    n = batch.lengths[b]
    ids, mask = pad_right([rows["input_ids"][b]])  # [1, n]
    alone_aux, alone_final = backend.capture(ids, mask)
    record = selfcheck.check(batch.indices[b], len(batch.indices), (aux[b, :n], final[b, :n]),
                             (alone_aux[0, :n].to("cpu"), alone_final[0, :n].to("cpu")), aux_ids, compute_dtype,
                             "transformers", time.monotonic() - t0, cfg.selfcheck_tolerance)
    selfcheck.record(store_dir, record, stats)


def _on_oom(cfg: ExtractConfig, batcher: TokenBudgetBatcher, budget: HalvingBudget, batch: Batch, message: str,
            stats: dict, progress: _SafeProgress) -> None:
    floor = budget.floor
    what = f"{len(batch.indices)} samples / {batch.padded_tokens:,} padded tokens"
    if budget.halve():
        batcher.budget = budget.value
        stats["token_budget_history"].append(budget.value)
        log.warning("out of memory on a batch of %s (%s): token budget halved %s, retrying the same samples (model "
                    "stays loaded)", what, message, budget.describe_halving())
        batcher.put_back(batch)
    elif len(batch.indices) > 1:
        log.warning("out of memory on a batch of %s at the token-budget floor (%s tokens, min_tokens_per_batch): "
                    "retrying these samples one at a time", what, f"{floor:,}")
        batcher.put_back(batch, singles=True)
    else:
        idx, n = batch.indices[0], batch.lengths[0]
        text = (f"sample {idx} ({n:,} tokens) does not fit in memory even alone, after halving the token budget "
                f"down to the floor of {floor:,} tokens per batch (min_tokens_per_batch); last error: {message}")
        if cfg.on_unfittable_sample == "fail":
            raise OutOfMemoryAfterRetries(text + " (on_unfittable_sample='fail')")
        log.warning("skipping %s (on_unfittable_sample='skip')", text)
        stats["samples_unfittable"].append(idx)
        progress.update(1, 0, f"skipped sample {idx}")


# -------------------------------------------------------------------------------------------------- entry point


def _selfcheck_outcome(cfg: ExtractConfig, stats: dict[str, Any], store_dir: Path) -> dict[str, Any]:
    """This run's self-check, else the one recorded by the run that extracted the store, else why none ran."""
    if not cfg.selfcheck:
        return selfcheck.not_run("extract.selfcheck is false")
    if "selfcheck" in stats:
        return stats["selfcheck"]
    if stats["samples_written"]:
        record = selfcheck.not_run("no forward pass held two samples (max_samples_per_batch 1, or one sample left)")
        log.warning("extract: %s", selfcheck.summary(record))
        return record
    return selfcheck.load(store_dir) or selfcheck.not_run("nothing was extracted in this run")



def _start(cfg: ExtractConfig, todo: dict[int, int], start: int, end: int, n: int, aux_ids: list[int],
           on_progress: Callable[[int, int, str], None] | None) -> _SafeProgress:
    log.info("extract: %d samples (%s tokens) to do in shard [%d, %d) of %d; aux_layer_ids %s (vLLM convention: "
             "residual stream entering layer k) + final pre-norm state; backend %s; budget %s padded tokens / "
             "%d samples per batch", len(todo), f"{sum(todo.values()):,}", start, end, n, aux_ids, cfg.backend,
             f"{cfg.max_tokens_per_batch:,}", cfg.max_samples_per_batch)
    return _SafeProgress(Progress("extract", total=len(todo), unit="samples", every_n=cfg.log_every_samples,
                                  every_s=cfg.log_every_seconds, logger=log, on_update=on_progress))


def extract_hidden_states(
    cfg: ExtractConfig | dict,
    dataset: PreparedData | str | Path,
    store_dir: str | Path,
    *,
    verifier: VerifierIdentity | None = None,
    guard: DeviceGuard | None = None,
    oom_injector: OomInjector | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> HiddenStates:
    """Extract aux states (vLLM layer-id convention) + final pre-norm states of every sample of the shard of
    ``dataset`` (the prepare stage's artifact, or a prepared dataset folder) into the store at ``store_dir``;
    resumes an interrupted run. The artifact (and its artifact.json) belongs to the stage folder holding the store.

    ``verifier``: the identity the flow computed (else computed here from ``cfg.verifier``); ``guard`` holds the
    devices while the model is loaded (default: the host file lock alone); ``oom_injector`` is a test hook.
    """
    cfg = ExtractConfig.model_validate(cfg)
    verifier = verifier or describe_verifier(cfg.verifier)
    spec = verifier.spec()
    aux_ids = spec.resolve_aux_layer_ids(cfg.aux_layer_ids)
    compute_dtype, store_dtype = cfg.resolved_dtypes(spec)
    dataset_dir = dataset.dataset_path if isinstance(dataset, PreparedData) else dataset
    ds, lengths = open_dataset(dataset_dir, spec.vocab_size)
    start, end = _shard(cfg, len(ds))
    store_dir = Path(store_dir)
    meta = ensure_store(store_dir, store_meta(
        verifier=verifier.path, aux_layer_ids=aux_ids, hidden_size=spec.hidden_size, dtype=store_dtype,
        num_samples=len(ds), backend=cfg.backend, group_size=cfg.group_size, fingerprint=verifier.fingerprint,
        compute_dtype=compute_dtype,
    ))
    stats: dict[str, Any] = {"model_loads": 0, "model_load_seconds": 0.0, "samples_written": 0, "bytes_written": 0,
                             "samples_unfittable": [], "token_budget_history": [cfg.max_tokens_per_batch]}
    if cfg.selfcheck:  # a failed self-check stays failed: never hand on states that depend on batch composition
        selfcheck.raise_if_failed(selfcheck.load(store_dir))
    t_start = time.monotonic()
    listed = read_manifest(store_dir, strict=False)
    temps_removed = dropped = rebuilt = 0
    if all(i in listed or final_file(store_dir, i, meta["group_size"]) is not None for i in range(start, end)):
        # looks complete (every sample listed, or in place to be listed again): verify without holding the devices
        r = resume_state(store_dir, start, end, cfg.resume_check, ds)
        done, temps_removed, dropped, rebuilt = r.done, r.temps_removed, r.dropped, r.rebuilt
        todo = {i: lengths[i] for i in range(start, end) if i not in done}
    else:
        todo = {i: lengths[i] for i in range(start, end)}
    if todo:
        gpu_ids = _gpu_ids(cfg)
        with (guard or file_lock_guard(logger=log))(gpu_ids) as lock_fds:
            # resume under the guard: a job that waited for it sees what the previous holder wrote, and no other
            # job on these devices is writing temp files of this shard while they are cleaned up
            r = resume_state(store_dir, start, end, cfg.resume_check, ds)
            done = r.done
            temps_removed, dropped, rebuilt = temps_removed + r.temps_removed, dropped + r.dropped, rebuilt + r.rebuilt
            todo = {i: lengths[i] for i in range(start, end) if i not in done}
            progress = _start(cfg, todo, start, end, len(ds), aux_ids, on_progress)
            if todo and gpu_ids and cfg.min_free_gpu_memory_fraction > 0:
                cuda_preflight(gpu_ids, cfg.min_free_gpu_memory_fraction, logger=log)
            if todo and cfg.backend == "vllm":
                from eagle3.extract import vllm_backend

                vllm_backend.run_vllm(cfg, spec, aux_ids, compute_dtype, ds, todo, store_dir, meta, stats, progress,
                                      lock_fds)
            elif todo:
                _run_transformers(cfg, spec, aux_ids, compute_dtype, ds, todo, store_dir, meta, progress,
                                  oom_injector, stats)
    else:
        _start(cfg, todo, start, end, len(ds), aux_ids, on_progress)
    extract_s = stats.get("extract_end", time.monotonic()) - stats.get("extract_start", t_start)
    store = HiddenStateStore(store_dir)
    manifest = store_dir / MANIFEST
    unfittable = stats["samples_unfittable"]
    tokens_written = sum(todo[i] for i in todo if i in store and i not in set(unfittable))
    files_bytes = sum(int(store.entry(i).get("bytes", 0)) or store.file(i).stat().st_size for i in store)
    result = HiddenStates(
        out_dir=str(store_dir.parent), fingerprint=store.fingerprint(), store_path=str(store_dir),
        verifier=verifier, aux_layer_ids=aux_ids, compute_dtype=compute_dtype, store_dtype=store_dtype,
        hidden_size=spec.hidden_size, max_seq_len=dataset.max_seq_len if isinstance(dataset, PreparedData)
        else max(lengths), backend=cfg.backend, num_samples=len(ds), shard=[start, end], samples_stored=len(store),
        store_tokens=store.total_tokens,
        bytes_on_disk=files_bytes + (store_dir / STORE_JSON).stat().st_size
        + (manifest.stat().st_size if manifest.exists() else 0),
        manifest_sha256=sha256_file(manifest) if manifest.exists() else "",
        samples_written=stats["samples_written"], samples_resumed=len(done), samples_unfittable=unfittable[:1000],
        samples_unfittable_count=len(unfittable), tokens_written=tokens_written,
        tokens_per_second=tokens_written / extract_s if extract_s > 0 else 0.0, extract_seconds=extract_s,
        model_load_seconds=stats["model_load_seconds"], model_loads=stats["model_loads"],
        token_budget_history=stats["token_budget_history"], temp_files_removed=temps_removed,
        manifest_entries_dropped=dropped, manifest_entries_rebuilt=rebuilt, vllm_logs=stats.get("vllm_logs", []),
        selfcheck=_selfcheck_outcome(cfg, stats, store_dir),
    )
    result.save()
    log.info("extract: done: %d samples written (%s tokens, %s bytes) at %s tok/s, %d resumed, %d unfittable "
             "skipped; store %s holds %d/%d samples", result.samples_written, f"{tokens_written:,}",
             f"{stats['bytes_written']:,}", f"{result.tokens_per_second:,.0f}", result.samples_resumed,
             len(unfittable), store_dir, len(store), len(ds))
    return result
