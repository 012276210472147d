"""Shared tiny models for tests, built from configs in this one place (deterministic seeds, nothing downloaded).

* ``tiny_llama_verifier``: a random-init 4-layer Llama saved with save_pretrained (float32), plus the bundled
  tokenizer when it exists, for tests that need a real model folder but not a trained one.
* ``kimi_like_target``: a random-init DeepseekV3 (MLA + MoE) language model saved SHARDED under the
  ``language_model.`` prefix with a nested ``text_config``, as Kimi-K2.5 ships, to prove that the code finds
  ``embed_tokens``, the final ``norm`` and ``lm_head`` through the safetensors index.
* ``kimi_shaped``: Kimi-K2.5's own layout and widths (tools/kimi_mini.py: MLA 512/1536/64/128/128, yarn rope,
  noaux_tc routing, per-expert tensors, a vision tower) at test size, random weights: what vLLM's CPU build serves
  through KimiK25ForConditionalGeneration.

Prefect, real parts only: ``prefect_harness`` (Prefect's test harness, a temporary server for flows run in this
process) and ``prefect_server`` (``prefect server start`` on a free loopback port with every service, as on a real
host: workers, deployments, automations; the UI off). One of each per test session, started on first use.
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

from tasks.prefect_env import apply_prefect_env_defaults, start_local_server, stop_process_group

# Prefect reads its logging and analytics settings when it is first imported: set ours before any test imports it
apply_prefect_env_defaults()

REPO = Path(__file__).resolve().parent.parent
BUNDLED_VERIFIER = REPO / "models" / "tiny-chat-verifier"
BUNDLED_DATA = REPO / "data" / "stdlib-chat"

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


def vllm_env_problem() -> str | None:
    """Why the vLLM environment is unusable here (None when it is there)."""
    from eagle3.support.paths import vllm_python

    try:
        vllm_python()
    except FileNotFoundError as e:
        return str(e)
    return None


def pytest_runtest_setup(item):
    """The one rule for tests marked ``vllm``: without the vLLM environment they skip on a developer's machine, and
    FAIL under CI=true (a broken setup step must not give a green run)."""
    if item.get_closest_marker("vllm") is None or (problem := vllm_env_problem()) is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and a vLLM test cannot run: {problem}", pytrace=False)
    pytest.skip(f"needs the vLLM environment: {problem}")


@pytest.fixture(scope="session", autouse=True)
def private_lock_dir(tmp_path_factory):
    """Every test's GPU/host locks in a folder of its own: parallel test runs (other checkouts) never contend."""
    mp = pytest.MonkeyPatch()
    mp.setenv("EAGLE3_LOCK_DIR", str(tmp_path_factory.mktemp("locks")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_llama_verifier(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "verifier")


@pytest.fixture(scope="session")
def kimi_like_target(tmp_path_factory) -> Path:
    return save_kimi_like_target(tmp_path_factory.mktemp("kimi-like") / "target")


# a Kimi-shaped verifier at test size: Kimi-K2.5's MLA widths (vLLM's CPU MLA kernel needs kv_lora_rank + rope = 576),
# yarn rope, routing and nested layout (tools/kimi_mini.py), random weights, small hidden / layers / experts
KIMI_SHAPED_SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,  # noqa: C408
                         num_hidden_layers=4, n_routed_experts=4)


@pytest.fixture(scope="session")
def kimi_shaped(tmp_path_factory) -> Path:
    from tools.kimi_mini import random_kimi_shaped

    return random_kimi_shaped(tmp_path_factory.mktemp("kimi-shaped") / "verifier", **KIMI_SHAPED_SMALL)


@pytest.fixture(scope="session")
def bundled_verifier() -> Path:
    if not (BUNDLED_VERIFIER / "model.safetensors").exists():
        pytest.fail(f"bundled verifier missing at {BUNDLED_VERIFIER}: run scripts/build_tiny_verifier.py")
    return BUNDLED_VERIFIER


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, converted by scripts/setup_envs.sh (a real instruct LLM: 30 layers, hidden 576)."""
    from eagle3.support.gguf_convert import SMOLLM2_DIR, is_converted, smollm2_source

    if not is_converted(SMOLLM2_DIR, smollm2_source()):
        pytest.fail(f"SmolLM2 verifier missing at {SMOLLM2_DIR}: run scripts/setup_envs.sh")
    return SMOLLM2_DIR


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread (OpenMP sync dominates on 2 busy cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------- Prefect servers

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


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """Prefect's test harness: flows called in this process run against a temporary server (SQLite); its startup
    timeout is tasks/prefect_env's (``server_startup_timeout=None`` reads the setting)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-home")))  # cache records live there
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=None):
        yield
    mp.undo()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """``prefect server start`` on a free loopback port (SQLite in a temp PREFECT_HOME, all services, no UI).
    Yields (env for CLI calls and flow processes against it, its PREFECT_HOME)."""
    home = tmp_path_factory.mktemp("prefect-server-home")
    try:
        server, env = start_local_server(home, extra_env={"PREFECT_LOGGING_LEVEL": "INFO", "EAGLE3_REPO_DIR": str(REPO)})
    except RuntimeError as e:
        pytest.fail(str(e))
    yield env, home
    stop_process_group(server)
