"""The extraction self-check (eagle3/extract/selfcheck.py): a sample extracted alone equals the same sample extracted
in a batch, per stored state, in every extraction; a mismatch fails the stage naming the sample and the layer."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_dataset

from eagle3.extract import selfcheck
from eagle3.extract.selfcheck import BatchInvarianceError
from eagle3.extract.stage import extract_hidden_states
from eagle3.store import HiddenStateStore

LENGTHS = [37, 5, 64, 12, 50]


def _cfg(verifier, **kw) -> dict:
    return {"verifier": str(verifier), "dtype": "float32", "store_dtype": "float32", "max_tokens_per_batch": 256,
            "min_tokens_per_batch": 16, "log_every_seconds": 0, "log_every_samples": 0, **kw}


def test_check_names_the_sample_and_the_worst_state():
    g = torch.Generator().manual_seed(0)
    aux, final = torch.randn(9, 3 * 8, generator=g), torch.randn(9, 8, generator=g)
    same = selfcheck.check(4, 3, (aux, final), (aux.clone(), final.clone()), [2, 5, 7], "float32", "vllm", 0.1)
    assert same["passed"] and same["relative_errors"]["aux layer 5"] == 0.0 and "message" not in same
    bent = aux.clone()
    bent[:, 8:16] *= 1.02  # aux layer 5 off by 2%: far beyond float32's 1e-3, within bf16's 3e-2
    bad = selfcheck.check(4, 3, (bent, final), (aux, final), [2, 5, 7], "float32", "vllm", 0.1)
    assert not bad["passed"] and "sample 4" in bad["message"] and "aux layer 5" in bad["message"]
    assert "batch of 3 samples" in bad["message"] and "relative L2 error 0.02" in bad["message"]
    assert selfcheck.check(4, 3, (bent, final), (aux, final), [2, 5, 7], "bfloat16", "vllm", 0.1)["passed"]
    with pytest.raises(BatchInvarianceError, match="sample 4 .* aux layer 5"):
        selfcheck.raise_if_failed(bad)
    # a batch copy computed alone, or first in a flattened step, compares nothing: inconclusive, never passed
    alone = selfcheck.check(4, 1, (bent, final), (aux, final), [2, 5, 7], "float32", "vllm", 0.1, tokens_ahead=0)
    first = selfcheck.check(4, 3, (aux, final), (aux, final), [2, 5, 7], "float32", "vllm", 0.1, tokens_ahead=0)
    assert alone["passed"] is None and "batch copy alone in its forward step" in alone["reason"]
    assert first["passed"] is None and "first of 3 samples" in first["reason"] and first["tokens_ahead"] == 0
    selfcheck.raise_if_failed(first)
    # a step that also continued earlier requests: the copy's place is not known, so a match proves nothing
    unknown = selfcheck.check(4, 3, (aux, final), (aux, final), [2, 5, 7], "float32", "vllm", 0.1,
                              tokens_ahead=selfcheck.ORDER_UNKNOWN)
    assert unknown["passed"] is None and "unknown place among 3 samples" in unknown["reason"]
    # but copies that differ prove batch dependence wherever the copy sat in a shared step
    for ahead in (0, selfcheck.ORDER_UNKNOWN):
        differ = selfcheck.check(4, 3, (bent, final), (aux, final), [2, 5, 7], "float32", "vllm", 0.1,
                                 tokens_ahead=ahead)
        assert differ["passed"] is False and "aux layer 5" in differ["message"]
    assert selfcheck.summary(first).startswith("self-check inconclusive: ")
    assert selfcheck.check(4, 3, (aux, final), (aux, final), [2, 5, 7], "float32", "vllm", 0.1, 9)["passed"]


def test_every_transformers_extraction_runs_it_and_records_it(tiny_llama_verifier, tmp_path):
    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=1)
    r = extract_hidden_states(_cfg(tiny_llama_verifier), ds, tmp_path / "store")
    check = r.selfcheck
    assert check["ran"] and check["passed"] and check["batch_samples"] > 1 and check["backend"] == "transformers"
    assert max(check["relative_errors"].values()) < 1e-5 and check["seconds"] < 10
    assert set(check["relative_errors"]) == {"aux layer 1", "aux layer 2",
                                             "final state (last layer's output, before the final norm)"}
    assert json.loads((tmp_path / "store" / selfcheck.SELFCHECK_FILE).read_text()) == check
    # a rerun that extracts nothing reports the recorded check; single-sample batches cannot run it
    assert extract_hidden_states(_cfg(tiny_llama_verifier), ds, tmp_path / "store").selfcheck == check
    single = extract_hidden_states(_cfg(tiny_llama_verifier, max_samples_per_batch=1), ds, tmp_path / "single")
    assert single.selfcheck["ran"] is False and "two samples" in single.selfcheck["reason"]


def test_batch_dependent_states_fail_the_stage_before_anything_is_written_injected_fault(tiny_llama_verifier,
                                                                                         tmp_path, monkeypatch):
    """A kernel that computes differently in a batch (injected: layer 2's input shifted by 1% of its norm when the
    forward holds several samples, as vLLM's CPU rope bug did for MLA) fails the stage naming sample and layer;
    the failure is recorded, so a rerun fails the same way."""
    from eagle3.extract import hf_backend

    real = hf_backend.TransformersBackend.__init__

    def faulty(self, model, aux_layer_ids):
        real(self, model, aux_layer_ids)

        def shift(_module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            if h.shape[0] > 1:
                h.mul_(1.01)

        self.layers[2].register_forward_pre_hook(shift, with_kwargs=True)

    monkeypatch.setattr(hf_backend.TransformersBackend, "__init__", faulty)
    ds = make_dataset(tmp_path / "ds", LENGTHS, 8192, seed=1)
    with pytest.raises(BatchInvarianceError, match=r"sample \d+ extracted alone differs .* batch of \d+ samples at its "
                                                   r"aux layer 2: relative L2 error 0\.01"):
        extract_hidden_states(_cfg(tiny_llama_verifier), ds, tmp_path / "store")
    assert len(HiddenStateStore(tmp_path / "store")) == 0  # nothing of the failing batch was written
    monkeypatch.undo()
    with pytest.raises(BatchInvarianceError, match="aux layer 2"):  # recorded: the rerun does not pass silently
        extract_hidden_states(_cfg(tiny_llama_verifier), ds, tmp_path / "store")
    off = extract_hidden_states(_cfg(tiny_llama_verifier, selfcheck=False), ds, tmp_path / "store")
    assert off.samples_stored == len(LENGTHS) and off.selfcheck == selfcheck.not_run("extract.selfcheck is false")
