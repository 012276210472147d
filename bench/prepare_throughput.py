"""Throughput of the data stage vs bare tokenisation, side by side in one run.

    .venv/bin/python bench/prepare_throughput.py [--tokenizer models/tiny-chat-verifier] [--repeat 3]

Times ``prepare_data`` (read jsonl, normalise, render with the chat template, mask, write Arrow + stats) on the
bundled data against a bare batched ``tokenizer(texts)`` over the SAME rendered conversation texts, and prints the
tokens/s of both and their ratio (target: >= 0.5). Best of ``--repeat`` runs each, interleaved, so both see the
same machine load.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from eagle3.chat.sources import iter_rows, normalize_row
from eagle3.prepare import PrepareConfig, prepare_data

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "data" / "stdlib-chat" / "train.openai.jsonl"))
    ap.add_argument("--tokenizer", default=str(REPO / "models" / "tiny-chat-verifier"))
    ap.add_argument("--mask-method", default="auto", choices=["auto", "generation", "prefix"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    cfg = PrepareConfig(sources=[args.data], tokenizer_path=args.tokenizer, mask_method=args.mask_method,
                        max_seq_len=1 << 20)
    encoder = cfg.encoder()
    texts = [encoder.render(normalize_row(row)) for _, row in iter_rows(cfg.sources)]

    bare_s, prep_s, bare_tokens, prep_tokens = [], [], 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            t = time.perf_counter()
            ids = encoder.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            bare_s.append(time.perf_counter() - t)
            bare_tokens = sum(map(len, ids))

            t = time.perf_counter()
            result = prepare_data(cfg, Path(tmp) / f"run{r}")
            prep_s.append(time.perf_counter() - t)
            prep_tokens = result.total_tokens

    bare_tps, prep_tps = bare_tokens / min(bare_s), prep_tokens / min(prep_s)
    print(json.dumps({
        "data": args.data, "tokenizer": args.tokenizer, "mask_method": encoder.method, "conversations": len(texts),
        "bare_tokenizer": {"tokens": bare_tokens, "best_s": round(min(bare_s), 4), "tokens_per_s": round(bare_tps)},
        "prepare_data": {"tokens": prep_tokens, "best_s": round(min(prep_s), 4), "tokens_per_s": round(prep_tps)},
        "ratio": round(prep_tps / bare_tps, 3), "target": 0.5,
    }, indent=2))


if __name__ == "__main__":
    main()
