"""Shared setup of the extraction benchmarks: a random-init Llama checkpoint and a prepared dataset on disk."""

from __future__ import annotations

import random
from pathlib import Path

import torch


def save_llama(out: Path, hidden: int = 1024, layers: int = 8, vocab: int = 8192, seed: int = 0,
               device: str = "cpu", dtype: torch.dtype | None = None) -> Path:
    """A random-init Llama big enough to be compute-bound on a CPU (hidden 1024, 8 layers: ~100M parameters).
    ``device``: where the weights are initialised (a GPU does a few hundred MB in a second); ``dtype``: the saved
    dtype (None = float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_dataset(out: Path, n: int, min_len: int, max_len: int, vocab: int = 8192, seed: int = 0) -> Path:
    """n samples of uniform random length in [min_len, max_len] tokens, loss mask on the second half."""
    import datasets

    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(n)]
    ids = [[rng.randrange(vocab) for _ in range(t)] for t in lengths]
    mask = [[int(j >= t // 2) for j in range(t)] for t in lengths]
    feats = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                               "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask}, features=feats).save_to_disk(str(out))
    return out


def quiet() -> None:
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
