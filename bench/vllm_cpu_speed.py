"""Why vLLM's CPU build decodes slower with an EAGLE-3 draft: output tok/s with and without a draft per runtime setting.

    .venv/bin/python bench/vllm_cpu_speed.py [--draft DIR] [--variants default,iomp,...] [--concurrency 1,4]
                                             [--prompts 8] [--max-tokens 64] [--repeats 1] [--schedule ABBA] [--k 3]

For each runtime variant (the environment and engine placement vLLM runs with, VARIANTS below), one vLLM process runs
the validation's own measurement (eagle3.validate.vllm_check.run_check): the verifier with the draft (A) and alone
(B) in the sessions of ``--schedule`` (ABBA by default: one engine alive at a time, a linear load drift cancels),
each timing greedy decodes of the held-out prompts at every ``--concurrency`` (requests in flight; 1 = one request
at a time). Printed per variant and concurrency: tok/s with and without the draft, the ratio, the draft's mean
acceptance length, the machine's 1-minute load during the decodes.

Without ``--draft`` an UNTRAINED draft is built (bench/smollm2_vllm_specdec.py's builder): it is accepted almost never
(acceptance length ~1.0), so its ratio is the price of the draft machinery per verifier step, and a trained draft of
acceptance length L decodes about L x that ratio as fast as the verifier alone (one request at a time; break-even at
1 / ratio). Needs models/smollm2-135m-instruct (scripts/setup_envs.sh). Runs each variant in turn, never two engines
at once; run nothing else heavy meanwhile and quote the load printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle3.chat.encoder import ChatSettings
from eagle3.engine.settings import EngineSettings, cpu_engine_env
from eagle3.support.paths import vllm_python, vllm_subprocess_env
from eagle3.support.subproc import run_subprocess
from tools.gguf_convert import SMOLLM2_DIR

CPU_DEFAULTS = ("LD_PRELOAD", "OMP_NUM_THREADS", "KMP_BLOCKTIME", "KMP_AFFINITY", "KMP_TPAUSE")
PROMPTS = REPO / "data" / "stdlib-chat" / "eval.openai.jsonl"


def _preload(python: str, *names: str) -> str:
    """LD_PRELOAD value for the named libraries of the vLLM environment: iomp (Intel OpenMP, <venv>/lib/libiomp5.so),
    gomp (PyTorch's libgomp), tcmalloc (the system's libtcmalloc_minimal, when installed)."""
    venv = Path(python).parent.parent
    paths = {"iomp": venv / "lib" / "libiomp5.so",
             "gomp": next(venv.glob("lib/python3*/site-packages/torch/lib/libgomp.so*"), None),
             "tcmalloc": next((p for p in map(Path, ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                                      "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"]) if p.exists()),
                              None)}
    missing = [n for n in names if not paths[n] or not Path(paths[n]).exists()]
    if missing:
        raise SystemExit(f"not found for LD_PRELOAD: {', '.join(missing)}")
    return ":".join(str(paths[n]) for n in names)


# name -> (environment changes, run the engine core in this process?)
VARIANTS: dict[str, tuple[dict[str, str], bool]] = {
    "default": ({}, True),                                   # the validation before issue 17: nothing preloaded
    "mp": ({}, False),                                       # engine core in its own process: vLLM's preloads apply
    "omp1": ({"OMP_NUM_THREADS": "1"}, True),                # one OpenMP thread
    "iomp": ({"LD_PRELOAD": "iomp"}, True),                  # Intel OpenMP preloaded (vLLM's CPU docs)
    "gomp": ({"LD_PRELOAD": "gomp"}, True),                  # PyTorch's libgomp preloaded (what vLLM preloads)
    "tcmalloc+iomp": ({"LD_PRELOAD": "tcmalloc:iomp"}, True),
    "tcmalloc+gomp": ({"LD_PRELOAD": "tcmalloc:gomp"}, True),
    "iomp-omp1": ({"LD_PRELOAD": "iomp", "OMP_NUM_THREADS": "1"}, True),
    "nobind": ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, False),
    "unpadded-drafter": ({}, True),                          # + speculative_config disable_padded_drafter_batch
    "block-size-32": ({}, True),                             # + engine block_size 32 (the CPU default is 128)
    "recommended": ({}, True),                               # the pipeline's CPU defaults (run_engine_job's)
    # own process: vLLM keeps one core for its scheduler process (VLLM_CPU_NUM_OF_RESERVED_CPU); here none
    "mp-reserve0": ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, False),
}


# variants that change the engine rather than its environment: extra keys of the vLLM check's args
ENGINE_EXTRA: dict[str, dict] = {
    "unpadded-drafter": {"speculative_config_extra": {"disable_padded_drafter_batch": True}},
    "block-size-32": {"engine_args_extra": {"block_size": 32}},
}


def variant_env(name: str, python: str) -> dict[str, str]:
    changes, in_process = VARIANTS[name]
    base = vllm_subprocess_env()
    if name != "recommended":  # the bare environment: none of the pipeline's CPU defaults
        for k in CPU_DEFAULTS:
            base.pop(k, None)
    else:  # what eagle3.engine.job.run_engine_job adds on a CPU host (the user's own variables win)
        base.update(cpu_engine_env())
    env = {**base, "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    for k, v in changes.items():
        env[k] = _preload(python, *v.split(":")) if k == "LD_PRELOAD" else v
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", help="draft checkpoint folder (default: an untrained draft)")
    ap.add_argument("--variants", default="default,iomp,gomp,omp1,mp", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--concurrency", default="1,4", help="requests in flight, comma-separated")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (eval split)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request at most (stops at eos)")
    ap.add_argument("--repeats", type=int, default=1, help="timed decodes per concurrency per session")
    ap.add_argument("--schedule", default="ABBA", help="engine sessions, A = with the draft, B = without")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--out", help="write every variant's result JSON here")
    ns = ap.parse_args()
    python = vllm_python()
    prompts = ChatSettings(tokenizer_path=str(SMOLLM2_DIR)).held_out_prompt_ids(PROMPTS, ns.prompts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-speed-") as td:
        if ns.draft:
            draft = str(Path(ns.draft).resolve())
        else:
            sys.path.insert(0, str(REPO / "bench"))
            from smollm2_vllm_specdec import build_untrained_draft

            draft = str(build_untrained_draft(Path(td) / "draft"))
        print(f"draft {draft}; load at start {os.getloadavg()}", flush=True)
        results = {}
        for name in ns.variants.split(","):
            out = Path(td) / f"{name}.json"
            args = {"verifier": str(SMOLLM2_DIR), "drafts": [draft], "prompt_token_ids": prompts,
                    "num_prompts": ns.prompts, "max_new_tokens": ns.max_tokens, "num_speculative_tokens": ns.k,
                    "dtype": "float32", "max_model_len": 2048, "engine": EngineSettings().llm_kwargs(on_gpu=False),
                    "seed": 0, "speed_repeats": ns.repeats, "schedule": ns.schedule,
                    "speed_concurrency": [int(c) for c in ns.concurrency.split(",")], "out": str(out),
                    **ENGINE_EXTRA.get(name, {})}
            (Path(td) / f"{name}.args.json").write_text(json.dumps(args))
            t = time.monotonic()
            res = run_subprocess([python, "-m", "eagle3.validate.vllm_check",
                                  str(Path(td) / f"{name}.args.json")], env=variant_env(name, python), cwd=REPO,
                                 log_file=Path(td) / f"{name}.log", log_prefix=f"[{name}] ")
            if res.returncode or not out.is_file():
                print(f"{name}: FAILED (exit {res.returncode})\n" + res.stdout[-3000:], flush=True)
                continue
            result = json.loads(out.read_text())
            results[name] = result
            acc = result["drafts"][0]["acceptance"]["mean_acceptance_length"]
            for lv in result["speed"]["levels"]:
                a, b = lv["draft_output_tokens_per_second"], lv["baseline_output_tokens_per_second"]
                row = (f"{name:14s} c={lv['concurrency']:<3d} with draft {' '.join(f'{x:6.2f}' for x in a)} | "
                       f"without {' '.join(f'{x:6.2f}' for x in b)} tok/s | ratio {lv['speedup']:.3f} | AL {acc:.3f} "
                       f"| load {lv['load_1min'][0]:.1f}-{lv['load_1min'][1]:.1f}")
                rows.append(row)
                print(row, flush=True)
            print(f"{name}: {time.monotonic() - t:.0f} s, {result['engine_starts']} engine starts "
                  f"({', '.join(f'{s:.0f}' for s in [result['drafts'][0]['engine_start_seconds'], result['baseline']['engine_start_seconds']])} s)",
                  flush=True)
        if ns.out:
            Path(ns.out).write_text(json.dumps(results, indent=1))
    print("\n" + "\n".join(rows))
    print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":  # vLLM spawns worker processes: keep the entry point guarded
    main()
