"""The trainer's input pipeline at Kimi-K2.5 shapes vs the disk it reads from, bf16 and FP8 stores, two store sizes.

    PYTHONPATH=. .venv/bin/python bench/train_loader.py [--sizes-gb 2 8] [--workers 1 2] [--rows-per-step 1] [--thp]
                                                        [--dir /var/tmp] [--keep]

Stores: synthetic, at Kimi-K2.5's layout (hidden 7168, aux [2, 30, 58] in vLLM's convention + the final state:
4 x 7168 values per token), written by the store's own writer (``init_store`` + ``write_sample``: temp + fsync +
rename + manifest) as bfloat16 and as float8_e4m3fn from the same samples (256-2048 tokens, packed by the trainer's
``pack_samples`` into rows of 2048 tokens), at two sizes (``--sizes-gb``: bf16 bytes; the FP8 store of the same
samples is about half). The page cache is dropped for each store's files before every timed read with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (the files are fsynced, so their pages are clean and the kernel drops them);
a read-speed check verifies it (a few files read right after dropping vs again while cached).

Per store, side by side in this run:
  disk      sequential read of every sample file in file order (64 MiB reads into one buffer), cache dropped first:
            bytes/s, and as tokens/s = bytes/s / the store's bytes per token (the physical limit of any loader)
  loader    two epochs of the trainer's own input pipeline in a fresh process (the first hashes every sample on its
            first read, as a training run's first epoch does; the second reads verified samples, as later epochs
            do), exactly as ``Trainer.train`` builds it: ``BatchPlan`` (seeded permutation of the packed rows,
            ``--rows-per-step`` rows per optimizer step, 1 process) + ``StepLoader`` (``--workers`` loader threads,
            2 steps in flight per thread) over ``collate`` (memory-mapped reads, WILLNEED-prefetched), cache dropped
            first; FP8 both ways the trainer runs it: ``dequant on device`` (its CUDA path: the loader delivers
            float8 + scales, Batch.to dequantizes on the GPU) and ``dequant on loader`` (its CPU path: the loader
            threads dequantize, here to bf16, Kimi's compute dtype); the consumer only counts tokens. Tokens/s
            steady (from the first batch on) and over the whole epoch; peak RSS of the process (ru_maxrss).
The disk read is repeated after the loader runs of each store (the virtual disk's rate drifts with the host's own
cache); loader / disk uses the mean of the two reads, both are printed.
Printed: loader / disk (target >= 0.8), loader / 12,000 tokens/s (the original run's pace: 6 steps/s of ~2k-token
rows), and the peak RSS of each store size (independent of the store's size). The stores are deleted at the end
unless --keep. Machine load (uptime) at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HIDDEN, AUX = 7168, [2, 30, 58]  # Kimi-K2.5; vLLM convention: residual streams entering layers 2, 30, 58
ROW_TOKENS = 2048
VOCAB = 163840
PACE_TOKENS_PER_S = 12_000  # the original run: 6 optimizer steps/s of ~2k-token packed rows
READ_CHUNK = 64 << 20


def drop_cache(files: list[Path]) -> None:
    """Evict the files' pages from the page cache (clean pages: the store's writer fsyncs every file)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sample_files(store: Path) -> list[Path]:
    from eagle3.store import sample_files as store_sample_files  # torch is imported where it is needed

    return store_sample_files(store)


def read_all(files: list[Path]) -> tuple[int, float]:
    """(bytes, seconds) of reading the files sequentially in order with large reads into one buffer."""
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def write_stores(root: Path, size_gb: float, seed: int) -> dict[str, Path]:
    """bf16 and FP8 stores of the same synthetic samples, ``size_gb`` GB of bf16 sample files."""
    import torch

    from eagle3.extract.writer import write_sample
    from eagle3.store import init_store

    rng = random.Random(seed)
    lengths, total = [], 0
    per_token = (len(AUX) + 1) * HIDDEN * 2
    while total < size_gb * 1e9:
        lengths.append(rng.randint(256, ROW_TOKENS))
        total += lengths[-1] * per_token
    g = torch.Generator().manual_seed(seed)
    # one random block reused (shifted per sample): file contents do not matter to the reads, generating 60M
    # random values per sample would dominate the setup
    block = torch.randn(ROW_TOKENS + 64, (len(AUX) + 1) * HIDDEN, generator=g) * 2.0
    out = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        store = root / f"store-{dtype}-{size_gb:g}gb"
        init_store(store, verifier="synthetic-kimi-k2.5-shape", aux_layer_ids=AUX, hidden_size=HIDDEN,
                   num_samples=len(lengths), dtype=dtype, fingerprint="synthetic")
        for i, n in enumerate(lengths):
            x = block[i % 64:i % 64 + n]  # [n, 4 * H]
            write_sample(store, i, x[:, :len(AUX) * HIDDEN], x[:, len(AUX) * HIDDEN:],
                         torch.randint(0, VOCAB, (n,), generator=g), torch.ones(n, dtype=torch.uint8))
        out[dtype] = store
    return out


