"""vLLM-side driver of the regenerate stage: ``python -m eagle3.regenerate.vllm_worker <job.json>``.

Runs in the vLLM environment (imports vllm, transformers and eagle3 modules that need nothing else). Started by
``eagle3.regenerate.stage`` through the engine layer (``eagle3.engine.job.run_engine_job``): its own process group,
holding the host's GPU lock.

Job keys: verifier, work_file (jsonl of {"index", "answer", "messages"}: the conversations to do; answer = which of
the row's answers_per_conversation), journal (jsonl the driver
appends finished rows to), stats_file, chat (eagle3.chat.encoder.ChatSettings: the prepare stage's tokenizer and
template), dtype, max_model_len (tokens), engine (the engine settings' ``vllm.LLM`` arguments), temperature,
top_p, max_new_tokens, seed, reasoning ("keep" | "strip"), reasoning_start, reasoning_end, batch_rows, min_batch_rows, inject_oom_batches (test
hook: batch numbers whose first attempt raises an out-of-memory error), baseline (None, or validation's baseline
request and its output file: generated on this engine once the conversations are done, eagle3.validate.baseline).

Per batch of ``batch_rows`` conversations, turn by turn: round r renders every row's messages up to its r-th
assistant turn (system prompt and earlier REGENERATED turns included) with the chat template and a generation
prompt, generates all of them in one ``LLM.generate`` call, and puts the answers in place. When the batch is done
its rows are appended to the journal in one write + fsync, so a kill loses at most the batch in flight; rows that
cannot be regenerated (template error, prompt longer than max_model_len, empty answer) are journaled as dropped
with the reason. An out-of-memory error halves the batch and retries it with the engine still loaded
(``eagle3.engine.oom.HalvingBudget``); at the floor the driver exits with ``EXIT_OOM``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from eagle3.chat.errors import BadRow
from eagle3.regenerate.config import journal_key, request_seed
from eagle3.support.io import atomic_write_json

END_OF_TURN_RESERVE = 8  # tokens of max_model_len kept free after a regenerated answer (end of turn + newline)


class InjectedOOM(RuntimeError):
    """The test hook's stand-in for an allocator failure (its text is what vLLM's OOM errors say)."""


def strip_reasoning(text: str, start: str, end: str) -> str:
    """``text`` without its reasoning blocks (start .. end, an unclosed one to the end), stripped of whitespace."""
    out, pos = [], 0
    while True:
        a = text.find(start, pos)
        if a < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:a])
        b = text.find(end, a + len(start))
        if b < 0:
            break
        pos = b + len(end)
    return "".join(out).strip()


def _assistant_turns(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def regenerate_batch(llm, encoder, rows: list[dict], job: dict, stats: dict) -> list[dict]:
    """Regenerate every assistant turn of ``rows`` ({"index", "answer", "messages"}), turn by turn. Returns journal
    lines.

    ``stats["tokens_generated"]`` grows only when the whole batch is done: a batch that runs out of memory at a later
    turn is redone, and the tokens of its discarded turns are not kept. ``stats["generate_seconds"]`` is all the time
    spent in ``generate``, the discarded attempts' included.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    state = {journal_key(r): {"messages": [dict(m) for m in r["messages"]], "turns": _assistant_turns(r["messages"]),
                              "done": 0, "tokens": 0, "cut": 0, "dropped": None} for r in rows}
    for s in state.values():  # trailing user turns after the last answer have nothing to regenerate
        s["messages"] = s["messages"][: s["turns"][-1] + 1] if s["turns"] else s["messages"]
    for _ in range(max((len(s["turns"]) for s in state.values()), default=0)):
        prompts, params, who = [], [], []
        for key, s in state.items():
            if s["dropped"] or s["done"] >= len(s["turns"]):
                continue
            at = s["turns"][s["done"]]
            try:  # rendered by the one chat encoder, with the prepare stage's tokenizer and template
                (ids,) = encoder.prompt_ids([s["messages"][:at]])
            except BadRow as e:  # a template that raises on this row: the row is dropped, named
                s["dropped"] = {"reason": "template_error", "detail": str(e)[:300]}
                continue
            # the answer may take what is left of max_model_len, less what the template writes after it (the
            # end-of-turn token and its newline): a conversation that fills the context must still fit it
            room = int(job["max_model_len"]) - len(ids) - END_OF_TURN_RESERVE
            if room < 1:
                s["dropped"] = {"reason": "prompt_too_long", "detail": f"turn {s['done']}: prompt of {len(ids)} "
                                f"tokens, max_model_len {job['max_model_len']}"}
                continue
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(SamplingParams(temperature=float(job["temperature"]), top_p=float(job["top_p"]),
                                         max_tokens=min(int(job["max_new_tokens"]), room),
                                         seed=request_seed(int(job["seed"]), index=key[0], turn=s["done"],
                                                           answer=key[1])))
            who.append(key)
        if not prompts:
            break
        t0 = time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats["generate_seconds"] += time.monotonic() - t0
        for key, out in zip(who, outputs):
            s, o = state[key], out.outputs[0]
            text = o.text
            if job["reasoning"] == "strip":
                text = strip_reasoning(text, job["reasoning_start"], job["reasoning_end"])
            s["tokens"] += len(o.token_ids)
            if not text.strip():
                s["dropped"] = {"reason": "empty_response", "detail": f"turn {s['done']}: the verifier's answer is "
                                f"empty{' after stripping its reasoning' if job['reasoning'] == 'strip' else ''}"}
                continue
            if o.finish_reason == "length":
                s["cut"] += 1
            s["messages"][s["turns"][s["done"]]] = {"role": "assistant", "content": text}
            s["done"] += 1
    lines = []
    for (index, answer), s in state.items():
        if s["dropped"] or not s["turns"]:
            lines.append({"index": index, "answer": answer,
                          "dropped": (s["dropped"] or {"reason": "no_assistant_turn"})["reason"],
                          "detail": (s["dropped"] or {}).get("detail", "")})
        else:
            lines.append({"index": index, "answer": answer, "messages": s["messages"], "turns": len(s["turns"]),
                          "tokens": s["tokens"], "cut_turns": s["cut"]})
    stats["tokens_generated"] += sum(s["tokens"] for s in state.values())
    return lines


