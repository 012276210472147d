"""SmolLM2 decoder forward on this CPU: bf16 vs float32, 1 vs 2 torch threads, side by side in one run.

    .venv/bin/python bench/smollm2_cpu_forward.py [--tokens 2048] [--rows 1 4] [--threads 1 2] [--repeat 2]

What extraction runs: the decoder (``model.model``, no lm_head) under inference_mode with an attention mask, over a
token-budget batch. ``--rows R`` splits ``--tokens`` into R rows; row r is shortened by (r % 4) / 16 of its width
and right-padded, so batches of R > 1 carry ~9% padding (a 4-D mask), as length-sorted token-budget batches do.
Cases alternate (dtype inner) so each pair sees the same machine load; the best of ``--repeat`` timed runs after
one warm-up is printed, and the ratio bf16 / float32 tokens per second. Also printed: the signals a "native bf16
matmul" rule could read.
Needs the converted verifier (scripts/setup_envs.sh -> models/smollm2-135m-instruct).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tools.gguf_convert import SMOLLM2_DIR


def cpu_signals() -> dict[str, object]:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        pass
    return {
        "cpuinfo avx512_bf16": "avx512_bf16" in flags, "cpuinfo amx_bf16": "amx_bf16" in flags,
        "torch.backends.cpu.get_cpu_capability()": torch.backends.cpu.get_cpu_capability(),
        "torch.ops.mkldnn._is_mkldnn_bf16_supported()": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        "load average": os.getloadavg(),
    }


def batch(tokens: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, T] ids and mask: ``tokens`` slots in all; row r has (r % 4) * T // 16 right-padding slots."""
    width = tokens // rows
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 49000, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    for r in range(rows):
        if r % 4:
            mask[r, width - (r % 4) * width // 16:] = 0
    return ids, mask


@torch.inference_mode()
def forward_s(decoder: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    t = time.perf_counter()
    decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - t


def main() -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048, help="padded token slots per batch")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeat", type=int, default=2)
    ns = ap.parse_args()
    for k, v in cpu_signals().items():
        print(f"{k}: {v}")
    models = {d: AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=getattr(torch, d)).eval().model
              for d in ns.dtypes}
    for threads in ns.threads:
        torch.set_num_threads(threads)
        for rows in ns.rows:
            ids, mask = batch(ns.tokens, rows)
            real = int(mask.sum())
            best = {}
            for d in ns.dtypes:
                forward_s(models[d], ids, mask)  # warm-up: oneDNN primitive creation, allocator
            times: dict[str, list[float]] = {d: [] for d in ns.dtypes}
            for _ in range(ns.repeat):
                for d in ns.dtypes:
                    times[d].append(forward_s(models[d], ids, mask))
            for d in ns.dtypes:
                best[d] = min(times[d])
                print(f"threads {threads} rows {rows} x {ids.shape[1]} ({ids.numel()} slots, {real} real tokens) "
                      f"{d:9s}: {min(times[d]):6.2f} s best of {[round(t, 2) for t in times[d]]}  "
                      f"{ids.numel() / best[d]:7.0f} slot tok/s  {real / best[d]:7.0f} real tok/s")
            if "float32" in best and "bfloat16" in best:
                print(f"  ratio bf16/float32 throughput: {best['float32'] / best['bfloat16']:.2f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
