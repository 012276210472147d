"""Training runs on real hidden-state stores: resume equivalence, keep_last_n / best, DDP and FSDP (2 gloo
processes) equal to one process, bad input, the Prefect task, and learning on the bundled verifier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft import checkpoint as ckpt
from eagle3.extract.stage import extract_hidden_states
from eagle3.extract.store import init_store
from eagle3.support.io import sha256_file
from eagle3.train.config import TrainConfig, TrainError
from eagle3.train.stage import train_draft
from eagle3.vocab import VocabConfig, build_vocab

TINY = {"lr": 3e-3, "batch_size": 2, "max_seq_len": 256, "ttt_steps": 3, "log_every_steps": 1, "device": "cpu",
        "warmup_ratio": 0.1}


def make_store(root: Path, verifier: Path, ids: list[list[int]], masks: list[list[int]], aux_layer_ids: list[int],
               draft_vocab: int, vocab_size: int, store_dtype: str = "float32") -> tuple[Path, Path]:
    """Prepared-dataset layout -> the extraction stage's store (transformers backend, float32 unless
    ``store_dtype``) + the vocab stage's mapping. Returns (store dir, mapping path)."""
    import datasets

    ds = root / "dataset"
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(ds))
    extract_hidden_states({"verifier": str(verifier), "aux_layer_ids": aux_layer_ids, "store_dtype": store_dtype,
                           "device": "cpu", "log_every_samples": 0,
                           "log_every_seconds": 0}, ds, root / "store")
    vocab = build_vocab(VocabConfig(draft_vocab_size=draft_vocab), ds, vocab_size, root / "vocab")
    return root / "store", Path(vocab.mapping_path)


