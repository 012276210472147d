"""Packing efficiency of the trainer = real tokens / token slots (rows x max_seq_len), on the bundled dataset.

    .venv/bin/python bench/packing_efficiency.py [--max-seq-len 512 2048] [--val-ratio 0.05]

Tokenizes data/stdlib-chat/train.openai.jsonl with the bundled verifier's tokenizer and chat template (the data
stage, eagle3.prepare), splits train/val as the trainer does and packs the training split with the trainer's own
``pack_samples`` (best-fit decreasing). Printed beside it, in the same run: one sample per row (padded to
max_seq_len) and one sample per row padded to the longest of each batch of 8 (what an unpacked trainer pays).
Target: packed >= 0.95.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from eagle3.prepare import PrepareConfig, prepare_data
from eagle3.support.paths import BUNDLED_DATA, BUNDLED_VERIFIER
from eagle3.train.trainer import pack_samples, packing_efficiency, split_indices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-seq-len", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--val-ratio", type=float, default=0.05)
    ap.add_argument("--source", default=str(BUNDLED_DATA / "train.openai.jsonl"))
    args = ap.parse_args()
    logging.disable(logging.INFO)
    import datasets

    with tempfile.TemporaryDirectory() as tmp:
        longest = max(args.max_seq_len)
        res = prepare_data(PrepareConfig(sources=[args.source], tokenizer_path=str(BUNDLED_VERIFIER),
                                            max_seq_len=longest, overlong="truncate"), Path(tmp) / "data")
        ds = datasets.load_from_disk(res.dataset_path)
        all_lengths = [len(x) for x in ds["input_ids"]]
    print(f"bundled dataset: {len(all_lengths)} samples, {sum(all_lengths):,} tokens, mean "
          f"{sum(all_lengths) / len(all_lengths):.1f} / max {max(all_lengths)} tokens per sample")
    for msl in args.max_seq_len:
        lengths = {i: min(n, msl) for i, n in enumerate(all_lengths)}
        train, _ = split_indices(list(lengths), args.val_ratio, seed=0)
        lens = {i: lengths[i] for i in train}
        bins = pack_samples(lens, msl)
        packed = packing_efficiency(bins, lens, msl)
        real = sum(lens.values())
        one_per_row = real / (len(lens) * msl)
        order = sorted(lens)
        batch_longest = sum(8 * max(lens[i] for i in order[j:j + 8]) for j in range(0, len(order), 8))
        print(f"max_seq_len {msl:5d}: packed rows {len(bins):5d}  efficiency {packed:.4f}   | one sample per row: "
              f"{one_per_row:.4f}   | padded to longest of 8: {real / batch_longest:.4f}   "
              f"(packed / padded-to-longest = {packed / (real / batch_longest):.2f}x)  target >= 0.95: "
              f"{'ok' if packed >= 0.95 else 'MISSED'}")


if __name__ == "__main__":
    main()
