"""The hidden-state store on its own: writer, manifest, memory-mapped reads, verification, crash leftovers."""

from __future__ import annotations

import json
import re

import pytest
import torch

from eagle3.extract.writer import write_sample
from eagle3.store import MANIFEST, HiddenStateStore, StoreError, init_store, read_manifest, sample_relpath


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


def test_sample_bytes_are_identical_in_every_process(tmp_path):
    """The same tensors serialize to the same bytes in separate processes whatever their hash seed (a multi-key
    safetensors metadata map came out in a per-process order: 2 different sha256 in 4 processes)."""
    import hashlib
    import os
    import subprocess
    import sys

    from helpers import REPO

    code = ("import hashlib, torch\n"
            "from eagle3.store import serialize_sample\n"
            "g = torch.Generator().manual_seed(0)\n"
            "t = (torch.randn(7, 24, generator=g), torch.randn(7, 8, generator=g), torch.arange(7), torch.ones(7))\n"
            "print(hashlib.sha256(serialize_sample(*t, torch.bfloat16, 3)).hexdigest())\n")
    digests = set()
    for seed in ("0", "1", "2", "3", "random"):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        digests.add(out.stdout.strip())
    from eagle3.store import serialize_sample

    g = torch.Generator().manual_seed(0)
    here = serialize_sample(torch.randn(7, 24, generator=g), torch.randn(7, 8, generator=g), torch.arange(7),
                            torch.ones(7), torch.bfloat16, 3)
    assert digests == {hashlib.sha256(here).hexdigest()}


def test_store_identity_is_what_was_extracted_not_paths_nor_bytes(tmp_path):
    """Two stores of the same samples, in other folders and from other verifier paths (same verifier content): one
    identity. A sample extracted again with states equal to float rounding (another batch composition) keeps it,
    though its bytes and sha256 differ (a repaired store keeps training's cache key); other tokens change it."""
    fingerprints = []
    for name, verifier in (("a", "/models/tiny"), ("b/deeper", "elsewhere/tiny")):
        init_store(tmp_path / name, verifier=verifier, aux_layer_ids=[1, 2, 3], hidden_size=8, num_samples=4,
                   dtype="float32", group_size=2, fingerprint="same-content")
        for i in (3, 0, 2):  # written in another order than the other store's
            write_sample(tmp_path / name, i, *_sample(5 + i, seed=i))
        fingerprints.append(HiddenStateStore(tmp_path / name).fingerprint())
    assert fingerprints[0] == fingerprints[1]
    aux, final, ids, mask = _sample(7, seed=2)
    before = read_manifest(tmp_path / "a")[2]["sha256"]
    write_sample(tmp_path / "a", 2, aux * (1 + 1e-6), final, ids, mask)  # re-extracted: 1e-6 apart
    assert read_manifest(tmp_path / "a")[2]["sha256"] != before
    assert HiddenStateStore(tmp_path / "a").fingerprint() == fingerprints[1]
    write_sample(tmp_path / "a", 2, aux, final, ids.flip(0), mask)  # other tokens
    assert HiddenStateStore(tmp_path / "a").fingerprint() != fingerprints[1]


@pytest.mark.parametrize("bad_file", ["/etc/passwd", "../../outside.safetensors", "rows_0-3/../../x.safetensors",
                                      "rows_0-3/sub/sample_000000001.safetensors", "notes.txt"])
def test_manifest_file_outside_the_store_is_one_clear_error(tmp_path, bad_file):
    _store(tmp_path)
    write_sample(tmp_path / "store", 0, *_sample(4))
    entry = {**read_manifest(tmp_path / "store")[0], "index": 1, "file": bad_file}
    with open(tmp_path / "store" / MANIFEST, "a") as f:
        f.write(json.dumps(entry) + "\n")
    with pytest.raises(StoreError, match=rf"{MANIFEST} line 2: file '{re.escape(bad_file)}' of sample 1 does not "
                                         r"lie inside the store"):
        HiddenStateStore(tmp_path / "store")
    # extraction's resume reads leniently: the line counts as damage (dropped by the repair, sample extracted again)
    assert list(HiddenStateStore(tmp_path / "store", strict=False).indices()) == [0]


def test_symlinked_sample_or_folder_is_refused(tmp_path):
    _store(tmp_path)
    for i in (0, 4):
        write_sample(tmp_path / "store", i, *_sample(4, seed=i))
    s = HiddenStateStore(tmp_path / "store")
    outside = tmp_path / "outside.safetensors"
    s.file(0).rename(outside)
    s.file(0).symlink_to(outside)  # the bytes are intact, but they lie outside the store
    group = s.file(4).parent
    group.rename(tmp_path / "elsewhere")
    group.symlink_to(tmp_path / "elsewhere")
    s = HiddenStateStore(tmp_path / "store")
    with pytest.raises(StoreError, match=r"sample 0: file .*sample_000000000.safetensors is a symlink"):
        s.load(0)
    assert "is a symlink" in s.check_file(4) and len(s.check_sizes()) == 2


def test_damaged_sample_fails_its_first_read_check_and_is_quarantined(tmp_path):
    """64 KiB zeroed inside a sample keeps its size (the reuse check passes) but not its sha256: the first-read
    check refuses it, moves it aside, and every reader then sees it missing (extraction extracts it again)."""
    from eagle3.store import QUARANTINE, CorruptSample

    _store(tmp_path, n=4)
    for i in range(3):
        write_sample(tmp_path / "store", i, *_sample(600, seed=i))  # 600 tokens x 32 floats: ~90 KB
    s = HiddenStateStore(tmp_path / "store")
    path = s.file(1)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - (64 << 10) - 16)
        f.write(bytes(64 << 10))
    assert path.stat().st_size == size and s.check_sizes() == []
    s.verify_sample(0)
    with pytest.raises(CorruptSample, match=rf"sample 1 of store .* is damaged: file {re.escape(str(path))} does "
                                            r"not match its manifest sha256. It was not trained on \(moved to .*"
                                            rf"{QUARANTINE}/sample_000000001.safetensors"):
        s.verify_sample(1)
    assert not path.exists() and len(list((tmp_path / "store" / QUARANTINE).iterdir())) == 1
    assert HiddenStateStore(tmp_path / "store").check_sizes() == [f"sample 1: file {path} is missing"]
