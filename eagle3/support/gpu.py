"""Host-level GPU hygiene for jobs that hold a verifier: a lock that cannot go stale, OOM detection, CUDA preflight.

* ``device_lock``: ``fcntl.flock`` on one lock file per GPU (``gpu-<id>.lock``) or per host for CPU jobs
  (``host-cpu.lock``), taken BEFORE the model loads. The kernel drops a flock when the last descriptor of the open
  file closes, i.e. when the holder dies for any reason (``kill -9`` included), so the lock never goes stale and
  needs no server. After locking, the holder writes its PID, command line and start time into the file so a waiting
  job can say who holds the GPU. ``DeviceGuard`` is the shape of the guard every GPU stage enters (extraction,
  training, validation, regeneration); ``file_lock_guard`` is this lock alone, the pipeline's tasks add the Prefect
  concurrency slots around it (tasks/common.py ``gpu_guard``).
* ``is_oom_error`` / ``is_oom_text``: THE out-of-memory classifier (the extraction loop, vLLM's log tail, the flow's
  OOM-only retry condition): ``torch.cuda.OutOfMemoryError`` / ``torch.OutOfMemoryError``, ``MemoryError`` and
  allocator failures reported as ``RuntimeError`` text, anywhere in the cause chain.
* ``cuda_preflight``: free memory per GPU (``torch.cuda.mem_get_info``); when low, names the processes that hold
  GPUs (pynvml or ``nvidia-smi`` when available).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import gc
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import psutil
import torch
from pydantic import BaseModel, Field

from eagle3.support.settings import RUNTIME, SETTINGS_MODEL

log = logging.getLogger("eagle3.support.gpu")

LOCK_DIR_ENV = "EAGLE3_LOCK_DIR"
# host-local on purpose (a GPU lock must not span hosts), per user (a folder others may write to lets them plant
# symlinks); every checkout of the same user on this host shares it, which is what guards the GPUs
DEFAULT_LOCK_DIR = f"/tmp/eagle3-locks-{os.getuid()}"
_POLL_SECONDS = 0.2

OOM_MARKERS = (  # lower-case substrings of allocator failures (torch errors and vLLM's log lines)
    "out of memory",  # CUDA / HIP: "CUDA out of memory. Tried to allocate ..."; torch.OutOfMemoryError
    "can't allocate memory",  # DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes
    "cannot allocate memory",  # errno ENOMEM surfaced through torch
    "not enough memory",  # DefaultCPUAllocator on Windows / some builds
    "failed to allocate",
    "outofmemoryerror",  # a traceback's exception name in a subprocess log
    "no available memory for the cache blocks",  # vLLM: the KV cache does not fit after loading the model
)


class OutOfMemoryAfterRetries(RuntimeError):
    """A sample does not fit even at the smallest token budget (``min_tokens_per_batch``); names the sample."""


class GpuBusyError(RuntimeError):
    """The GPU / host lock is held by another process; the message names its PID, command line and start time."""


def is_oom_text(text: str) -> bool:
    """True when a log text (e.g. a subprocess's last lines) reports an allocation failure."""
    low = text.lower()
    return any(m in low for m in OOM_MARKERS)


def is_oom_error(exc: BaseException | None) -> bool:
    """True when ``exc`` or an exception in its cause chain is an out-of-memory failure that a smaller batch may
    avoid (GPU or CPU allocator). Never for ``OutOfMemoryAfterRetries`` (the job already halved its budget down to
    the floor: retrying cannot help), and never for bad-input errors (``ValueError``), whatever their text."""
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OutOfMemoryAfterRetries):
            return False
        if isinstance(exc, (*oom_types, MemoryError)):
            return True
        if isinstance(exc, RuntimeError) and is_oom_text(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_memory(device: torch.device | str | None = None) -> None:
    """Release what a failed forward left behind: Python garbage, then the CUDA caching allocator's free blocks."""
    gc.collect()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- host lock


class LockSettings(BaseModel):
    """Where the host's GPU lock files live and how long a job waits for a busy one (the pipeline's host config)."""

    model_config = SETTINGS_MODEL

    lock_dir: str | None = Field(
        None, description="Host-local folder of the GPU/host lock files; None = $EAGLE3_LOCK_DIR or "
        "/tmp/eagle3-locks-UID (this user's id). Must belong to this user and not be writable by others. Every checkout of the "
        "same user on this host shares it: that is what keeps two runs off the same GPUs.",
        json_schema_extra=RUNTIME)
    lock_wait_seconds: float = Field(
        0.0, description="Seconds to wait for a busy GPU/host lock: 0 = fail at once naming the holder, negative "
        "= forever.", json_schema_extra=RUNTIME)


class LockDirError(RuntimeError):
    """The lock folder is not safe to use (owned by another user, writable by others, or not a folder)."""


def lock_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The lock folder, created owner-only when missing; refused when another user owns it or others may write
    to it (they could plant a symlink named like a lock file)."""
    root = Path(explicit or os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(root)
    except OSError as e:
        raise LockDirError(f"lock folder {root} cannot be created or read: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise LockDirError(f"lock folder {root} is not a folder (a symlink or a file is refused)")
    if st.st_uid != os.getuid():
        raise LockDirError(f"lock folder {root} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
                           f"set host.lock_dir or {LOCK_DIR_ENV} to a folder of your own")
    if st.st_mode & 0o022:
        raise LockDirError(f"lock folder {root} is writable by others (mode {stat.filemode(st.st_mode)}): "
                           f"chmod go-w it, or set host.lock_dir / {LOCK_DIR_ENV} to a private folder")
    return root


def cuda_device_ids(device: str | None = None, device_map: object = None, count: int | None = None) -> list[int]:
    """CUDA device indices a job will use (empty without CUDA): ``count`` devices 0..count-1 (tensor parallel,
    torchrun), or every device a ``device_map`` names ("auto" = all visible), or the one ``device``."""
    if not torch.cuda.is_available():
        return []
    if count is not None:
        return list(range(count))
    if device_map is not None:
        if isinstance(device_map, dict):
            ids = {torch.device(d).index or 0 if isinstance(d, str) else int(d)
                   for d in device_map.values() if not str(d).startswith(("cpu", "disk"))}
            return sorted(ids)
        return list(range(torch.cuda.device_count()))
    dev = torch.device("cuda:0" if device in (None, "auto") else device)
    return [dev.index or 0] if dev.type == "cuda" else []


def lock_names(gpu_ids: list[int]) -> list[str]:
    """Lock-file stems: one per GPU, named by its physical id (or UUID) as CUDA_VISIBLE_DEVICES names it, or
    ``host-cpu`` for a job that uses no GPU."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return [f"gpu-{visible[i] if i < len(visible) else i}" for i in gpu_ids] or ["host-cpu"]


def _holder_info() -> dict:
    p = psutil.Process()
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "cmdline": " ".join(p.cmdline()) or sys.executable,
        "started": _dt.datetime.fromtimestamp(p.create_time()).isoformat(timespec="seconds"),
        "locked_at": _dt.datetime.now().isoformat(timespec="seconds"),
    }


