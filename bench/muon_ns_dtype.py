"""Muon's Newton-Schulz dtype on this CPU: training tokens/s of the smollm2 preset with ``train.muon_ns_dtype``
float32 and bfloat16 (and AdamW beside them), measured side by side in one process on a real store.

    .venv/bin/python bench/muon_ns_dtype.py --run-dir R/smollm2-demo [--steps 20] [--order float32,bfloat16,adamw]

``--run-dir``: a pipeline run folder holding a regenerated dataset and an extraction (``make demo-real``'s, or a
bench/recipe.py run's). Each variant trains the preset's draft from scratch for ``--steps`` optimizer steps into a
temporary folder (``train.stop_after_steps``), the variants in the given order and then in reverse (A B C C B A),
so a change in the machine's load lands on all of them. The figure is the trainer's own tokens/s over the steps after
its first logged window (the first optimizer steps pay one-time setup), the median of each variant's two runs.
Prints the machine load (1/5/15 min) before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe import latest_dir

from eagle3.config import load_config
from eagle3.support.dtypes import cpu_has_native_bf16
from eagle3.support.verifier import VerifierSpec
from eagle3.train.stage import train_draft
from eagle3.vocab import build_vocab

VARIANTS = {
    "float32": {"train.optimizer": "muon", "train.muon_ns_dtype": "float32"},
    "bfloat16": {"train.optimizer": "muon", "train.muon_ns_dtype": "bfloat16"},
    "adamw": {"train.optimizer": "adamw"},
}


def steady_tokens_per_s(metrics: Path) -> float:
    """Tokens/s between the first and the last train record of metrics.jsonl (after the first window's setup)."""
    recs = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "train"]
    if len(recs) < 2:
        raise SystemExit(f"{metrics}: fewer than 2 train records; raise --steps")
    # a fresh run: each record's tokens_per_s is tokens_seen over the seconds since training started
    (t0, e0), (t1, e1) = ((r["tokens_seen"], r["tokens_seen"] / r["tokens_per_s"]) for r in (recs[0], recs[-1]))
    return (t1 - t0) / (e1 - e0)


def print_medians(rates: dict[str, list[float]], order: list[str], notes: dict[str, str] | None = None) -> None:
    """One line per variant of ``order``: the median tokens/s of its runs, each run's, and the ratio to the first
    variant's median (+ its note)."""
    base = statistics.median(rates[order[0]])
    for name in order:
        med = statistics.median(rates[name])
        print(f"{name:10} median {med:8,.0f} tok/s  ({', '.join(f'{r:,.0f}' for r in rates[name])})  "
              f"{med / base:.2f}x {order[0]}{(notes or {}).get(name, '')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    ap.add_argument("--order", default="float32,bfloat16,adamw", help="comma-separated: " + ", ".join(VARIANTS))
    args = ap.parse_args()
    order = args.order.split(",")
    if unknown := set(order) - set(VARIANTS):
        raise SystemExit(f"--order: unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    dataset = latest_dir(args.run_dir, "prepare-regenerated") / "dataset"
    store = latest_dir(args.run_dir, "extract-hidden-states") / "store"
    print(f"CPU native bf16 matmul: {cpu_has_native_bf16()}; load before: {os.getloadavg()}", flush=True)
    results: dict[str, list[float]] = {name: [] for name in order}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(order + order[::-1]):
            config = load_config("smollm2", {**VARIANTS[name], "train.stop_after_steps": args.steps,
                                             "train.log_every_steps": 5})
            out = Path(tmp) / f"{i}-{name}"
            vocab = build_vocab(config.vocab, dataset, VerifierSpec.from_path(config.verifier).vocab_size,
                                out / "vocab")
            train_draft(config.train_config(), store, vocab, out / "train", verifier=config.verifier)
            rate = steady_tokens_per_s(out / "train" / "metrics.jsonl")
            results[name].append(rate)
            print(f"{name}: {rate:,.0f} tok/s", flush=True)
    print(f"load after: {os.getloadavg()}")
    print_medians(results, order)


if __name__ == "__main__":
    main()
