"""Extraction overhead: extraction wall time / bare forward wall time on the SAME batches, side by side in one run.

    .venv/bin/python bench/extract_overhead.py [--samples 8] [--repeat 4]

Model: random-init Llama, hidden 1024, 8 layers (compute-bound on a CPU). Bare = the same decoder forward over the
same token-budget batches (data fetch + padding included), nothing captured or written, on a freshly loaded model.
Extraction = ``extract_hidden_states`` (hooks, unpadding, bf16 cast, safetensors + sha256 + fsync + rename +
manifest on the writer thread), timed from after the model load to the last sample on disk. Pairs alternate their
order (extract/bare, bare/extract, ...) so both see the same machine load; a first pair warms up and is not
counted. Printed: the ratio of the best of each and the median of the per-pair ratios. Target: <= 1.15.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _extract_common import quiet, save_dataset, save_llama

from eagle3.extract import hf_backend
from eagle3.extract.batching import TokenBudgetBatcher, pad_right
from eagle3.extract.stage import extract_hidden_states, open_dataset
from eagle3.support.verifier import VerifierSpec


def bare_pass(backend, ds, lengths: list[int], max_tokens: int, max_samples: int) -> float:
    batcher = TokenBudgetBatcher(dict(enumerate(lengths)), max_tokens, max_samples)
    t = time.perf_counter()
    while (batch := batcher.next()) is not None:
        rows = ds[batch.indices]
        ids, mask = pad_right(rows["input_ids"])
        backend.bare_forward(ids, mask)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--max-tokens-per-batch", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args()
    quiet()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        verifier = save_llama(tmp / "verifier")
        ds_dir = save_dataset(tmp / "ds", args.samples, args.min_len, args.max_len)
        spec = VerifierSpec.from_path(verifier)
        ds, lengths = open_dataset(ds_dir, spec.vocab_size)
        aux = spec.resolve_aux_layer_ids(None)
        cfg = {"verifier": str(verifier), "aux_layer_ids": aux, "store_dtype": "bfloat16", "device": "cpu",
               "max_tokens_per_batch": args.max_tokens_per_batch, "max_samples_per_batch": 64,
               "log_every_samples": 0, "log_every_seconds": 0, "resume_check": "size"}
        bare_s, ext_s = [], []
        for r in range(args.repeat + 1):  # pair 0 warms up (allocator, kernels, page cache) and is not counted
            times = {}
            for which in (("bare", "extract") if r % 2 else ("extract", "bare")):  # alternate the order too
                if which == "bare":  # a freshly loaded model, as extraction loads one: same weight allocation
                    backend = hf_backend.TransformersBackend(hf_backend.load_hf_model(spec, torch.float32, "cpu"), aux)
                    times[which] = bare_pass(backend, ds, lengths, args.max_tokens_per_batch, 64)
                    del backend
                else:
                    shutil.rmtree(tmp / "store", ignore_errors=True)
                    times[which] = extract_hidden_states(cfg, ds_dir, tmp / "store").extract_seconds
            if r:
                bare_s.append(times["bare"])
                ext_s.append(times["extract"])
        tokens = sum(lengths)
        out = {
            "model": f"random-init Llama hidden 1024, 8 layers, float32, CPU, torch threads {torch.get_num_threads()}",
            "samples": args.samples, "tokens": tokens, "aux_layer_ids (vLLM convention)": aux,
            "max_tokens_per_batch (padded tokens)": args.max_tokens_per_batch,
            "bare_forward_s": [round(x, 2) for x in bare_s], "extraction_s": [round(x, 2) for x in ext_s],
            "bare_tok_per_s": round(tokens / min(bare_s)), "extraction_tok_per_s": round(tokens / min(ext_s)),
            "overhead_ratio (extraction / bare, best of each)": round(min(ext_s) / min(bare_s), 3),
            "overhead_ratio per pair (median)": round(statistics.median(e / b for e, b in zip(ext_s, bare_s)), 3),
            "target": "<= 1.15",
        }
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
