"""The regenerate stage: the verifier writes every assistant turn of the training conversations itself (on-policy
data), so the draft learns the distribution it will be asked to predict at serving time.

Pipeline position: prepare (the original data: which rows, in which order) -> capacity -> **regenerate** ->
prepare (the regenerated conversations) -> extract -> ...

The conversations are exactly the rows the prepare stage kept (its ``source_index`` column), read again from the
sources and normalised the same way. Every assistant turn is regenerated through vLLM
(eagle3/regenerate/vllm_worker.py, in the vLLM interpreter, inside the device guard), turn by turn (a later turn
sees the regenerated earlier ones; system prompts kept). Finished rows land in ``journal.jsonl`` batch by batch;
a rerun continues from it, so a kill -9 loses at most the batch in flight and every (row, answer) ends up exactly
once.
The output is ``conversations.jsonl`` (OpenAI messages, the prepared order) for the prepare stage to read. With
``answers_per_conversation`` N > 1 (sampled, temperature > 0) every kept row is regenerated N times, each answer
its own conversation (its own seed), the N side by side: more training data from the same prompts.

Verifier loads (the capacity plan counts them: eagle3.capacity.verifier_loads). This stage's engine session also
generates validation's verifier-alone baseline when the engines match (eagle3.validate.baseline), so validation
starts only the engine with the draft: the kimi-k2.5 preset loads the verifier 3 times per run (regeneration,
extraction, validation), not 4. Why not 2, i.e. why regeneration does not share extraction's engine session:
extraction's engine is started with vLLM's ``extract_hidden_states`` speculative method, our KV connector and prefix
caching off; vLLM fixes all three at engine start. Generating in that engine would run its proposer on every
decode step (two tokens verified per step, each step's aux + final states cached per token: (n_aux + 1) x hidden
values, for Kimi-K2.5 4 x 7168 bf16 = 57 KB a token beside MLA's ~70 KB of KV cache, so far fewer sequences in
flight) and lose prefix caching between the turns of a conversation; and what extraction reads is the regenerated
conversations after the prepare stage (rendered, masked, filtered, in the pipeline environment). One session for
both would cost generation throughput on every run to save one load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from eagle3.chat.dataset import load_prepared
from eagle3.chat.errors import BadRow
from eagle3.chat.sources import iter_rows, normalize_row
from eagle3.engine.job import on_gpu, run_engine_job
from eagle3.engine.settings import (
    CPU_KV_CACHE_ENV,
    CPU_KV_CACHE_MAX_SHARE,
    kv_cache_bytes_per_token,
    sized_cpu_kv_cache_env,
)
from eagle3.prepare import PrepareConfig, PreparedData
from eagle3.regenerate.config import RegenerateConfig, journal_key
from eagle3.support.artifacts import Artifact, file_problem
from eagle3.support.dtypes import describe_compute_dtype
from eagle3.support.dtypes import dtype as dtype_info
from eagle3.support.gpu import DeviceGuard, OutOfMemoryAfterRetries, cuda_device_ids, file_lock_guard
from eagle3.support.io import atomic_write_json, atomic_write_text, sha256_file
from eagle3.support.paths import resolve_path
from eagle3.support.progress import Progress
from eagle3.support.verifier import VerifierIdentity
from eagle3.validate.baseline import BASELINES, baseline_path, request_for_validation, reuse_problem
from eagle3.validate.config import ValidateConfig

log = logging.getLogger("eagle3")

JOURNAL = "journal.jsonl"
CONVERSATIONS = "conversations.jsonl"
STATS = "stats.json"
VLLM_LOG = "vllm.log"  # everything vLLM printed (the logs carry its errors and the driver's own lines)
_FIRST_NAMED = 20  # dropped rows named per reason in the stats


class RegenerateError(RuntimeError):
    """The vLLM generation driver failed; the message carries its last output lines."""


class RegeneratedData(Artifact):
    """The regenerate stage's output: the conversations with the verifier's own answers, and what it took."""

    stage: ClassVar[str] = "regenerate"

    conversations_path: str = Field(description="conversations.jsonl: OpenAI-format rows, the prepared order.")
    vllm_log: str | None = Field(description="vLLM's whole output of the last invocation that generated.")
    stats_path: str = Field(description="stats.json: the counts below plus the dropped rows by name.")
    rows_in: int = Field(description="Conversations to write: the rows the prepare stage kept x "
                         "answers_per_conversation.")
    rows_written: int = Field(description="Conversations written with every assistant turn regenerated.")
    rows_dropped: int = Field(description="Conversations dropped (template error, prompt too long, empty answer).")
    rows_dropped_by_reason: dict[str, int] = Field(description="rows_dropped by reason.")
    turns_generated: int = Field(description="Assistant turns regenerated.")
    turns_cut: int = Field(description="Turns cut at max_new_tokens (kept).")
    tokens_generated: int = Field(description="Tokens the verifier generated, all turns of all written rows.")
    tokens_per_second: float = Field(description="Generated tokens / generation wall time of the last invocation "
                                     "(engine start excluded; 0 when nothing was left to do).")
    engine_start_seconds: float = Field(description="vLLM engine start (the verifier load) of the last invocation.")
    generate_seconds: float = Field(description="Generation wall time of the last invocation, seconds.")
    rows_resumed: int = Field(description="Conversations (row, answer) already in the journal from an interrupted "
                              "run (not redone).")
    sampling: dict[str, Any] = Field(description="temperature, top_p, max_new_tokens (tokens), seed, "
                                     "answers_per_conversation, reasoning, dtype.")
    baselines_dir: str | None = Field(None, description="Validation's verifier-alone baselines this stage's engine "
                                      "sessions generated (eagle3.validate.baseline), by request key.")

    def outputs(self) -> list[str]:
        return [self.conversations_path, self.stats_path]

    def problems(self) -> list[str]:
        """Reuse check: conversations.jsonl's sha256 is the fingerprint (text: ~4 KB per conversation)."""
        return super().problems() or [p for p in [file_problem(self.conversations_path, sha256=self.fingerprint)]
                                      if p]


