"""On-policy vs off-policy training data, side by side in one run on SmolLM2-135M-Instruct (issue 13).

The same N prompts of the bundled stdlib chats and the same training budget (epochs, batch, steps per sample):
draft A is trained on the dataset's own answers, draft B on the answers SmolLM2 regenerated itself (the regenerate
stage). Both are validated in real vLLM (CPU build) on the same held-out prompts (the eval split's first user
turns, never trained on); the figure is B/A of vLLM's mean acceptance length (target >= 1.10), with the per-position
rates, beside the trainer's own simulated acceptance on its validation split (does the offline estimate track the
real one?). Both pipelines run as one Prefect flow each (ephemeral API), sharing the cached prepare stage.

Regenerated answers can differ in length from the dataset's, so at equal epochs A and B take different numbers of
optimizer steps. ``--control`` adds draft A' (dataset answers, epochs raised until A' takes at least B's steps; its
data, states and vocabulary come from A's cache): if B still beats A', the gain is not a token-budget artifact.

    .venv/bin/python bench/onpolicy.py [--samples 500] [--epochs 4] [--prompts 32] [--control] [--runs-dir DIR]
                                       [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
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
    ap.add_argument("--control", action="store_true", help="also train A for at least B's optimizer steps")
    ap.add_argument("--set", action="append", default=[], help="more overrides for both pipelines")
    args = ap.parse_args()
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="eagle3-onpolicy-")
    common = {"runs_dir": runs_dir, "data.max_samples": args.samples, "train.epochs": args.epochs,
              "validate.num_prompts": args.prompts, "validate.compare_untrained": False,
              "validate.speed_repeats": 1, "validate.min_mean_acceptance_length": None,
              "vocab.size_to_data": False,  # A's and B's answers hold different tokens: one draft size for all
              **parse_set(args.set)}
    print(f"runs in {runs_dir}; machine load (1/5/15 min) at start: {_load()}", flush=True)
    rows = {}

    def run(label: str, regenerate: bool, epochs: int) -> None:
        config = load_config("smollm2", {**common, "regenerate.enabled": regenerate, "train.epochs": epochs,
                                         "run_name": "onpolicy"})
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

    run("A (dataset)", False, args.epochs)
    run("B (on-policy)", True, args.epochs)
    a, b = rows["A (dataset)"], rows["B (on-policy)"]
    if args.control:
        run("A' (B's steps)", False, math.ceil(args.epochs * b["steps"] / a["steps"]))
    cols = list(rows)
    print("\n" + f"{'':28}" + "".join(f"{c:>16}" for c in cols))

    def line(name: str, values: list[str]) -> None:
        print(f"{name:28}" + "".join(f"{v:>16}" for v in values))

    line("vLLM mean acceptance length", [f"{rows[c]['vllm']:.3f}" for c in cols])
    for i in range(len(a["per_position"])):
        line(f"  acceptance at position {i + 1}", [f"{rows[c]['per_position'][i]:.3f}" for c in cols])
    line("trainer simulated accept", [f"{rows[c]['sim']:.3f}" for c in cols])
    line("trainer chain accept", [f"{rows[c]['chain']:.3f}" for c in cols])
    line("optimizer steps / tokens", [f"{rows[c]['steps']} / {rows[c]['tokens']}" for c in cols])
    line("decoding speedup (vLLM CPU)", [f"{rows[c]['speedup'] or 0:.3f}" for c in cols])
    line("wall (s)", [f"{rows[c]['wall_s']:.0f}" for c in cols])
    print(f"\nB/A vLLM mean acceptance length: {b['vllm'] / a['vllm']:.3f} (target >= 1.10); samples {args.samples}, "
          f"epochs {args.epochs}, {args.prompts} held-out prompts; load at the end {_load()}")
    if args.control:
        c = rows["A' (B's steps)"]
        print(f"B/A' (A trained for {c['steps']} steps, B {b['steps']}): {b['vllm'] / c['vllm']:.3f}")


if __name__ == "__main__":
    main()
