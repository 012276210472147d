"""The two draft kinds side by side on one kimi-mini store (issue 16): MLA (vLLM's Eagle3DeepseekV3ForCausalLM) and
Llama-style (Eagle3LlamaForCausalLM), same states, vocabulary, recipe and seed.

The kimi-mini preset runs once (regeneration, vLLM extraction, the MLA draft, validation in vLLM); then a llama draft
is trained on the same store and vocabulary with the same settings. Each draft is measured by
- parameters (trainable; and the attention block alone),
- training tokens/s (one engine at a time, the machine's load printed),
- acceptance in vLLM where vLLM serves the pair (CPU: the MLA draft only; vLLM's CPU build refuses a llama draft
  beside an MLA verifier), and by the offline reference (eagle3.validate.specdec: the same greedy chain, computed
  with transformers; it equals vLLM's figure for the MLA draft, printed side by side) on the same held-out prompts.

    .venv/bin/python bench/draft_kinds.py [--runs-dir DIR] [--prompts 16] [--set KEY=VALUE ...]
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
from eagle3.draft.checkpoint import read_config
from eagle3.draft.config import DraftArchitecture
from eagle3.support.paths import resolve_path
from eagle3.train.memory import parameter_counts
from eagle3.train.stage import train_draft
from eagle3.validate.specdec import offline_acceptance
from flows.eagle3_pipeline import eagle3_pipeline


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _train_rate(metrics: Path) -> float:
    """Tokens per second of the run's last train record (wall clock of the training loop)."""
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if '"event": "train"' in x]
    return float(recs[-1]["tokens_per_s"]) if recs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs-dir", default=None)
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for both acceptance figures")
    ap.add_argument("--set", action="append", default=[], help="more overrides of the kimi-mini preset")
    args = ap.parse_args()
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="eagle3-draft-kinds-")
    config = load_config("kimi-mini", {"runs_dir": runs_dir, "validate.num_prompts": args.prompts,
                                       "validate.compare_untrained": False, **parse_set(args.set)})
    print(f"runs in {runs_dir}; machine load (1/5/15 min) at start: {_load()}", flush=True)
    t0 = time.perf_counter()
    state = eagle3_pipeline(config, return_state=True)
    summary = state.result()
    print(f"kimi-mini pipeline (MLA draft): {time.perf_counter() - t0:.0f} s, load {_load()}", flush=True)
    run_dir = Path(config.run_dir)
    store = next(run_dir.glob("extract-hidden-states-*/store"))
    vocab = next(run_dir.glob("build-vocab-*/mapping.safetensors"))
    mla_ckpt = Path(summary["checkpoint"])
    report = json.loads(Path(summary["report"]).with_name("report.json").read_text())

    train = config.train_config().model_copy(update={"draft": DraftArchitecture(kind="llama")})
    t0 = time.perf_counter()
    llama = train_draft(train, store, vocab, run_dir / "train-llama-draft", verifier=config.verifier)
    print(f"llama draft trained: {time.perf_counter() - t0:.0f} s, load {_load()}", flush=True)

    v = config.validate_config
    prompts = config.chat_settings().held_out_prompt_ids(resolve_path(v.prompts_path), args.prompts)
    rows = {}
    for label, ckpt, metrics in (("mla", mla_ckpt, mla_ckpt.parent.parent / "metrics.jsonl"),
                                 ("llama", Path(llama.checkpoint_dir), Path(llama.metrics_path))):
        cfg = read_config(ckpt)
        off = offline_acceptance(config.verifier, ckpt, prompts, v.num_speculative_tokens,
                                 v.max_new_tokens, v.engine.trust_remote_code)
        rows[label] = {"trainable parameters (M)": sum(parameter_counts(cfg)[0].values()) / 1e6,
                       "attention parameters (M)": cfg.attention_params() / 1e6,
                       "training tok/s": _train_rate(metrics),
                       "offline acceptance length": off.acceptance.mean_acceptance_length,
                       "vLLM acceptance length": (report["vllm"]["acceptance"]["mean_acceptance_length"]
                                                  if label == "mla" else None)}
    print(f"\nload at end: {_load()}")
    print("| | MLA draft | llama draft | llama / MLA |\n|---|---|---|---|")
    for key in rows["mla"]:
        a, b = rows["mla"][key], rows["llama"][key]
        fmt = (lambda x: "not served (vLLM CPU)" if x is None else f"{x:.3f}")
        ratio = f"{b / a:.3f}" if a and b else "-"
        print(f"| {key} | {fmt(a)} | {fmt(b)} | {ratio} |")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
