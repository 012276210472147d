"""Prefect glue shared by the stage tasks: content-addressed cache keys, per-stage output folders, OOM-only
retries with a smaller batch per attempt, and the host GPU concurrency limit.

Cache keys are computed from CONTENT, never from a path alone: a stage's key hashes its stage name, the package
version, its settings, and the ``fingerprint`` of every upstream manifest it consumes (each manifest carries the
content hash of what its stage wrote). The inputs of the first stage (dataset files, the verifier's config.json,
weight index and tokenizer) are fingerprinted by ``describe_inputs``. A stage writes into
``<run_dir>/<stage>-<key[:12]>`` so that changed settings never resume into the folder of other settings, while a
crashed run with unchanged settings resumes into its own folder.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import task
from pydantic import BaseModel

import eagle3
from eagle3.support.io import fingerprint_paths, sha256_file, sha256_json

# parameters that never change a stage's outcome: progress cadence, and where the GPUs' concurrency limit lives
_NOT_IN_KEY = {"log_every_seconds", "log_every_samples", "log_every_steps", "host"}


def _canonical(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return _canonical(value.model_dump(mode="json"))
    if isinstance(value, dict):
        if "fingerprint" in value:  # an upstream manifest: its content hash stands for all of it
            return {"fingerprint": value["fingerprint"]}
        return {k: _canonical(v) for k, v in value.items() if k not in _NOT_IN_KEY}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def stage_key(stage: str, inputs: dict[str, Any]) -> str:
    """Content key of one stage run: stage name + package version + settings + upstream fingerprints.

    ``run_dir`` is part of the key (a result in another run folder points at other files).
    """
    return sha256_json({"stage": stage, "version": eagle3.__version__, "inputs": _canonical(inputs)})


def cache_key(context, parameters: dict[str, Any]) -> str:
    """Prefect ``cache_key_fn``: the task's name is the stage."""
    return stage_key(context.task.name, parameters)


def stage_dir(run_dir: str, stage: str, inputs: dict[str, Any], folder_ignores: tuple[str, ...] = ()) -> Path:
    """``<run_dir>/<stage>-<key[:12]>``; ``folder_ignores`` lists cfg fields that must not split the folder
    (extraction shards of one dataset fill one store)."""
    if folder_ignores and "cfg" in inputs:
        cfg = _canonical(inputs["cfg"])
        inputs = {**inputs, "cfg": {k: v for k, v in cfg.items() if k not in folder_ignores}}
    return Path(run_dir) / f"{stage}-{stage_key(stage, inputs)[:12]}"


def result_storage_block(location: str):
    """Result storage for cached manifests: a local folder, or an fsspec URL (s3://..., gs://..., memory://...).

    Prefect wants task result storage saved server-side: the block is saved under a name derived from the location.
    """
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    if "://" in location and not location.startswith("file://"):
        block = RemoteFileSystem(basepath=location)
    else:
        location = str(Path(location.removeprefix("file://")).resolve())
        block = LocalFileSystem(basepath=location)
    block.save(f"eagle3-results-{hashlib.sha256(location.encode()).hexdigest()[:12]}", overwrite=True)
    return block


def run_stage(stage_task, **params) -> dict:
    """Run a cached stage; a cached manifest whose files were deleted since is recomputed (refresh_cache)."""
    manifest = stage_task(**params)
    if not manifest_ok(manifest):
        manifest = stage_task.with_options(refresh_cache=True)(**params)
    return manifest


def manifest_ok(manifest: dict | None) -> bool:
    """A (possibly cached) manifest is usable only if every file/folder it lists still exists."""
    if not manifest:
        return False
    paths = manifest.get("paths", {})
    return all(Path(p).exists() for p in paths.values())


# ---------------------------------------------------------------- input fingerprints


