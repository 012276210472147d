"""Prefect glue shared by the stage tasks: content-addressed cache keys, per-stage output folders, reuse of cached
artifacts only when they pass their integrity check (``Artifact.problems``: outputs in place with their recorded
sizes and small-file hashes), OOM-only retries with a smaller batch per attempt, and the GPU guard every GPU stage
enters.

Cache keys are computed from CONTENT, never from a path alone: a stage's key hashes its stage name, the package
version, its output settings (eagle3.support.settings: runtime settings never enter a key) and the identity of
every upstream artifact it consumes (its ``fingerprint``, and those of the records nested in it such as the
verifier's). A stage writes into ``<run_dir>/<stage>-<key[:12]>``, where the folder key also leaves out the
resumable settings (an extraction shard's range, a time-boxed training job's step limit): shards of one dataset
fill one store, and a longer job resumes the shorter one's folder, while other output settings never resume into
the folder of other settings.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import task
from pydantic import BaseModel

import eagle3
from eagle3.chat.encoder import ChatSettings, describe_tokenizer
from eagle3.chat.sources import DataSources, describe_sources
from eagle3.config import HostConfig
from eagle3.support.artifacts import A, Artifact, identity, with_producer
from eagle3.support.gpu import DeviceGuard, device_lock, is_oom_error, lock_names
from eagle3.support.io import sha256_json
from eagle3.support.settings import output_view
from eagle3.support.verifier import VerifierIdentity, describe_verifier
from tasks.logs import logs_from_all_threads


def _canonical(value: Any, keep_resumable: bool) -> Any:
    if isinstance(value, BaseModel) and "fingerprint" in type(value).model_fields:
        return identity(value)  # an upstream artifact (or the verifier): its content identity stands for all of it
    if isinstance(value, BaseModel):
        return output_view(value, keep_resumable=keep_resumable)  # settings: output fields only
    if isinstance(value, dict):
        return {k: _canonical(v, keep_resumable) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, keep_resumable) for v in value]
    return value


# task parameters about orchestration, never about what the stage computes (``baseline_for``: regeneration's engine
# session also generates validation's verifier-alone baseline; asking for it never regenerates the data)
NOT_KEYED = frozenset({"reuse_only", "placement", "baseline_for"})


def stage_key(stage: str, inputs: dict[str, Any], keep_resumable: bool = True) -> str:
    """Content key of one stage run: stage name + package version + output settings + upstream identities.

    ``run_dir`` is part of the key (a result in another run folder points at other files).
    """
    inputs = {k: v for k, v in inputs.items() if k not in NOT_KEYED}
    return sha256_json({"stage": stage, "version": eagle3.__version__, "inputs": _canonical(inputs, keep_resumable)})


def cache_key(context, parameters: dict[str, Any]) -> str:
    """Prefect ``cache_key_fn``: the task's name is the stage."""
    return stage_key(context.task.name, parameters)


# the running stage task's (stage name, parameters), set by ``stage_task``'s wrapper
_STAGE_CALL: contextvars.ContextVar[tuple[str, dict[str, Any]] | None] = contextvars.ContextVar("stage_call",
                                                                                               default=None)


def stage_dir(run_dir: str, stage: str | None = None, inputs: dict[str, Any] | None = None) -> Path:
    """``<run_dir>/<stage>-<key[:12]>``, keyed without the resumable settings. ``stage`` and ``inputs`` default to
    the running stage task's name and the parameters it was called with (``stage_task`` records them), so the folder
    key and the cache key read the same inputs. Inside a task run the stage is the task's name (one task body serves
    prepare-data and prepare-regenerated)."""
    from prefect.context import TaskRunContext

    call = _STAGE_CALL.get()
    ctx = TaskRunContext.get()
    stage = ctx.task.name if ctx is not None else stage or (call[0] if call else None)
    inputs = inputs if inputs is not None else (call[1] if call else None)
    if inputs is None or stage is None:
        raise RuntimeError("stage_dir() without a stage and its inputs outside a stage task")
    return Path(run_dir) / f"{stage}-{stage_key(stage, inputs, keep_resumable=False)[:12]}"


def result_storage_block(location: str):
    """Result storage for cached artifacts: a local folder, or an fsspec URL (s3://..., gs://..., memory://...).

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


def produced_here(artifact: A) -> A:
    """Stamp a stage's artifact with the flow run that ran the stage (kept when later runs reuse it from cache)."""
    try:
        from prefect.runtime import flow_run

        return with_producer(artifact, f"flow run {flow_run.name} ({flow_run.id})") if flow_run.id else artifact
    except Exception:  # noqa: BLE001 - outside a flow run (task.fn in tests): nothing to stamp
        return artifact


