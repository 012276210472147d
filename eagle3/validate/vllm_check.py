"""The real vLLM check: EAGLE-3 speculative decoding with a draft checkpoint, measured acceptance, losslessness.

Pipeline position: train -> checkpoint -> validate (eagle3.validate.stage) -> **this module, in the vLLM environment**.

Runs as a subprocess of the vLLM interpreter (``eagle3.support.paths.vllm_python()``; eagle3.validate.stage starts it through
eagle3.support.subproc so its whole process group dies on timeout or cancellation):

    python -m eagle3.validate.vllm_check --args-json <work>/vllm_args.json

The args file names the verifier, the draft folders, the prompts and the settings; the result goes to
``args["out"]`` (JSON, written to a temp name and renamed). For every draft, the verifier is loaded with
``speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": K}`` and greedy-generates on the
held-out prompts; ``llm.get_metrics()`` gives

    num_drafts            verification steps that carried draft tokens
    num_draft_tokens      draft tokens proposed (K per step)
    num_accepted_tokens   draft tokens the verifier accepted
    accepted_per_pos[i]   steps whose draft token i (0-based) was accepted

    mean acceptance length = 1 + num_accepted_tokens / num_drafts   (tokens per verifier step, the bonus included)
    acceptance rate at position i = accepted_per_pos[i] / num_drafts

Then the same verifier WITHOUT speculation generates on the same prompts: at temperature 0 speculative decoding is
lossless, so the token ids must be identical.

Imports: the standard library at module level (eagle3.validate.specdec and eagle3.validate.stage import the prompt helpers and
``AcceptanceStats`` from here); transformers and vLLM only inside the functions that run in the vLLM environment.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------- shared with the offline reference


@dataclass
class AcceptanceStats:
    """Speculative-decoding counters, as vLLM's spec-decode metrics define them."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [num_speculative_tokens]

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification step that carried ``num_draft_tokens`` drafts, of which the first ``num_accepted``
        were accepted (greedy chain: acceptance stops at the first mismatch)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verifier step: 1 (the verifier's own token) + accepted drafts per step."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of verification steps whose draft token at position i was accepted (i = 0 .. K-1)."""
        return [a / self.num_drafts if self.num_drafts else float("nan") for a in self.accepted_per_pos]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance": self.per_position_acceptance,
                "draft_acceptance_rate": self.draft_acceptance_rate}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AcceptanceStats:
        return cls(num_speculative_tokens=int(d["num_speculative_tokens"]), num_drafts=int(d["num_drafts"]),
                   num_draft_tokens=int(d["num_draft_tokens"]), num_accepted_tokens=int(d["num_accepted_tokens"]),
                   accepted_per_pos=[int(a) for a in d["accepted_per_pos"]])


def load_tokenizer(verifier_path: str | os.PathLike, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(verifier_path), trust_remote_code=trust_remote_code)


