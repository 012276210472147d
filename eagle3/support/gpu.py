"""Host-level GPU hygiene for jobs that hold a verifier: a lock that cannot go stale, OOM detection, CUDA preflight.

* ``device_lock``: ``fcntl.flock`` on one lock file per GPU (``gpu-<id>.lock``) or per host for CPU jobs
  (``host-cpu.lock``), taken BEFORE the model loads. The kernel drops a flock when the last descriptor of the open
  file closes, i.e. when the holder dies for any reason (``kill -9`` included), so the lock never goes stale and
  needs no server. After locking, the holder writes its PID, command line and start time into the file so a waiting
  job can say who holds the GPU.
* ``is_oom_error``: True for ``torch.cuda.OutOfMemoryError`` / ``torch.OutOfMemoryError`` and for CPU allocation
  failures (``RuntimeError`` "DefaultCPUAllocator: can't allocate memory", ``MemoryError``). The extraction loop and
  the flow's retry condition use it.
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
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

log = logging.getLogger("eagle3.support.gpu")

LOCK_DIR_ENV = "EAGLE3_LOCK_DIR"
DEFAULT_LOCK_DIR = "/tmp/eagle3-locks"  # host-local on purpose: a GPU lock must not span hosts
_POLL_SECONDS = 0.2

_OOM_MESSAGES = (
    "out of memory",  # CUDA / HIP: "CUDA out of memory. Tried to allocate ..."
    "can't allocate memory",  # DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes
    "not enough memory",  # DefaultCPUAllocator on Windows / some builds
    "cannot allocate memory",  # errno ENOMEM surfaced through torch
    "failed to allocate",
)


class OutOfMemoryAfterRetries(RuntimeError):
    """A sample does not fit even at the smallest token budget (``min_tokens_per_batch``); names the sample."""


class GpuBusyError(RuntimeError):
    """The GPU / host lock is held by another process; the message names its PID, command line and start time."""


def is_oom_error(exc: BaseException) -> bool:
    """True when ``exc`` is an out-of-memory failure that a smaller batch may avoid (GPU or CPU allocator)."""
    if isinstance(exc, OutOfMemoryAfterRetries):
        return False  # already retried down to the floor: retrying the task will not help
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if isinstance(exc, (*oom_types, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(m in msg for m in _OOM_MESSAGES)
    return False


def free_memory(device: torch.device | str | None = None) -> None:
    """Release what a failed forward left behind: Python garbage, then the CUDA caching allocator's free blocks."""
    gc.collect()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- host lock


def lock_dir(explicit: str | os.PathLike | None = None) -> Path:
    return Path(explicit or os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)


def lock_names(device: str | torch.device | None, device_map: object = None) -> list[str]:
    """Lock-file stems for the devices a job will use: one per GPU (physical id or UUID as CUDA_VISIBLE_DEVICES
    names it), or ``host-cpu`` for a CPU job. ``device_map`` values (``"auto"``, dicts of layer -> device) mean:
    every visible GPU that may be used."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]

    def physical(i: int) -> str:
        return f"gpu-{visible[i] if i < len(visible) else i}"

    if device_map is not None:
        if isinstance(device_map, dict):
            ids = sorted({torch.device(d).index or 0 for d in device_map.values()
                          if str(d) not in ("cpu", "disk") and not str(d).startswith("cpu")})
            if not ids and any(str(d) not in ("cpu", "disk") for d in device_map.values()):
                ids = [0]
        else:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            ids = list(range(n))
        return [physical(i) for i in ids] or ["host-cpu"]
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        return [physical(dev.index or 0)]
    return [f"host-{dev.type}"]


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
    root.mkdir(parents=True, exist_ok=True)
    fds: list[int] = []
    try:
        for name in sorted(set(names)):
            path = root / f"{name}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            fds.append(fd)
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