def describe_holder(path: Path) -> str:
    """Who holds the lock file ``path``: PID, command line and start time from the file, refreshed by psutil."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        info = {}
    pid = info.get("pid")
    if not pid:
        return "an unknown process (the holder has not written its details yet)"
    cmd, started = info.get("cmdline", "?"), info.get("started", "?")
    try:
        p = psutil.Process(int(pid))
        cmd = " ".join(p.cmdline()) or cmd
        started = _dt.datetime.fromtimestamp(p.create_time()).isoformat(timespec="seconds")
    except (psutil.Error, ValueError):
        pass
    return f"PID {pid} on {info.get('host', '?')} (command: {cmd}; started {started}; locked at {info.get('locked_at', '?')})"


@contextlib.contextmanager
def device_lock(
    names: list[str],
    directory: str | os.PathLike | None = None,
    wait_seconds: float = 0.0,
    logger: logging.Logger | None = None,
) -> Iterator[list[int]]:
    """Hold exclusive flocks on ``<directory>/<name>.lock`` for every name (sorted, so two jobs cannot deadlock).

    ``wait_seconds`` = 0: fail at once when busy; > 0: wait up to that many seconds; < 0: wait forever.
    Raises ``GpuBusyError`` naming the holder. Yields the open lock descriptors (pass them to a subprocess with
    ``pass_fds`` to keep the lock held for as long as that subprocess lives, even if this process dies first).
    """
    logger = logger or log
    root = lock_dir(directory)
    fds: list[int] = []
    try:
        for name in sorted(set(names)):
            path = root / f"{name}.lock"
            try:  # never through a symlink: a planted one would make us truncate and overwrite its target
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise LockDirError(f"lock file {path} cannot be opened ({e.strerror}; a symlink there is refused)"
                                   ) from None
            fds.append(fd)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise LockDirError(f"lock file {path} is not a regular file")
            deadline = time.monotonic() + wait_seconds if wait_seconds >= 0 else float("inf")
            announced = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = describe_holder(path)
                    if time.monotonic() >= deadline:
                        waited = f" after waiting {wait_seconds:.0f} s" if wait_seconds > 0 else ""
                        raise GpuBusyError(
                            f"{name} is busy{waited}: lock {path} is held by {holder}. Wait for it, stop it, or "
                            f"raise lock_wait_seconds."
                        ) from None
                    if not announced:
                        logger.info("waiting up to %s for %s: held by %s",
                                    "forever" if wait_seconds < 0 else f"{wait_seconds:.0f} s", name, holder)
                        announced = True
                    time.sleep(_POLL_SECONDS)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(_holder_info()) + "\n").encode(), 0)
            os.fsync(fd)
        logger.info("holding %s (lock dir %s)", ", ".join(sorted(set(names))), root)
        yield fds
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the last descriptor releases the flock


# ---------------------------------------------------------------------------------------------------- preflight


def gpu_processes() -> str:
    """Processes holding GPUs, as text: pynvml, else nvidia-smi, else a note that neither is available."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        lines = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                try:
                    cmd = " ".join(psutil.Process(p.pid).cmdline())
                except psutil.Error:
                    cmd = "?"
                lines.append(f"GPU {i}: PID {p.pid} uses {(p.usedGpuMemory or 0) / 2**30:.1f} GiB: {cmd}")
        return "\n".join(lines) or "no compute processes reported by NVML"
    except Exception as e:  # noqa: BLE001 - pynvml missing or NVML unavailable: try nvidia-smi
        log.debug("pynvml unavailable (%s); trying nvidia-smi", e)
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=False,
            )
            return out.stdout.strip() or "no compute processes reported by nvidia-smi"
        except (OSError, subprocess.SubprocessError) as e:
            return f"nvidia-smi failed: {e}"
    return "cannot list GPU processes: neither pynvml nor nvidia-smi is available"


