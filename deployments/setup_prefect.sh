#!/usr/bin/env bash
# One-time setup against a Prefect server (PREFECT_API_URL must point at it):
#   * the process work pool the GPU host's worker polls,
#   * the host's global concurrency limit, one slot per GPU (extraction occupies every GPU it uses, training the
#     GPUs it uses; tasks acquire it with strict=True in deployments, so a missing limit is an error, not a free pass).
# Usage: deployments/setup_prefect.sh [POOL] [LIMIT_NAME] [NUM_GPUS]
set -euo pipefail
POOL=${1:-${EAGLE3_WORK_POOL:-gpu-host}}
LIMIT=${2:-${EAGLE3_GPU_LIMIT:-gpu-host-gpus}}
if [ -n "${3:-}" ]; then
  GPUS=$3
elif command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L | wc -l)
else
  GPUS=1
fi
PREFECT=${PREFECT:-prefect}
"$PREFECT" work-pool inspect "$POOL" >/dev/null 2>&1 || "$PREFECT" work-pool create "$POOL" --type process
if "$PREFECT" global-concurrency-limit inspect "$LIMIT" >/dev/null 2>&1; then
  "$PREFECT" global-concurrency-limit update "$LIMIT" --limit "$GPUS"
else
  "$PREFECT" global-concurrency-limit create "$LIMIT" --limit "$GPUS"
fi
echo "work pool '$POOL' (process) and global concurrency limit '$LIMIT' = $GPUS GPU slot(s) are ready"
