"""kill -9 of an extraction process at a random point, then a rerun: it completes, every file verifies, no sample
is listed twice and no temp file is left."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import make_dataset

from eagle3.extract.stage import extract_hidden_states
from eagle3.store import MANIFEST, HiddenStateStore

REPO = Path(__file__).resolve().parent.parent
N = 90  # samples; the kill lands in the first third, so at least 60 remain to be cut off (>= 30 forwards)


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
def test_kill_9_then_rerun_completes_without_duplicates(tiny_llama_verifier, tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    lengths = [rng.randint(16, 160) for _ in range(N)]
    ds = make_dataset(tmp_path / "ds", lengths, 8192, seed=5)
    store_dir = tmp_path / "store"
    cfg = {"verifier": str(tiny_llama_verifier), "store_dtype": "float32", "max_tokens_per_batch": 256,
           "max_samples_per_batch": 2, "min_tokens_per_batch": 16,
           "log_every_seconds": 0, "log_every_samples": 0}
    code = textwrap.dedent(f"""
        from eagle3.extract.stage import extract_hidden_states
        extract_hidden_states({cfg!r}, {str(ds)!r}, {str(store_dir)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    kill_after = rng.randint(1, N // 3)  # manifest lines seen before the kill
    extra_delay = rng.random() * 0.05  # and a random moment after that, inside a forward or a write
    deadline = time.monotonic() + 120
    while _lines(store_dir / MANIFEST) < kill_after:
        assert proc.poll() is None, f"extraction ended early (seed {seed}): {proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, f"no progress (seed {seed})"
        time.sleep(0.01)
    time.sleep(extra_delay)
    assert proc.poll() is None, f"seed {seed}: extraction finished before the kill; the test interrupted nothing"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(HiddenStateStore(store_dir, strict=False))
    assert 0 < done_before < N, f"seed {seed}"

    r = extract_hidden_states(cfg, ds, store_dir)
    assert r.samples_resumed + r.samples_written == N, f"seed {seed}: {r}"
    assert r.samples_resumed >= kill_after - 1 and r.model_loads == 1
    store = HiddenStateStore(store_dir)
    assert store.verify() == {"samples": N, "tokens": sum(lengths), "bytes": r.bytes_on_disk - (
        (store_dir / "store.json").stat().st_size + (store_dir / MANIFEST).stat().st_size)}
    indices = [json.loads(x)["index"] for x in (store_dir / MANIFEST).read_text().splitlines()]
    assert sorted(indices) == list(range(N)), f"seed {seed}: duplicates or gaps"
    assert not list(store_dir.rglob("*.tmp")), f"seed {seed}: temp files left"
    files = sorted(p.relative_to(store_dir).as_posix() for p in store_dir.rglob("sample_*.safetensors"))
    assert files == sorted(store.entry(i)["file"] for i in range(N))
