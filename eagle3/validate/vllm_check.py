"""The real vLLM check: EAGLE-3 speculative decoding with a draft checkpoint, measured acceptance, losslessness.

Pipeline position: train -> checkpoint -> validate (eagle3.validate.stage) -> **this module, in the vLLM environment**.

Runs as an engine job in the vLLM interpreter (eagle3.validate.stage starts it through
``eagle3.engine.job.run_engine_job``, so its whole process group dies on timeout or cancellation):

    python -m eagle3.validate.vllm_check <work>/vllm_args.json

The job file names the verifier, the draft folders, the prompts' token ids, the settings and ``engine`` (the
pipeline's engine settings as ``vllm.LLM`` arguments); the result goes to
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

Decoding speed (``speed_repeats`` > 0): the engine with the trained draft (A) and the verifier alone (B) run in the
sessions of ``schedule`` ("AB", "ABA", "ABBA": one engine start per letter, one engine alive at a time, since
two live CPU engines slow each other), and each session times ``speed_repeats`` greedy decodes of the prompts at
every level of ``speed_concurrency`` (requests in flight, ``decode_at_concurrency``). Per level: speedup = median
output tok/s with the draft / median without; the first level (1: one request at a time) is the headline.

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

# the libraries this interpreter was started with: vLLM's CPU platform writes its own LD_PRELOAD advice (libgomp,
# tcmalloc) into os.environ at the first engine start, which only processes started later would load; the engine
# here runs in this process (engine_in_process), so that later value never applies to it
PRELOADED = os.environ.get("LD_PRELOAD", "")

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


def _engine(args: dict[str, Any], draft: str | None):
    """Start one engine: the verifier, with ``draft`` as its EAGLE-3 draft (or none). -> (llm, start seconds)."""
    from vllm import LLM

    k = int(args["num_speculative_tokens"])
    engine_args: dict[str, Any] = {
        "model": args["verifier"], "dtype": args["dtype"], "seed": int(args.get("seed", 0)), "disable_log_stats": False,
        **args["engine"],  # the pipeline's engine settings (eagle3.engine.settings.EngineSettings.llm_kwargs)
    }
    if args.get("max_model_len"):
        engine_args["max_model_len"] = int(args["max_model_len"])
    engine_args.update(args.get("engine_args_extra") or {})  # bench/vllm_cpu_speed.py's variants only
    if draft is not None:
        engine_args["speculative_config"] = {"method": "eagle3", "model": draft, "num_speculative_tokens": k,
                                             **(args.get("speculative_config_extra") or {})}
        if "attention_backend" in args["engine"]:  # the CPU MLA pin: vLLM never hands the verifier's backend to
            # the draft (it auto-selects, AMX_MLA on AMX CPUs); beside an MLA verifier on a CPU the draft is MLA too
            engine_args["speculative_config"].setdefault("attention_backend", args["engine"]["attention_backend"])
    _log(f"starting engine ({f'draft {draft}' if draft else 'no speculation'}); load {_load()}")
    t0 = time.monotonic()
    llm = LLM(**engine_args)
    start_s = time.monotonic() - t0
    # the engine core runs in this process unless VLLM_ENABLE_V1_MULTIPROCESSING asks for its own (then it was
    # started with vLLM's LD_PRELOAD)
    own = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
    _log(f"engine ready in {start_s:.1f} s; LD_PRELOAD {os.environ.get('LD_PRELOAD', '') if own else PRELOADED!r} "
         f"({'the engine core process' if own else 'this process, in which the engine core runs'})")
    return llm, start_s


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def speed_requests(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The requests timed at one concurrency level: the prompts, repeated in order up to twice the concurrency when
    there are fewer (so that ``concurrency`` requests stay in flight for most of the run)."""
    n = max(len(prompts), 2 * concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]


