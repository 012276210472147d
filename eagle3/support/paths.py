"""Where things live: the checkout (presets, bundled models and data), and the separate vLLM interpreter (see
scripts/setup_envs.sh for why vLLM has its own environment)."""

from __future__ import annotations

import os
from pathlib import Path

from eagle3.engine.settings import CPU_KV_CACHE_ENV, CPU_KV_CACHE_GIB

# The folder holding the `eagle3` package: the checkout when run from one (what presets, bundled models and data
# are relative to); site-packages when the library is installed elsewhere (then nothing below exists there).
REPO_ROOT = Path(__file__).resolve().parents[2]
PREFECT_YAML = REPO_ROOT / "prefect.yaml"  # the presets (definitions.presets) and deployments
BUNDLED_VERIFIER = REPO_ROOT / "models" / "tiny-chat-verifier"
BUNDLED_DATA = REPO_ROOT / "data" / "stdlib-chat"
MODELS_DIR = REPO_ROOT / "models"  # bundled and setup-converted verifiers (models/smollm2-135m-instruct: git-ignored)
VLLM_PYTHON_ENV = "EAGLE3_VLLM_PYTHON"


def resolve_path(p: str | os.PathLike, must_exist: bool = True) -> str:
    """Relative paths mean relative to the checkout (presets ship checkout-relative paths, portable between
    machines); URLs, absolute paths and names that are not in the checkout (e.g. a Hugging Face id) pass through."""
    p = str(p)
    if "://" in p or Path(p).is_absolute():
        return p
    in_repo = REPO_ROOT / p
    return str(in_repo) if in_repo.exists() or not must_exist else p


def vllm_python(explicit: str | None = None) -> str:
    """The interpreter that has vLLM: ``explicit``, else $EAGLE3_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    candidate = explicit or os.environ.get(VLLM_PYTHON_ENV) or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(candidate).exists():
        raise FileNotFoundError(
            f"vLLM interpreter not found: {candidate}. Run scripts/setup_envs.sh to create .venv-vllm, or set "
            f"{VLLM_PYTHON_ENV} (or the vllm_python setting) to the python of an existing vLLM install."
        )
    return candidate


def vllm_subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM subprocess: the checkout on PYTHONPATH so it can import `eagle3` helpers."""
    env = dict(os.environ)
    if PREFECT_YAML.is_file():  # a checkout: the vLLM interpreter imports eagle3 from it (installed: from its own env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault(CPU_KV_CACHE_ENV, str(CPU_KV_CACHE_GIB))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update(extra)
    return env
