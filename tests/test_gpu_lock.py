"""The host GPU lock (fcntl.flock), OOM classification and the CUDA preflight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from eagle3.support.gpu import (
    GpuBusyError,
    LockSettings,
    OutOfMemoryAfterRetries,
    cuda_preflight,
    device_lock,
    file_lock_guard,
    is_oom_error,
    lock_names,
)

REPO = Path(__file__).resolve().parent.parent


def _holder(lock_dir: Path, names: list[str], hold_seconds: float = 60.0) -> subprocess.Popen:
    """A separate process that takes the lock, says so on stdout, and sleeps."""
    code = textwrap.dedent(f"""
        import sys, time
        from eagle3.support.gpu import device_lock
        with device_lock({names!r}, {str(lock_dir)!r}):
            print("locked", flush=True)
            time.sleep({hold_seconds})
    """)
    p = subprocess.Popen([sys.executable, "-c", code, "--holder-marker"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_busy_lock_fails_fast_naming_holder(tmp_path):
    p = _holder(tmp_path, ["gpu-0"])
    try:
        t0 = time.monotonic()
        with pytest.raises(GpuBusyError) as e, device_lock(["gpu-0"], tmp_path, wait_seconds=0):
            pass
        assert time.monotonic() - t0 < 5
        msg = str(e.value)
        assert f"PID {p.pid}" in msg and "--holder-marker" in msg and "started 20" in msg and "gpu-0" in msg
        with device_lock(["gpu-1"], tmp_path):  # another GPU is free
            pass
    finally:
        p.kill()
        p.wait()


def test_waits_until_holder_releases(tmp_path):
    p = _holder(tmp_path, ["host-cpu"], hold_seconds=1.0)
    t0 = time.monotonic()
    try:
        with device_lock(["host-cpu"], tmp_path, wait_seconds=60) as fds:
            assert len(fds) == 1
            assert time.monotonic() - t0 > 0.5  # we got it only once the holder let go
    finally:
        p.wait()


def test_wait_timeout_names_holder(tmp_path):
    p = _holder(tmp_path, ["gpu-3"])
    try:
        with pytest.raises(GpuBusyError, match=rf"after waiting 1 s: .* PID {p.pid}"), \
                device_lock(["gpu-3"], tmp_path, wait_seconds=1.0):
            pass
    finally:
        p.kill()
        p.wait()


def test_lock_of_killed_process_is_free_immediately(tmp_path):
    p = _holder(tmp_path, ["gpu-0", "gpu-1"])
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    with device_lock(["gpu-1", "gpu-0"], tmp_path, wait_seconds=0):
        info = (tmp_path / "gpu-0.lock").read_text()
        assert f'"pid": {os.getpid()}' in info  # the new holder wrote its details


def test_extraction_refuses_held_lock_before_loading(tiny_llama_verifier, tmp_path, monkeypatch):
    from helpers import make_dataset

    from eagle3.extract import hf_backend
    from eagle3.extract.stage import extract_hidden_states

    ds = make_dataset(tmp_path / "ds", [5, 9], 8192)
    loads = []
    monkeypatch.setattr(hf_backend, "load_hf_model", lambda *a, **k: loads.append(1))
    p = _holder(tmp_path / "locks", ["host-cpu"])
    try:
        with pytest.raises(GpuBusyError, match=f"PID {p.pid}"):
            extract_hidden_states({"verifier": str(tiny_llama_verifier), "device": "cpu"}, ds, tmp_path / "store",
                                  guard=file_lock_guard(LockSettings(lock_dir=str(tmp_path / "locks"))))
        assert not loads
    finally:
        p.kill()
        p.wait()


def test_lock_names_per_gpu_or_host(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert lock_names([1]) == ["gpu-6"]  # CUDA index 1 is physical GPU 6
    assert lock_names([0, 1]) == ["gpu-4", "gpu-6"]
    assert lock_names([]) == ["host-cpu"]


def test_is_oom_error_classification():
    try:
        torch.empty(1 << 60, dtype=torch.uint8)  # a real CPU allocator failure
    except RuntimeError as e:
        assert is_oom_error(e)
    assert is_oom_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    assert is_oom_error(MemoryError())
    assert not is_oom_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_oom_error(ValueError("out of memory"))  # bad input, whatever its text
    assert not is_oom_error(OutOfMemoryAfterRetries("sample 3 does not fit"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_preflight_gpu_reports_and_refuses_busy_gpu():
    report = cuda_preflight([0], min_free_fraction=0.0)
    free, total = report[0]
    assert 0 < free <= total
    hog = torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda:0")
    try:
        with pytest.raises(GpuBusyError, match="cuda:0 has .* GiB free"):
            cuda_preflight([0], min_free_fraction=0.9)
    finally:
        del hog
        torch.cuda.empty_cache()


def test_second_extraction_waits_then_resumes_what_the_first_wrote(tiny_llama_verifier, tmp_path):
    import json

    from helpers import make_dataset

    from eagle3.extract.stage import extract_hidden_states
    from eagle3.store import MANIFEST

    ds = make_dataset(tmp_path / "ds", [40 + i for i in range(24)], 8192)
    cfg = {"verifier": str(tiny_llama_verifier), "device": "cpu",
           "max_samples_per_batch": 1, "log_every_seconds": 0, "log_every_samples": 0}
    code = f"from eagle3.extract.stage import extract_hidden_states; extract_hidden_states({cfg!r}, " \
           f"{str(ds)!r}, {str(tmp_path / 'store')!r})"
    locks = tmp_path / "locks"
    first = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE,
                             env={**os.environ, "EAGLE3_LOCK_DIR": str(locks)})
    try:
        manifest = tmp_path / "store" / MANIFEST
        while not (manifest.exists() and manifest.read_text()):  # the first job holds the lock and writes
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            time.sleep(0.02)
        r = extract_hidden_states(cfg, ds, tmp_path / "store",
                                  guard=file_lock_guard(LockSettings(lock_dir=str(locks), lock_wait_seconds=120)))
        assert first.wait() == 0
    finally:
        first.kill()
        first.wait()
    assert (r.samples_written, r.samples_resumed, r.model_loads) == (0, 24, 0)
    indices = [json.loads(x)["index"] for x in manifest.read_text().splitlines()]
    assert sorted(indices) == list(range(24))


def test_planted_symlink_is_refused_and_its_target_left_alone(tmp_path):
    """Whoever plants ``host-cpu.lock -> a file of yours`` must not get that file truncated and overwritten with
    the holder's JSON: the lock is opened without following symlinks."""
    from eagle3.support.gpu import LockDirError

    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    victim = tmp_path / "precious.txt"
    victim.write_text("my thesis\n")
    (locks / "host-cpu.lock").symlink_to(victim)
    with pytest.raises(LockDirError, match=r"host-cpu.lock cannot be opened .*a symlink there is refused"), \
            device_lock(["host-cpu"], locks):
        pass
    assert victim.read_text() == "my thesis\n"


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_lock_folder_writable_by_others_is_refused(tmp_path, mode):
    from eagle3.support.gpu import LockDirError

    locks = tmp_path / "shared-locks"
    locks.mkdir()
    locks.chmod(mode)
    with pytest.raises(LockDirError, match=r"shared-locks is writable by others"), device_lock(["gpu-0"], locks):
        pass
    assert not (locks / "gpu-0.lock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user needs root (chown)")
def test_lock_folder_of_another_user_is_refused(tmp_path):
    import pwd

    from eagle3.support.gpu import LockDirError

    nobody = pwd.getpwnam("nobody").pw_uid
    locks = tmp_path / "their-locks"
    locks.mkdir(mode=0o755)
    os.chown(locks, nobody, -1)
    with pytest.raises(LockDirError, match=rf"their-locks belongs to uid {nobody}, not to this user"), \
            device_lock(["host-cpu"], locks):
        pass


def test_default_lock_folder_is_per_user_and_private(tmp_path, monkeypatch):
    from eagle3.support import gpu

    monkeypatch.delenv(gpu.LOCK_DIR_ENV, raising=False)
    assert gpu.DEFAULT_LOCK_DIR == f"/tmp/eagle3-locks-{os.getuid()}"
    monkeypatch.setattr(gpu, "DEFAULT_LOCK_DIR", str(tmp_path / "fresh" / "eagle3-locks"))
    with device_lock(["host-cpu"]):
        pass
    assert (tmp_path / "fresh" / "eagle3-locks").stat().st_mode & 0o777 == 0o700