def _baseline_job(cfg: RegenerateConfig, validation: ValidateConfig | None, prepare_cfg: PrepareConfig, dtype: str,
                  out_dir: Path, verifier_path: str) -> dict[str, Any] | None:
    """The driver's baseline job for validation (request + output file), or None with the reason logged."""
    if validation is None:
        return None
    prompts = prepare_cfg.chat_settings().held_out_prompt_ids(resolve_path(validation.prompts_path),
                                                              validation.num_prompts)
    request = request_for_validation(validation, prompts, verifier_path)
    problem = reuse_problem(validation, cfg.enabled, dtype, cfg.engine, cfg.max_model_len, request)
    if problem:
        log.info("[regenerate] validation will start its own verifier-alone engine: %s", problem)
        return None
    log.info("[regenerate] this engine session also generates validation's verifier-alone baseline (%d held-out "
             "prompts, %d new tokens): one verifier load less later", len(prompts), request.max_new_tokens)
    return {"request": request.model_dump(), "out": str(baseline_path(out_dir / BASELINES, request))}


def read_journal(path: Path) -> dict[tuple[int, int], dict]:
    """(source row index, answer) -> the latest journal line of that answer; a torn last line (a kill inside the
    write) is ignored. Lines without an answer (journals written before answers_per_conversation) are answer 0."""
    out: dict[tuple[int, int], dict] = {}
    if not path.is_file():
        return out
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            out[journal_key(entry)] = entry
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return out


def selected_conversations(prepared: PreparedData, prepare_cfg: PrepareConfig) -> list[dict]:
    """The conversations the prepare stage kept, in its order, as {"index", "messages"} (index = source row)."""
    order = load_prepared(prepared.dataset_path, ("source_index",)).select_columns(["source_index"])
    wanted = [int(i) for i in order["source_index"]]
    position = {index: k for k, index in enumerate(wanted)}
    found: list[dict | None] = [None] * len(wanted)
    count = 0
    for index, row in iter_rows(prepare_cfg.sources, prepare_cfg.hf_split):
        k = position.get(index)
        if k is None:
            continue
        if isinstance(row, BadRow):
            raise RegenerateError(f"source row {index} was kept by the prepare stage but no longer reads: {row}")
        found[k] = {"index": index, "messages": normalize_row(row, prepare_cfg.format)}
        count += 1
        if count == len(wanted):  # every kept row read: the rest of the sources is not needed
            break
    missing = [wanted[k] for k, f in enumerate(found) if f is None]
    if missing:
        raise RegenerateError(f"source rows {missing[:10]} of {prepared.dataset_path} are not in the sources "
                              f"{prepare_cfg.sources} any more: rerun the prepare stage")
    return found  # type: ignore[return-value]