def fingerprint_verifier(path: str) -> str:
    """config.json + weight index (or each shard's safetensors header) + tokenizer files; never 500 GB of weights."""
    root = Path(path)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json", "generation_config.json"):
        if (root / name).is_file():
            h.update(name.encode() + sha256_file(root / name).encode())
    for shard in sorted(root.glob("*.safetensors")):
        with open(shard, "rb") as f:  # the header lists every tensor's name, dtype, shape and byte range
            n = int.from_bytes(f.read(8), "little")
            h.update(shard.name.encode() + f.read(min(n, 100 << 20)) + str(shard.stat().st_size).encode())
    for tok in sorted(root.glob("tokenizer*")) + sorted(root.glob("*.jinja")) + sorted(root.glob("special_tokens*")):
        h.update(tok.name.encode() + sha256_file(tok).encode())
    return h.hexdigest()


def fingerprint_sources(sources: list[str]) -> str:
    """Local files/folders by content; URLs and hub ids by their string (and revision, if pinned in the id)."""
    parts = []
    for src in sources:
        local = Path(src.removeprefix("file://"))
        parts.append(fingerprint_paths([local]) if local.exists() else f"remote:{src}")
    return sha256_json(parts)


@task(name="describe-inputs")
def describe_inputs(verifier_path: str, sources: list[str]) -> dict:
    """Content fingerprints of the pipeline's inputs; every stage's cache key includes this one (never cached)."""
    verifier_fp, sources_fp = fingerprint_verifier(verifier_path), fingerprint_sources(sources)
    return {"verifier_path": verifier_path, "sources": sources, "verifier_fingerprint": verifier_fp,
            "sources_fingerprint": sources_fp, "fingerprint": sha256_json([verifier_fp, sources_fp])}


@task(name="describe-file")
def describe_file(path: str) -> dict:
    """Content fingerprint of one side input (e.g. the validation prompts), for the stages that read it."""
    return {"path": path, "fingerprint": fingerprint_sources([path])}


# ---------------------------------------------------------------- OOM-only retries


OOM_MARKERS = ("out of memory", "outofmemoryerror", "cuda error: out of memory", "cannot allocate memory",
               "defaultcpuallocator: can't allocate memory")


def is_oom_exception(exc: BaseException | None) -> bool:
    """True for an allocation failure anywhere in the cause chain. Not for ``OutOfMemoryAfterRetries``: the job
    already halved its budget down to the floor, so a retry at a smaller batch cannot help."""
    while exc is not None:
        if type(exc).__name__ == "OutOfMemoryAfterRetries":
            return False
        text = f"{type(exc).__name__}: {exc}".lower()
        if isinstance(exc, MemoryError) or any(m in text for m in OOM_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_on_oom_only(task, task_run, state) -> bool:
    """``retry_condition_fn``: retry when the failure was an out-of-memory error, never on bad input."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as exc:  # noqa: BLE001 - we classify, then decide
        return is_oom_exception(exc)
    return False


def attempt_batch_scale() -> float:
    """1.0 on the first attempt, then 1/2, 1/4, ...: each OOM retry runs at a smaller batch."""
    try:
        from prefect.runtime import task_run

        return 0.5 ** max(0, int(task_run.run_count or 1) - 1)
    except Exception:  # noqa: BLE001 - outside a task run (task.fn in tests) there is no attempt count
        return 1.0


# ---------------------------------------------------------------- GPU concurrency


@contextlib.contextmanager
def gpu_slots(limit_name: str | None, slots: int, strict: bool) -> Iterator[None]:
    """Hold ``slots`` of the host's Prefect global concurrency limit (slots = GPUs) while the block runs.

    Combined with the host file lock taken inside extraction (eagle3.support.gpu), which works without any server.
    ``limit_name=None`` (the laptop demo) skips it.
    """
    if not limit_name or slots <= 0:
        yield
        return
    from prefect.concurrency.sync import concurrency

    with concurrency(limit_name, occupy=slots, strict=strict):
        yield

