"""Extraction with the transformers backend on real tiny checkpoints: exact states, batching, OOM recovery, resume,
bad input. Layer ids in vLLM's convention (id k = residual stream entering layer k = HF hidden_states[k])."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from helpers import make_dataset
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from eagle3.extract import hf_backend
from eagle3.extract.stage import ExtractError, extract_hidden_states
from eagle3.store import MANIFEST, HiddenStateStore, StoreError
from eagle3.support.dtypes import resolve_compute_dtype, torch_dtype
from eagle3.support.gpu import OutOfMemoryAfterRetries, is_oom_error
from eagle3.support.verifier import VerifierError, load_verifier_head

LENGTHS = [37, 5, 64, 12, 50, 3, 29, 41, 8, 60]


def _cfg(verifier: Path, tmp_path: Path, **kw) -> dict:
    base = {"verifier": str(verifier), "store_dtype": "float32", "max_tokens_per_batch": 256, "min_tokens_per_batch": 16,
            "log_every_seconds": 0, "log_every_samples": 0}
    return {**base, **kw}


def _reference_model(verifier: Path) -> torch.nn.Module:
    """The verifier built independently of the extraction loader (nested configs: weights loaded by hand)."""
    cfg = json.loads((verifier / "config.json").read_text())
    if "text_config" not in cfg:
        return AutoModelForCausalLM.from_pretrained(str(verifier), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg["text_config"]), dtype=torch.float32)
    state = {}
    for shard in sorted(verifier.glob("*.safetensors")):
        state.update({k.removeprefix("language_model."): v for k, v in load_file(str(shard)).items()})
    model.load_state_dict(state, strict=True)
    return model.eval()


def _check_exact(verifier: Path, store_dir: Path, aux_ids: list[int], samples: list[int]) -> None:
    store = HiddenStateStore(store_dir)
    ref = _reference_model(verifier)
    head = load_verifier_head(verifier, with_embedding=False)
    h = store.hidden_size
    assert store.aux_layer_ids == aux_ids
    for i in samples:
        t = store.load(i)
        with torch.no_grad():
            out = ref(t["input_ids"][None], output_hidden_states=True)
        # teacher logits rebuilt from the stored final (pre-norm) state = the verifier's own logits
        torch.testing.assert_close(head.logits(t["final_hidden_state"]), out.logits[0].float(), atol=1e-4, rtol=0)
        for j, k in enumerate(aux_ids):  # aux states = HF output_hidden_states[k] (vLLM id k)
            torch.testing.assert_close(t["aux_hidden_states"][:, j * h : (j + 1) * h], out.hidden_states[k][0],
                                       atol=1e-5, rtol=0)


def test_tiny_llama_states_and_teacher_logits_exact(tiny_llama_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192)
    r = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, aux_layer_ids=[0, 2, 3]), ds, tmp_path / "store")
    assert r.samples_written == len(LENGTHS) and r.tokens_written == sum(LENGTHS) and r.model_loads == 1
    store = HiddenStateStore(tmp_path / "store")
    assert store.verify()["samples"] == len(LENGTHS)
    t = store.load(3)  # padding dropped, ids / mask carried through
    assert t["input_ids"].shape == (12,) and t["loss_mask"].tolist() == [int(j >= 4) for j in range(12)]
    _check_exact(tiny_llama_verifier, tmp_path / "store", [0, 2, 3], [0, 2, 5, 9])


def test_kimi_like_nested_deepseek_v3_exact(kimi_like_target, tmp_path):
    ds = make_dataset(tmp_path / "ds", [20, 7, 33, 16], 1024)
    r = extract_hidden_states(_cfg(kimi_like_target, tmp_path), ds, tmp_path / "store")  # default aux ids
    assert r.samples_written == 4
    # vLLM's default (2, L//2, L-3) for L = 6 is (2, 3, 3); vLLM keeps sorted(set(...)) = [2, 3]
    _check_exact(kimi_like_target, tmp_path / "store", [2, 3], [0, 1, 2, 3])
    # the training head reads only the draft-vocab rows of lm_head (sharded, prefixed checkpoint)
    draft_ids = torch.tensor([3, 4, 5, 17, 400, 401, 1023])
    head = load_verifier_head(kimi_like_target, draft_token_ids=draft_ids, with_embedding=False)
    full = load_verifier_head(kimi_like_target, with_embedding=False)
    final = HiddenStateStore(tmp_path / "store").load(2)["final_hidden_state"]
    torch.testing.assert_close(head.logits(final), full.logits(final)[:, draft_ids])


def test_bundled_verifier_teacher_logits_exact(bundled_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", [40, 17, 64], 8192, seed=3)
    # the checkpoint is bf16: compute and store in fp32 so the rebuilt logits can match to 1e-4
    extract_hidden_states(_cfg(bundled_verifier, tmp_path, dtype="float32"), ds, tmp_path / "store")
    _check_exact(bundled_verifier, tmp_path / "store", HiddenStateStore(tmp_path / "store").aux_layer_ids, [0, 1, 2])
    # default dtype "auto": what the dtype rule picks on THIS machine (bf16 on a CPU with native bf16 matmul, else
    # float32: the test asks the rule, it does not assume the answer); states equal an HF forward in that dtype
    want = resolve_compute_dtype("auto", "bfloat16", "cpu")
    extract_hidden_states(_cfg(bundled_verifier, tmp_path, store_dtype="model", max_samples_per_batch=1), ds,
                          tmp_path / "auto")
    store = HiddenStateStore(tmp_path / "auto")
    assert store.meta["dtype"] == want
    ref = AutoModelForCausalLM.from_pretrained(str(bundled_verifier), dtype=torch_dtype(want)).eval()
    t = store.load(1)
    with torch.no_grad():
        hs = ref(t["input_ids"][None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(t["aux_hidden_states"][:, 256:512], hs[store.aux_layer_ids[1]][0])


def test_auto_dtype_follows_the_rule_on_either_kind_of_cpu(bundled_verifier, tmp_path, monkeypatch):
    """Both answers of the rule, whichever CPU runs the suite: with and without native bf16 matmul."""
    from eagle3.support import dtypes

    ds = make_dataset(tmp_path / "ds", [12], 8192, seed=3)
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda native=native: native)
        extract_hidden_states(_cfg(bundled_verifier, tmp_path, store_dtype="model"), ds, tmp_path / want)
        assert HiddenStateStore(tmp_path / want).meta["dtype"] == want


def test_batching_invariance(tiny_llama_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=1)
    extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, max_samples_per_batch=1), ds, tmp_path / "alone")
    r = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, max_tokens_per_batch=4096), ds, tmp_path / "mixed")
    assert r.samples_written == len(LENGTHS)
    alone, mixed = HiddenStateStore(tmp_path / "alone"), HiddenStateStore(tmp_path / "mixed")
    for i in range(len(LENGTHS)):
        a, b = alone.load(i), mixed.load(i)
        for k in ("aux_hidden_states", "final_hidden_state"):
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)


def _count_loads(monkeypatch) -> list[int]:
    loads = []
    real = hf_backend.load_hf_model

    def counting(*a, **k):
        loads.append(1)
        return real(*a, **k)

    monkeypatch.setattr(hf_backend, "load_hf_model", counting)
    return loads


def test_injected_oom_at_several_batches_halves_budget_keeps_model(tiny_llama_verifier, tmp_path, monkeypatch, caplog):
    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=2)
    loads = _count_loads(monkeypatch)
    attempts: list[tuple[list[int], int]] = []  # (dataset indices, padded tokens) per forward attempt
    failing = (0, 2, 4, 5)  # attempt 5 retries the batch that failed at attempt 4

    def inject(attempt: int, indices: list[int], padded_tokens: int) -> None:
        attempts.append((indices, padded_tokens))
        if attempt in failing[:3]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if attempt == failing[3]:
            torch.empty(1 << 60, dtype=torch.uint8)  # a real CPU allocator failure (RuntimeError)

    caplog.set_level("WARNING", logger="eagle3.extract")
    r = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, max_tokens_per_batch=512), ds, tmp_path / "store",
                              oom_injector=inject)
    assert r.token_budget_history == [512, 256, 128, 64, 32]  # halved once per OOM
    assert sum("token budget halved" in m for m in caplog.messages) == 4
    assert len(loads) == 1 and r.model_loads == 1  # the model stayed loaded
    for a in failing:  # the retry starts with the samples of the failed batch, under the halved budget
        failed, retried = attempts[a][0], attempts[a + 1][0]
        assert retried == failed[: len(retried)]
    budget_after = {a: 512 >> (n + 1) for n, a in enumerate(failing)}
    for a, (indices, padded) in enumerate(attempts):
        budget = min([512] + [b for f, b in budget_after.items() if f < a])
        assert padded <= budget or len(indices) == 1
    lines = [json.loads(x) for x in (tmp_path / "store" / MANIFEST).read_text().splitlines()]
    assert sorted(e["index"] for e in lines) == list(range(len(LENGTHS)))  # every sample exactly once
    assert HiddenStateStore(tmp_path / "store").verify()["samples"] == len(LENGTHS)


def test_unfittable_sample_skipped_or_fails_by_name(tiny_llama_verifier, tmp_path, monkeypatch):
    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=2)
    loads = _count_loads(monkeypatch)

    def always_oom_for_64(attempt: int, indices: list[int], padded_tokens: int) -> None:
        if 2 in indices:  # sample 2 has 64 tokens
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    r = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, max_tokens_per_batch=256, min_tokens_per_batch=64),
                              ds, tmp_path / "skip", oom_injector=always_oom_for_64)
    assert r.samples_unfittable == [2] and r.samples_written == len(LENGTHS) - 1 and len(loads) == 1
    assert r.token_budget_history == [256, 128, 64]
    assert 2 not in HiddenStateStore(tmp_path / "skip")
    with pytest.raises(OutOfMemoryAfterRetries, match=r"sample 2 \(64 tokens\)") as e:
        extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, on_unfittable_sample="fail", min_tokens_per_batch=64),
                              ds, tmp_path / "fail", oom_injector=always_oom_for_64)
    assert not is_oom_error(e.value)  # the flow must not retry a sample that cannot fit


def test_non_oom_errors_propagate(tiny_llama_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", [5, 6], 8192)

    def boom(attempt, indices, tokens):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), ds, tmp_path / "store", oom_injector=boom)


def test_shards_resume_and_repair(tiny_llama_verifier, tmp_path, monkeypatch):
    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=4)
    store_dir = tmp_path / "store"
    r1 = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, shard_end=4), ds, store_dir)
    r2 = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, shard_start=4), ds, store_dir)
    assert (r1.samples_written, r2.samples_written) == (4, 6) and r2.samples_stored == len(LENGTHS)
    store = HiddenStateStore(store_dir)
    before = store.load(7)["final_hidden_state"].clone()
    # damage: a flipped byte in sample 7, a duplicate line, a leftover temp file of an interrupted write
    raw = bytearray(store.file(7).read_bytes())
    raw[-3] ^= 0x55
    store.file(7).write_bytes(bytes(raw))
    manifest = store_dir / MANIFEST
    manifest.write_text(manifest.read_text() + manifest.read_text().splitlines()[0] + "\n")
    tmp = store.file(1).parent / ".sample_000000001.safetensors.999.tmp"
    tmp.write_bytes(b"partial")
    loads = _count_loads(monkeypatch)
    r3 = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), ds, store_dir)
    assert r3.samples_written == 1 and r3.samples_resumed == len(LENGTHS) - 1 and len(loads) == 1
    assert r3.manifest_entries_dropped == 1 and r3.temp_files_removed == 1 and not tmp.exists()
    indices = [json.loads(x)["index"] for x in manifest.read_text().splitlines()]
    assert sorted(indices) == list(range(len(LENGTHS)))
    store = HiddenStateStore(store_dir)
    store.verify()
    torch.testing.assert_close(store.load(7)["final_hidden_state"], before)
    loads.clear()
    r4 = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), ds, store_dir)  # all done: no model load
    assert r4.samples_written == 0 and not loads and r4.manifest_sha256 == r3.manifest_sha256


def test_rerun_with_other_settings_refuses_store(tiny_llama_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", [5, 6], 8192)
    extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), ds, tmp_path / "store")
    with pytest.raises(StoreError, match="aux_layer_ids: store has"):
        extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, aux_layer_ids=[0, 1]), ds, tmp_path / "store")


def test_bad_input_one_clear_error_each(tiny_llama_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", [5, 6], 8192)
    with pytest.raises(VerifierError, match="nowhere"):
        extract_hidden_states(_cfg(tmp_path / "nowhere", tmp_path), ds, tmp_path / "s1")
    with pytest.raises(VerifierError, match=r"aux_layer_ids \[4\] out of range .* 4 layers"):
        extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, aux_layer_ids=[1, 4]), ds, tmp_path / "s2")
    with pytest.raises(VerifierError, match="strictly increasing"):
        extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path, aux_layer_ids=[2, 1]), ds, tmp_path / "s3")
    no_ids = tmp_path / "no_ids"
    datasets.Dataset.from_dict({"text": ["a", "b"], "loss_mask": [[1], [1]]}).save_to_disk(str(no_ids))
    with pytest.raises(ExtractError, match=r"lacks column\(s\) \['input_ids'\]"):
        extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), no_ids, tmp_path / "s4")
    big = make_dataset(tmp_path / "big_ids", [5, 6], 9000, seed=11)
    with pytest.raises(ExtractError, match=r"sample [01]: token id \d+ outside the verifier's vocabulary \[0, 8192\)"):
        extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), big, tmp_path / "s5")
    for d in ("s1", "s2", "s3", "s4", "s5"):  # nothing half-written
        assert not (tmp_path / d / MANIFEST).exists()


def test_task_artifact_and_shards_share_one_store(tiny_llama_verifier, tmp_path):
    from eagle3.extract.config import ExtractConfig
    from eagle3.prepare import PreparedData
    from eagle3.support.io import sha256_file
    from eagle3.support.verifier import describe_verifier
    from tasks.common import reusable
    from tasks.extract import extract_hidden_states_task

    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=6)
    prepared = PreparedData(out_dir=str(tmp_path), fingerprint="d" * 64, dataset_path=str(ds),
                            stats_path=str(ds / "state.json"), max_seq_len=64, rows_read=10, samples=10,
                            rows_skipped=0, rows_skipped_by_reason={}, samples_truncated=0,
                            total_tokens=sum(LENGTHS), assistant_tokens=0, elapsed_s=0.0)
    verifier, plan = describe_verifier(tiny_llama_verifier), None
    first = ExtractConfig.model_validate(_cfg(tiny_llama_verifier, tmp_path, shard_end=4))
    second = first.model_copy(update={"shard_start": 4, "shard_end": None, "max_tokens_per_batch": 128})
    a = extract_hidden_states_task.fn(first, verifier, prepared, plan, str(tmp_path / "run"))
    b = extract_hidden_states_task.fn(second, verifier, prepared, plan, str(tmp_path / "run"))
    assert a.store_path == b.store_path and reusable(b) and len(b.model_dump_json()) < 20_000
    assert (a.samples_written, b.samples_written, b.samples_stored) == (4, 6, len(LENGTHS))
    assert b.store_tokens == sum(LENGTHS) and b.manifest_sha256 == sha256_file(Path(b.store_path) / MANIFEST)
    assert b.fingerprint != a.fingerprint and b.bytes_on_disk > 0 and b.tokens_per_second > 0
    assert b.verifier == verifier and b.aux_layer_ids == [1, 2] and b.store_dtype == "float32"  # default ids


def test_lost_or_torn_manifest_is_rebuilt_from_the_intact_files(tiny_llama_verifier, tmp_path, monkeypatch):
    """manifest.jsonl deleted (or torn mid-file) with every sample file intact: resume lists the files again
    (hashes, tokens from the header, the dataset's tokens compared), extracts nothing, loads no model, and the store
    has its old fingerprint. A file holding another row's tokens is extracted again."""
    import shutil

    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=5)
    store_dir = tmp_path / "store"
    first = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), ds, store_dir)
    manifest = store_dir / MANIFEST
    loads = _count_loads(monkeypatch)

    manifest.unlink()
    r = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), ds, store_dir)
    assert (r.samples_written, r.manifest_entries_rebuilt, r.samples_resumed, len(loads)) == (0, len(LENGTHS),
                                                                                            len(LENGTHS), 0)
    assert r.fingerprint == first.fingerprint and HiddenStateStore(store_dir).verify()["samples"] == len(LENGTHS)

    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[:3]) + lines[3][:20] + "\n" + "".join(lines[6:]))  # torn in the middle
    r = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), ds, store_dir)
    assert (r.samples_written, r.manifest_entries_rebuilt, len(loads)) == (0, 3, 0)
    assert r.fingerprint == first.fingerprint

    store = HiddenStateStore(store_dir)
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(x for x in lines if json.loads(x)["index"] != 4))
    shutil.copy(store.file(1), store.file(4))  # in place, complete, but the tokens of row 1
    r = extract_hidden_states(_cfg(tiny_llama_verifier, tmp_path), ds, store_dir)
    assert (r.samples_written, r.manifest_entries_rebuilt, len(loads)) == (1, 0, 1)
    assert HiddenStateStore(store_dir).load(4)["input_ids"].shape == (LENGTHS[4],)


def test_quarantined_sample_alone_is_extracted_again_and_the_fingerprint_holds(tiny_llama_verifier, tmp_path,
                                                                              monkeypatch):
    """A sample the trainer's first-read check quarantined is the only one extracted again; its states come back
    bit-identical (one sample per forward both times), so the store's fingerprint is the same: training stays
    cached."""
    from eagle3.store import CorruptSample

    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=7)
    cfg = _cfg(tiny_llama_verifier, tmp_path, max_samples_per_batch=1)
    first = extract_hidden_states(cfg, ds, tmp_path / "store")
    store = HiddenStateStore(tmp_path / "store")
    path = store.file(2)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 4096] = bytes(4096)
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptSample, match="sample 2 "):
        store.verify_sample(2)
    loads = _count_loads(monkeypatch)
    r = extract_hidden_states(cfg, ds, tmp_path / "store")
    assert (r.samples_written, r.samples_resumed, r.manifest_entries_dropped, len(loads)) == (1, 9, 1, 1)
    assert r.fingerprint == first.fingerprint
