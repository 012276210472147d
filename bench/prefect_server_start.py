"""How long Prefect's temporary (ephemeral) server takes to answer /health, idle and under CPU load.

The number behind tasks/prefect_env.EPHEMERAL_STARTUP_TIMEOUT_SECONDS. Each measurement is a fresh interpreter
(import included, as in `make demo`) with a fresh PREFECT_HOME, while N busy Python loops load the CPUs:

    .venv/bin/python bench/prefect_server_start.py --busy 0 2 8 --repeat 2

Prints, per load level, the wall seconds of the import and of SubprocessASGIServer.start(), and the load average.
Measured 2026-12-01 on the 2-core machine (other sessions' load ~1.5 on top): 0 loops: import 2.3 s, start
7.7-8.2 s; 2 loops (load 2.8-4.2): import 8-10 s, start 16-27 s; 8 loops (load ~10): import 26-29 s, start 58-65 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_ONE = """
import os, time
t0 = time.monotonic()
from prefect.server.api.server import SubprocessASGIServer
t_import = time.monotonic() - t0
server = SubprocessASGIServer()
t1 = time.monotonic()
server.start(timeout=900)
print(f"{t_import:.1f} {time.monotonic() - t1:.1f}", flush=True)
server.stop()
"""


def measure(busy: int, repeat: int) -> None:
    from tasks.prefect_env import apply_prefect_env_defaults

    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(10 if busy else 0)  # let the load average climb
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as home:
                env = apply_prefect_env_defaults({**os.environ, "PREFECT_HOME": home})
                out = subprocess.run([sys.executable, "-c", _ONE], env=env, capture_output=True, text=True,
                                     timeout=1200, check=True)
            t_import, t_start = out.stdout.split()[-2:]
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"busy loops {busy}: import {t_import} s, server start {t_start} s (load average {load})",
                  flush=True)
    finally:
        for p in loops:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 2], help="numbers of busy Python loops to run")
    ap.add_argument("--repeat", type=int, default=2, help="measurements per load level")
    args = ap.parse_args()
    for busy in args.busy:
        measure(busy, args.repeat)


if __name__ == "__main__":
    main()