def cuda_preflight(devices: list[int] | None = None, min_free_fraction: float = 0.8,
                   logger: logging.Logger | None = None) -> dict[int, tuple[int, int]]:
    """Check free memory on each CUDA device before loading a model. Returns {device: (free bytes, total bytes)}.

    Raises ``GpuBusyError`` listing the devices below ``min_free_fraction`` of their memory free and the processes
    holding GPUs. A no-op without CUDA.
    """
    logger = logger or log
    if not torch.cuda.is_available():
        return {}
    devices = list(range(torch.cuda.device_count())) if devices is None else devices
    report, low = {}, []
    for d in devices:
        free, total = torch.cuda.mem_get_info(d)
        report[d] = (free, total)
        logger.info("cuda:%d free %.1f GiB of %.1f GiB", d, free / 2**30, total / 2**30)
        if free < min_free_fraction * total:
            low.append(f"cuda:{d} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    if low:
        raise GpuBusyError(
            f"GPU memory already in use ({'; '.join(low)}; need >= {min_free_fraction:.0%} free, setting "
            f"min_free_gpu_memory_fraction). Processes holding GPUs:\n{gpu_processes()}"
        )
    return report


# ---------------------------------------------------------------------------------------------------- the guard

# A guard takes the CUDA device indices a stage will use (empty: CPU) and holds them for the block, yielding the
# lock file descriptors (hand them to subprocesses with ``pass_fds`` so the lock lives as long as they do).
DeviceGuard = Callable[[list[int]], AbstractContextManager[list[int]]]


def file_lock_guard(settings: LockSettings | None = None, logger: logging.Logger | None = None) -> DeviceGuard:
    """The host file lock alone (library callers; the pipeline's tasks wrap it with Prefect's slots)."""
    settings = settings or LockSettings()

    def guard(gpu_ids: list[int]) -> AbstractContextManager[list[int]]:
        return device_lock(lock_names(gpu_ids), settings.lock_dir, settings.lock_wait_seconds, logger=logger)

    return guard
