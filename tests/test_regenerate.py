"""The regenerate stage on the bundled verifier through real vLLM (CPU build): on-policy answers turn by turn,
rows that cannot be regenerated counted and named, an OOM halving the batch with the engine kept, kill -9 in
the middle of a run followed by a rerun giving every row exactly once, and several sampled answers per
conversation."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from helpers import BUNDLED_DATA, REPO

from eagle3.engine.settings import SMALL_CPU_HOST_CORES
from eagle3.prepare import PrepareConfig, prepare_data
from eagle3.regenerate.config import RegenerateConfig, request_seed
from eagle3.regenerate.stage import JOURNAL, RegenerateError, _finish, read_journal, regenerate
from eagle3.regenerate.vllm_worker import strip_reasoning
from eagle3.support.gpu import device_lock
from eagle3.support.verifier import describe_verifier

pytestmark = pytest.mark.vllm


def _conversations(path: Path, n_single: int, long_prompt: bool = False) -> Path:
    """n_single one-turn chats (the bundled data's held-out questions, with a short answer), two two-turn chats, and
    optionally one whose prompt is far longer than the others (to be dropped as too long for a small max_model_len)."""
    rows = []
    for line in (BUNDLED_DATA / "eval.openai.jsonl").read_text().splitlines():
        user = next(m for m in json.loads(line)["messages"] if m["role"] == "user")
        rows.append({"messages": [{"role": "system", "content": "You are a concise assistant for Python developers."},
                                  user, {"role": "assistant", "content": "See its documentation."}]})
    rows = rows[:n_single]
    for k in range(2):
        rows.append({"messages": [{"role": "user", "content": f"What does os.path.join do? ({k})"},
                                  {"role": "assistant", "content": "Join one or more path components."},
                                  {"role": "user", "content": "And os.path.split?"},
                                  {"role": "assistant", "content": "Split a pathname into a pair."}]})
    if long_prompt:
        rows.append({"messages": [{"role": "user", "content": "Explain " + "this and that " * 60},
                                  {"role": "assistant", "content": "It depends."}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepare(tmp_path: Path, bundled_verifier: Path, src: Path) -> tuple[PrepareConfig, object]:
    cfg = PrepareConfig(sources=[str(src)], tokenizer_path=str(bundled_verifier), max_seq_len=512)
    return cfg, prepare_data(cfg, tmp_path / "prepared")


def _status(process: psutil.Process) -> str:
    try:
        return process.status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD


def _regen_cfg(**kw) -> RegenerateConfig:
    return RegenerateConfig(**{"enabled": True, "max_new_tokens": 16, "batch_rows": 4, "max_model_len": 512,
                               "log_every_seconds": 0, **kw})


def test_strip_reasoning_blocks():
    assert strip_reasoning("<think>plan</think> The answer.", "<think>", "</think>") == "The answer."
    assert strip_reasoning("A <think>x</think>B<think>y</think> C", "<think>", "</think>") == "A B C"
    assert strip_reasoning("Answer first <think>never closed", "<think>", "</think>") == "Answer first"
    assert strip_reasoning("<think>only thoughts</think>", "<think>", "</think>") == ""


def test_dropped_rows_are_counted_and_named(tmp_path):
    rows = [{"index": i, "messages": []} for i in (3, 5, 8)]
    journal = {(3, 0): {"index": 3, "messages": [{"role": "user", "content": "q"},
                                                 {"role": "assistant", "content": "a"}],
                        "turns": 1, "tokens": 4, "cut_turns": 1},
               (5, 0): {"index": 5, "dropped": "empty_response", "detail": "turn 0: the verifier's answer is empty"},
               (8, 0): {"index": 8, "dropped": "template_error", "detail": "TemplateError: boom"}}
    r = _finish(_regen_cfg(), rows, journal, 0, {"engine_start_seconds": 1.0, "generate_seconds": 2.0,
                                                  "tokens_generated": 4}, tmp_path, "float32")
    assert (r.rows_in, r.rows_written, r.rows_dropped, r.turns_cut) == (3, 1, 2, 1)
    assert r.rows_dropped_by_reason == {"empty_response": 1, "template_error": 1}
    named = json.loads(Path(r.stats_path).read_text())["dropped"]
    assert named["template_error"]["first"] == [{"index": 8, "answer": 0, "detail": "TemplateError: boom"}]
    lines = Path(r.conversations_path).read_text().splitlines()
    assert [json.loads(x)["source_index"] for x in lines] == [3]
    with pytest.raises(RegenerateError, match="no conversation could be regenerated"):
        _finish(_regen_cfg(), rows[1:], journal, 0, {"engine_start_seconds": 0, "generate_seconds": 0,
                                                      "tokens_generated": 0}, tmp_path / "none", "float32")


def test_several_answers_need_a_temperature_and_keep_the_first_answers_seeds(tmp_path):
    with pytest.raises(ValueError, match="answers_per_conversation 2 with temperature 0"):
        _regen_cfg(answers_per_conversation=2)
    assert request_seed(7, index=5, turn=1, answer=0) == 7 + 5 * 1000 + 1  # answer 0: the seeds of older journals
    for i in range(2000):  # a turn's answers sample with different seeds, also in the low 32 bits vLLM keeps
        for t in range(3):
            assert len({request_seed(0, index=i, turn=t, answer=a) % 2**32 for a in range(4)}) == 4
    journal = tmp_path / JOURNAL  # a journal written before answers existed reads as answer 0
    journal.write_text(json.dumps({"index": 4, "dropped": "empty_response"}) + "\n"
                       + json.dumps({"index": 4, "answer": 1, "dropped": "template_error"}) + "\n")
    assert {k: v["dropped"] for k, v in read_journal(journal).items()} == {(4, 0): "empty_response",
                                                                           (4, 1): "template_error"}


@pytest.mark.slow
def test_several_sampled_answers_per_conversation_each_its_own_conversation(bundled_verifier, tmp_path):
    src = _conversations(tmp_path / "chats.jsonl", 3)  # 3 one-turn chats + 2 two-turn chats
    prepare_cfg, prepared = _prepare(tmp_path, bundled_verifier, src)
    cfg = _regen_cfg(answers_per_conversation=2, temperature=1.0)
    r = regenerate(cfg, prepared, prepare_cfg, describe_verifier(bundled_verifier), tmp_path / "regen")
    assert (r.rows_in, r.rows_written, r.turns_generated) == (10, 10, 2 * (3 + 2 * 2))
    assert r.sampling["answers_per_conversation"] == 2
    out = [json.loads(x) for x in Path(r.conversations_path).read_text().splitlines()]
    assert [(o["source_index"], o["answer"]) for o in out] == [(i, a) for i in range(5) for a in range(2)]
    answers = [[m["content"] for m in o["messages"] if m["role"] == "assistant"] for o in out]
    assert sum(answers[2 * i] != answers[2 * i + 1] for i in range(5)) >= 4  # each answer its own sample
    asked = [[m for m in o["messages"] if m["role"] != "assistant"] for o in out]
    assert all(asked[2 * i] == asked[2 * i + 1] for i in range(5))  # the same prompts (system and user turns)
    again = regenerate(cfg, prepared, prepare_cfg, describe_verifier(bundled_verifier), tmp_path / "regen")
    assert again.rows_resumed == 10 and again.fingerprint == r.fingerprint  # resumed by (row, answer): nothing redone
    prepared_again = prepare_data(prepare_cfg.model_copy(update={"sources": [r.conversations_path],
                                                                  "format": "openai"}), tmp_path / "prepared-regen")
    assert prepared_again.samples == 10


@pytest.mark.slow
def test_regenerates_turn_by_turn_names_dropped_rows_and_survives_an_injected_oom(bundled_verifier, tmp_path):
    src = _conversations(tmp_path / "chats.jsonl", 5, long_prompt=True)
    prepare_cfg, prepared = _prepare(tmp_path, bundled_verifier, src)
    assert prepared.samples == 8
    long_row = 7
    cfg = _regen_cfg(max_model_len=160)  # the long prompt (~250 tokens) leaves no room: dropped, named
    r = regenerate(cfg, prepared, prepare_cfg, describe_verifier(bundled_verifier), tmp_path / "regen",
                   inject_oom_batches=[0])
    stats = json.loads(Path(r.stats_path).read_text())
    assert stats["oom_halvings"] == 1  # the first batch of 4 ran out of memory: 2 rows per batch, engine kept
    assert r.rows_dropped_by_reason == {"prompt_too_long": 1}
    assert stats["dropped"]["prompt_too_long"]["first"][0]["index"] == long_row
    assert r.rows_written == 7 and r.turns_generated == 5 + 2 * 2 and r.tokens_generated > 0
    # the engine computed on every core (eagle3.engine.settings.cpu_engine_env), as vLLM's worker binding states it:
    # on a small host no core is kept for vLLM's scheduler process (its default keeps one: half of 2 cores idle)
    reserved = re.findall(r"reserved_cpus=\[([\d, ]*)\]", Path(r.vllm_log).read_text())
    assert reserved, "vLLM's log states no CPU binding"
    cores = len(os.sched_getaffinity(0))
    assert (reserved[-1] == "") == (cores <= SMALL_CPU_HOST_CORES), (cores, reserved)
    original = [json.loads(x)["messages"] for x in src.read_text().splitlines()]
    out = [json.loads(x) for x in Path(r.conversations_path).read_text().splitlines()]
    assert [o["source_index"] for o in out] == list(range(7))
    for o in out:
        before, after = original[o["source_index"]], o["messages"]
        assert [m["role"] for m in after] == [m["role"] for m in before]
        assert [m["content"] for m in after if m["role"] != "assistant"] == \
            [m["content"] for m in before if m["role"] != "assistant"]  # system and user turns kept
        assert all(m["content"].strip() for m in after)
    # on-policy: the bundled verifier's answers are not the dataset's
    assert sum(a["content"] != b["content"] for o in out for a, b in zip(o["messages"], original[o["source_index"]])
               if a["role"] == "assistant") >= 8
    # the output is what the prepare stage reads
    again = prepare_data(prepare_cfg.model_copy(update={"sources": [r.conversations_path], "format": "openai"}),
                         tmp_path / "prepared-regen")
    assert again.samples == 7 and again.rows_skipped == 0


@pytest.mark.slow
def test_kill_9_mid_regeneration_then_rerun_gives_every_row_exactly_once(bundled_verifier, tmp_path):
    src = _conversations(tmp_path / "chats.jsonl", 65)  # 67 rows: far more than the worker can do after the kill
    prepare_cfg, prepared = _prepare(tmp_path, bundled_verifier, src)
    out = tmp_path / "regen"
    code = textwrap.dedent(f"""
        from eagle3.prepare import PrepareConfig, PreparedData
        from eagle3.regenerate.config import RegenerateConfig
        from eagle3.regenerate.stage import regenerate
        from eagle3.support.verifier import describe_verifier
        regenerate(RegenerateConfig.model_validate({_regen_cfg(batch_rows=2).model_dump()!r}),
                   PreparedData.load({prepared.out_dir!r}), PrepareConfig.model_validate({prepare_cfg.model_dump()!r}),
                   describe_verifier({str(bundled_verifier)!r}), {str(out)!r})
    """)
    victim = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    groups: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while len(read_journal(out / JOURNAL)) < 4:  # at least two batches are on disk
            assert victim.poll() is None, victim.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Freeze vLLM's process group (the guard that leads it and the worker) before the pipeline process dies:
        # otherwise the worker goes on journaling until the guard sees its owner gone (it polls every 0.5 s), and a
        # fast machine finished the whole job in that moment. Only the guard is woken after the kill, so the
        # worker dies exactly where it was frozen (maybe inside a journal write), as after a kill -9 at that instant.
        groups = {os.getpgid(p.pid) for p in psutil.Process(victim.pid).children()} - {os.getpgid(victim.pid)}
        assert groups, "the regenerate stage's vLLM process group was not found"
        for g in groups:
            os.killpg(g, signal.SIGSTOP)
        members = [m for g in groups for m in [psutil.Process(g), *psutil.Process(g).children(recursive=True)]]
        stopped = (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        while not all(_status(m) in stopped for m in members):  # a signal lands when its process next runs
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        victim.kill()  # SIGKILL: the pipeline process dies (no-op if it exited)
        victim.wait()
    try:
        frozen = len(read_journal(out / JOURNAL))
        for g in groups:
            os.kill(g, signal.SIGCONT)  # the guard (the group's leader) finds its owner gone and SIGKILLs the group
        # until the group is gone its guard holds the host lock: wait for the lock before counting what is on disk
        with device_lock(["host-cpu"], None, wait_seconds=120):
            pass
    finally:
        for g in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(g, signal.SIGKILL)  # whatever the guard left behind
    partial = len(read_journal(out / JOURNAL))
    assert partial == frozen and 4 <= partial < prepared.samples, (frozen, partial)
    r = regenerate(_regen_cfg(batch_rows=2), prepared, prepare_cfg, describe_verifier(bundled_verifier), out)
    assert r.rows_resumed == partial and r.rows_written == prepared.samples == 67
    indices = []
    for line in (out / JOURNAL).read_text().splitlines():
        try:
            indices.append(json.loads(line)["index"])
        except json.JSONDecodeError:
            pass  # a line torn by the kill (its row was redone)
    assert sorted(indices) == list(range(67))  # no row journaled twice, none missing
    rows = [json.loads(x)["source_index"] for x in Path(r.conversations_path).read_text().splitlines()]
    assert rows == list(range(67))  # every row exactly once, in order
