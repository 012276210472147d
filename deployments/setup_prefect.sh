#!/usr/bin/env bash
# One-time setup against a Prefect server (PREFECT_API_URL must point at it); safe to run again:
#   * the process work pool the GPU host's worker polls,
#   * the host's global concurrency limit, one slot per GPU (extraction occupies every GPU it uses, training the
#     GPUs it uses; tasks acquire it with strict=True in deployments, so a missing limit is an error, not a free pass),
#   * the automation that marks a flow run Crashed when its heartbeats stop (tasks/crash_detection.py).
# Uses the checkout's .venv (no need to activate it); PREFECT=/path/to/prefect overrides the CLI, and the python
# next to that CLI runs the automation step.
# Usage: deployments/setup_prefect.sh [POOL] [LIMIT_NAME] [NUM_GPUS]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
POOL=${1:-${EAGLE3_WORK_POOL:-gpu-host}}
LIMIT=${2:-${EAGLE3_GPU_LIMIT:-gpu-host-gpus}}
if [ -n "${3:-}" ]; then
  GPUS=$3
elif command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L | wc -l)
else
  GPUS=1
fi
PREFECT=${PREFECT:-$ROOT/.venv/bin/prefect}
if ! PREFECT_BIN=$(command -v "$PREFECT"); then
  echo "prefect CLI not found at '${PREFECT}': run scripts/setup_envs.sh in $ROOT, or set PREFECT=/path/to/prefect" >&2
  exit 1
fi
PREFECT=$PREFECT_BIN
PYTHON=$(dirname "$PREFECT")/python
"$PREFECT" work-pool inspect "$POOL" >/dev/null 2>&1 || "$PREFECT" work-pool create "$POOL" --type process
if "$PREFECT" global-concurrency-limit inspect "$LIMIT" >/dev/null 2>&1; then
  "$PREFECT" global-concurrency-limit update "$LIMIT" --limit "$GPUS"
else
  "$PREFECT" global-concurrency-limit create "$LIMIT" --limit "$GPUS"
fi
(cd "$ROOT" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m tasks.crash_detection)
echo "work pool '$POOL' (process) and global concurrency limit '$LIMIT' = $GPUS GPU slot(s) are ready"
