"""On-policy vs off-policy training data, side by side in one run on SmolLM2-135M-Instruct (issue 13).

The same N prompts of the bundled stdlib chats and the same training budget (epochs, batch, steps per sample):
draft A is trained on the dataset's own answers, draft B on the answers SmolLM2 regenerated itself (the regenerate
stage). Both are validated in real vLLM (CPU build) on the same held-out prompts (the eval split's first user
turns, never trained on); the figure is B/A of vLLM's mean acceptance length (target >= 1.10), with the per-position
rates, beside the trainer's own simulated acceptance on its validation split (does the offline estimate track the
real one?). Both pipelines run as one Prefect flow each (ephemeral API), sharing the cached prepare stage.

    .venv/bin/python bench/onpolicy.py [--samples 500] [--epochs 4] [--prompts 32] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from tasks.prefect_env import apply_prefect_env_defaults  # before Prefect is imported

apply_prefect_env_defaults()

from eagle3.config import load_config, parse_set
from eagle3.train.stage import DraftCheckpoint
from flows.eagle3_pipeline import eagle3_pipeline


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=500, help="training conversations (both drafts)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32, help="held-out validation prompts")
    ap.add_argument("--runs-dir", default=None)
    ap.add_argument("--set", action="append", default=[], help="more overrides for both pipelines")
    args = ap.parse_args()
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="eagle3-onpolicy-")
    common = {"runs_dir": runs_dir, "data.max_samples": args.samples, "train.epochs": args.epochs,
              "validate.num_prompts": args.prompts, "validate.compare_untrained": False,
              "validate.speed_repeats": 1, "validate.min_mean_acceptance_length": None, **parse_set(args.set)}
    print(f"runs in {runs_dir}; machine load (1/5/15 min) at start: {_load()}", flush=True)
    rows = {}
    for label, regenerate in (("A: dataset answers", False), ("B: SmolLM2's own answers", True)):
        config = load_config("smollm2", {**common, "regenerate.enabled": regenerate, "run_name": "onpolicy"})
        t0 = time.perf_counter()
        summary = eagle3_pipeline(config)
        wall = time.perf_counter() - t0
        report = json.loads(Path(summary["report"]).with_name("report.json").read_text())
        ckpt = DraftCheckpoint.load(Path(summary["checkpoint"]).parent.parent)
        acc = report["vllm"]["acceptance"]
        rows[label] = {"wall_s": wall, "vllm": acc["mean_acceptance_length"],
                       "per_position": acc["per_position_acceptance"],
                       "sim": (ckpt.final_val or {}).get("sim_accept_len"),
                       "chain": (ckpt.final_val or {}).get("chain_accept_len"),
                       "steps": ckpt.global_step, "tokens": ckpt.tokens_seen,
                       "speedup": (report["vllm"].get("speed") or {}).get("speedup")}
        print(f"{label}: {json.dumps(rows[label])} (load {_load()})", flush=True)
    a, b = rows["A: dataset answers"], rows["B: SmolLM2's own answers"]
    print(f"\n{'':28}{'A (dataset)':>14}{'B (on-policy)':>16}")
    print(f"{'vLLM mean acceptance length':28}{a['vllm']:>14.3f}{b['vllm']:>16.3f}")
    for i, (pa, pb) in enumerate(zip(a["per_position"], b["per_position"])):
        print(f"{f'  acceptance at position {i + 1}':28}{pa:>14.3f}{pb:>16.3f}")
    print(f"{'trainer simulated accept':28}{a['sim']:>14.3f}{b['sim']:>16.3f}")
    print(f"{'trainer chain accept':28}{a['chain']:>14.3f}{b['chain']:>16.3f}")
    print(f"{'optimizer steps / tokens':28}{a['steps']:>7} {a['tokens']:>6}{b['steps']:>8} {b['tokens']:>7}")
    print(f"{'decoding speedup (vLLM CPU)':28}{a['speedup'] or 0:>14.3f}{b['speedup'] or 0:>16.3f}")
    print(f"{'wall (s)':28}{a['wall_s']:>14.0f}{b['wall_s']:>16.0f}")
    print(f"\nB/A vLLM mean acceptance length: {b['vllm'] / a['vllm']:.3f} (target >= 1.10); samples {args.samples}, "
          f"epochs {args.epochs}, {args.prompts} held-out prompts; load at the end {_load()}")


if __name__ == "__main__":
    main()
