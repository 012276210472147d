#!/usr/bin/env bash
# Start the Prefect process worker on the GPU host, from the checkout (flows run with the checkout's .venv).
#   CUDA_VISIBLE_DEVICES   which GPUs this worker's flow runs may use (default: all)
#   EAGLE3_VLLM_PYTHON     python of the vLLM install used for extraction (vllm backend) and validation
#                          (default: <checkout>/.venv-vllm/bin/python, created by scripts/setup_envs.sh)
#   PREFECT_API_URL        the Prefect server
#   PREFECT                the prefect CLI (default: <checkout>/.venv/bin/prefect; no need to activate the venv:
#                          flow runs start with the worker's own interpreter)
# Usage: deployments/start_worker.sh [POOL] [WORK_QUEUE]
set -euo pipefail
cd "$(dirname "$0")/.."
POOL=${1:-${EAGLE3_WORK_POOL:-gpu-host}}
QUEUE=${2:-${EAGLE3_WORK_QUEUE:-default}}
export EAGLE3_REPO_DIR=${EAGLE3_REPO_DIR:-$(pwd)}
export PREFECT_LOGGING_EXTRA_LOGGERS=${PREFECT_LOGGING_EXTRA_LOGGERS:-eagle3}
: "${PREFECT_API_URL:?set PREFECT_API_URL to the Prefect server, e.g. http://prefect.internal:4200/api}"
PREFECT=${PREFECT:-$(pwd)/.venv/bin/prefect}
if ! PREFECT_BIN=$(command -v "$PREFECT"); then
  echo "prefect CLI not found at '${PREFECT}': run scripts/setup_envs.sh in $(pwd), or set PREFECT=/path/to/prefect" >&2
  exit 1
fi
exec "$PREFECT_BIN" worker start --pool "$POOL" --work-queue "$QUEUE" --type process
