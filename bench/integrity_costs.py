"""What the integrity checks cost, each beside the work it guards, measured in one run (docs/DESIGN.md quotes it).

    .venv/bin/python bench/integrity_costs.py [--samples 20000] [--sample-tokens 2048] [--hidden 1024]

1. Reuse check of a cached store (``HiddenStates.problems``: manifest sha256 + one lstat per sample) on a store of
   ``--samples`` small samples, per sample and extrapolated to 1M samples (warm inode cache: a cold or network
   file system costs more per lstat).
2. First-read hash (``HiddenStateStore.verify_sample``) of one sample of ``--sample-tokens`` tokens (aux 3 x H + final,
   bf16) beside the read the trainer's collate does anyway (``load`` + copy into a batch), page cache warm both;
   extrapolated to a Kimi-K2.5 sample (H = 7168) at the measured hash rate.
3. One resume-state save (``save_trainer_state`` of the draft's fp32 weights + AdamW moments, as the trainer writes
   it) for the tiny preset's draft and a hidden-``--hidden`` draft, and the Kimi-K2.5 draft's state size (its
   trainable parameters counted on the meta device) with the time at the measured write rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def reuse_check(tmp: Path, n: int) -> None:
    from eagle3.store import (
        MANIFEST,
        HiddenStateStore,
        append_manifest_entries,
        init_store,
        sample_relpath,
        serialize_sample,
    )
    from eagle3.support.io import sha256_file

    store_dir = tmp / "store"
    init_store(store_dir, verifier="bench", aux_layer_ids=[1, 2, 3], hidden_size=8, num_samples=n,
               dtype="bfloat16", fingerprint="bench")
    entries = []
    for i in range(n):  # plain writes (no fsync per file): the read side is what is measured
        t = 16
        data = serialize_sample(torch.randn(t, 24), torch.randn(t, 8), torch.arange(t), torch.ones(t),
                                torch.bfloat16, i)
        path = store_dir / sample_relpath(i, 2000)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        entries.append({"index": i, "file": sample_relpath(i, 2000), "tokens": t,
                        "sha256": __import__("hashlib").sha256(data).hexdigest(), "bytes": len(data)})
    append_manifest_entries(store_dir, entries)
    manifest = store_dir / MANIFEST

    store = HiddenStateStore(store_dir)
    parts = {"manifest sha256": _median(lambda: sha256_file(manifest), 5),
             "manifest parse": _median(lambda: HiddenStateStore(store_dir), 5),
             "lstat + size per sample": _median(lambda: store.check_sizes(), 5)}
    s = sum(parts.values())
    detail = ", ".join(f"{k} {v / n * 1e6:.1f}" for k, v in parts.items())
    print(f"1. reuse check of a {n:,}-sample store ({manifest.stat().st_size / n:.0f} B per manifest line): "
          f"{s:.3f} s = {s / n * 1e6:.1f} us per sample ({detail}) -> 1M samples: {s / n * 1e6:.1f} s")


def first_read_hash(tmp: Path, tokens: int, hidden: int) -> float:
    from eagle3.extract.writer import write_sample
    from eagle3.store import HiddenStateStore, init_store
    from eagle3.support.io import sha256_file

    store_dir = tmp / "big"
    init_store(store_dir, verifier="bench", aux_layer_ids=[1, 2, 3], hidden_size=hidden, num_samples=1,
               dtype="bfloat16", fingerprint="bench")
    write_sample(store_dir, 0, torch.randn(tokens, 3 * hidden), torch.randn(tokens, hidden), torch.arange(tokens),
                 torch.ones(tokens))
    store = HiddenStateStore(store_dir)
    path = store.file(0)
    size = path.stat().st_size
    sha256_file(path)  # warm the page cache

    def read() -> None:  # what collate does with a sample: map it, copy its rows into the batch tensors
        t = store.load(0)
        torch.empty_like(t["aux_hidden_states"]).copy_(t["aux_hidden_states"])
        torch.empty_like(t["final_hidden_state"]).copy_(t["final_hidden_state"])

    h, r = _median(lambda: sha256_file(path), 5), _median(read, 5)
    rate = size / h
    kimi = tokens * 4 * 7168 * 2
    print(f"2. first-read hash of a {tokens:,}-token sample (hidden {hidden}, {size / 1e6:.1f} MB): sha256 "
          f"{h * 1e3:.1f} ms ({rate / 1e9:.2f} GB/s) vs the collate read {r * 1e3:.1f} ms: ratio {h / r:.2f}; "
          f"a Kimi-K2.5 sample of {tokens:,} tokens ({kimi / 1e6:.0f} MB): {kimi / rate:.2f} s, once per run")
    return rate


def _kimi_trainable() -> int:
    from eagle3.draft.config import DraftConfig
    from eagle3.draft.model import Eagle3Draft

    cfg = DraftConfig(hidden_size=7168, target_hidden_size=7168, intermediate_size=18432, num_attention_heads=64,
                      num_key_value_heads=64, head_dim=128, vocab_size=163840, draft_vocab_size=32000,
                      aux_layer_ids=[2, 30, 58], rms_norm_eps=1e-6, rope_theta=50000.0,
                      max_position_embeddings=262144, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = Eagle3Draft(cfg)
    return sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")


def state_save(tmp: Path, hidden: int) -> None:
    from eagle3.draft import checkpoint as ckpt
    from eagle3.draft.config import DraftConfig
    from eagle3.draft.model import Eagle3Draft

    rates = []
    for name, h, vocab, draft_vocab in (("tiny preset", 64, 8192, 2048), (f"hidden {hidden}", hidden, 32000, 8192)):
        cfg = DraftConfig(hidden_size=h, target_hidden_size=h, intermediate_size=h * 11 // 4,
                          num_attention_heads=max(1, h // 64), num_key_value_heads=max(1, h // 128),
                          head_dim=min(64, h), vocab_size=vocab, draft_vocab_size=draft_vocab,
                          aux_layer_ids=[1, 2, 3], torch_dtype="float32")
        model = Eagle3Draft(cfg)
        model.embed_tokens.weight.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()  # the moments exist, as in a trainer's state
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        state = {"model": {k: v for k, v in model.state_dict().items() if k in trainable},
                 "optimizer": opt.state_dict(), "progress": {"global_step": 1}}
        folder = tmp / f"state-{h}"
        s = _median(lambda folder=folder, state=state: ckpt.save_trainer_state(folder, state), 3)
        nbytes = (folder / ckpt.STATE_TENSORS).stat().st_size
        rates.append(nbytes / s)
        print(f"3. resume-state save, {name} draft ({sum(p.numel() for p in params) / 1e6:.1f}M trainable "
              f"parameters): {s:.3f} s for {nbytes / 1e6:.1f} MB ({nbytes / s / 1e9:.2f} GB/s, fsync'd)")
    kimi = _kimi_trainable()
    kimi_bytes = kimi * 12  # fp32 weights + 2 fp32 AdamW moments
    print(f"   Kimi-K2.5 draft: {kimi / 1e9:.2f}B trainable parameters -> {kimi_bytes / 1e9:.1f} GB per save, "
          f"{kimi_bytes / rates[-1]:.0f} s at this disk's {rates[-1] / 1e9:.2f} GB/s "
          f"(plus the GPU -> CPU gather of the full state)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--sample-tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} (1 min average), {os.cpu_count()} CPUs; torch threads "
          f"{torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        reuse_check(tmp, args.samples)
        first_read_hash(tmp, args.sample_tokens, args.hidden)
        state_save(tmp, args.hidden)
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()
