"""What tests share besides fixtures (tests/conftest.py holds those): paths, tiny model and dataset builders, the
draft vocabulary tables, and the helpers that start and wait for processes. Tests import from here
(``from helpers import ...``), never from conftest or from another test module.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BUNDLED_VERIFIER = REPO / "models" / "tiny-chat-verifier"
BUNDLED_DATA = REPO / "data" / "stdlib-chat"

# GPU tests (marker ``gpu``, each module also marks itself ``cuda_or_dry_run``): they run on CUDA, skip without it, and
# EAGLE3_GPU_DRY_RUN=1 runs the same code on the CPU (float32, small sizes, no CUDA figures) so that it cannot rot
# between GPU runs (bench/gpu_smoke.sh is the GPU run)
GPU_DRY_RUN = os.environ.get("EAGLE3_GPU_DRY_RUN") == "1"
cuda_or_dry_run = pytest.mark.skipif(not (torch.cuda.is_available() or GPU_DRY_RUN),
                                     reason="needs CUDA (EAGLE3_GPU_DRY_RUN=1: the same code on the CPU)")

TINY_LLAMA = dict(  # noqa: C408 - reads like the config it is
    vocab_size=8192,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

TINY_DEEPSEEK_V3 = dict(  # noqa: C408 - reads like the config it is
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def save_tiny_llama(out: Path, seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    if (BUNDLED_VERIFIER / "tokenizer.json").exists() and cfg.vocab_size == 8192:
        for f in BUNDLED_VERIFIER.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, out / f.name)
    return out


def save_kimi_like_target(out: Path, seed: int = 0, shard_size: str = "200KB") -> Path:
    """DeepseekV3 language model nested like Kimi-K2.5: weights `language_model.<hf name>`, config `text_config`."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**TINY_DEEPSEEK_V3)
    model = DeepseekV3ForCausalLM(cfg).eval()
    out.mkdir(parents=True, exist_ok=True)
    state = {f"language_model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    # shard by a byte budget, as save_pretrained does, so the three head tensors land in different files
    budget = 200_000
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > budget:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                    "weight_map": weight_map}, indent=2)
    )
    text_config = cfg.to_dict()
    text_config["torch_dtype"] = "float32"
    (out / "config.json").write_text(
        json.dumps({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                    "text_config": text_config, "torch_dtype": "float32"}, indent=2)
    )
    return out


def vocab_tables(vocab: int, draft_vocab: int, seed: int | None = 0, kept=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a draft vocabulary: the target ids ``kept`` (ascending), else ``draft_vocab`` random ids
    (``seed``), else (seed None) every other id 0, 2, 4, ...; built by the library's one owner, eagle3.vocab."""
    from eagle3.vocab import tables_for

    if kept is None:
        kept = (torch.arange(0, 2 * draft_vocab, 2) if seed is None else
                torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values)
    return tables_for(torch.as_tensor(kept), vocab)


def make_dataset(path: Path, lengths: list[int], vocab: int, seed: int = 0) -> Path:
    """A prepared-dataset folder (the prepare stage's Arrow layout) of random token ids; the last two thirds of
    each sample are loss-masked (assistant)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    mask = [[int(j >= n // 3) for j in range(n)] for n in lengths]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask},
                                    features=datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                                                "loss_mask": datasets.Sequence(datasets.Value("int8"))}))
    ds.save_to_disk(str(path))
    return path


# a Kimi-shaped verifier at test size: Kimi-K2.5's MLA widths (vLLM's CPU MLA kernel needs kv_lora_rank + rope = 576),
# yarn rope, routing and nested layout (tools/kimi_mini.py), random weights, small hidden / layers / experts
KIMI_SHAPED_SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,  # noqa: C408
                         num_hidden_layers=4, n_routed_experts=4)




def reference_draft_tail(draft, residual: torch.Tensor, rms) -> tuple[torch.Tensor, torch.Tensor]:
    """The part every EAGLE-3 draft layer shares after its attention, written out from the weights (the tests'
    independent references of vLLM's layers): post-attention norm, SiLU-gated MLP, residual, final norm, lm_head.
    ``residual`` [T, H]: the stream after attention; ``rms(weight, x)``: the reference's RMSNorm. Returns
    (pre-norm output [T, H], draft logits [T, draft vocab])."""
    layer = draft.midlayer
    m = rms(layer.post_attention_layernorm.weight, residual)
    mlp = layer.mlp
    y = (torch.nn.functional.silu(m @ mlp.gate_proj.weight.T) * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    prenorm = y + residual
    return prenorm, rms(draft.norm.weight, prenorm) @ draft.lm_head.weight.T

# ---------------------------------------------------------------- training stores and drafts

# training settings of the tiny mechanics tests (lr, batch in packed sequences, tokens, TTT steps, cpu)
TINY = {"lr": 3e-3, "batch_size": 2, "max_seq_len": 256, "ttt_steps": 3, "log_every_steps": 1, "device": "cpu",
        "warmup_ratio": 0.1}


def make_store(root: Path, verifier: Path, ids: list[list[int]], masks: list[list[int]], aux_layer_ids: list[int],
               draft_vocab: int, vocab_size: int, store_dtype: str = "float32") -> tuple[Path, Path]:
    """Prepared-dataset layout -> the extraction stage's store (transformers backend, float32 unless
    ``store_dtype``) + the vocab stage's mapping of exactly ``draft_vocab`` rows. Returns (store dir, mapping path)."""
    import datasets

    from eagle3.extract.stage import extract_hidden_states
    from eagle3.vocab import VocabConfig, build_vocab

    ds = root / "dataset"
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(ds))
    extract_hidden_states({"verifier": str(verifier), "aux_layer_ids": aux_layer_ids, "store_dtype": store_dtype,
                           "device": "cpu", "log_every_samples": 0,
                           "log_every_seconds": 0}, ds, root / "store")
    vocab = build_vocab(VocabConfig(draft_vocab_size=draft_vocab, size_to_data=False), ds, vocab_size,
                        root / "vocab")
    return root / "store", Path(vocab.mapping_path)


def tiny_draft(verifier: Path, dtype: str = "bfloat16", draft_vocab: int = 256):
    """An untrained draft of ``verifier`` (aux layers 1, 2, 3; every other target id in its vocabulary)."""
    from eagle3.draft.config import DraftConfig
    from eagle3.draft.model import Eagle3Draft
    from eagle3.support.verifier import VerifierSpec

    spec = VerifierSpec.from_path(verifier)
    d2t, t2d = vocab_tables(spec.vocab_size, draft_vocab, seed=None)
    cfg = DraftConfig.build(spec, draft_vocab, [1, 2, 3], torch_dtype=dtype)
    return Eagle3Draft.from_verifier(cfg, verifier, d2t, t2d)


# ---------------------------------------------------------------- processes and Prefect servers

BIN = Path(sys.executable).parent  # the pipeline venv's bin (prefect CLI)


def start_process(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """A long-running helper process (server, worker) in its own process group, output to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(what: str, check, deadline_s: float, every_s: float = 1.0):
    """``check()``'s first truthy value, read every ``every_s`` seconds; AssertionError naming ``what`` after
    ``deadline_s`` seconds (tests wait for what they read, never a fixed time)."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {deadline_s:.0f} s")
        time.sleep(every_s)


@contextlib.contextmanager
def prefect_client(env: dict):
    """A synchronous Prefect client of the server ``env`` points at (``prefect_server``'s env), whatever server this
    process's own settings name."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        yield client


