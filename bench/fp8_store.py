"""FP8 vs bf16 hidden-state store on SmolLM2: store bytes and vLLM acceptance at the same training budget, one run.

    PYTHONPATH=. .venv/bin/python bench/fp8_store.py [--samples 300] [--epochs 4] [--prompts 64] [--max-new-tokens 96]
                                        [--seeds 0] [--work DIR]

The pipeline's own stage functions, the ``smollm2`` preset's settings when this was measured (aux layers [2, 15, 27]
in vLLM's convention, draft vocab 8192, max_seq_len 768, lr 2e-3 cosine, batch 8 packed rows, 3 TTT steps), on the
bundled stdlib-chat data's own responses (no regeneration: both drafts see the same data, which is all this
comparison needs):
prepare_data and build_vocab once; then per store dtype (bfloat16, float8_e4m3fn) extract_hidden_states (transformers
backend, same compute dtype, so both stores quantize the same states), train_draft with the same settings and seed,
and validate_draft in real vLLM (.venv-vllm, float32, greedy, num_speculative_tokens 3) on the same held-out
prompts (acceptance only: no timed decodes, speed_repeats 0). Printed: bytes of each store (sample files) and their
ratio (target <= 0.51), the trainer's validation figures, vLLM's mean acceptance length (pooled: 1 + accepted /
drafts) and per-position acceptance of each draft, and fp8 / bf16 (target within 2%). With several ``--seeds`` every
seed trains both drafts, so the fp8-bf16 gap can be read against the seed-to-seed spread. With ``--work`` a rerun
reuses the stage folders an earlier run finished (same settings; times then are those of the earlier run's folder,
not re-measured). Needs models/smollm2-135m-instruct (scripts/setup_envs.sh).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _extract_common import quiet

from eagle3.extract.stage import extract_hidden_states
from eagle3.prepare import prepare_data
from eagle3.store import sample_files
from eagle3.support.artifacts import Artifact
from eagle3.support.paths import REPO_ROOT
from eagle3.support.verifier import VerifierSpec
from eagle3.train.config import TrainConfig
from eagle3.train.stage import DraftCheckpoint, train_draft
from eagle3.validate.config import ValidateConfig
from eagle3.validate.stage import ValidationReport, validate_draft
from eagle3.vocab import VocabConfig, build_vocab
from tools.gguf_convert import SMOLLM2_DIR

DTYPES = ("bfloat16", "float8_e4m3fn")
AUX = [2, 15, 27]  # vLLM convention: residual streams entering layers 2, 15, 27 (vLLM's default for 30 layers)


def store_bytes(store_dir: Path) -> int:
    return sum(f.stat().st_size for f in sample_files(store_dir))


def reuse(cls: type[Artifact], out_dir: Path, cfg, upstream: Artifact | None = None) -> Artifact | None:
    """A finished stage folder of an earlier run of this bench with ``--work`` (same settings, same upstream
    checkpoint, nothing missing or changed): its artifact, so an interrupted bench resumes instead of training and
    validating again. None = run the stage."""
    try:
        art = cls.load(out_dir)
    except ValueError:
        return None
    settings = json.loads((out_dir / "settings.json").read_text()) if (out_dir / "settings.json").is_file() else None
    if art.problems() or settings != {"cfg": cfg.model_dump(mode="json"),
                                      "upstream": upstream.fingerprint if upstream else None}:
        return None
    print(f"  reusing {out_dir} (finished by an earlier run of this bench)", flush=True)
    return art


def remember(out_dir: Path, cfg, upstream: Artifact | None = None) -> None:
    """Record what a finished stage folder was run with (``reuse`` compares it)."""
    (out_dir / "settings.json").write_text(json.dumps({"cfg": cfg.model_dump(mode="json"),
                                                       "upstream": upstream.fingerprint if upstream else None}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=300, help="conversations (the smollm2 preset then: 300; now 600)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts for vLLM (the eval file has 65)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (each trains both drafts)")
    ap.add_argument("--work", type=Path, default=None, help="keep everything here (default: a temp folder)")
    args = ap.parse_args()
    # a lock folder of its own, as the tests do: the host lock serializes pipeline runs, not benchmarks
    os.environ.setdefault("EAGLE3_LOCK_DIR", tempfile.mkdtemp(prefix="fp8-bench-locks-"))
    quiet()
    logging.basicConfig(level=logging.WARNING)
    work = args.work or Path(tempfile.mkdtemp(prefix="fp8-store-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = VerifierSpec.from_path(SMOLLM2_DIR)
    print(f"load average at start {os.getloadavg()}", flush=True)
    t0 = time.monotonic()
    data = prepare_data({"sources": [str(REPO_ROOT / "data/stdlib-chat/train.openai.jsonl")],
                         "tokenizer_path": str(SMOLLM2_DIR), "max_seq_len": 768, "max_samples": args.samples,
                         "shuffle_seed": 0}, work / "prepare")
    vocab = build_vocab(VocabConfig(draft_vocab_size=8192, size_to_data=False), data, spec.vocab_size,
                        work / "vocab")
    print(f"prepared {data.samples} samples, {data.total_tokens:,} tokens; vocab coverage "
          f"{json.loads(Path(vocab.report_path).read_text())['coverage']:.4f} ({time.monotonic() - t0:.0f} s)",
          flush=True)

    val_cfg = ValidateConfig(num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, num_speculative_tokens=3,
                             dtype="float32", require_lossless=False, speed_repeats=0)
    rows: dict[tuple[str, int], dict] = {}
    for dt in DTYPES:
        t = time.monotonic()
        store = extract_hidden_states({"verifier": str(SMOLLM2_DIR), "aux_layer_ids": AUX, "store_dtype": dt,
                                       "device": "cpu", "max_tokens_per_batch": 8192, "log_every_samples": 0,
                                       "log_every_seconds": 0}, data, work / f"extract-{dt}" / "store")
        nbytes = store_bytes(Path(store.store_path))
        print(f"[{dt}] extracted {store.store_tokens:,} tokens in {time.monotonic() - t:.0f} s (compute "
              f"{store.compute_dtype}): {nbytes:,} bytes of sample files, {nbytes / store.store_tokens:,.1f} B/token",
              flush=True)
        for seed in args.seeds:
            t = time.monotonic()
            cfg = TrainConfig(epochs=args.epochs, lr=2e-3, schedule="cosine", batch_size=8, ttt_steps=3,
                              max_seq_len=768, val_ratio=0.05, keep_last_n=1, log_every_steps=10, device="cpu",
                              seed=seed)
            ckpt = reuse(DraftCheckpoint, work / f"train-{dt}-s{seed}", cfg) or train_draft(
                cfg, store, vocab, work / f"train-{dt}-s{seed}")
            remember(work / f"train-{dt}-s{seed}", cfg)
            train_s = time.monotonic() - t
            t = time.monotonic()
            rep = reuse(ValidationReport, work / f"validate-{dt}-s{seed}", val_cfg, ckpt) or validate_draft(
                val_cfg, ckpt, work / f"validate-{dt}-s{seed}")
            if rep.mean_acceptance_length is None:  # vLLM did not measure it: say why, keep nothing to reuse
                raise SystemExit(f"[{dt} seed {seed}] vLLM gave no acceptance figure: {'; '.join(rep.reasons)} "
                                 f"(report {rep.report_json}, vLLM log {rep.vllm_log})")
            remember(work / f"validate-{dt}-s{seed}", val_cfg, ckpt)
            rows[dt, seed] = {"bytes": nbytes, "tokens": store.store_tokens, "steps": ckpt.global_step,
                              "tokens_seen": ckpt.tokens_seen, "val": ckpt.final_val,
                              "al": rep.mean_acceptance_length, "pos": rep.per_position_acceptance,
                              "lossless": rep.lossless, "train_s": train_s, "validate_s": time.monotonic() - t}
            r = rows[dt, seed]
            print(f"[{dt} seed {seed}] trained {r['steps']} steps / {r['tokens_seen']:,} tokens in {train_s:.0f} s: "
                  f"val loss {r['val']['loss']:.4f}, sim accept {r['val']['sim_accept_len']:.3f} | vLLM mean "
                  f"acceptance length {r['al']:.4f}, per position {[round(p, 4) for p in r['pos']]}, lossless "
                  f"{r['lossless']} ({r['validate_s']:.0f} s)", flush=True)

    print(f"\n== FP8 vs bf16 store, SmolLM2-135M-Instruct, {data.samples} samples, {args.epochs} epochs, "
          f"{args.prompts} vLLM prompts x {args.max_new_tokens} tokens, k=3 ==")
    b, f = rows[DTYPES[0], args.seeds[0]], rows[DTYPES[1], args.seeds[0]]
    ratio = f["bytes"] / b["bytes"]
    print(f"store bytes: bf16 {b['bytes']:,}, fp8 {f['bytes']:,} -> ratio {ratio:.4f} (target <= 0.51: "
          f"{'ok' if ratio <= 0.51 else 'MISSED'})")
    gaps = []
    for seed in args.seeds:
        b, f = rows[DTYPES[0], seed], rows[DTYPES[1], seed]
        gap = f["al"] / b["al"] - 1
        gaps.append(gap)
        print(f"seed {seed}: vLLM acceptance length bf16 {b['al']:.4f}, fp8 {f['al']:.4f} -> fp8/bf16 - 1 = "
              f"{gap:+.2%} | trainer val loss bf16 {b['val']['loss']:.4f}, fp8 {f['val']['loss']:.4f}; sim accept "
              f"bf16 {b['val']['sim_accept_len']:.3f}, fp8 {f['val']['sim_accept_len']:.3f}")
    if len(args.seeds) > 1:
        bf = [rows[DTYPES[0], s]["al"] for s in args.seeds]
        print(f"seed-to-seed spread of the bf16 drafts: {min(bf):.4f} .. {max(bf):.4f} "
              f"(stdev {statistics.stdev(bf):.4f}); mean fp8/bf16 - 1 = {statistics.mean(gaps):+.2%}")
    worst = max(abs(g) for g in gaps)
    print(f"acceptance within 2%: {'ok' if worst <= 0.02 else 'MISSED'} (largest |gap| {worst:.2%})")
    print(f"load average at end {os.getloadavg()}; total {time.monotonic() - t0:.0f} s; work folder {work}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