@pytest.fixture(scope="module")
def random_store(tiny_llama_verifier, tmp_path_factory):
    """40 random-token samples of 20-120 tokens (the last two thirds are 'assistant') through the random tiny
    Llama: states are real, the teacher is not meaningful (fine for the mechanics)."""
    g = torch.Generator().manual_seed(0)
    ids, masks = [], []
    for _ in range(40):
        n = int(torch.randint(20, 120, (1,), generator=g))
        ids.append(torch.randint(0, 300, (n,), generator=g).tolist())
        masks.append([0] * (n // 3) + [1] * (n - n // 3))
    return make_store(tmp_path_factory.mktemp("random-store"), tiny_llama_verifier, ids, masks, [1, 2, 3], 256,
                      8192)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_metrics(a: list[dict], b: list[dict], tol: float) -> None:
    assert [(r["event"], r["global_step"]) for r in a] == [(r["event"], r["global_step"]) for r in b]
    for x, y in zip(a, b):
        for key in ("loss", "sim_accept_len"):
            assert abs(x[key] - y[key]) <= tol, (x["event"], x["global_step"], key, x[key], y[key])
        assert max(abs(p - q) for p, q in zip(x["loss_per_step"], y["loss_per_step"])) <= tol
        assert x["counted_per_step"] == y["counted_per_step"]


def test_resume_reproduces_the_uninterrupted_run_and_keeps_last_n(random_store, tiny_llama_verifier, tmp_path):
    store, vocab = random_store
    cfg = TrainConfig(epochs=3, keep_last_n=1, **TINY)
    full = train_draft(cfg, store, vocab, tmp_path / "full", verifier=tiny_llama_verifier)
    assert full.global_step == full.total_steps == 12 and not full.stopped_early
    # interrupted mid-epoch 2 (4 steps per epoch), then resumed from latest/
    part = train_draft(cfg.model_copy(update={"stop_after_steps": 6}), store, vocab,
                       tmp_path / "resumed", verifier=tiny_llama_verifier)
    assert part.stopped_early and part.global_step == 6 and part.epochs_done == 1
    state = ckpt.load_trainer_state(tmp_path / "resumed" / "latest")
    assert state["progress"] == {"epoch": 1, "step_in_epoch": 2, "global_step": 6,
                                 "tokens_seen": state["progress"]["tokens_seen"]}
    resumed = train_draft(cfg, store, vocab, tmp_path / "resumed", verifier=tiny_llama_verifier)
    assert resumed.global_step == 12 and resumed.epochs_done == 3
    _assert_same_metrics(_metrics(tmp_path / "full"), _metrics(tmp_path / "resumed"), tol=1e-6)
    a = load_file(str(tmp_path / "full/checkpoints/epoch-003/model.safetensors"))
    b = load_file(str(tmp_path / "resumed/checkpoints/epoch-003/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)
    # a finished run resumes to "nothing to do"
    again = train_draft(cfg, store, vocab, tmp_path / "resumed", verifier=tiny_llama_verifier)
    assert again.global_step == 12 and again.weights_sha256 == resumed.weights_sha256

    # keep_last_n = 1: the newest epoch + best survive; optimizer state only in latest/
    ckpts = tmp_path / "full" / "checkpoints"
    best = ckpt.best_dir(ckpts)
    kept = {p.name for p in ckpt.list_epoch_dirs(ckpts)}
    assert kept == {"epoch-003", best.name} and full.checkpoint_dir == str(best)
    vals = {r["epoch"]: r["sim_accept_len"] for r in _metrics(tmp_path / "full") if r["event"] == "val"}
    assert vals[int(best.name[-3:])] == max(vals[e] for e in (1, 2, 3)) == full.best_sim_accept_len
    for d in ckpt.list_epoch_dirs(ckpts):
        assert sorted(p.name for p in d.iterdir()) == ["config.json", "eagle3_run.json", "model.safetensors"]
    assert full.weights_sha256 == sha256_file(best / "model.safetensors")
    run = json.loads((best / "eagle3_run.json").read_text())
    assert run["run_config"]["epochs"] == 3 and "torch" in run["versions"] and "git_revision" in run
    assert sorted(p.name for p in (tmp_path / "full/latest").iterdir()) == ["trainer_state.json",
                                                                            "trainer_state.safetensors"]
    # progress artefacts: one metrics line per step, per-epoch validation, PNG curves
    m = _metrics(tmp_path / "full")
    assert [r["global_step"] for r in m if r["event"] == "train"] == list(range(1, 13))
    assert [r["epoch"] for r in m if r["event"] == "val"] == [0, 1, 2, 3]
    assert {Path(p).name for p in full.plots} == {"loss.png", "accuracy.png", "acceptance.png"}
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in full.plots)


def test_resume_refuses_changed_settings(random_store, tiny_llama_verifier, tmp_path):
    store, vocab = random_store
    cfg = TrainConfig(epochs=1, stop_after_steps=1, **TINY)
    train_draft(cfg, store, vocab, tmp_path / "out", verifier=tiny_llama_verifier)
    with pytest.raises(TrainError, match=r"settings \['lr'\] differ"):
        train_draft(cfg.model_copy(update={"lr": 1e-3}), store, vocab, tmp_path / "out", verifier=tiny_llama_verifier)
    fresh = train_draft(cfg.model_copy(update={"lr": 1e-3}), store, vocab, tmp_path / "out", verifier=tiny_llama_verifier,
                        resume=False)
    assert fresh.global_step == 1


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_processes_equal_one(random_store, tiny_llama_verifier, tmp_path, parallel):
    """torchrun with 2 CPU processes (gloo), the same global batch (2 packed rows = 1 per process, or 2 x 2
    accumulation micro-batches) gives the same losses as one process."""
    store, vocab = random_store
    cfg = TrainConfig(epochs=2, keep_last_n=0, **{**TINY, "batch_size": 4})
    train_draft(cfg.model_copy(update={"grad_accum_steps": 2}), store, vocab, tmp_path / "one", verifier=tiny_llama_verifier)
    two = train_draft(cfg.model_copy(update={"nproc": 2, "parallel": parallel}), store, vocab,
                      tmp_path / "two", verifier=tiny_llama_verifier)
    assert two.nproc == 2 and "[train]" in (tmp_path / "two" / "train-rank0.log").read_text()
    _assert_same_metrics(_metrics(tmp_path / "one"), _metrics(tmp_path / "two"), tol=1e-5)
    a = load_file(str(tmp_path / "one/checkpoints/epoch-002/model.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/epoch-002/model.safetensors"))
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-5) for k in a)


def test_bad_input_one_clear_error_each(random_store, tiny_llama_verifier, tmp_path):
    from conftest import save_tiny_llama

    store, vocab = random_store
    cfg = TrainConfig(epochs=1, **TINY)
    wide = save_tiny_llama(tmp_path / "wide-verifier", hidden_size=128)
    with pytest.raises(TrainError, match=r"store .*store.json has hidden_size 64 but the verifier .*wide-verifier/"
                                         r"config.json has hidden_size 128"):
        train_draft(cfg, store, vocab, tmp_path / "o1", verifier=wide)
    init_store(tmp_path / "empty", verifier=tiny_llama_verifier, aux_layer_ids=[1, 2, 3], hidden_size=64,
               num_samples=5, dtype="float32")
    with pytest.raises(TrainError, match=r"store .*empty is empty: no finished samples"):
        train_draft(cfg, tmp_path / "empty", vocab, tmp_path / "o2", verifier=tiny_llama_verifier)
    big = tmp_path / "big-vocab" / "mapping.safetensors"
    big.parent.mkdir()
    save_file({"d2t": torch.zeros(9000, dtype=torch.int64), "t2d": torch.ones(9000, dtype=torch.bool)}, str(big))
    with pytest.raises(TrainError, match=r"draft vocab 9000 is larger than the verifier's vocabulary \(8192 tokens"):
        train_draft(cfg, store, big, tmp_path / "o3", verifier=tiny_llama_verifier)
    other = save_tiny_llama(tmp_path / "other-verifier", seed=1)
    with pytest.raises(TrainError, match="extracted from another verifier"):
        train_draft(cfg, store, vocab, tmp_path / "o4", verifier=other)
    with pytest.raises(TrainError, match="batch_size 3 .* not a multiple of nproc 1 x grad_accum_steps 2"):
        train_draft(cfg.model_copy(update={"batch_size": 3, "grad_accum_steps": 2}), store, vocab, tmp_path / "o5", verifier=tiny_llama_verifier)
    assert not (tmp_path / "o1" / "checkpoints").exists()  # nothing half-written


def test_train_task_returns_the_checkpoint_artifact(random_store, tiny_llama_verifier, tmp_path):
    from eagle3.extract.stage import HiddenStates
    from eagle3.train.stage import DraftCheckpoint
    from eagle3.vocab import VocabMapping
    from tasks.common import reusable
    from tasks.train import train_draft_task

    store, vocab = random_store
    store_artifact = HiddenStates.load(store.parent)  # what the extraction stage wrote beside its store
    vocab_artifact = VocabMapping.load(vocab.parent)
    cfg = TrainConfig(epochs=1, **TINY)
    m = train_draft_task.fn(cfg, store_artifact, vocab_artifact, str(tmp_path))
    assert isinstance(m, DraftCheckpoint) and reusable(m) and len(m.model_dump_json()) < 20_000
    assert m.weights_sha256 == sha256_file(Path(m.checkpoint_dir) / "model.safetensors")
    assert m.epochs_done == 1 and m.verifier == store_artifact.verifier and m.aux_layer_ids == [1, 2, 3]
    assert m.final_val["sim_accept_len"] >= 1.0 and len(m.final_val["acc_per_step"]) == 3
    # the same settings with another log cadence train in the same folder (and resume there)
    again = train_draft_task.fn(cfg.model_copy(update={"log_every_steps": 5}), store_artifact, vocab_artifact,
                                str(tmp_path))
    assert again.out_dir == m.out_dir and again.weights_sha256 == m.weights_sha256


def test_worker_bad_input_reaches_the_caller(random_store, tiny_llama_verifier, tmp_path):
    """A bad-input error inside the torchrun workers is re-raised in the caller with its own message."""
    _, vocab = random_store
    init_store(tmp_path / "empty", verifier=tiny_llama_verifier, aux_layer_ids=[1, 2, 3], hidden_size=64,
               num_samples=5, dtype="float32")
    with pytest.raises(TrainError, match=r"store .*empty is empty: no finished samples"):
        train_draft(TrainConfig(epochs=1, nproc=2, **TINY), tmp_path / "empty", vocab,
                    tmp_path / "out", verifier=tiny_llama_verifier)


def test_trains_against_a_kimi_like_sharded_nested_verifier(kimi_like_target, tmp_path):
    """DeepseekV3 (MLA + MoE) nested under `language_model.` and sharded, as Kimi-K2.5 ships: the teacher head and
    the embedding come through the safetensors index; the checkpoint loads back with the verifier's embedding."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (40, 70, 55, 90, 30, 64, 81, 47)]
    masks = [[0] * 10 + [1] * (len(x) - 10) for x in ids]
    store, vocab = make_store(tmp_path, kimi_like_target, ids, masks, [1, 3, 4], 128, 1024)
    r = train_draft(TrainConfig(epochs=1, val_ratio=0.25, **TINY), store, vocab, tmp_path / "out", verifier=kimi_like_target)
    cfg = json.loads((Path(r.checkpoint_dir) / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["eagle_aux_hidden_state_layer_ids"]) == (1024, 128, [1, 3, 4])
    draft = ckpt.load_draft(r.checkpoint_dir)  # embedding read from the verifier named in eagle3_run.json
    assert draft.embed_tokens.weight.shape == (1024, 64)