def decode_at_concurrency(llm, prompts: list[list[int]], params, concurrency: int, tag: str,
                          num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """Greedy-decode every prompt with at most ``concurrency`` requests in flight: a new request starts as soon as
    one finishes (what ``concurrency`` clients that each send their next request at once would see; 1 = one request
    at a time, the latency setting speculative decoding is for). Timed from the first request to the last token.

    -> {"concurrency", "requests", "output_tokens", "seconds", "output_tokens_per_second", "load_1min"} plus, with a
    draft (``num_speculative_tokens``), the mean acceptance length of these decodes."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it finishes
    before = acceptance_from_metrics(llm.get_metrics(), num_speculative_tokens) if num_speculative_tokens else None
    pending = list(enumerate(prompts))
    in_flight = tokens = 0
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i, p = pending.pop(0)
            engine.add_request(f"{tag}-c{concurrency}-{i}", TokensPrompt(prompt_token_ids=p), params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                tokens += len(out.outputs[0].token_ids)
    seconds = time.monotonic() - t0
    row: dict[str, Any] = {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens,
                           "seconds": seconds, "output_tokens_per_second": tokens / seconds,
                           "load_1min": os.getloadavg()[0]}
    if before is not None:
        row["mean_acceptance_length"] = _minus(acceptance_from_metrics(llm.get_metrics(), num_speculative_tokens),
                                               before).mean_acceptance_length
    return row


def _session(args: dict[str, Any], prompts: list[list[int]], draft: str | None, *, reference: bool,
             levels: list[int], tag: str) -> dict[str, Any]:
    """One engine's life: start it, ``measure``, free it. Only one engine is ever alive: two engines on the same CPU
    cores slow each other down (vLLM's CPU workers keep their OpenMP threads spinning)."""
    llm, start_s = _engine(args, draft)
    result = {"engine_start_seconds": start_s, **measure(llm, args, prompts, draft, reference=reference,
                                                             levels=levels, tag=tag)}
    _free(llm)
    return result


def measure(llm, args: dict[str, Any], prompts: list[list[int]], draft: str | None, *, reference: bool,
            levels: list[int], tag: str) -> dict[str, Any]:
    """On a live engine (``draft``: its EAGLE-3 draft, or None): with ``reference`` greedy-generate every prompt in
    one batch (the tokens the losslessness check compares, and with a draft its acceptance), else a short warm-up;
    then ``args["speed_repeats"]`` timed decodes at each concurrency of ``levels``. The regeneration driver calls it
    on its own engine for validation's baseline (eagle3.validate.baseline)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    k = int(args["num_speculative_tokens"])
    params = SamplingParams(temperature=0.0, max_tokens=int(args["max_new_tokens"]))
    result: dict[str, Any] = {"draft": draft}
    if reference:
        before = acceptance_from_metrics(llm.get_metrics(), k) if draft is not None else None
        t0 = time.monotonic()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        result["generate_seconds"] = time.monotonic() - t0
        result.update({
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "texts": [o.outputs[0].text for o in outputs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})
        if draft is not None:
            stats = _minus(acceptance_from_metrics(llm.get_metrics(), k), before)
            result["acceptance"] = stats.to_dict()
            _log(f"draft {draft}: mean acceptance length {stats.mean_acceptance_length:.3f}, per position "
                 f"{[round(r, 3) for r in stats.per_position_acceptance]}, {stats.num_drafts} drafts")
    elif levels:  # the reference pass warms a fresh engine up; a speed-only session warms up on one short request
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0.0, max_tokens=8),
                     use_tqdm=False)
    rounds = []
    for c in levels:
        for r in range(int(args.get("speed_repeats", 0))):
            row = decode_at_concurrency(llm, speed_requests(prompts, c), params, c, f"{tag}-r{r}",
                                        k if draft is not None else None)
            _log(f"{'with draft' if draft else 'no draft'}, concurrency {c}: {row['output_tokens']} tokens in "
                 f"{row['seconds']:.2f} s = {row['output_tokens_per_second']:.2f} tok/s (load {_load()})")
            rounds.append({**row, "session": tag})
    result["speed_rounds"] = rounds
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


def speed_summary(schedule: str, levels: list[int], draft_rounds: list[dict[str, Any]],
                  baseline_rounds: list[dict[str, Any]], engine_starts: int) -> dict[str, Any]:
    """Per concurrency level: output tok/s of every timed decode with the draft and without, and the speedup =
    median with / median without. The first level is the headline (its figures are repeated at the top level)."""
    out: dict[str, Any] = {"schedule": schedule, "engine_starts": engine_starts, "levels": []}
    for c in levels:
        at = [r for r in draft_rounds + baseline_rounds if r["concurrency"] == c]
        a = [r["output_tokens_per_second"] for r in draft_rounds if r["concurrency"] == c]
        b = [r["output_tokens_per_second"] for r in baseline_rounds if r["concurrency"] == c]
        loads = [r["load_1min"] for r in at]
        acc = [r["mean_acceptance_length"] for r in draft_rounds if r["concurrency"] == c
               and r.get("mean_acceptance_length") is not None]
        out["levels"].append({
            "concurrency": c, "requests": at[0]["requests"] if at else None,
            "draft_output_tokens_per_second": a, "baseline_output_tokens_per_second": b,
            "speedup": statistics.median(a) / statistics.median(b) if a and b else None,
            "load_1min": [min(loads), max(loads)] if loads else None,
            "mean_acceptance_length": statistics.median(acc) if acc else None})
    if out["levels"]:
        head = out["levels"][0]
        out.update({"concurrency": head["concurrency"], "speedup": head["speedup"],
                    "draft_output_tokens_per_second": head["draft_output_tokens_per_second"],
                    "baseline_output_tokens_per_second": head["baseline_output_tokens_per_second"]})
    return out


def run_check(args: dict[str, Any]) -> dict[str, Any]:
    """The trained draft (A) and the verifier alone (B) in the sessions of ``schedule`` (one engine alive at a
    time; the first A and the first B also generate the reference outputs; speed not measured: just A then B), then
    every other draft (acceptance only); compare token ids."""
    import vllm

    tokenizer = load_tokenizer(args["verifier"], bool(args["engine"].get("trust_remote_code", False)))  # decoding, stop ids
    prompts = [list(map(int, p)) for p in args["prompt_token_ids"]]  # rendered by the stage's chat encoder
    _log(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    speed = int(args.get("speed_repeats", 0)) > 0
    levels = [int(c) for c in args.get("speed_concurrency") or [1]] if speed else []
    schedule = str(args["schedule"])  # A / B sessions in order (ValidateConfig.engine_sessions)
    trained, others = args["drafts"][0], args["drafts"][1:]
    first: dict[str, dict[str, Any]] = {}
    rounds: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    if args.get("baseline"):  # the verifier alone ran in the regeneration's engine session (eagle3.validate.baseline)
        first["B"] = {**args["baseline"]["result"], "engine_start_seconds": 0.0,
                      "source": args["baseline"]["source"]}
        rounds["B"] = list(first["B"]["speed_rounds"])
    for i, who in enumerate(schedule):
        s = _session(args, prompts, trained if who == "A" else None, reference=who not in first, levels=levels,
                     tag=f"{who}{i}")
        first.setdefault(who, s)
        rounds[who] += s["speed_rounds"]
    drafts = [first["A"]] + [_session(args, prompts, d, reference=True, levels=[], tag=f"U{i}")
                             for i, d in enumerate(others)]
    baseline = first["B"]
    for d in drafts:
        mismatches = []
        for i, (a, b) in enumerate(zip(d["token_ids"], baseline["token_ids"])):
            j = first_difference(a, b)
            if j is not None:
                mismatches.append({"prompt": i, "first_difference_at_token": j,
                                   "speculative": tokenizer.decode(a[j:j + 8]), "baseline": tokenizer.decode(b[j:j + 8])})
        d["lossless"] = not mismatches and d["texts"] == baseline["texts"]
        d["mismatches"] = mismatches
    engine_starts = len(schedule) + len(others)
    return {
        "format": "eagle3-vllm-check/2",
        "vllm_version": vllm.__version__,
        "settings": {k: v for k, v in args.items() if k != "out"},
        "prompt_token_ids": prompts,
        "stop_token_ids": stop_token_ids(args["verifier"], tokenizer),
        "drafts": drafts,
        "baseline": baseline,
        "engine_starts": engine_starts,
        "baseline_source": baseline.get("source", "a verifier-alone engine of this check"),
        "speed": speed_summary(schedule, levels, rounds["A"], rounds["B"], engine_starts) if speed else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="EAGLE-3 draft check in vLLM (run by eagle3.validate.stage).")
    ap.add_argument("job", help="JSON job file: verifier, drafts, prompt_token_ids, settings, engine, out")
    ns = ap.parse_args(argv)
    args = json.loads(Path(ns.job).read_text())
    result = run_check(args)
    from eagle3.support.io import atomic_write_json  # stdlib only: safe in the vLLM interpreter

    out = atomic_write_json(args["out"], result)
    _log(f"result written to {out}")
    return 0


if __name__ == "__main__":  # vLLM spawns worker processes: keep the entry point guarded
    sys.exit(main())
