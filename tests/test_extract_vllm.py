"""The vLLM backend (real vLLM CPU build in .venv-vllm) writes the same store as the transformers backend."""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers import make_dataset

from eagle3.extract.stage import extract_hidden_states
from eagle3.extract.vllm_backend import VllmExtractionError
from eagle3.store import HiddenStateStore
from eagle3.support.verifier import load_verifier_head

pytestmark = [pytest.mark.vllm]

LENGTHS = [48, 7, 130, 33, 90, 12]


def _cfg(verifier, tmp_path, **kw) -> dict:
    return {"verifier": str(verifier), "dtype": "float32", "store_dtype": "float32", "max_tokens_per_batch": 128,
            "max_samples_per_batch": 4, "min_tokens_per_batch": 16,
            "log_every_seconds": 0, "log_every_samples": 0, **kw}


def test_vllm_backend_matches_transformers_on_bundled_verifier(bundled_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=7)
    hf = extract_hidden_states(_cfg(bundled_verifier, tmp_path), ds, tmp_path / "hf")
    # chunked prefill: the 130-token sample is split over steps of <= 128 tokens
    vl = extract_hidden_states(_cfg(bundled_verifier, tmp_path, backend="vllm"), ds, tmp_path / "vllm")
    assert (hf.samples_written, vl.samples_written, vl.model_loads) == (len(LENGTHS), len(LENGTHS), 1)
    a, b = HiddenStateStore(tmp_path / "hf"), HiddenStateStore(tmp_path / "vllm")
    assert b.meta["backend"] == "vllm" and b.aux_layer_ids == a.aux_layer_ids == [1, 2]  # L = 4: (2, 2, 1) -> [1, 2]
    assert b.verify()["tokens"] == sum(LENGTHS)
    head = load_verifier_head(bundled_verifier, with_embedding=False)
    for i in range(len(LENGTHS)):
        x, y = a.load(i), b.load(i)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        torch.testing.assert_close(y["aux_hidden_states"], x["aux_hidden_states"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y["final_hidden_state"], x["final_hidden_state"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.logits(y["final_hidden_state"]), head.logits(x["final_hidden_state"]),
                                   atol=1e-3, rtol=1e-4)


def test_vllm_timeout_kills_process_group(bundled_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", [9, 5], 8192)
    with pytest.raises(VllmExtractionError, match=r"engine.timeout_s=3") as e:
        extract_hidden_states(_cfg(bundled_verifier, tmp_path, backend="vllm", engine={"timeout_s": 3}), ds,
                              tmp_path / "store")
    pids = [int(x) for x in re.search(r"process group \(pids ([\d, ]+)\)", str(e.value)).group(1).split(", ")]
    assert pids
    for pid in pids:  # nothing of the driver, engine core or workers is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert len(HiddenStateStore(tmp_path / "store")) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and a CUDA build of vLLM")
def test_vllm_backend_tensor_parallel_gpu(bundled_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=7)
    tp = 2 if torch.cuda.device_count() >= 2 else 1
    hf = _cfg(bundled_verifier, tmp_path, device="cuda:0", dtype="bfloat16", store_dtype="bfloat16",
              min_free_gpu_memory_fraction=0.0)
    extract_hidden_states(hf, ds, tmp_path / "hf")
    extract_hidden_states({**hf, "backend": "vllm",
                           "engine": {"tensor_parallel_size": tp, "gpu_memory_utilization": 0.5}}, ds, tmp_path / "vllm")
    a, b = HiddenStateStore(tmp_path / "hf"), HiddenStateStore(tmp_path / "vllm")
    for i in range(len(LENGTHS)):
        torch.testing.assert_close(b.load(i)["final_hidden_state"].float(), a.load(i)["final_hidden_state"].float(),
                                   atol=0.1, rtol=0.05)
