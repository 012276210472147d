"""eagle3.support.subproc: output streaming, failures, and no process left behind (timeout, interrupt, owner killed,
stray background workers). Real processes: `sh` and `python` trees that write their pids to a file."""

from __future__ import annotations

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

from eagle3.support.subproc import SubprocessFailed, run_subprocess

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
