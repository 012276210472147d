"""Training efficiency = (draft training FLOPs per token x trained tokens/s) / (matmul peak of this CPU), one run.

    .venv/bin/python bench/train_efficiency.py [--hidden 1024] [--ttt-steps 3] [--samples 20]

Setup: a random-init Llama verifier (hidden 1024, 4 layers, vocab 8192), random-token samples of 250-500 tokens
extracted into a real store (eagle3.extract), draft vocab 8192; the draft takes the verifier's geometry (hidden
1024, 16 heads x 64, 8 KV heads, MLP 2816: ~30M weights in matmuls, compute-bound on a CPU). ``train_draft`` runs
one epoch (float32, packed rows of 512 tokens, 2 rows per optimizer step); tokens/s is the trainer's own figure in
metrics.jsonl (data loading included; validation and checkpoint writing excluded).

Model FLOPs per trained token: fc once, then per TTT step the attention projections, MLP and lm_head (2 FLOPs per
weight forward, x3 with backward) plus attention scores over each entry's context (its position + 1 in its sample) and
its own earlier steps. The verifier-head teacher, softmaxes and KL are NOT counted (overhead). The peak is the best
of a 2048^3 float32 matmul timed before and after training in the same process. Target: efficiency >= 0.35.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _extract_common import quiet, save_dataset, save_llama

from eagle3.draft.config import DraftConfig
from eagle3.extract.stage import extract_hidden_states
from eagle3.store import HiddenStateStore
from eagle3.support.verifier import VerifierSpec
from eagle3.train.config import TrainConfig
from eagle3.train.stage import train_draft
from eagle3.vocab import VocabConfig, build_vocab


def matmul_peak(n: int = 2048, repeat: int = 6) -> float:
    """Best float32 GFLOP/s of an n x n x n matmul over ``repeat`` timings."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def train_flops_per_token(cfg: DraftConfig, ttt_steps: int, mean_context: float) -> float:
    h, hd = cfg.hidden_size, cfg.head_dim
    fc = cfg.n_aux * cfg.target_hidden_size * h
    per_step = cfg.matmul_params() - fc
    fwd = 2 * fc + 2 * per_step * ttt_steps
    for k in range(ttt_steps):  # QK^T and AV: 2 x 2 FLOPs per head dim per attended key
        fwd += 4 * cfg.num_attention_heads * hd * (mean_context + k)
    return 3 * fwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--max-seq-len", type=int, default=512)
    args = ap.parse_args()
    quiet()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        verifier = save_llama(tmp / "verifier", hidden=args.hidden, layers=4)
        ds = save_dataset(tmp / "ds", args.samples, 250, 500)
        extract_hidden_states({"verifier": str(verifier), "aux_layer_ids": [1, 2, 3], "store_dtype": "float32",
                               "device": "cpu", "log_every_samples": 0,
                               "log_every_seconds": 0}, ds, tmp / "store")
        vocab = build_vocab(VocabConfig(draft_vocab_size=8192, size_to_data=False), ds, 8192,
                            tmp / "vocab")["mapping_path"]
        peak_before = matmul_peak()
        cfg = TrainConfig(epochs=1, batch_size=2, max_seq_len=args.max_seq_len, ttt_steps=args.ttt_steps,
                          val_ratio=0.0, eval_before_training=False, log_every_steps=1000, device="cpu",
                          keep_last_n=1)
        result = train_draft(cfg, tmp / "store", vocab, tmp / "out", verifier=verifier)
        peak = max(peak_before, matmul_peak())
        train_lines = [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
        tok_s = [r for r in train_lines if r["event"] == "train"][-1]["tokens_per_s"]
        draft_cfg = DraftConfig.build(VerifierSpec.from_path(verifier), 8192, [1, 2, 3])
        store = HiddenStateStore(tmp / "store")
        lengths = [min(store.tokens(i), args.max_seq_len) for i in store.indices()]
        mean_context = sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)  # keys a step-0 entry attends to
        flops = train_flops_per_token(draft_cfg, args.ttt_steps, mean_context)
    eff = flops * tok_s / peak
    print(f"draft: hidden {draft_cfg.hidden_size}, heads {draft_cfg.num_attention_heads}x{draft_cfg.head_dim}, "
          f"kv {draft_cfg.num_key_value_heads}, mlp {draft_cfg.intermediate_size}, draft vocab 8192, "
          f"{draft_cfg.matmul_params() / 1e6:.1f}M matmul weights, TTT steps {args.ttt_steps}")
    print(f"trained {result['tokens_seen']:,} tokens in {result['global_step']} optimizer steps "
          f"(packing efficiency {result['packing_efficiency']:.3f})")
    print(f"model FLOPs per token {flops / 1e6:.1f} MFLOP | {tok_s:.1f} tok/s -> {flops * tok_s / 1e9:.1f} GFLOP/s")
    print(f"matmul peak (fp32 2048^3, best of before/after) {peak / 1e9:.1f} GFLOP/s")
    print(f"efficiency {eff:.3f}  target >= 0.35: {'ok' if eff >= 0.35 else 'MISSED'}")


if __name__ == "__main__":
    main()
