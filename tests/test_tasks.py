"""The stage tasks' bodies (``task.fn``, no Prefect server) and the Prefect glue: content cache keys, per-stage
folders, manifests, OOM-only retries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import BUNDLED_DATA

from eagle3.config import load_config
from tasks.capacity import plan_capacity_task
from tasks.common import describe_inputs, is_oom_exception, manifest_ok, stage_dir, stage_key
from tasks.prepare import prepare_data
from tasks.vocab import build_vocab_task


@pytest.fixture(scope="module")
def front(tiny_llama_verifier, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    cfg = load_config("tiny", {"verifier_path": str(tiny_llama_verifier),
                               "data": {"sources": [str(BUNDLED_DATA / "eval.openai.jsonl")], "max_samples": 24},
                               "vocab": {"draft_vocab_size": 256}})
    inputs = describe_inputs.fn(cfg.verifier, cfg.sources)
    data = prepare_data.fn(cfg.prepare_config(), inputs, run_dir)
    return cfg, inputs, data, run_dir


def test_manifests_are_small_json_with_existing_paths_and_fingerprints(front):
    cfg, inputs, data, run_dir = front
    plan = plan_capacity_task.fn(cfg.capacity_config(), cfg.extract_config(), inputs, data, run_dir)
    vocab = build_vocab_task.fn(cfg.vocab, inputs, data, run_dir)
    for m in (data, plan, vocab):
        assert manifest_ok(m), m
        assert len(m["fingerprint"]) == 64
        assert len(json.dumps(m)) < 20_000
        assert Path(m["out_dir"]).parent == Path(run_dir)
    assert data["samples_kept"] == 24
    # tiny verifier in conftest: hidden 64; tiny preset stores float32 aux [1, 2, 3] + final
    assert plan["bytes_per_token"] == 4 * 64 * 4
    assert plan["total_tokens"] == data["total_tokens"]
    assert vocab["draft_vocab_size"] == 256 and 0 < vocab["coverage"] <= 1


def test_stage_folder_and_key_follow_content_not_paths(front):
    cfg, inputs, data, run_dir = front
    base = {"cfg": cfg.vocab, "inputs": inputs, "data": data, "run_dir": run_dir}
    same = {**base, "data": {**data, "out_dir": "/elsewhere"}}  # a manifest is keyed by its fingerprint alone
    other_cfg = {**base, "cfg": cfg.vocab.model_copy(update={"draft_vocab_size": 512})}
    other_data = {**base, "data": {**data, "fingerprint": "0" * 64}}
    assert stage_key("build-vocab", base) == stage_key("build-vocab", same)
    assert stage_key("build-vocab", base) != stage_key("build-vocab", other_cfg)
    assert stage_key("build-vocab", base) != stage_key("build-vocab", other_data)
    assert stage_dir(run_dir, "build-vocab", base) != stage_dir(run_dir, "build-vocab", other_cfg)
    # extraction shards of one dataset share one store folder but not one cache entry
    ex = {"cfg": cfg.extract_config(), "inputs": inputs, "data": data, "run_dir": run_dir}
    shard = {**ex, "cfg": cfg.extract_config().model_copy(update={"shard_start": 10})}
    ignore = ("shard_start", "shard_end")
    assert stage_dir(run_dir, "x", ex, ignore) == stage_dir(run_dir, "x", shard, ignore)
    assert stage_key("x", ex) != stage_key("x", shard)


def test_inputs_fingerprint_changes_with_dataset_content(tmp_path, tiny_llama_verifier):
    src = tmp_path / "chats.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    a = describe_inputs.fn(str(tiny_llama_verifier), [str(src)])
    src.write_text(src.read_text().replace("yo", "hello"))
    b = describe_inputs.fn(str(tiny_llama_verifier), [str(src)])
    assert a["verifier_fingerprint"] == b["verifier_fingerprint"]
    assert a["fingerprint"] != b["fingerprint"]


def test_deleted_outputs_invalidate_a_manifest(tmp_path):
    (tmp_path / "f").write_text("x")
    assert manifest_ok({"paths": {"f": str(tmp_path / "f")}})
    assert not manifest_ok({"paths": {"f": str(tmp_path / "gone")}})
    assert not manifest_ok(None)


def test_oom_classification_for_retries():
    try:
        try:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except RuntimeError as inner:
            raise ValueError("extraction failed") from inner
    except ValueError as exc:
        assert is_oom_exception(exc)
    assert is_oom_exception(MemoryError())
    assert not is_oom_exception(ValueError("aux_layer_ids [99] out of range"))
    assert not is_oom_exception(FileNotFoundError("verifier config not found"))
    from eagle3.support.gpu import OutOfMemoryAfterRetries

    assert not is_oom_exception(OutOfMemoryAfterRetries("sample 7 does not fit at the floor: out of memory"))