def loader_child(ns: argparse.Namespace) -> None:
    """Two epochs of the trainer's input pipeline over ``ns.store`` in this fresh process (the first hashes every
    sample, the second reads verified ones; cache dropped before each); JSON result on stdout."""
    import torch

    from eagle3.store import HiddenStateStore
    from eagle3.train.data import BatchPlan, StepLoader, pack_samples

    store = HiddenStateStore(ns.store)
    lengths = {i: min(store.tokens(i), ROW_TOKENS) for i in store.indices()}
    rows = pack_samples(lengths, ROW_TOKENS)
    steps_per_epoch = len(rows) // ns.rows_per_step
    if not steps_per_epoch:
        raise SystemExit(f"store {ns.store}: {len(rows)} packed rows, fewer than --rows-per-step "
                         f"{ns.rows_per_step}: a larger --sizes-gb is needed")
    plan = BatchPlan(rows, 0, ns.rows_per_step, 1, 1, 0)

    def epoch(e: int) -> dict:
        loader = StepLoader(store, plan, [(e, s) for s in range(steps_per_epoch)], ROW_TOKENS, 7, VOCAB,
                            ns.workers, pin_memory=False, dequant_dtype=torch.bfloat16,
                            dequantize=ns.dequant == "loader")
        tokens = steps = 0
        t0 = time.perf_counter()
        first = first_tokens = None
        for batches in loader:
            tokens += sum(b.tokens for b in batches)
            steps += 1
            if first is None:
                first, first_tokens = time.perf_counter(), tokens
        end = time.perf_counter()
        loader.close()
        return {"tokens": tokens, "steps": steps, "seconds": end - t0, "first_batch_s": first - t0,
                # after the first batch (its wait is the pipeline's start-up); a one-step epoch: the whole epoch
                "steady_tokens_per_s": (tokens - first_tokens) / (end - first) if steps > 1 else tokens / (end - t0),
                "batch_dtype": str(batches[0].aux.dtype)}

    # epoch 0 hashes every sample on its first read (HiddenStateStore.verify_sample, as in a training run's first
    # epoch); epoch 1, the cache dropped again, reads samples this store object has verified (every later epoch)
    first_epoch = epoch(0)
    drop_cache(sample_files(Path(ns.store)))
    later = epoch(1)
    print(json.dumps({
        **first_epoch, "rows": len(rows), "later_epoch_tokens_per_s": later["steady_tokens_per_s"],
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def run_loader(store: Path, workers: int, rows_per_step: int, dequant: str, thp: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if thp:  # PyTorch's CPU allocator asks for transparent huge pages on big allocations: 512x fewer page faults
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    out = subprocess.run([sys.executable, __file__, "--child", str(store), "--workers", str(workers),
                          "--rows-per-step", str(rows_per_step), "--dequant", dequant], env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"loader on {store} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gb", type=float, nargs=2, default=[2.0, 8.0], help="bf16 store sizes (GB)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="loader threads (loader_workers) to try")
    ap.add_argument("--rows-per-step", type=int, default=1, help="packed 2048-token rows per optimizer step")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the stores go")
    ap.add_argument("--keep", action="store_true", help="keep the stores")
    ap.add_argument("--dequant", nargs="+", default=["device", "loader"], choices=["device", "loader"],
                    help="FP8: where the states are dequantized (device = the trainer's CUDA path: the loader "
                    "delivers float8 + scales; loader = its CPU path: workers dequantize to bf16)")
    ap.add_argument("--thp", action="store_true", help="also run each loader with THP_MEM_ALLOC_ENABLE=1 (a "
                    "deployment setting: fresh batch buffers fault in 2 MB pages)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        ns.store = ns.child
        ns.workers, ns.dequant = ns.workers[0], ns.dequant[0]
        loader_child(ns)
        return
    print(f"load average at start {os.getloadavg()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="train-loader-", dir=ns.dir))
    try:
        stores = {}
        for k, size in enumerate(ns.sizes_gb):
            t = time.perf_counter()
            stores[size] = write_stores(root, size, seed=k)
            files = sample_files(stores[size]["bfloat16"])
            print(f"wrote the {size:g} GB stores ({len(files)} samples each, bf16 + fp8) in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)

        # the cache drop works: the same files read right after dropping vs again while cached
        probe = sample_files(stores[ns.sizes_gb[0]]["bfloat16"])[:8]
        drop_cache(probe)
        cold = read_all(probe)
        warm = read_all(probe)
        print(f"read-speed check on {cold[0] / 1e6:,.0f} MB: after POSIX_FADV_DONTNEED {cold[0] / cold[1] / 1e6:,.0f} "
              f"MB/s, cached {warm[0] / warm[1] / 1e6:,.0f} MB/s (x{(warm[0] / warm[1]) / (cold[0] / cold[1]):.1f})",
              flush=True)

        results = []
        for size in ns.sizes_gb:
            for dtype, store in stores[size].items():
                from eagle3.store import HiddenStateStore

                files = sample_files(store)
                tokens = HiddenStateStore(store).total_tokens
                drop_cache(files)
                nbytes, secs = read_all(files)
                runs = []
                modes = ns.dequant if dtype == "float8_e4m3fn" else ["-"]
                for w, mode, thp in ((w, m, t) for w in ns.workers for m in modes for t in [False] + [True] * ns.thp):
                    drop_cache(files)
                    r = run_loader(store, w, ns.rows_per_step, mode if mode != "-" else "loader", thp)
                    label = (dtype if mode == "-" else f"{dtype} dequant on {mode}") + (" +THP" if thp else "")
                    runs.append((w, label, r))
                drop_cache(files)
                nbytes2, secs2 = read_all(files)
                disk = [nbytes / secs, nbytes2 / secs2]  # bytes/s before and after the loader runs
                disk_tps = sum(disk) / 2 / (nbytes / tokens)
                for w, label, r in runs:
                    tps = r["steady_tokens_per_s"]
                    results.append((size, label, w, tps, disk_tps, r))
                    print(f"{label:>36} {size:g} GB store ({nbytes / 1e9:.2f} GB, {nbytes / tokens:,.0f} B/token): "
                          f"disk {disk[0] / 1e6:,.0f} / {disk[1] / 1e6:,.0f} MB/s = {disk_tps:,.0f} tok/s | "
                          f"loader {w} thread(s): {tps:,.0f} tok/s steady over {r['steps']} steps "
                          f"({r['tokens'] / r['seconds']:,.0f} tok/s from the start, first batch after "
                          f"{r['first_batch_s']:.1f} s) -> loader/disk {tps / disk_tps:.2f}, loader/12k "
                          f"{tps / PACE_TOKENS_PER_S:.2f} | later epochs (verified) "
                          f"{r['later_epoch_tokens_per_s']:,.0f} tok/s -> loader/disk "
                          f"{r['later_epoch_tokens_per_s'] / disk_tps:.2f} | peak RSS {r['maxrss'] / 1e9:.2f} GB "
                          f"({r['batch_dtype']} batches)", flush=True)
        print("\n== summary (steady tokens/s; first epoch = every sample hashed on its first read, later = verified; "
              "targets: loader/disk >= 0.8, and the 12k tokens/s pace) ==")
        for size, label, w, tps, disk_tps, r in results:
            lat = r["later_epoch_tokens_per_s"]
            print(f"{label:>36} {size:>4g} GB  threads {w}: first epoch {tps:>8,.0f} ({tps / disk_tps:4.2f} of disk), "
                  f"later {lat:>8,.0f}  disk {disk_tps:>8,.0f}  "
                  f"later/disk {lat / disk_tps:5.2f} ({'ok' if lat / disk_tps >= 0.8 else 'MISSED'})  "
                  f"loader/12k {tps / PACE_TOKENS_PER_S:5.2f}  peak RSS {r['maxrss'] / 1e9:5.2f} GB")
        print(f"load average at end {os.getloadavg()}")
    finally:
        if ns.keep:
            print(f"stores kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