def append_journal(path: Path, lines: list[dict]) -> None:
    """One write + fsync per batch: a kill leaves whole batches (and at worst one torn last line, ignored)."""
    data = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a line torn by a kill: the next batch starts on a line of its own
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def main(job_path: str) -> int:
    from vllm import LLM

    from eagle3.chat.encoder import ChatSettings
    from eagle3.engine.exits import EXIT_OOM
    from eagle3.engine.oom import HalvingBudget
    from eagle3.support.gpu import is_oom_text

    job = json.loads(Path(job_path).read_text())
    rows = [json.loads(line) for line in Path(job["work_file"]).read_text().splitlines() if line.strip()]
    journal = Path(job["journal"])
    stats = {"rows": len(rows), "tokens_generated": 0, "generate_seconds": 0.0, "oom_halvings": 0,
             "batch_rows": int(job["batch_rows"])}
    encoder = ChatSettings.model_validate(job["chat"]).encoder()
    t0 = time.monotonic()
    llm = LLM(model=job["verifier"], dtype=job["dtype"], max_model_len=int(job["max_model_len"]),
              seed=int(job["seed"]), disable_log_stats=True, **job["engine"])
    stats["engine_start_seconds"] = time.monotonic() - t0
    print(f"[regenerate] engine ready in {stats['engine_start_seconds']:.1f} s; {len(rows)} conversations to do",
          flush=True)
    inject = set(job.get("inject_oom_batches") or [])
    budget = HalvingBudget(int(job["batch_rows"]), min(int(job["min_batch_rows"]), int(job["batch_rows"])), "rows")
    done, batch_no = 0, 0
    while done < len(rows):
        batch = rows[done:done + budget.value]
        try:
            if batch_no in inject:
                inject.discard(batch_no)
                raise InjectedOOM("CUDA out of memory (injected by the test hook inject_oom_batches)")
            lines = regenerate_batch(llm, encoder, batch, job, stats)
        except Exception as e:  # only OOM is handled here; anything else ends the driver with its traceback
            if not is_oom_text(f"{type(e).__name__}: {e}"):
                raise
            if not budget.halve():
                print(f"[regenerate] out of memory at the batch floor ({budget.value} rows, min_batch_rows): {e}",
                      file=sys.stderr, flush=True)
                return EXIT_OOM
            stats["oom_halvings"] += 1
            print(f"[regenerate] out of memory on a batch of {len(batch)} rows ({e}); batch halved "
                  f"{budget.describe_halving()}, retrying with the engine still loaded", flush=True)
            continue
        append_journal(journal, lines)
        done += len(batch)
        batch_no += 1
        print(f"[regenerate] batch {batch_no}: {done}/{len(rows)} conversations, {stats['tokens_generated']:,} "
              f"tokens generated in {stats['generate_seconds']:.0f} s", flush=True)
    stats["batch_rows_final"] = budget.value
    if job.get("baseline"):
        stats["baseline_seconds"] = validation_baseline(llm, job["baseline"])
    atomic_write_json(job["stats_file"], stats)
    return 0


def validation_baseline(llm, baseline: dict) -> float:
    """Validation's verifier-alone baseline on this engine (eagle3.validate.baseline): greedy outputs of the
    held-out prompts and their timed decodes, written to ``baseline["out"]``; returns the seconds it took."""
    import vllm

    from eagle3.validate.vllm_check import measure

    t0 = time.monotonic()
    req = baseline["request"]
    print(f"[regenerate] validation's verifier-alone baseline: {len(req['prompt_token_ids'])} held-out prompts, "
          f"{req['max_new_tokens']} new tokens, speed at concurrency {req['speed_levels'] or 'not measured'}",
          flush=True)
    args = {"num_speculative_tokens": 1, "max_new_tokens": req["max_new_tokens"], "speed_repeats": req["speed_repeats"]}
    result = measure(llm, args, req["prompt_token_ids"], None, reference=True, levels=req["speed_levels"],
                     tag="B-regenerate")
    Path(baseline["out"]).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(baseline["out"], {"request": req, "result": result, "vllm_version": vllm.__version__,
                                        "source": "the regeneration's engine session"})
    return time.monotonic() - t0


if __name__ == "__main__":  # vLLM spawns worker processes: keep the entry point guarded
    sys.exit(main(sys.argv[1]))
