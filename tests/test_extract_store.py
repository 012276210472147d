"""The hidden-state store on its own: writer, manifest, memory-mapped reads, verification, crash leftovers."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.extract.store import (
    MANIFEST,
    HiddenStateStore,
    StoreError,
    init_store,
    read_manifest,
    sample_relpath,
    write_sample,
)


def _sample(t: int, n_aux: int = 3, h: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, n_aux * h, generator=g), torch.randn(t, h, generator=g),
            torch.randint(0, 100, (t,), generator=g), (torch.arange(t) % 2).to(torch.uint8))


def _store(tmp_path, dtype="float32", n=10, group_size=4):
    return init_store(tmp_path / "store", verifier="tiny", aux_layer_ids=[1, 2, 3], hidden_size=8, num_samples=n,
                      dtype=dtype, group_size=group_size, fingerprint="test")


def test_roundtrip_exact_memory_mapped_and_grouped(tmp_path):
    _store(tmp_path)
    want = {i: _sample(3 + i, seed=i) for i in (0, 5, 9)}
    for i, (aux, fin, ids, mask) in want.items():
        write_sample(tmp_path / "store", i, aux, fin, ids, mask)
    s = HiddenStateStore(tmp_path / "store")
    assert len(s) == 3 and s.indices() == [0, 5, 9] and s.meta["n_aux"] == 3
    assert s.file(5).relative_to(s.path).as_posix() == "rows_4-7/sample_000000005.safetensors"
    for i, (aux, fin, ids, mask) in want.items():
        t = s.load(i)
        assert torch.equal(t["aux_hidden_states"], aux) and torch.equal(t["final_hidden_state"], fin)
        assert torch.equal(t["input_ids"], ids) and torch.equal(t["loss_mask"], mask)
        assert t["input_ids"].dtype == torch.int64 and t["loss_mask"].dtype == torch.uint8
    assert s.verify() == {"samples": 3, "tokens": 3 + 8 + 12, "bytes": sum(s.file(i).stat().st_size for i in want)}
    assert s.missing_indices() == [1, 2, 3, 4, 6, 7, 8]


def test_bf16_store_casts_and_sizes(tmp_path):
    _store(tmp_path, dtype="bfloat16")
    aux, fin, ids, mask = _sample(50)
    write_sample(tmp_path / "store", 1, aux, fin, ids, mask)
    s = HiddenStateStore(tmp_path / "store")
    t = s.load(1)
    assert t["aux_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(t["final_hidden_state"], fin.bfloat16())
    payload = 50 * 4 * 8 * 2 + 50 * 8 + 50
    assert s.file(1).stat().st_size < payload + 512  # header only on top of the raw bytes


def test_verify_names_corrupted_and_missing_samples(tmp_path):
    _store(tmp_path)
    for i in range(3):
        write_sample(tmp_path / "store", i, *_sample(4, seed=i))
    s = HiddenStateStore(tmp_path / "store")
    raw = bytearray(s.file(1).read_bytes())
    raw[-1] ^= 0xFF
    s.file(1).write_bytes(bytes(raw))
    s.file(2).unlink()
    with pytest.raises(StoreError, match=r"2 bad samples: sample 1: .*sha256.*sample 2: .*missing"):
        s.verify()


def test_torn_last_manifest_line_ignored_and_duplicates_collapse(tmp_path):
    _store(tmp_path)
    write_sample(tmp_path / "store", 0, *_sample(4))
    write_sample(tmp_path / "store", 0, *_sample(4))  # rewrite of the same sample: latest line wins
    with open(tmp_path / "store" / MANIFEST, "ab") as f:
        f.write(b'{"index": 3, "file": "rows_0-3/samp')  # kill -9 inside an append
    assert list(read_manifest(tmp_path / "store")) == [0]
    assert len(HiddenStateStore(tmp_path / "store")) == 1


def test_mid_file_garbage_and_mismatched_store_are_clear_errors(tmp_path):
    _store(tmp_path)
    (tmp_path / "store" / MANIFEST).write_text("not json\n" + json.dumps({"index": 0}) + "\n")
    with pytest.raises(StoreError, match="line 1"):
        HiddenStateStore(tmp_path / "store")
    with pytest.raises(StoreError, match="hidden_size: store has 8, run wants 16"):
        init_store(tmp_path / "store", verifier="tiny", aux_layer_ids=[1, 2, 3], hidden_size=16, num_samples=10,
                   dtype="float32", group_size=4, fingerprint="test")
    with pytest.raises(StoreError, match="store.json is missing"):
        HiddenStateStore(tmp_path / "nowhere")


def test_write_sample_rejects_wrong_shapes(tmp_path):
    _store(tmp_path)
    aux, fin, ids, mask = _sample(4)
    with pytest.raises(StoreError, match="sample 2"):
        write_sample(tmp_path / "store", 2, aux[:, :8], fin, ids, mask)
    with pytest.raises(StoreError, match="inconsistent shapes"):
        write_sample(tmp_path / "store", 2, aux, fin, ids[:3], mask)
    assert not (tmp_path / "store" / sample_relpath(2, 4)).exists()
