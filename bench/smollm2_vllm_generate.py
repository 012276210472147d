"""Greedy generation with SmolLM2 in vLLM on CPU, as the regeneration stage would run it (sizing, not a target).

    .venv-vllm/bin/python bench/smollm2_vllm_generate.py [--cases 16x128 64x256] [--repetition-penalty 1.0] [--bare]

Each case NxM generates greedy answers to the first N bundled training prompts (first user turn, chat template)
with max_tokens M, in one engine. Printed per case: wall time, output tok/s, mean generated length, how many answers
hit max_tokens, how many of those end in an exact token loop (the last 128 tokens repeat with a period < 64), and
the mean length of the original answers. The KV cache is sized as regeneration sizes it (the largest case's rows
at max_model_len; VLLM_CPU_KVCACHE_SPACE, when set, wins). The engine runs in the pipeline's CPU environment
(eagle3.engine.settings.cpu_engine_env: every core computes); ``--bare`` leaves vLLM's own thread rules (one core
kept for its scheduler process). Needs models/smollm2-135m-instruct (scripts/setup_envs.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the vLLM environment does not install this checkout
TRAIN = REPO / "data" / "stdlib-chat" / "train.openai.jsonl"
LOOP_TAIL_TOKENS = 128
MAX_MODEL_LEN = 2048  # tokens


def loops(ids: list[int], tail: int = LOOP_TAIL_TOKENS) -> bool:
    """The last ``tail`` tokens are one period (< tail / 2 tokens) repeated: greedy decoding stuck in a loop."""
    t = ids[-tail:]
    return len(t) == tail and any(t[:-p] == t[p:] for p in range(1, tail // 2))


def main() -> None:
    from eagle3.chat.encoder import ChatSettings
    from eagle3.engine.settings import (
        CPU_KV_CACHE_ENV,
        cpu_engine_env,
        kv_cache_bytes_per_token,
        sized_cpu_kv_cache_env,
    )
    from eagle3.support.dtypes import dtype
    from eagle3.support.verifier import VerifierSpec
    from eagle3.validate.vllm_check import load_tokenizer
    from tools.gguf_convert import SMOLLM2_DIR

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["16x128", "16x256", "64x128", "64x256"],
                    help="NxM: N prompts, max_tokens M")
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--bare", action="store_true", help="vLLM's own thread rules, not the pipeline's")
    ns = ap.parse_args()
    cases = [tuple(map(int, c.split("x"))) for c in ns.cases]
    n_max = max(n for n, _ in cases)
    # the KV cache as regeneration sizes it (its whole batch at MAX_MODEL_LEN; VLLM_CPU_KVCACHE_SPACE set wins)
    os.environ.update(sized_cpu_kv_cache_env(n_max * MAX_MODEL_LEN, kv_cache_bytes_per_token(
        VerifierSpec.from_path(SMOLLM2_DIR).text_config, dtype("float32").bytes)))
    print(f"{CPU_KV_CACHE_ENV}={os.environ[CPU_KV_CACHE_ENV]} GiB", flush=True)
    if not ns.bare:  # the pipeline's CPU engine environment (eagle3.engine.job.run_engine_job): every core computes
        os.environ.update(cpu_engine_env())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = load_tokenizer(SMOLLM2_DIR)
    prompts = ChatSettings(tokenizer_path=str(SMOLLM2_DIR)).held_out_prompt_ids(TRAIN, n_max)
    with TRAIN.open() as f:
        original = [len(tok(next(m["content"] for m in json.loads(line)["messages"] if m["role"] == "assistant"))
                        ["input_ids"]) for line, _ in zip(f, range(n_max))]
    print(f"load {os.getloadavg()}", flush=True)
    t = time.monotonic()
    llm = LLM(model=str(SMOLLM2_DIR), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN, seed=0,
              distributed_executor_backend="uni")
    print(f"engine start {time.monotonic() - t:.1f} s, load {os.getloadavg()}", flush=True)
    for n, max_tokens in cases:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, repetition_penalty=ns.repetition_penalty)
        t = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:n]], params, use_tqdm=False)
        s = time.monotonic() - t
        ids = [list(o.outputs[0].token_ids) for o in outs]
        capped = [i for i, o in zip(ids, outs) if o.outputs[0].finish_reason == "length"]
        total = sum(map(len, ids))
        print(f"{n} prompts x max_tokens {max_tokens}: {s:.1f} s, {total / s:.1f} out tok/s, mean length "
              f"{total / n:.1f}, hit max_tokens {len(capped)}/{n} ({sum(map(loops, capped))} in a loop); original "
              f"answers {sum(original[:n]) / n:.1f} tokens; load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":  # vLLM spawns worker processes: keep the entry point guarded
    main()
