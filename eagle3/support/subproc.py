"""Run a command in its own process group and never leave a process of it behind.

Stages that run code in another interpreter (the vLLM environment) go through ``run_subprocess``:

* the command starts in a NEW session / process group (``start_new_session``), under a tiny stdlib guard process
  that is the group leader: the guard starts the command, forwards SIGTERM/SIGINT to the whole group, and kills the
  group when OUR process disappears (a Prefect cancellation that SIGKILLs the flow process, an OOM kill), which no
  ``finally`` block in this process could do;
* stdout and stderr are merged and streamed line by line to the logger (``log_prefix`` in front), the last lines
  kept for error messages; with ``log_file`` every line goes to that file instead and the logger gets only the
  lines ``VllmOutputFilter`` keeps (vLLM's errors, Python tracebacks, the pipeline's own ``[name]`` lines), unless
  EAGLE3_VLLM_VERBOSE=1 streams them all;
* on timeout, on KeyboardInterrupt / task cancellation (any exception while waiting) the whole group gets SIGTERM,
  then SIGKILL after ``grace_s``; descendants that left the group (setsid) are found through psutil and killed too.

    result = run_subprocess([python, "-m", "eagle3.validate.vllm_check", ...], env=env, timeout_s=900, log_prefix="[vllm] ",
                            log_file=work_dir / "vllm.log")
    result.check()  # raises SubprocessFailed naming the command, the exit status, the log file and the last lines
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger("eagle3")

_TAIL_LINES = 200  # output lines kept for the result and error messages
_GUARD_POLL_S = 0.5  # how often the guard checks that our process is still alive

# With a log file, "1" here streams every output line to the logger too (debugging a vLLM start, say). An
# environment variable, not a setting: it can be flipped for one run (shell, worker environment) without editing
# a config, and it never enters a stage's cache key.
VERBOSE_ENV = "EAGLE3_VLLM_VERBOSE"

# The guard runs with OUR interpreter (stdlib only), so it works whatever the command's interpreter is.
# argv: <owner pid> <command...>. It is the process-group leader; the command inherits the group.
_GUARD_SOURCE = r"""
import os, signal, subprocess, sys
owner = int(sys.argv[1])
child = subprocess.Popen(sys.argv[2:])
def owner_gone():
    if os.getppid() != owner:  # we were reparented: the owner exited
        return True
    # A dying multi-threaded owner (SIGKILL) hands us to one of its other threads while they exit: getppid() still
    # names it, but its main thread is already a zombie.
    try:
        with open(f"/proc/{owner}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return os.path.isdir("/proc/self")  # with procfs, no stat means no owner; without, getppid() is all we have
def on_term(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal below reaches the guard too
    try:
        os.killpg(os.getpgrp(), signal.SIGTERM)
    except ProcessLookupError:
        pass
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the owner's terminal is the owner's to handle
while True:
    try:
        rc = child.wait(timeout=POLL_S)
        break
    except subprocess.TimeoutExpired:
        pass
    if owner_gone():  # nobody will ever wait for this group
        os.killpg(os.getpgrp(), signal.SIGKILL)
if owner_gone():  # the command ended (e.g. of EPIPE) as the owner died: its leftovers go with it
    os.killpg(os.getpgrp(), signal.SIGKILL)
sys.exit(rc if rc >= 0 else 128 - rc)
""".replace("POLL_S", repr(_GUARD_POLL_S))


# The reaper (``start_reaper``): a watcher of OUR process that, once we are gone, ends the direct children we left.
# argv: <owner pid> <poll seconds> <grace seconds>. It runs with our interpreter (psutil is there).
_REAPER_SOURCE = r"""
import os, signal, sys, time
import psutil
owner_pid, poll_s, grace_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the owner's to handle; we act once it is gone
try:
    owner = psutil.Process(owner_pid)
except psutil.Error:
    sys.exit(0)
def owner_alive():
    try:  # a SIGKILLed owner is a zombie until its parent reaps it
        return owner.is_running() and owner.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
known = {}
while owner_alive():
    try:
        for child in owner.children():
            if child.pid != os.getpid():
                known[child.pid] = child
    except psutil.Error:
        pass
    time.sleep(poll_s)
left = [c for c in known.values() if c.is_running()]  # is_running compares start times: a reused pid is not ours
for c in left:
    try:
        c.terminate()
    except psutil.Error:
        pass
_, alive = psutil.wait_procs(left, timeout=grace_s)
for c in alive:
    try:
        c.kill()
    except psutil.Error:
        pass
"""


def start_reaper(poll_s: float = 1.0, grace_s: float = 5.0) -> subprocess.Popen:
    """Start a watcher (its own session, stdlib + psutil) that SIGTERMs, then after ``grace_s`` SIGKILLs, the
    direct children this process leaves behind when it ends, however it ends: a kill -9 or the OOM killer runs no
    ``finally`` or ``atexit``. For a local flow run that is Prefect's temporary API server (a uvicorn process that
    would otherwise live on, holding its port and SQLite file); stages' subprocesses have their own guard
    (``popen_guarded``) and need none. Children are seen by polling every ``poll_s`` seconds, so one started
    less than that before the end may be missed. Returns the watcher (it exits on its own after us)."""
    cmd = [sys.executable, "-c", _REAPER_SOURCE, str(os.getpid()), repr(poll_s), repr(grace_s)]
    # no stdio of ours: a pipe read to its end by whoever started us must not wait for the watcher too
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


class VllmOutputFilter:
    """Which lines of a vLLM subprocess's output are worth the flow's logs; the rest stay in the log file.

    Kept: vLLM log records at ERROR / CRITICAL, Python tracebacks (frames, the exception line and its indented
    continuation, chained causes), bare exception lines (``torch.OutOfMemoryError: ...``) and the pipeline's own
    lines, which our scripts print with a ``[name] `` prefix (``[vllm_check]``, ``[eagle3-vllm]``). Dropped:
    vLLM's INFO / WARNING / DEBUG records, progress bars, library warnings, blank lines.

    vLLM 0.32's record format, after an optional ``(ProcessName pid=N) `` prefix that vLLM also puts in front of
    everything its child processes print: ``INFO 12-01 10:26:16 [model.py:733] message`` (continuation lines of a
    multi-line message repeat the whole prefix). Tracebacks are followed per process prefix, so an engine core's
    traceback interleaved with the main process's records stays whole. One instance per subprocess.
    """

    _PROCESS = re.compile(r"^(\([^()]* pid=\d+\) )?(\[rank\d+\]: )?")  # vLLM's and torch.distributed's prefixes
    _RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d ")
    _OWN = re.compile(r"^\[[A-Za-z][\w.-]*\] ")  # our scripts' "[vllm_check] ..." lines
    _EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(:|$)")
    _TRACEBACK = "Traceback (most recent call last)"
    _CHAINED = ("During handling of the above exception", "The above exception was the direct cause")

    def __init__(self) -> None:
        # per process prefix: "frames" (inside a traceback) or "exception" (just after its exception line)
        self._state: dict[str, str] = {}

    def __call__(self, line: str) -> bool:
        m = self._PROCESS.match(line)
        who, body = m.group(0), line[m.end():]
        if not body.strip():
            return False
        record = self._RECORD.match(body)
        if record:
            return record.group(1) in ("ERROR", "CRITICAL")
        state = self._state.pop(who, None)
        if body.startswith(self._TRACEBACK):
            self._state[who] = "frames"
            return True
        if state == "frames":  # frames and code lines are indented; the first line that is not is the exception
            self._state[who] = "frames" if body[0].isspace() else "exception"
            return True
        if state == "exception" and (body[0].isspace() or body.startswith(self._CHAINED)):
            self._state[who] = "exception"  # an exception message's indented continuation, or a chained cause
            return True
        return bool(self._OWN.match(body) or self._EXCEPTION.match(body))


class SubprocessFailed(RuntimeError):
    """A subprocess exited non-zero or ran past its timeout; the message names the command and shows its last lines."""


@dataclass
class SubprocessResult:
    """What ``subprocess.CompletedProcess`` holds, plus the timeout flag and the output tail."""

    args: list[str]
    returncode: int
    stdout: str  # the last _TAIL_LINES lines of merged stdout+stderr
    timed_out: bool
    seconds: float
    killed_pids: list[int] = field(default_factory=list)
    log_file: str | None = None  # every output line, when run_subprocess was given one

    def check(self) -> SubprocessResult:
        where = f"\n--- full output: {self.log_file} ---" if self.log_file else ""
        if self.timed_out:
            raise SubprocessFailed(
                f"command timed out after {self.seconds:.0f} s and was killed with its process group: "
                f"{_short(self.args)}{where}\n--- last output ---\n{_last(self.stdout)}"
            )
        if self.returncode != 0:
            raise SubprocessFailed(
                f"command exited with status {self.returncode}: {_short(self.args)}{where}\n--- last output ---\n"
                f"{_last(self.stdout)}"
            )
        return self


def _short(args: Sequence[str]) -> str:
    text = " ".join(str(a) for a in args)
    return text if len(text) < 400 else text[:400] + " ..."


def _last(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter(["pid"]):
        # a process listed a moment ago may be gone: os.getpgid raises ProcessLookupError (not a psutil.Error)
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid:
                members.append(p)
    return members


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_dead(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none of ``procs`` runs; returns those still running. Never reaps (psutil's wait_procs would
    reap our own child, and Popen.wait would then lose its exit status)."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _running(p)]
    return alive


def kill_process_tree(leader_pid: int, grace_s: float = 5.0) -> list[int]:
    """SIGTERM the process group led by ``leader_pid`` (and every descendant, in or out of the group), wait up to
    ``grace_s`` seconds, SIGKILL what is left. Returns the pids that were signalled."""
    procs: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        leader = psutil.Process(leader_pid)
        procs[leader.pid] = leader
        for c in leader.children(recursive=True):
            procs[c.pid] = c
    for p in _group_members(leader_pid):
        procs.setdefault(p.pid, p)
        with contextlib.suppress(psutil.Error):
            for c in p.children(recursive=True):
                procs.setdefault(c.pid, c)
    procs.pop(os.getpid(), None)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader_pid, signal.SIGTERM)
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.terminate()
    alive = _wait_dead(list(procs.values()), grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader_pid, signal.SIGKILL)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _wait_dead(alive, grace_s)
    return sorted(procs)


def popen_guarded(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """Start ``cmd`` in a new process group under the guard (the returned Popen is the guard, the group leader).

    Callers that poll on their own use this directly and end the group with ``kill_process_tree(proc.pid)``.
    File descriptors in ``pass_fds`` stay open in the guard: a lock held that way lives exactly as long as the group.
    """
    guard = [sys.executable, "-c", _GUARD_SOURCE, str(os.getpid()), *(str(a) for a in cmd)]
    return subprocess.Popen(guard, stdin=subprocess.DEVNULL, start_new_session=True, **popen_kwargs)


def run_subprocess(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    log_prefix: str = "",
    cwd: str | os.PathLike | None = None,
    logger: logging.Logger | None = None,
    grace_s: float = 5.0,
    log_file: str | os.PathLike | None = None,
    pass_fds: Sequence[int] = (),
) -> SubprocessResult:
    """Run ``cmd`` (list of str) in its own process group; stream its output lines to ``logger`` (INFO).

    ``timeout_s``: wall-clock seconds before the group is killed (None: no limit); the result then has
    ``timed_out=True``. Any exception while waiting (KeyboardInterrupt, a cancelled task) kills the group and is
    re-raised. Call ``.check()`` on the result to turn a failure into ``SubprocessFailed``.

    ``log_file``: every line is appended there (after a header naming the command), and only the lines
    ``VllmOutputFilter`` keeps reach ``logger``; $EAGLE3_VLLM_VERBOSE=1 sends every line to ``logger`` as well.
    The file's path is logged first. The result's ``stdout`` tail always holds every line.

    ``pass_fds``: descriptors that stay open in the guard (not in the command) as long as the group lives: a host
    lock held through them is released only when the last process of the group is gone (see ``popen_guarded``).
    """
    logger = logger or log
    args = [str(a) for a in cmd]
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    show: Callable[[str], bool] | None = None
    sink = None
    if log_file is not None:
        log_file = Path(log_file)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        # line-buffered (tail -f follows the run); the reader thread closes it at end of output
        sink = open(log_file, "a", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
        command = _short(args).replace("\n", "\\n")  # one header line, even for `python -c` code
        sink.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {command}\n")
        verbose = os.environ.get(VERBOSE_ENV) == "1"
        show = None if verbose else VllmOutputFilter()
        logger.info("%sfull output in %s (%s)", log_prefix, log_file,
                    f"{VERBOSE_ENV}=1: every line shown here too" if verbose else
                    f"only errors, tracebacks and the pipeline's own lines shown here; {VERBOSE_ENV}=1 shows all")
    start = time.monotonic()
    try:
        proc = popen_guarded(args, env=dict(env) if env is not None else None, cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, bufsize=1, text=True, errors="replace",
                             pass_fds=tuple(pass_fds))
    except BaseException:
        if sink is not None:
            sink.close()
        raise

    def pump() -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                if sink is not None:
                    sink.write(line + "\n")
                if show is None or show(line):
                    logger.info("%s%s", log_prefix, line)
        finally:
            if sink is not None:
                sink.close()

    reader = threading.Thread(target=pump, name=f"subproc-{proc.pid}", daemon=True)
    reader.start()
    timed_out = False
    killed: list[int] = []
    try:
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            logger.warning("%scommand ran past %s s: killing its process group %d", log_prefix, timeout_s, proc.pid)
            killed = kill_process_tree(proc.pid, grace_s)
            returncode = proc.wait()
    except BaseException:
        logger.warning("%sinterrupted: killing process group %d", log_prefix, proc.pid)
        kill_process_tree(proc.pid, grace_s)
        with contextlib.suppress(Exception):
            proc.wait(timeout=grace_s)
        reader.join(timeout=grace_s)
        raise
    # the command is done; anything it left running in its group (a stray worker) goes with it
    leftovers = [p.pid for p in _group_members(proc.pid)]
    if leftovers:
        logger.warning("%scommand left processes %s behind: killing them", log_prefix, leftovers)
        killed += kill_process_tree(proc.pid, grace_s)
    reader.join(timeout=grace_s)
    return SubprocessResult(
        args=args,
        returncode=returncode,
        stdout="\n".join(tail),
        timed_out=timed_out,
        seconds=time.monotonic() - start,
        killed_pids=killed,
        log_file=str(log_file) if log_file is not None else None,
    )
