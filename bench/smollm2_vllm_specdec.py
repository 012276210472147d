"""EAGLE-3 in vLLM on CPU with SmolLM2: decode tok/s with vs without a draft, side by side in one run.

    .venv/bin/python bench/smollm2_vllm_specdec.py [--draft DIR] [--prompts 16] [--max-tokens 64] [--k 3]
                                                   [--repeats 3] [--iomp]

Without ``--draft`` an UNTRAINED draft is built with the project's own code (DraftConfig.build with vLLM's default
aux layers, Eagle3Draft.from_verifier, save_draft; d2t/t2d from the assistant-token counts of the bundled train
data, draft vocab 8192): its acceptance is ~0, so the ratio shows the machinery's cost per verifier step (the
break-even acceptance length is about 1 / ratio). Both engines (verifier alone, verifier + draft) stay alive in one
vLLM process and generate the same greedy prompts in alternating order; a first round warms up and is not counted.
Printed per repeat: tok/s of each, the ratio, the draft's mean acceptance length (vLLM's pooled convention); then
whether the outputs are identical. ``--iomp`` preloads the vLLM environment's libiomp5 (vLLM warns that speculative
decoding on CPU is slow without it). Needs models/smollm2-135m-instruct (scripts/setup_envs.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "data" / "stdlib-chat" / "eval.openai.jsonl"
TRAIN = REPO / "data" / "stdlib-chat" / "train.openai.jsonl"
DRAFT_VOCAB = 8192


def build_untrained_draft(out: Path) -> Path:
    """Pipeline side (.venv): the draft before training, from the verifier and assistant-token counts."""
    import torch
    from transformers import AutoTokenizer

    from eagle3.draft.checkpoint import save_draft
    from eagle3.draft.config import DraftConfig
    from eagle3.draft.model import Eagle3Draft
    from eagle3.support.verifier import VerifierSpec
    from eagle3.vocab import build_vocab_mapping
    from tools.gguf_convert import SMOLLM2_DIR

    spec = VerifierSpec.from_path(SMOLLM2_DIR)
    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    counts = torch.zeros(spec.vocab_size, dtype=torch.int64)  # [target_vocab]
    with TRAIN.open() as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                if m["role"] == "assistant":
                    ids = torch.tensor(tok(m["content"])["input_ids"])
                    counts += torch.bincount(ids, minlength=spec.vocab_size)
    d2t, t2d, _ = build_vocab_mapping(counts, DRAFT_VOCAB)
    cfg = DraftConfig.build(spec, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=spec.resolve_aux_layer_ids(None))
    draft = Eagle3Draft.from_verifier(cfg, SMOLLM2_DIR, d2t, t2d, seed=0)
    return save_draft(out, cfg, draft.state_dict(), {"verifier": str(SMOLLM2_DIR), "untrained": True})


def vllm_side(ns: argparse.Namespace) -> None:
    """vLLM side (.venv-vllm): two engines, alternating greedy generation, ratios printed."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3.chat.encoder import ChatSettings
    from eagle3.validate.vllm_check import acceptance_from_metrics
    from tools.gguf_convert import SMOLLM2_DIR

    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in ChatSettings(tokenizer_path=str(SMOLLM2_DIR)).held_out_prompt_ids(PROMPTS, ns.prompts)]
    common = {"model": str(SMOLLM2_DIR), "dtype": "float32", "enforce_eager": True, "max_model_len": 2048,
              "seed": 0, "distributed_executor_backend": "uni", "disable_log_stats": False}
    spec = {"method": "eagle3", "model": ns.draft, "num_speculative_tokens": ns.k}
    print(f"LD_PRELOAD={os.environ.get('LD_PRELOAD')} load {os.getloadavg()}", flush=True)
    engines = {}
    # the baseline first: a later LLM in the same process re-registers vLLM's metrics, and only the last engine's
    # spec-decode counters stay readable
    for name, extra in (("baseline", {}), ("eagle3", {"speculative_config": spec})):
        t = time.monotonic()
        engines[name] = LLM(**common, **extra)
        print(f"{name} engine start {time.monotonic() - t:.1f} s", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)  # same length for both
    rates: dict[str, list[float]] = {n: [] for n in engines}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(ns.repeats + 1):  # round 0 warms up
        for name in ("eagle3", "baseline") if rep % 2 else ("baseline", "eagle3"):
            llm = engines[name]
            before = acceptance_from_metrics(llm.get_metrics(), ns.k)
            t = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=False)
            s = time.monotonic() - t
            after = acceptance_from_metrics(llm.get_metrics(), ns.k)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
            n = sum(map(len, tokens[name]))
            drafts = after.num_drafts - before.num_drafts
            al = f" AL {1 + (after.num_accepted_tokens - before.num_accepted_tokens) / drafts:.3f}" if drafts else ""
            print(f"round {rep} {name:8s}: {n} tokens in {s:.2f} s = {n / s:.1f} tok/s{al} "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            if rep:
                rates[name].append(n / s)
    ratios = [a / b for a, b in zip(rates["eagle3"], rates["baseline"])]
    print(f"speedup (eagle3 / baseline tok/s) per repeat {[round(r, 3) for r in ratios]}, "
          f"mean {sum(ratios) / len(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    print(f"lossless (identical token ids): {tokens['eagle3'] == tokens['baseline']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", help="draft checkpoint folder (default: build an untrained one)")
    ap.add_argument("--prompts", type=int, default=16, help="eval prompts generated per round")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (eos ignored)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up round")
    ap.add_argument("--iomp", action="store_true", help="LD_PRELOAD the vLLM environment's libiomp5.so")
    ap.add_argument("--vllm-side", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.vllm_side:
        return vllm_side(ns)
    from eagle3.support.paths import vllm_python, vllm_subprocess_env

    with tempfile.TemporaryDirectory(prefix="smollm2-draft-") as td:
        draft = ns.draft or str(build_untrained_draft(Path(td) / "draft"))
        python = vllm_python()
        env = vllm_subprocess_env()
        if ns.iomp:
            iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # <venv>/bin/python -> <venv>/lib
            env["LD_PRELOAD"] = str(iomp)
        cmd = [python, __file__, "--vllm-side", "--draft", draft, "--prompts", str(ns.prompts),
               "--max-tokens", str(ns.max_tokens), "--k", str(ns.k), "--repeats", str(ns.repeats)]
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
        lines = [ln for ln in done.stdout.splitlines() if not ln.startswith(("(", "INFO", "WARNING"))]
        print("\n".join(lines))
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            sys.exit(done.returncode)


if __name__ == "__main__":  # vLLM spawns worker processes: keep the entry point guarded
    main()
