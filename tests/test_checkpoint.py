"""Draft checkpoints (vLLM folder layout, dtype, provenance), trainer state without pickle, keep_last_n / best."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import torch
from helpers import tiny_draft
from safetensors import safe_open

from eagle3.draft import checkpoint as ckpt
from eagle3.support.paths import REPO_ROOT, vllm_python, vllm_subprocess_env

CONTRACT = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def test_vllm_folder_layout_dtype_and_provenance(tiny_llama_verifier, tmp_path):
    draft = tiny_draft(tiny_llama_verifier)
    folder = ckpt.save_draft(tmp_path / "epoch-001", draft.config, draft.state_dict(),
                             {"verifier": str(tiny_llama_verifier), "run_config": {"lr": 1e-4}})
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "eagle3_run.json", "model.safetensors"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert names == CONTRACT  # no embedding by default: vLLM shares the verifier's (same hidden size)
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert torch.equal(f.get_tensor("d2t"), draft.d2t)
    run = json.loads((folder / "eagle3_run.json").read_text())
    assert run["run_config"] == {"lr": 1e-4} and run["versions"]["torch"] == torch.__version__
    assert run["git_revision"] is None or len(run["git_revision"].split("-")[0]) == 40
    # round trip: embedding back from the verifier named in eagle3_run.json, weights = bf16-rounded originals
    back = ckpt.load_draft(folder)
    assert torch.equal(back.embed_tokens.weight, draft.embed_tokens.weight)
    assert torch.equal(back.fc.weight, draft.fc.weight.to(torch.bfloat16).float())
    assert not back.embed_tokens.weight.requires_grad


def test_embedding_saved_when_asked_and_float32_exact(tiny_llama_verifier, tmp_path):
    draft = tiny_draft(tiny_llama_verifier, dtype="float32")
    folder = ckpt.save_draft(tmp_path / "d", draft.config, draft.state_dict(), {}, include_embedding=True)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == CONTRACT | {"embed_tokens.weight"}
    back = ckpt.load_draft(folder)  # no verifier needed
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), draft.state_dict().values()))


def test_load_errors_name_the_file(tiny_llama_verifier, tmp_path):
    draft = tiny_draft(tiny_llama_verifier, dtype="float32")
    folder = ckpt.save_draft(tmp_path / "d", draft.config, draft.state_dict(), {})
    with pytest.raises(ckpt.CheckpointError, match="no embed_tokens.weight and no verifier path"):
        ckpt.load_draft(folder)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ckpt.CheckpointError, match=r"missing tensors \['midlayer.hidden_norm.weight'\]"):
        ckpt.load_draft(folder, verifier_path=tiny_llama_verifier)


def test_trainer_state_roundtrip_without_pickle(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    import random

    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "progress": {"epoch": 2, "step": 7},
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "none": None}
    folder = ckpt.save_trainer_state(tmp_path / "latest", state)
    assert sorted(p.name for p in folder.iterdir()) == ["trainer_state.json", "trainer_state.safetensors"]
    back = ckpt.load_trainer_state(folder)
    assert back["progress"] == {"epoch": 2, "step": 7} and back["none"] is None
    assert back["rng"]["python"] == state["rng"]["python"]  # tuples stay tuples
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    opt2 = torch.optim.AdamW(model.parameters(), lr=5.0)
    opt2.load_state_dict(back["optimizer"])  # int param ids and tuple betas survive
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95) and opt2.param_groups[0]["lr"] == 1e-3
    assert torch.equal(opt2.state[model.weight]["exp_avg_sq"], opt.state[model.weight]["exp_avg_sq"])
    with pytest.raises(ckpt.CheckpointError, match="cannot store a object without pickle"):
        ckpt.save_trainer_state(tmp_path / "bad", {"x": object()})


def test_keep_last_n_never_deletes_best(tmp_path):
    root = tmp_path / "checkpoints"
    for e in range(1, 6):
        (root / ckpt.epoch_dir_name(e)).mkdir(parents=True)
    ckpt.set_best(root, root / "epoch-002")
    deleted = ckpt.prune_epochs(root, keep_last_n=2)
    assert sorted(p.name for p in deleted) == ["epoch-001", "epoch-003"]
    assert [p.name for p in ckpt.list_epoch_dirs(root)] == ["epoch-002", "epoch-004", "epoch-005"]
    assert ckpt.best_dir(root) == (root / "epoch-002").resolve()
    ckpt.set_best(root, root / "epoch-005")
    ckpt.prune_epochs(root, keep_last_n=1)
    assert [p.name for p in ckpt.list_epoch_dirs(root)] == ["epoch-005"]
    assert ckpt.prune_epochs(root, keep_last_n=0) == []


@pytest.mark.vllm
def test_vllm_loads_the_checkpoint_and_drafts(tmp_path):
    """The real vLLM CPU build loads a saved draft (no embedding in the file: vLLM shares the verifier's) and runs
    EAGLE-3 speculative decoding with it. head_dim 32: vLLM's CPU attention has no kernel for 16."""
    from helpers import save_tiny_llama

    verifier = save_tiny_llama(tmp_path / "verifier", hidden_size=128)
    draft = tiny_draft(verifier, dtype="float32")
    folder = ckpt.save_draft(tmp_path / "draft", draft.config, draft.state_dict(), {"verifier": str(verifier)})
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM(model={str(verifier)!r}, skip_tokenizer_init=True, dtype="float32",
                      enforce_eager=True, disable_log_stats=False, max_model_len=256,
                      speculative_config={{"method": "eagle3", "model": {str(folder)!r},
                                          "num_speculative_tokens": 3}})
            out = llm.generate([{{"prompt_token_ids": [5, 17, 99, 1000]}}],
                               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            m = {{x.name: getattr(x, "value", None) for x in llm.get_metrics()}}
            print("RESULT", json.dumps({{"tokens": len(out[0].outputs[0].token_ids),
                                        "drafts": m.get("vllm:spec_decode_num_drafts")}}))
    """))
    proc = subprocess.run([vllm_python(), str(script)], capture_output=True, text=True, timeout=600,
                          env=vllm_subprocess_env(), cwd=REPO_ROOT, check=False)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(line[0][len("RESULT "):])
    assert res["tokens"] == 12 and res["drafts"] and res["drafts"] > 0


def test_written_safetensors_get_the_usual_file_mode(tiny_llama_verifier, tmp_path):
    """safetensors' writer creates 0600 files: a vLLM server under another account could not read the checkpoint.
    Under umask 022 every safetensors file the project writes is 0644 (checkpoint, trainer state, vocab mapping,
    the vLLM extraction work file)."""
    import os
    import stat
    import sys

    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, "tests")
        from helpers import tiny_draft
        from eagle3.draft import checkpoint as ckpt
        from eagle3.extract.vllm_backend import write_work_file
        from eagle3.vocab import save_mapping
        out = {str(tmp_path)!r}
        draft = tiny_draft({str(tiny_llama_verifier)!r})
        ckpt.save_draft(out + "/epoch-001", draft.config, draft.state_dict(), {{}})
        ckpt.save_trainer_state(out + "/latest", {{"w": torch.ones(3)}})
        d2t, t2d = draft.d2t, draft.t2d
        save_mapping(out + "/vocab", d2t, t2d, {{}})
        import datasets, pathlib
        rows = datasets.Dataset.from_dict({{"input_ids": [[1, 2]], "loss_mask": [[0, 1]]}})
        write_work_file(pathlib.Path(out + "/work/todo.safetensors"), rows, [0])
    """)
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, preexec_fn=lambda: os.umask(0o022))
    files = ["epoch-001/model.safetensors", "latest/trainer_state.safetensors", "vocab/mapping.safetensors",
             "work/todo.safetensors", "epoch-001/config.json", "vocab/report.json"]
    assert {f: stat.filemode((tmp_path / f).stat().st_mode) for f in files} == {f: "-rw-r--r--" for f in files}
