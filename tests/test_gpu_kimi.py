"""GPU checks of Kimi-K2.5's architecture path (marker ``gpu``): kimi-mini on CUDA, so the first run on a GPU host
covers what no CPU test can.

* extraction of kimi-mini's nested MLA + MoE checkpoint on the GPU in bf16 (transformers backend) with the
  self-check (a sample alone vs in a batch) measured at bf16's tolerance, and states close to the CPU float32 ones;
* the MLA draft trained on the GPU (bf16 autocast): its first losses track a float32 CPU run, and the CUDA peak
  stays within the training memory plan (eagle3/train/memory.py);
* with a CUDA build of vLLM: extraction in vLLM on the GPU (its MLA backends), both draft kinds trained on the same
  store and served by vLLM beside the Kimi-K2.5 class (GPU backends share block sizes), each lossless, with the
  offline reference within the parity tolerance.

Run on the GPU host: ``.venv/bin/python -m pytest -m gpu tests/test_gpu_kimi.py``. ``EAGLE3_GPU_DRY_RUN=1`` runs the
same code on the CPU here (float32, no CUDA figures) so that it cannot rot between GPU runs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import BUNDLED_DATA

from eagle3.config import load_config
from eagle3.draft.config import DraftArchitecture
from eagle3.extract.stage import extract_hidden_states
from eagle3.prepare import PrepareConfig, prepare_data
from eagle3.store import HiddenStateStore
from eagle3.train.config import TrainConfig
from eagle3.train.stage import train_draft
from eagle3.validate.config import ValidateConfig
from eagle3.validate.stage import validate_draft
from eagle3.vocab import VocabConfig, build_vocab
from tools.kimi_mini import KIMI_MINI_DIR

DRY = os.environ.get("EAGLE3_GPU_DRY_RUN") == "1"
CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (CUDA or DRY), reason="needs CUDA (EAGLE3_GPU_DRY_RUN=1: CPU)")]
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = "bfloat16" if CUDA else "float32"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """48 of the bundled chats rendered with kimi-mini's Kimi chat template."""
    if not (KIMI_MINI_DIR / "config.json").is_file():
        pytest.fail(f"kimi-mini missing at {KIMI_MINI_DIR}")
    out = tmp_path_factory.mktemp("kimi-gpu")
    cfg = PrepareConfig(sources=[str(BUNDLED_DATA / "train.openai.jsonl")], tokenizer_path=str(KIMI_MINI_DIR),
                        max_seq_len=512, max_samples=48, shuffle_seed=0)
    return prepare_data(cfg, out / "prep"), out


def _extract(prepared, out: Path, **kw):
    cfg = {"verifier": str(KIMI_MINI_DIR), "device": DEVICE, "dtype": DTYPE, "store_dtype": DTYPE,
           "max_tokens_per_batch": 4096, "log_every_seconds": 0, "log_every_samples": 0, **kw}
    return extract_hidden_states(cfg, prepared, out)


def test_kimi_mini_extraction_on_the_device_with_the_selfcheck(prepared):
    data, out = prepared
    gpu = _extract(data, out / f"store-{DEVICE}")
    check = gpu.selfcheck
    assert check["ran"] and check["passed"], check  # bf16 on CUDA: within 3e-2 of the sample alone
    print(f"[gpu-kimi] self-check on {DEVICE} ({DTYPE}): {check['relative_errors']}")
    _extract(data, out / "store-cpu-f32", device="cpu", dtype="float32", store_dtype="float32", shard_end=4)
    a, b = HiddenStateStore(out / f"store-{DEVICE}"), HiddenStateStore(out / "store-cpu-f32")
    for i in range(4):
        x, y = a.load(i)["aux_hidden_states"].float(), b.load(i)["aux_hidden_states"]
        assert float((x - y).norm() / y.norm()) < (3e-2 if CUDA else 1e-5)


def test_mla_draft_trains_on_the_device_like_on_the_cpu_within_the_memory_plan(prepared):
    data, out = prepared
    store = out / f"store-{DEVICE}"
    if not (store / "manifest.jsonl").is_file():
        _extract(data, store)
    vocab = build_vocab(VocabConfig(draft_vocab_size=1024), data, 8208, out / "vocab")
    base = dict(epochs=1, stop_after_steps=4, batch_size=4, max_seq_len=512, ttt_steps=3, val_ratio=0.1,  # noqa: C408
                eval_before_training=False, log_every_steps=1, draft=DraftArchitecture(kind="mla"))
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    run = train_draft(TrainConfig(**base, device=DEVICE), store, vocab.mapping_path, out / f"train-{DEVICE}",
                      verifier=str(KIMI_MINI_DIR))
    assert run.global_step == 4
    if CUDA:
        from eagle3.draft.checkpoint import read_config
        from eagle3.train.memory import plan_training_memory

        plan = plan_training_memory(read_config(run.checkpoint_dir), TrainConfig(**base, device="cuda"), 1, "cuda")
        peak = torch.cuda.max_memory_allocated()
        print(f"[gpu-kimi] MLA draft training: CUDA peak {peak / 1e9:.3f} GB, plan {plan.peak_bytes / 1e9:.3f} GB")
        assert peak <= plan.peak_bytes * 1.2
        ref = train_draft(TrainConfig(**base, device="cpu"), store, vocab.mapping_path, out / "train-cpu",
                          verifier=str(KIMI_MINI_DIR))

        def losses(d):
            return [json.loads(x)["loss"] for x in Path(d.metrics_path).read_text().splitlines() if '"train"' in x]

        for a, b in zip(losses(run), losses(ref)):
            assert abs(a - b) <= 0.03 * abs(b)  # bf16 autocast vs float32


@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["mla", "llama"])
def test_vllm_serves_each_draft_kind_beside_the_kimi_class_lossless_with_parity(prepared, kind):
    if not CUDA and kind == "llama":
        pytest.skip("vLLM's CPU build serves only the MLA kind beside an MLA verifier (the GPU run covers llama)")
    data, out = prepared
    store = out / "store-vllm"
    if not (store / "manifest.jsonl").is_file():
        res = _extract(data, store, backend="vllm", dtype=DTYPE, max_samples_per_batch=16)
        assert res.selfcheck["passed"], res.selfcheck
    vocab = build_vocab(VocabConfig(draft_vocab_size=1024), data, 8208, out / "vocab-vllm")
    run = train_draft(TrainConfig(epochs=2, batch_size=4, max_seq_len=512, ttt_steps=3, val_ratio=0.1,
                                  device=DEVICE, draft=DraftArchitecture(kind=kind)),
                      store, vocab.mapping_path, out / f"train-vllm-{kind}", verifier=str(KIMI_MINI_DIR))
    preset = load_config("kimi-mini").validate_config
    cfg = ValidateConfig(**{**preset.model_dump(), "dtype": DTYPE, "num_prompts": 4, "max_new_tokens": 32,
                            "compare_untrained": False, "speed_repeats": 0,
                            "parity_tolerance": 0.10 if CUDA else 0.02, "min_mean_acceptance_length": None})
    report = validate_draft(cfg, run, out / f"validate-{kind}")
    assert report.verdict == "pass", report.reasons
    assert report.lossless and report.offline_relative_difference <= cfg.parity_tolerance
    print(f"[gpu-kimi] {kind} draft served by vLLM on {DEVICE}: acceptance {report.mean_acceptance_length:.3f}, "
          f"offline {report.offline_mean_acceptance_length:.3f}")
    shutil.rmtree(out / f"validate-{kind}" / "vllm", ignore_errors=True)