def stop_token_ids(verifier_path: str | os.PathLike, tokenizer) -> list[int]:
    """The ids generation stops at: generation_config.json's eos_token_id (int or list) + the tokenizer's eos."""
    ids: set[int] = set()
    gen = Path(verifier_path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------- vLLM side


def acceptance_from_metrics(metrics, num_speculative_tokens: int) -> AcceptanceStats:
    """Sum vLLM's spec-decode counters (over engines) from ``llm.get_metrics()``."""
    stats = AcceptanceStats(num_speculative_tokens)
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            stats.num_drafts += int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            stats.num_draft_tokens += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            stats.num_accepted_tokens += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            for i, v in enumerate(m.values[:num_speculative_tokens]):
                stats.accepted_per_pos[i] += int(v)
    return stats


def _minus(after: AcceptanceStats, before: AcceptanceStats) -> AcceptanceStats:
    return AcceptanceStats(
        after.num_speculative_tokens, after.num_drafts - before.num_drafts,
        after.num_draft_tokens - before.num_draft_tokens, after.num_accepted_tokens - before.num_accepted_tokens,
        [a - b for a, b in zip(after.accepted_per_pos, before.accepted_per_pos)])


def _log(msg: str) -> None:
    print(f"[vllm_check] {msg}", flush=True)


def _generate(args: dict[str, Any], prompts: list[list[int]], draft: str | None) -> dict[str, Any]:
    """Start one engine (with ``draft`` as the EAGLE-3 draft, or none), generate greedily, free the engine."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    k = int(args["num_speculative_tokens"])
    tp = int(args["tensor_parallel_size"])
    engine_args: dict[str, Any] = {
        "model": args["verifier"], "dtype": args["dtype"], "tensor_parallel_size": tp, "seed": int(args.get("seed", 0)),
        "enforce_eager": bool(args.get("enforce_eager", True)), "disable_log_stats": False,
        "trust_remote_code": bool(args.get("trust_remote_code", False)),
        # one worker in this process when there is one device: no extra interpreter to start (~10 s on CPU)
        "distributed_executor_backend": "uni" if tp == 1 else "mp",
    }
    if args.get("max_model_len"):
        engine_args["max_model_len"] = int(args["max_model_len"])
    if args.get("gpu_memory_utilization"):
        engine_args["gpu_memory_utilization"] = float(args["gpu_memory_utilization"])
    if draft is not None:
        engine_args["speculative_config"] = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    label = f"draft {draft}" if draft else "no speculation"
    _log(f"starting engine ({label})")
    t0 = time.monotonic()
    llm = LLM(**engine_args)
    start_s = time.monotonic() - t0
    _log(f"engine ready in {start_s:.1f} s")
    params = SamplingParams(temperature=0.0, max_tokens=int(args["max_new_tokens"]))
    before = acceptance_from_metrics(llm.get_metrics(), k)
    t0 = time.monotonic()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    gen_s = time.monotonic() - t0
    stats = _minus(acceptance_from_metrics(llm.get_metrics(), k), before)
    # decode speed: the same prompts again on the warm engine, ``speed_repeats`` times (output tokens / second)
    speed = []
    for _ in range(int(args.get("speed_repeats", 0))):
        t0 = time.monotonic()
        again = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        speed.append(sum(len(o.outputs[0].token_ids) for o in again) / (time.monotonic() - t0))
    result = {
        "draft": draft,
        "engine_start_seconds": start_s,
        "generate_seconds": gen_s,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "output_tokens_per_second": speed,
    }
    if draft is not None:
        result["acceptance"] = stats.to_dict()
        _log(f"{label}: mean acceptance length {stats.mean_acceptance_length:.3f}, per position "
             f"{[round(r, 3) for r in stats.per_position_acceptance]}, {stats.num_drafts} drafts")
    _free(llm)
    return result


def _free(llm) -> None:
    """Shut the engine down so the next one in this process gets the memory (and, on GPUs, the devices)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, engine, core
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:  # noqa: BLE001 - best effort; the process ends soon anyway
        _log(f"cleanup after engine: {e}")


def run_check(args: dict[str, Any]) -> dict[str, Any]:
    """Every draft in ``args["drafts"]`` with speculation, then the verifier alone; compare token ids."""
    import vllm

    tokenizer = load_tokenizer(args["verifier"], bool(args.get("trust_remote_code", False)))  # decoding, stop ids
    prompts = [list(map(int, p)) for p in args["prompt_token_ids"]]  # rendered by the stage's chat encoder
    _log(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens from "
         f"{args['prompts_path']}")
    drafts = [_generate(args, prompts, d) for d in args["drafts"]]
    baseline = _generate(args, prompts, None)
    base_speed = baseline["output_tokens_per_second"]
    for d in drafts:
        if d["output_tokens_per_second"] and base_speed:  # the decoding speedup: medians of the repeats
            d["speedup"] = statistics.median(d["output_tokens_per_second"]) / statistics.median(base_speed)
        mismatches = []
        for i, (a, b) in enumerate(zip(d["token_ids"], baseline["token_ids"])):
            j = first_difference(a, b)
            if j is not None:
                mismatches.append({"prompt": i, "first_difference_at_token": j,
                                   "speculative": tokenizer.decode(a[j:j + 8]), "baseline": tokenizer.decode(b[j:j + 8])})
        d["lossless"] = not mismatches and d["texts"] == baseline["texts"]
        d["mismatches"] = mismatches
    return {
        "format": "eagle3-vllm-check/1",
        "vllm_version": vllm.__version__,
        "settings": {k: v for k, v in args.items() if k != "out"},
        "prompt_token_ids": prompts,
        "stop_token_ids": stop_token_ids(args["verifier"], tokenizer),
        "drafts": drafts,
        "baseline": baseline,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="EAGLE-3 draft check in vLLM (run by eagle3.validate.stage).")
    ap.add_argument("--args-json", required=True, help="JSON file with verifier, drafts, prompts_path, settings, out")
    ns = ap.parse_args(argv)
    args = json.loads(Path(ns.args_json).read_text())
    result = run_check(args)
    from eagle3.support.io import atomic_write_json  # stdlib only: safe in the vLLM interpreter

    out = atomic_write_json(args["out"], result)
    _log(f"result written to {out}")
    return 0


if __name__ == "__main__":  # vLLM spawns worker processes: keep the entry point guarded
    sys.exit(main())
