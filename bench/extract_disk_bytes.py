"""Store size on disk vs the raw payload: bytes on disk / (tokens x (n_aux + 1) x hidden x 2). Target: <= 1.01.

    .venv/bin/python bench/extract_disk_bytes.py [--samples 48]

Extracts a dataset of realistic lengths (64-1024 tokens) with a random-init Llama of hidden 1024 into a bf16 store
and counts every byte the store occupies (sample files with their safetensors headers, input_ids int64 and
loss_mask uint8, manifest.jsonl, store.json) against the bf16 states alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _extract_common import quiet, save_dataset, save_llama

from eagle3.extract.stage import extract_hidden_states
from eagle3.store import HiddenStateStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    args = ap.parse_args()
    quiet()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hidden = 1024
        verifier = save_llama(tmp / "verifier", hidden=hidden, layers=4)
        ds = save_dataset(tmp / "ds", args.samples, args.min_len, args.max_len)
        aux = [1, 2, 3]
        r = extract_hidden_states({"verifier": str(verifier), "aux_layer_ids": aux, "store_dtype": "bfloat16",
                                   "device": "cpu", "max_tokens_per_batch": 4096,
                                   "log_every_samples": 0, "log_every_seconds": 0}, ds, tmp / "store")
        store = HiddenStateStore(tmp / "store")
        on_disk = sum(f.stat().st_size for f in (tmp / "store").rglob("*") if f.is_file())
        payload = store.total_tokens * (len(aux) + 1) * hidden * 2
        print(json.dumps({
            "samples": len(store), "tokens": store.total_tokens, "n_aux": len(aux), "hidden": hidden,
            "store_dtype": "bfloat16", "bytes_on_disk": on_disk, "bytes_on_disk (extraction result)": r.bytes_on_disk,
            "payload_bytes (tokens x (n_aux+1) x hidden x 2)": payload,
            "ratio (bytes on disk / payload)": round(on_disk / payload, 5), "target": "<= 1.01",
        }, indent=2))


if __name__ == "__main__":
    main()