def regenerate(cfg: RegenerateConfig, prepared: PreparedData, prepare_cfg: PrepareConfig,
               verifier: VerifierIdentity, out_dir: str | Path, *, guard: DeviceGuard | None = None,
               on_progress: Callable[[int, int, str], None] | None = None,
               inject_oom_batches: list[int] | None = None,
               validation: ValidateConfig | None = None) -> RegeneratedData:
    """Regenerate the assistant turns of the rows ``prepared`` kept (read from ``prepare_cfg.sources``) into
    ``out_dir``; resumes from the journal. ``guard`` holds the devices while vLLM runs (default: the host file
    lock alone); ``inject_oom_batches`` is a test hook (see vllm_worker). ``validation``: the run's validation
    settings, for whose verifier-alone baseline the same engine session also generates when the engines match
    (eagle3.validate.baseline; never part of what is regenerated)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    journal = out_dir / JOURNAL
    rows = [{**r, "answer": j} for r in selected_conversations(prepared, prepare_cfg)
            for j in range(cfg.answers_per_conversation)]  # a conversation's answers side by side
    spec = verifier.spec()
    dtype = describe_compute_dtype(cfg.dtype, spec.dtype, "auto")
    stats: dict[str, Any] = {"engine_start_seconds": 0.0, "generate_seconds": 0.0, "tokens_generated": 0}
    on_disk = read_journal(journal)  # read once: the check below looks up every row
    resumed = sum(journal_key(r) in on_disk for r in rows)
    if resumed < len(rows):
        # decide what is left UNDER the guard: a run that waited for it must see what the previous holder wrote
        with (guard or file_lock_guard(logger=log))(cuda_device_ids(count=cfg.engine.tensor_parallel_size)) as fds:
            done = read_journal(journal)
            todo = [r for r in rows if journal_key(r) not in done]
            resumed = len(rows) - len(todo)
            log.info("[regenerate] %d conversations (%d already in %s)%s; temperature %s, top_p %s, "
                     "max_new_tokens %d, batches of %d rows, dtype %s", len(rows), resumed, journal,
                     f" = {len(rows) // cfg.answers_per_conversation} x {cfg.answers_per_conversation} answers"
                     if cfg.answers_per_conversation > 1 else "", cfg.temperature, cfg.top_p, cfg.max_new_tokens,
                     cfg.batch_rows, dtype)
            if todo:
                baseline = _baseline_job(cfg, validation, prepare_cfg, dtype, out_dir, verifier.path)
                stats.update(_run_driver(cfg, todo, len(rows), prepare_cfg, verifier, dtype, out_dir, fds,
                                         on_progress, inject_oom_batches, baseline))
    return _finish(cfg, rows, read_journal(journal), resumed, stats, out_dir, dtype)


def _kv_cache_env(cfg: RegenerateConfig, verifier: VerifierIdentity, dtype: str) -> dict[str, str]:
    """On a CPU host, a KV cache for the whole batch of rows at their longest (batch_rows x max_model_len tokens),
    within eagle3.engine.settings.cpu_kv_cache_gib's bounds; a VLLM_CPU_KVCACHE_SPACE the user set wins. Nothing on
    GPUs (vLLM sizes its KV cache from gpu_memory_utilization there)."""
    if on_gpu():
        return {}
    try:
        per_token = kv_cache_bytes_per_token(verifier.spec().text_config, dtype_info(dtype).bytes)
    except ValueError as e:
        raise RegenerateError(f"{Path(verifier.path) / 'config.json'}: {e}") from None
    env = sized_cpu_kv_cache_env(cfg.batch_rows * cfg.max_model_len, per_token)
    if env:
        log.info("[regenerate] vLLM CPU KV cache %s GiB (%s): %d rows x %d tokens x %d bytes per token, at most "
                 "%.0f%% of the available memory", env[CPU_KV_CACHE_ENV], CPU_KV_CACHE_ENV, cfg.batch_rows,
                 cfg.max_model_len, per_token, 100 * CPU_KV_CACHE_MAX_SHARE)
    return env


def _run_driver(cfg: RegenerateConfig, todo: list[dict], total: int, prepare_cfg: PrepareConfig,
                verifier: VerifierIdentity, dtype: str, out_dir: Path, lock_fds: list[int],
                on_progress: Callable[[int, int, str], None] | None,
                inject_oom_batches: list[int] | None, baseline: dict[str, Any] | None) -> dict[str, Any]:
    """Run the vLLM generation driver over ``todo`` (one engine job); returns its stats (engine start, generation
    time, tokens)."""
    journal = out_dir / JOURNAL
    work = out_dir / "work.jsonl"
    atomic_write_text(work, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in todo))
    job = {"verifier": verifier.path, "work_file": str(work), "journal": str(journal),
           "stats_file": str(out_dir / "driver_stats.json"), "chat": prepare_cfg.chat_settings().model_dump(),
           "dtype": dtype, "max_model_len": cfg.max_model_len,
           "temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
           "seed": cfg.seed, "reasoning": cfg.reasoning, "reasoning_start": cfg.reasoning_start,
           "reasoning_end": cfg.reasoning_end, "batch_rows": cfg.batch_rows, "min_batch_rows": cfg.min_batch_rows,
           "inject_oom_batches": inject_oom_batches or [], "baseline": baseline}
    (out_dir / "driver_stats.json").unlink(missing_ok=True)
    progress = Progress("regenerate", total, unit="conversations", every_s=cfg.log_every_seconds, logger=log,
                        on_update=on_progress)
    progress.done = total - len(todo)
    seen = [len(read_journal(journal))]

    def follow() -> None:  # a line per batch the driver appended to the journal
        n = len(read_journal(journal))
        if n > seen[0]:
            progress.update(n - seen[0], extra="batch written")
            seen[0] = n

    # an engine session that also times validation's baseline runs where validation's engines run (its request's
    # placement); otherwise vLLM's default, the engine core in its own process
    in_process = bool(baseline and baseline["request"]["engine_in_process"])
    result = run_engine_job(cfg.engine, "eagle3.regenerate.vllm_worker", job, out_dir / "job.json",
                            log_file=out_dir / VLLM_LOG, lock_fds=lock_fds, env=_kv_cache_env(cfg, verifier, dtype),
                            in_process=in_process, follow=follow, follow_every_s=1.0)
    if result.oom:
        raise OutOfMemoryAfterRetries(f"regeneration ran out of memory at the batch floor (min_batch_rows "
                                      f"{cfg.min_batch_rows}); last output:\n{result.tail(60)}")
    if not result.ok:
        raise RegenerateError(f"the vLLM generation driver failed (exit {result.returncode}"
                              f"{', timed out' if result.timed_out else ''}); its whole output is in "
                              f"{out_dir / VLLM_LOG}; last lines:\n{result.tail(80)}")
    work.unlink(missing_ok=True)
    return json.loads((out_dir / "driver_stats.json").read_text())


def _finish(cfg: RegenerateConfig, rows: list[dict], journal: dict[tuple[int, int], dict], resumed: int,
            stats: dict, out_dir: Path, dtype: str) -> RegeneratedData:
    written, dropped = [], {}
    turns = cut = tokens = 0
    for r in rows:
        index, answer = journal_key(r)
        entry = journal[index, answer]
        if "messages" in entry:
            written.append({"messages": entry["messages"], "source_index": index, "answer": answer})
            turns, cut, tokens = turns + entry["turns"], cut + entry["cut_turns"], tokens + entry["tokens"]
        else:
            d = dropped.setdefault(entry["dropped"], {"count": 0, "first": []})
            d["count"] += 1
            if len(d["first"]) < _FIRST_NAMED:
                d["first"].append({"index": index, "answer": answer, "detail": entry.get("detail", "")})
    if not written:
        raise RegenerateError(f"no conversation could be regenerated: {json.dumps(dropped)[:2000]}")
    for reason, d in dropped.items():
        log.warning("[regenerate] dropped %d conversations (%s), e.g. source rows %s", d["count"], reason,
                    [x["index"] for x in d["first"][:5]])
    conversations = atomic_write_text(out_dir / CONVERSATIONS,
                                      "".join(json.dumps(w, ensure_ascii=False) + "\n" for w in written))
    gen_s = float(stats["generate_seconds"])
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
                "seed": cfg.seed, "answers_per_conversation": cfg.answers_per_conversation,
                "reasoning": cfg.reasoning, "dtype": dtype}
    summary = {"rows_in": len(rows), "rows_written": len(written), "rows_dropped": len(rows) - len(written),
               "rows_dropped_by_reason": {k: v["count"] for k, v in dropped.items()}, "turns_generated": turns,
               "turns_cut": cut, "tokens_generated": tokens,
               "tokens_per_second": stats["tokens_generated"] / gen_s if gen_s > 0 else 0.0,
               "engine_start_seconds": float(stats["engine_start_seconds"]), "generate_seconds": gen_s,
               "rows_resumed": resumed, "sampling": sampling}
    stats_path = atomic_write_json(out_dir / STATS, {**summary, "dropped": dropped,
                                                     "oom_halvings": stats.get("oom_halvings", 0)})
    log.info("[regenerate] done: %d of %d conversations, %d turns (%d cut at max_new_tokens), %s tokens, %.1f tok/s",
             len(written), len(rows), turns, cut, f"{tokens:,}", summary["tokens_per_second"])
    log_file = out_dir / VLLM_LOG
    artifact = RegeneratedData(out_dir=str(out_dir), fingerprint=sha256_file(conversations),
                               conversations_path=str(conversations), stats_path=str(stats_path),
                               vllm_log=str(log_file) if log_file.is_file() else None,
                               baselines_dir=str(out_dir / BASELINES), **summary)
    artifact.save()
    return artifact
