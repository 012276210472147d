"""Fixtures and the vLLM rule of the test session; the builders and constants they use live in tests/helpers.py
(tests import those from there, never from this file or from another test module).

Shared tiny models for tests, built from configs in one place (deterministic seeds, nothing downloaded).

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

import os
from pathlib import Path

import pytest
import torch
from helpers import (
    BUNDLED_VERIFIER,
    KIMI_SHAPED_SMALL,
    REPO,
    make_store,
    save_kimi_like_target,
    save_tiny_llama,
)

from tasks.prefect_env import apply_prefect_env_defaults, start_local_server, stop_process_group

# Prefect reads its logging and analytics settings when it is first imported: set ours before any test imports it
apply_prefect_env_defaults()


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


@pytest.fixture(scope="session")
def kimi_shaped(tmp_path_factory) -> Path:
    from tools.kimi_mini import random_kimi_shaped

    return random_kimi_shaped(tmp_path_factory.mktemp("kimi-shaped") / "verifier", **KIMI_SHAPED_SMALL)


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


@pytest.fixture(scope="session")
def bundled_verifier() -> Path:
    if not (BUNDLED_VERIFIER / "model.safetensors").exists():
        pytest.fail(f"bundled verifier missing at {BUNDLED_VERIFIER}: run tools/build_tiny_verifier.py")
    return BUNDLED_VERIFIER


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, converted by scripts/setup_envs.sh (a real instruct LLM: 30 layers, hidden 576)."""
    from tools.gguf_convert import SMOLLM2_DIR, is_converted, smollm2_source

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
