"""Training memory plan vs the measured peak on CPU, SmolLM2's draft, several batch shapes side by side; and the plan
of the kimi-k2.5 preset.

    PYTHONPATH=. .venv/bin/python bench/train_memory.py [--cases 2x768x3 4x768x3 2x1536x5 1x2048x7]
                                                        [--store-dtype float32] [--steps 3]

Each case ``BxTxK`` (packed rows per micro-batch x max_seq_len tokens x TTT steps) trains SmolLM2-135M's draft
(hidden 576, 9 heads / 3 KV heads, MLP 1536, draft vocab 8192, aux [2, 15, 27] in vLLM's convention; 10.4M
trainable + 28.3M frozen parameters) for ``--steps`` optimizer steps with ``train_draft`` in a fresh process, on a
synthetic store written by the store's own writer (random states; every sample exactly T tokens, so every packed row
is full, the plan's worst case), loader_workers 0 (batches load in the training process, as the plan counts them
for CPU), no validation. Measured: the process's peak RSS (ru_maxrss, the kernel's high-water mark) minus its RSS
just before ``train_draft`` (imports done, store and mapping on disk). Printed per case: the plan's peak, the
measured growth, their ratio (target within 20%), and the plan's items. Then the kimi-k2.5 preset's plan (one H200
per process, 8 processes, DDP; and the same on FSDP) from Kimi-K2.5's config shape.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AUX = [2, 15, 27]  # vLLM convention: residual streams entering layers 2, 15, 27
DRAFT_VOCAB = 8192


def _write_case(work: Path, spec, b: int, t: int, steps: int, store_dtype: str) -> tuple[Path, Path]:
    """A synthetic store of b * steps samples of exactly t tokens (the store's own writer) + its vocab mapping."""
    import torch

    from eagle3.extract.writer import write_sample
    from eagle3.store import init_store
    from eagle3.vocab import build_vocab_mapping, save_mapping

    samples = b * steps
    store = work / "store"
    init_store(store, verifier=spec.path, aux_layer_ids=AUX, hidden_size=spec.hidden_size, num_samples=samples,
               dtype=store_dtype)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(spec.vocab_size, dtype=torch.int64)
    for i in range(samples):
        ids = torch.randint(0, spec.vocab_size, (t,), generator=g)
        counts += torch.bincount(ids, minlength=spec.vocab_size)
        write_sample(store, i, torch.randn(t, 3 * spec.hidden_size, generator=g),
                     torch.randn(t, spec.hidden_size, generator=g), ids, torch.ones(t, dtype=torch.uint8))
    d2t, t2d, report = build_vocab_mapping(counts, DRAFT_VOCAB)
    return store, save_mapping(work / "vocab", d2t, t2d, report)


def child(ns: argparse.Namespace) -> None:
    """One case in this fresh process: a tiny warm-up training (imports everything training imports lazily:
    checkpoint, plotting), then the case; reports peak RSS growth over the RSS before it, and the plan, as JSON."""
    import gc

    import psutil

    from eagle3.draft.config import DraftConfig
    from eagle3.store import HiddenStateStore
    from eagle3.support.verifier import VerifierSpec
    from eagle3.train.config import TrainConfig
    from eagle3.train.memory import plan_training_memory
    from eagle3.train.stage import train_draft
    from tools.gguf_convert import SMOLLM2_DIR

    b, t, k = ns.case
    work = Path(ns.work)
    spec = VerifierSpec.from_path(SMOLLM2_DIR)

    def cfg(b: int, t: int, k: int) -> TrainConfig:
        return TrainConfig(epochs=1, batch_size=b, max_seq_len=t, ttt_steps=k, val_ratio=0.0,
                           eval_before_training=False, loader_workers=0, device="cpu", log_every_steps=1000,
                           keep_last_n=1)

    warm_store, warm_vocab = _write_case(work / "warm-up", spec, 1, 16, 1, ns.store_dtype)
    train_draft(cfg(1, 16, 1), warm_store, warm_vocab, work / "warm-up" / "train", verifier=SMOLLM2_DIR)
    store, mapping = _write_case(work / "case", spec, b, t, ns.steps, ns.store_dtype)
    gc.collect()
    base = psutil.Process().memory_info().rss
    result = train_draft(cfg(b, t, k), store, mapping, work / "case" / "train", verifier=SMOLLM2_DIR)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    st = HiddenStateStore(store)
    state_bytes = 4 if st.scaled else st.dtype.itemsize  # a float8 store arrives dequantized to float32 on CPU
    plan = plan_training_memory(DraftConfig.build(spec, DRAFT_VOCAB, AUX), cfg(b, t, k), 1, "cpu",
                                batch_dtype_bytes=state_bytes)
    print(json.dumps({"base": base, "peak": peak, "steps": result.global_step, "plan": plan.model_dump()}))


def kimi_plans() -> None:
    from eagle3.config import load_config
    from eagle3.draft.config import DraftConfig
    from eagle3.support.verifier import VerifierSpec
    from eagle3.train.memory import plan_training_memory

    with tempfile.TemporaryDirectory() as tmp:
        text = {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
                "num_attention_heads": 64, "num_key_value_heads": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "vocab_size": 163840, "rope_theta": 50000.0, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 262144, "torch_dtype": "bfloat16", "kv_lora_rank": 512,
                "q_lora_rank": 1536}
        (Path(tmp) / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                           "model_type": "kimi_k25", "text_config": text}))
        spec = VerifierSpec.from_path(tmp)
        for preset in ("kimi-k2.5", "kimi-k2.5-2nodes"):  # one host of 8 GPUs; two hosts (the world doubles)
            pre = load_config(preset)
            cfg = pre.train_config()
            draft = DraftConfig.build(spec, pre.vocab.draft_vocab_size, pre.extract.aux_layer_ids, cfg.draft)
            print(f"\n== {preset} preset: draft hidden {draft.hidden_size}, {draft.num_attention_heads} heads x "
                  f"{draft.head_dim} ({draft.num_key_value_heads} KV), MLP {draft.intermediate_size}, draft vocab "
                  f"{draft.draft_vocab_size}, vocab {draft.vocab_size}; batch_size {cfg.batch_size}, nodes "
                  f"{cfg.nodes} x nproc {cfg.nproc}, grad_accum {cfg.grad_accum_steps}, max_seq_len "
                  f"{cfg.max_seq_len}, ttt_steps {cfg.ttt_steps} ==")
            for parallel in ("ddp", "fsdp"):
                plan = plan_training_memory(draft, cfg.model_copy(update={"parallel": parallel}), device="cuda",
                                            batch_dtype_bytes=2)
                print(plan.summary())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["2x768x3", "4x768x3", "2x1536x5", "1x2048x7"])
    ap.add_argument("--store-dtype", default="float32", choices=["float32", "bfloat16", "float8_e4m3fn"])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per case")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        ns.case = [int(x) for x in ns.child.split("x")]
        child(ns)
        return
    print(f"load average {os.getloadavg()}; store dtype {ns.store_dtype}", flush=True)
    rows = []
    for case in ns.cases:
        with tempfile.TemporaryDirectory() as work:
            env = {**os.environ, "PYTHONPATH": str(REPO), "EAGLE3_LOCK_DIR": work}
            out = subprocess.run([sys.executable, __file__, "--child", case, "--work", work, "--store-dtype",
                                  ns.store_dtype, "--steps", str(ns.steps)], env=env, capture_output=True, text=True,
                                 check=False)
        if out.returncode != 0:
            print(out.stderr[-3000:])
            raise SystemExit(f"case {case} failed")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        grown, planned = r["peak"] - r["base"], r["plan"]["peak_bytes"]
        rows.append((case, planned, grown))
        print(f"case {case} (rows x tokens x TTT steps), {r['steps']} steps: plan {planned / 1e9:.3f} GB, measured "
              f"peak RSS growth {grown / 1e9:.3f} GB -> plan / measured {planned / grown:.3f}", flush=True)
        for it in r["plan"]["items"]:
            print(f"    {it['name']:<24} {it['bytes'] / 1e9:8.3f} GB  {it['detail']}")
    worst = max(abs(p / g - 1) for _, p, g in rows)
    print(f"largest |plan / measured - 1| = {worst:.1%} (target <= 20%: {'ok' if worst <= 0.2 else 'MISSED'}); "
          f"load average {os.getloadavg()}")
    kimi_plans()


if __name__ == "__main__":
    main()
