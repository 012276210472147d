"""The store's read path against the disk: samples read through ``HiddenStateStore.load`` (safetensors.safe_open)
and copied into a batch, against a plain read of the same files' bytes, side by side in one run.

    .venv/bin/python bench/store_reader.py [--tokens 2048] [--hidden 7168] [--samples 4] [--repeats 5]

Defaults: Kimi-K2.5 rows (2,048 tokens, aux [2, 30, 58] + final, hidden 7168, bf16: 117 MB a sample), page cache
warm (read once before timing). Prints ms per sample for each path and their ratio, with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eagle3.extract.writer import write_sample
from eagle3.store import HiddenStateStore, init_store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    t, h, n = args.tokens, args.hidden, args.samples
    with tempfile.TemporaryDirectory(prefix="eagle3-store-reader-") as tmp:
        store_dir = Path(tmp) / "store"
        init_store(store_dir, verifier="synthetic", aux_layer_ids=[2, 30, 58], hidden_size=h, num_samples=n,
                   dtype="bfloat16", fingerprint="synthetic")
        for i in range(n):
            write_sample(store_dir, i, torch.randn(t, 3 * h), torch.randn(t, h), torch.zeros(t, dtype=torch.long),
                         torch.ones(t, dtype=torch.uint8))
        store = HiddenStateStore(store_dir)
        batch = torch.empty(t, 3 * h, dtype=torch.bfloat16)

        def via_store() -> None:
            for i in range(n):
                batch.copy_(store.load(i)["aux_hidden_states"])

        def plain_read() -> None:
            for i in range(n):
                store.file(i).read_bytes()

        via_store()
        plain_read()  # page cache warm
        times: dict[str, list[float]] = {"store.load + copy into a batch": [], "plain read of the file": []}
        for _ in range(args.repeats):
            for label, fn in zip(times, (via_store, plain_read)):
                t0 = time.perf_counter()
                fn()
                times[label].append((time.perf_counter() - t0) / n)
        size = store.file(0).stat().st_size
    med = {k: statistics.median(v) for k, v in times.items()}
    a, b = med.values()
    print(f"{n} samples of {t} tokens x hidden {h} ({size / 1e6:.0f} MB each), median of {args.repeats}, "
          f"load {os.getloadavg()[0]:.2f}:")
    for k, v in med.items():
        print(f"  {k}: {v * 1e3:.1f} ms per sample ({size / v / 1e9:.2f} GB/s)")
    print(f"  ratio store/plain: {a / b:.2f}")


if __name__ == "__main__":
    main()