def stage_task(artifact: type[Artifact], oom_retries: int = 0):
    """The decorator of every stage task: a Prefect task named after the stage its artifact type belongs to
    (``artifact.stage``: the one place a stage's name is written), cached by content (``cache_key``) with its
    artifact persisted as JSON, the log lines of all its threads routed to its run (tasks.logs), its artifact
    stamped with the producing flow run, and ``oom_retries`` retries on out-of-memory errors only (each at a smaller
    batch)."""
    name = artifact.stage

    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def body(*args, **kwargs):
            params = signature.bind(*args, **kwargs)
            params.apply_defaults()
            token = _STAGE_CALL.set((name, dict(params.arguments)))
            try:
                with logs_from_all_threads():
                    return produced_here(fn(*args, **kwargs))
            finally:
                _STAGE_CALL.reset(token)

        return task(name=name, cache_key_fn=cache_key, persist_result=True, result_serializer="json",
                    retries=oom_retries, retry_condition_fn=retry_on_oom_only if oom_retries else None)(body)

    return wrap


def run_stage(stage_task, **params) -> Artifact:
    """Run a cached stage; a cached artifact that fails its integrity check (outputs deleted, resized or rewritten
    since: ``Artifact.problems``) is recomputed (refresh_cache), which repairs what the stage can repair (extraction
    re-extracts only the bad samples, training resumes)."""
    state = stage_task(**params, return_state=True)
    artifact = state.result()  # raises the stage's error when it failed
    if state.name == "Cached":
        problems = artifact.problems() if artifact is not None else ["no cached artifact"]
        if problems:
            from prefect.logging import get_run_logger

            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            get_run_logger().warning("%s: the cached result cannot be reused, recomputing: %s%s", stage_task.name,
                                     "; ".join(problems[:10]), more)
            artifact = stage_task.with_options(refresh_cache=True)(**params)
    return artifact


def reusable(artifact: Artifact | None) -> bool:
    """A (possibly cached) artifact is usable only when its integrity check finds nothing (``Artifact.problems``)."""
    return artifact is not None and not artifact.problems()


# ---------------------------------------------------------------- input identities (never cached: they read content)


@task(name="describe-verifier")
def describe_verifier_task(verifier_path: str) -> VerifierIdentity:
    """The verifier's content identity; every stage that depends on it keys its cache on the fingerprint."""
    return describe_verifier(verifier_path)


@task(name="describe-sources")
def describe_sources_task(sources: list[str]) -> DataSources:
    """Content fingerprint of the training data sources (the chat datasets)."""
    return describe_sources(sources)


# the same description of other inputs, under their own names in the run's task list and logs
describe_regenerated_task = describe_sources_task.with_options(name="describe-regenerated")  # the verifier's answers
describe_prompts_task = describe_sources_task.with_options(name="describe-prompts")  # the validation prompts


@task(name="describe-tokenizer")
def describe_tokenizer_task(cfg: ChatSettings) -> DataSources:
    """Content fingerprint of what renders the conversations (tokenizer files, chat-template override)."""
    return describe_tokenizer(cfg)


# ---------------------------------------------------------------- OOM-only retries


def retry_on_oom_only(task, task_run, state) -> bool:
    """``retry_condition_fn``: retry when the failure was an out-of-memory error, never on bad input."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as exc:  # noqa: BLE001 - we classify, then decide
        return is_oom_error(exc)
    return False


def attempt_batch_scale() -> float:
    """1.0 on the first attempt, then 1/2, 1/4, ...: each OOM retry runs at a smaller batch."""
    try:
        from prefect.runtime import task_run

        return 0.5 ** max(0, int(task_run.run_count or 1) - 1)
    except Exception:  # noqa: BLE001 - outside a task run (task.fn in tests) there is no attempt count
        return 1.0


# ---------------------------------------------------------------- the GPU guard


def gpu_guard(host: HostConfig | None) -> DeviceGuard:
    """The guard of every stage that uses the GPUs: ``max(1, devices)`` slots of the host's Prefect global
    concurrency limit (when one is configured), then the host file lock on exactly those devices.

    The stage calls it with the CUDA device indices it will use (empty on CPU: one slot and the host-cpu lock)."""
    host = HostConfig.model_validate(host or {})

    @contextlib.contextmanager
    def guard(gpu_ids: list[int]) -> Iterator[list[int]]:
        with _slots(host.gpu_concurrency_limit, max(1, len(gpu_ids)), host.strict, host.lock_wait_seconds), \
                device_lock(lock_names(gpu_ids), host.lock_dir, host.lock_wait_seconds) as fds:
            yield fds

    return guard


@contextlib.contextmanager
def _slots(limit_name: str | None, slots: int, strict: bool, wait_seconds: float) -> Iterator[None]:
    """``slots`` of the host's global concurrency limit, waiting up to ``wait_seconds`` (negative: forever), like the
    host lock."""
    if not limit_name:
        yield
        return
    from prefect.concurrency.sync import concurrency

    with concurrency(limit_name, occupy=slots, strict=strict, timeout_seconds=None if wait_seconds < 0 else
                     max(wait_seconds, 1.0)):
        yield
