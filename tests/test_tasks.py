"""The stage tasks' bodies (``task.fn``, no Prefect server) and the Prefect glue: content cache keys, per-stage
folders, typed artifacts, OOM-only retries; plus the regressions of the two planning bugs the contract owners
removed (capacity and extraction disagreeing on the store dtype and on the default aux layers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import BUNDLED_DATA

from eagle3.capacity import CapacityPlan
from eagle3.config import load_config
from eagle3.prepare import PreparedData
from eagle3.support.gpu import OutOfMemoryAfterRetries, is_oom_error
from eagle3.vocab import VocabMapping
from tasks.capacity import plan_capacity_task
from tasks.common import (
    describe_sources_task,
    describe_tokenizer_task,
    describe_verifier_task,
    reusable,
    stage_dir,
    stage_key,
)
from tasks.prepare import prepare_data_task
from tasks.vocab import build_vocab_task


@pytest.fixture(scope="module")
def front(tiny_llama_verifier, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    cfg = load_config("tiny", {"verifier_path": str(tiny_llama_verifier),
                               "data": {"sources": [str(BUNDLED_DATA / "eval.openai.jsonl")], "max_samples": 24},
                               "vocab": {"draft_vocab_size": 256}})
    verifier = describe_verifier_task.fn(cfg.verifier)
    sources = describe_sources_task.fn(cfg.sources)
    tokenizer = describe_tokenizer_task.fn(cfg.prepare_config())
    prepared = prepare_data_task.fn(cfg.prepare_config(), sources, tokenizer, run_dir)
    return cfg, verifier, prepared, run_dir


def test_stage_tasks_return_small_typed_artifacts_with_existing_outputs(front):
    cfg, verifier, prepared, run_dir = front
    plan = plan_capacity_task.fn(cfg.capacity, cfg.extract_config(), verifier, prepared, run_dir)
    vocab = build_vocab_task.fn(cfg.vocab, verifier, prepared, run_dir)
    for a, kind in ((prepared, PreparedData), (plan, CapacityPlan), (vocab, VocabMapping)):
        assert isinstance(a, kind) and reusable(a), a
        assert len(a.fingerprint) == 64 and len(a.model_dump_json()) < 20_000
        assert Path(a.out_dir).parent == Path(run_dir)
        assert kind.load(a.out_dir) == a  # artifact.json in the stage folder says what it holds
    assert prepared.samples == 24
    # tiny verifier in conftest: hidden 64; tiny preset stores float32 aux [1, 2, 3] + final
    assert plan.bytes_per_token == 4 * 64 * 4 and plan.aux_layer_ids == [1, 2, 3] and plan.store_dtype == "float32"
    assert json.loads(Path(plan.plan_path).read_text())["total_tokens"] == prepared.total_tokens
    assert vocab.draft_vocab_size == 256 and 0 < vocab.coverage <= 1


def test_capacity_refuses_an_init_layer_the_draft_cannot_start_from_without_reading_weights(
        front, monkeypatch, tmp_path_factory):
    """train.init_from_layer is checked at plan time, from config.json and the weights' names and header shapes (no
    tensor data is read): a layer the verifier lacks, one that is not a plain Llama layer (biases), or one whose
    weights do not have config.json's widths is refused before regeneration and extraction, naming the field; a
    layer the draft can start from plans as before."""
    from helpers import save_tiny_llama
    from safetensors import safe_open

    import eagle3.support.verifier as verifier_mod
    from eagle3.capacity import CapacityError

    class HeadersOnly:  # safetensors' file handle that refuses to read tensor data
        def __init__(self, *args, **kwargs):
            self.f = safe_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            shape = self.f.get_slice(name).get_shape()
            return type("Header", (), {"get_shape": lambda _: shape})()

        def get_tensor(self, name):
            raise AssertionError(f"the plan read tensor {name}")

    monkeypatch.setattr(verifier_mod, "safe_open", HeadersOnly)
    cfg, verifier, prepared, _ = front
    run_dir = str(tmp_path_factory.mktemp("init-layer-run"))
    shape = cfg.training_shape()
    layers = verifier.spec().num_hidden_layers
    assert shape.init_from_layer is None  # the tiny preset starts from a seeded init

    def plan(init_layer, verifier_path=None):
        ident = describe_verifier_task.fn(str(verifier_path)) if verifier_path else verifier
        extract = cfg.extract_config().model_copy(update={"verifier": ident.path})
        return plan_capacity_task.fn(cfg.capacity, extract, ident, prepared, run_dir,
                                     training=shape.model_copy(update={"init_from_layer": init_layer}))

    with pytest.raises(CapacityError, match=rf"^train\.init_from_layer: {layers} is not a decoder layer of the "):
        plan(layers)
    assert plan(-1).aux_layer_ids == [1, 2, 3]
    biased = save_tiny_llama(tmp_path_factory.mktemp("biased") / "verifier", attention_bias=True)
    with pytest.raises(CapacityError, match=r"^train\.init_from_layer: the verifier's layer 1 is not a plain Llama "
                                            r"layer .*it also has self_attn.k_proj.bias"):
        plan(1, biased)
    mislabelled = save_tiny_llama(tmp_path_factory.mktemp("mislabelled") / "verifier")
    config = json.loads((mislabelled / "config.json").read_text())
    (mislabelled / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    with pytest.raises(CapacityError, match=r"^train\.init_from_layer: the verifier's layer 0 mlp.gate_proj.weight is "
                                            r"\(\d+, \d+\) in its weights, the draft's midlayer.mlp.gate_proj.weight "
                                            r"takes"):
        plan(0, mislabelled)


def test_capacity_artifact_opens_with_its_verdict_and_wraps_at_the_ui_width(front):
    """Issue 20: the capacity-plan artifact was a code block whose long lines the UI cut off on the right, the
    "fits" verdict with them. It now opens with the verdict and its figures, and each plan line is a list item."""
    from tasks.capacity import plan_markdown

    cfg, verifier, prepared, run_dir = front
    plan = plan_capacity_task.fn(cfg.capacity, cfg.extract_config(), verifier, prepared, run_dir)
    md = plan_markdown(plan)
    assert md.startswith("# Capacity plan: fits\n") and "```" not in md
    assert "**The hidden-state store needs " in md and " free. Estimated time: " in md
    for line in plan.summary.splitlines()[1:]:
        assert f"- {line.strip()}" in md


def test_stage_folder_and_key_follow_content_not_paths(front):
    cfg, verifier, prepared, run_dir = front
    base = {"cfg": cfg.vocab, "verifier": verifier, "prepared": prepared, "run_dir": run_dir}
    same = {**base, "prepared": prepared.model_copy(update={"out_dir": "/elsewhere"})}  # keyed by identity alone
    other_cfg = {**base, "cfg": cfg.vocab.model_copy(update={"draft_vocab_size": 512})}
    other_data = {**base, "prepared": prepared.model_copy(update={"fingerprint": "0" * 64})}
    other_verifier = {**base, "verifier": verifier.model_copy(update={"fingerprint": "1" * 64})}
    assert stage_key("build-vocab", base) == stage_key("build-vocab", same)
    assert len({stage_key("build-vocab", x) for x in (base, other_cfg, other_data, other_verifier)}) == 4
    assert stage_dir(run_dir, "build-vocab", base) != stage_dir(run_dir, "build-vocab", other_cfg)
    # extraction shards of one dataset share one store folder but not one cache entry (shard range: RESUMABLE);
    # batch settings change neither (RUNTIME)
    ex = {"cfg": cfg.extract_config(), "verifier": verifier, "prepared": prepared, "run_dir": run_dir}
    shard = {**ex, "cfg": cfg.extract_config().model_copy(update={"shard_start": 10})}
    batch = {**ex, "cfg": cfg.extract_config().model_copy(update={"max_tokens_per_batch": 128})}
    dtype = {**ex, "cfg": cfg.extract_config().model_copy(update={"store_dtype": "bfloat16"})}
    assert stage_dir(run_dir, "x", ex) == stage_dir(run_dir, "x", shard) == stage_dir(run_dir, "x", batch)
    assert stage_key("x", ex) != stage_key("x", shard) and stage_key("x", ex) == stage_key("x", batch)
    assert stage_dir(run_dir, "x", ex) != stage_dir(run_dir, "x", dtype)
    # the host config (slots, locks) never changes a key
    host = load_config("tiny", {"host": {"gpu_concurrency_limit": "x", "lock_wait_seconds": 5}}).host
    assert stage_key("x", {**ex, "host": host}) == stage_key("x", {**ex, "host": cfg.host})


def test_sources_fingerprint_follows_dataset_content(tmp_path, tiny_llama_verifier):
    src = tmp_path / "chats.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    a = describe_sources_task.fn([str(src)])
    src.write_text(src.read_text().replace("yo", "hello"))
    b = describe_sources_task.fn([str(src)])
    assert a.fingerprint != b.fingerprint
    v1, v2 = describe_verifier_task.fn(str(tiny_llama_verifier)), describe_verifier_task.fn(str(tiny_llama_verifier))
    assert v1 == v2


def test_one_dataset_in_two_folders_gives_one_fingerprint_and_one_stage_folder(tiny_llama_verifier, tmp_path):
    """The dataset's content keys the cache, not where it lies: the same file copied into two folders describes
    (sources) and prepares (PreparedData.fingerprint) the same: one cache entry, one stage folder, and the stages
    downstream (keyed by the prepared fingerprint) reuse their work."""
    text = (BUNDLED_DATA / "eval.openai.jsonl").read_text()
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "chats.jsonl").write_text(text)
        cfg = load_config("tiny", {"verifier_path": str(tiny_llama_verifier), "data": {
            "sources": [str(tmp_path / name / "chats.jsonl")], "max_samples": 6}})
        sources = describe_sources_task.fn(cfg.sources)
        tokenizer = describe_tokenizer_task.fn(cfg.prepare_config())
        run_dir = str(tmp_path / "run")
        prepared = prepare_data_task.fn(cfg.prepare_config(), sources, tokenizer, run_dir)
        inputs = {"cfg": cfg.prepare_config(), "sources": sources, "tokenizer": tokenizer, "run_dir": run_dir}
        vocab_key = stage_key("build-vocab", {"cfg": cfg.vocab, "verifier": describe_verifier_task.fn(cfg.verifier),
                                              "prepared": prepared, "run_dir": run_dir})
        runs.append((sources, prepared, stage_key("prepare-data", inputs), prepared.out_dir, vocab_key))
    (s1, p1, k1, d1, v1), (s2, p2, k2, d2, v2) = runs
    assert s1.fingerprint == s2.fingerprint and p1.fingerprint == p2.fingerprint
    assert k1 == k2 and d1 == d2 and v1 == v2


def test_deleted_outputs_make_an_artifact_unusable(front):
    _, _, prepared, _ = front
    assert reusable(prepared)
    assert not reusable(prepared.model_copy(update={"stats_path": str(Path(prepared.out_dir) / "gone.json")}))
    assert not reusable(None)


def test_oom_classification_for_retries():
    try:
        try:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except RuntimeError as inner:
            raise ValueError("extraction failed") from inner
    except ValueError as exc:
        assert is_oom_error(exc)
    assert is_oom_error(MemoryError())
    assert not is_oom_error(ValueError("aux_layer_ids [99] out of range"))
    assert not is_oom_error(FileNotFoundError("verifier config not found"))
    assert not is_oom_error(OutOfMemoryAfterRetries("sample 7 does not fit at the floor: out of memory"))


def test_capacity_plans_the_dtype_extraction_writes(front, bundled_verifier, tmp_path):
    """Regression (a): ``store_dtype: model`` with ``dtype: float32`` on the bf16 bundled verifier: the plan used
    to assume bfloat16 while extraction wrote float32 (a disk plan 2x too small). Both now resolve through
    ``ExtractConfig.resolved_dtypes``, and the plan equals the bytes extraction writes."""
    from eagle3.extract.stage import extract_hidden_states
    from eagle3.store import HiddenStateStore

    cfg = load_config("tiny", {"extract": {"store_dtype": "model", "dtype": "float32", "device": "cpu"},
                               "data": {"sources": [str(BUNDLED_DATA / "eval.openai.jsonl")], "max_samples": 6}})
    verifier = describe_verifier_task.fn(cfg.verifier)
    assert verifier.spec().dtype == "bfloat16"
    prepared = prepare_data_task.fn(cfg.prepare_config(), describe_sources_task.fn(cfg.sources),
                                    describe_tokenizer_task.fn(cfg.prepare_config()), str(tmp_path))
    plan = plan_capacity_task.fn(cfg.capacity, cfg.extract_config(), verifier, prepared, str(tmp_path))
    assert plan.store_dtype == "float32" and plan.bytes_per_token == 4 * 256 * 4
    store = extract_hidden_states(cfg.extract_config(), prepared, tmp_path / "store", verifier=verifier)
    assert HiddenStateStore(store.store_path).meta["dtype"] == "float32" == store.store_dtype
    files = sum(Path(f).stat().st_size for f in Path(store.store_path).rglob("sample_*.safetensors"))
    assert files == plan.total_bytes


def test_capacity_plans_the_aux_layers_extraction_stores(front, tiny_llama_verifier, tmp_path):
    """Regression (b): ``aux_layer_ids`` unset on a 4-layer verifier: capacity planned [2, 2, 1] (3 aux states per
    token), extraction stored [1, 2]. One rule (VerifierSpec.resolve_aux_layer_ids: vLLM's default, deduplicated
    and ascending; vLLM convention) now serves both."""
    from eagle3.extract.stage import extract_hidden_states

    cfg, verifier, prepared, run_dir = front
    extract = cfg.extract_config().model_copy(update={"aux_layer_ids": None})
    plan = plan_capacity_task.fn(cfg.capacity, extract, verifier, prepared, run_dir)
    store = extract_hidden_states(extract.model_copy(update={"shard_end": 2}), prepared, tmp_path / "store",
                                  verifier=verifier)
    assert plan.aux_layer_ids == store.aux_layer_ids == [1, 2]
    assert plan.bytes_per_token == (2 + 1) * 64 * 4


def test_reuse_check_catches_outputs_resized_or_rewritten_in_place(front, tmp_path):
    """A cached artifact is reusable only while its outputs are the ones it recorded: the sha256 of its small files
    (stats.json, plan.json, mapping.safetensors) and the byte size of every dataset file."""
    cfg, verifier, _, _ = front
    run_dir = str(tmp_path)
    prepared = prepare_data_task.fn(cfg.prepare_config(), describe_sources_task.fn(cfg.sources), verifier, run_dir)
    plan = plan_capacity_task.fn(cfg.capacity, cfg.extract_config(), verifier, prepared, run_dir)
    vocab = build_vocab_task.fn(cfg.vocab, verifier, prepared, run_dir)
    assert prepared.problems() == plan.problems() == vocab.problems() == []

    stats = Path(prepared.stats_path)
    stats.write_text(stats.read_text().replace('"samples_kept": 24', '"samples_kept": 25'))
    (arrow,) = Path(prepared.dataset_path).glob("*.arrow")
    with open(arrow, "ab") as f:
        f.write(b"\0")
    size = arrow.stat().st_size
    assert prepared.problems() == [f"{stats} changed since it was written (sha256 differs from the recorded one)",
                                   f"{arrow} has {size} bytes, {size - 1} were recorded"]
    Path(plan.plan_path).write_text(Path(plan.plan_path).read_text() + " ")
    changed = f"{plan.plan_path} changed since it was written (sha256 differs from the recorded one)"
    assert plan.problems() == [changed]
    raw = bytearray(Path(vocab.mapping_path).read_bytes())
    raw[-1] ^= 1  # the same size, one bit of t2d
    Path(vocab.mapping_path).write_bytes(bytes(raw))
    assert not reusable(vocab) and "mapping.safetensors changed" in vocab.problems()[0]


def test_capacity_refuses_a_draft_kind_vllm_cannot_serve_here_before_anything_runs(front, kimi_shaped, tmp_path):
    """A llama draft beside an MLA verifier (Kimi-K2.5) on a CPU: vLLM's CPU build cannot serve the pair, so the
    capacity plan refuses in one sentence naming the setting, before regeneration, extraction or training."""
    from eagle3.capacity import CapacityError
    from eagle3.draft.config import DraftArchitecture

    cfg, _, prepared, _ = front
    verifier = describe_verifier_task.fn(str(kimi_shaped))
    extract = cfg.extract_config().model_copy(update={"verifier": str(kimi_shaped), "aux_layer_ids": None})
    if torch.cuda.is_available():
        pytest.skip("on a GPU host vLLM serves both draft kinds beside an MLA verifier")
    with pytest.raises(CapacityError, match=r"cannot serve a llama draft beside an MLA verifier .* set "
                                            r"train.draft.kind: mla$"):
        plan_capacity_task.fn(cfg.capacity, extract, verifier, prepared, str(tmp_path),
                              training=cfg.training_shape().model_copy(update={"draft": DraftArchitecture()}))
    plan = plan_capacity_task.fn(cfg.capacity, extract, verifier, prepared, str(tmp_path),
                                 training=cfg.training_shape().model_copy(update={"draft": DraftArchitecture(kind="mla")}))
    assert plan.aux_layer_ids == [1, 2]
