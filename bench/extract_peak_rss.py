"""Peak RSS of extraction when extracting 4x more samples: grows by at most 10% (streaming, nothing accumulated).

    .venv/bin/python bench/extract_peak_rss.py [--samples 32]

Each size runs in a FRESH subprocess (same model, same length distribution, N and 4N samples) that reports its
peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) and its RSS just before extraction (interpreter + torch +
transformers imported). Printed: both peaks, the growth of the peak, and the growth of the part above the baseline
(model + activations + write queue), which is the stricter figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _extract_common import quiet, save_dataset, save_llama

CHILD = """
import json, resource, sys
import psutil, torch, transformers, datasets  # imported before the baseline reading
from eagle3.extract.stage import extract_hidden_states
base = psutil.Process().memory_info().rss
r = extract_hidden_states(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
print(json.dumps({"baseline_rss": base, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "samples": r.samples_written, "tokens": r.tokens_written}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args()
    quiet()
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        verifier = save_llama(tmp / "verifier", hidden=1024, layers=2)
        cfg = {"verifier": str(verifier), "aux_layer_ids": [0, 1], "store_dtype": "bfloat16", "device": "cpu",
               "max_tokens_per_batch": 2048, "log_every_samples": 0,
               "log_every_seconds": 0}
        runs = {}
        for n in (args.samples, 4 * args.samples):
            ds = save_dataset(tmp / f"ds{n}", n, args.min_len, args.max_len, seed=1)
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), str(ds), str(tmp / f"store{n}")],
                                 cwd=repo, capture_output=True, text=True, check=True)
            runs[n] = json.loads(out.stdout.strip().splitlines()[-1])
        small, big = runs[args.samples], runs[4 * args.samples]
        mib = 2**20
        print(json.dumps({
            "model": "random-init Llama hidden 1024, 2 layers, float32, CPU; bf16 store",
            f"N={args.samples}": {k: (round(v / mib, 1) if "rss" in k else v) for k, v in small.items()},
            f"4N={4 * args.samples}": {k: (round(v / mib, 1) if "rss" in k else v) for k, v in big.items()},
            "peak_rss_growth (4N / N - 1)": round(big["peak_rss"] / small["peak_rss"] - 1, 4),
            "above_baseline_growth (4N / N - 1)": round((big["peak_rss"] - big["baseline_rss"])
                                                        / (small["peak_rss"] - small["baseline_rss"]) - 1, 4),
            "target": "peak RSS growth <= 0.10", "units": "RSS in MiB",
        }, indent=2))


if __name__ == "__main__":
    main()
