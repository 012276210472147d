#!/usr/bin/env bash
# The GPU run: every test marked `gpu`, under pytest on a CUDA host, with the packages the host lacks installed from
# carried wheels, under one time budget.
#
#     bash bench/gpu_smoke.sh [pytest arguments]    # default: the tests/ files that mark tests `gpu`
#
# The tests (their module docstrings list the checks):
#   tests/test_gpu_smoke.py   the CUDA paths no CPU test runs, with their figures: environment (versions, GPU, NCCL,
#                             bf16 matmul TFLOP/s); extraction on the bundled verifier and on a ~0.5 GB random Llama
#                             (injected OOMs halve the budget with the verifier kept loaded, states vs an independent
#                             forward, a real CUDA OOM under a memory cap); training in bf16 autocast vs float32 on the
#                             CPU, pinned loader batches, the CUDA peak within the memory plan; the FP8 store
#                             (dequantized on the device like on the CPU, losses near the bf16 store's); DDP / FSDP
#                             launches equal to the single-process run
#   tests/test_gpu_lock.py    the CUDA preflight (passes the idle GPU, refuses it with 30% held), the GPU's lock
#   tests/test_gpu_kimi.py    Kimi-K2.5's architecture path on kimi-mini (models/kimi-mini must be there)
#   tests marked `vllm` too   skip without a vLLM interpreter (EAGLE3_VLLM_PYTHON; conftest.py's rule)
#
# Output: pytest -v -s: each test's `[gpu] ...` figure lines (tok/s, step ms, CUDA peaks; never asserted) and its
# PASSED / FAILED / SKIPPED, the slowest durations, the summary (-ra). The same text goes to $OUT/gpu_smoke.log
# ($WORK/gpu_smoke.log without $OUT), JUnit XML to gpu_smoke.xml beside it. Exit status: pytest's (0: nothing
# failed), 124 when the budget ran out (the log holds what ran until then).
#
# Time: GPU_SMOKE_BUDGET_S (default 450 s, the wheels included) bounds the whole run; pytest gets what is left and is
# killed 10 s after it (estimated 4-5 minutes on one H200, never measured there). Wheels: `bash bench/gpu_smoke_wheels.sh` here first (~11.5 MB into .gpu-wheels/, git-ignored);
# they install with pip --no-index --target into $WORK/site-packages, put on PYTHONPATH ahead of the interpreter's
# own packages (not a venv: an image's python3 may itself be a venv, whose --system-site-packages child would see the
# base interpreter's packages, not torch). GPU_SMOKE_PYTHON names the interpreter (default python3).
#
# With the device tool (one call; $OUT/gpu_smoke.log and gpu_smoke.xml come back): run the wheels script in the
# checkout the session started in, then
#     run(command="bash bench/gpu_smoke.sh", carry=[".gpu-wheels"], timeout_s=540)
# and give_back unless rerunning at once. Without a GPU the same tests run on the CPU, float32 at small sizes (the
# CUDA-only checks skip): EAGLE3_GPU_DRY_RUN=1 .venv/bin/python -m pytest -m gpu tests/test_gpu_smoke.py
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
BUDGET_S=${GPU_SMOKE_BUDGET_S:-450}
PY=${GPU_SMOKE_PYTHON:-python3}
WORK=${GPU_SMOKE_WORK:-$(mktemp -d /tmp/gpu-smoke.XXXXXX)}
mkdir -p "$WORK"
LOG=${OUT:+$OUT/gpu_smoke.log}
LOG=${LOG:-$WORK/gpu_smoke.log}
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

# --- interpreter and wheels ------------------------------------------------------------------------------------
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
say "[setup] $("$PY" --version 2>&1) at $(command -v "$PY"); work $WORK; budget ${BUDGET_S}s; $(uptime)"
case $pyver in
  3.10|3.11|3.12|3.13) ;;
  *) say "[setup] FAIL: python '$pyver': the carried wheels cover CPython 3.10-3.13"; exit 1 ;;
esac
if [[ ! -f .gpu-wheels/requirements.txt ]]; then
  say "[setup] FAIL: .gpu-wheels/ missing: run 'bash bench/gpu_smoke_wheels.sh' here and carry .gpu-wheels"; exit 1
fi
if ! "$PY" -c 'import pytest' 2>/dev/null; then
  say "[setup] FAIL: no pytest in $PY"; exit 1
fi
# datasets 5.2 needs pyarrow >= 24; the interpreter's pyarrow is used (too large to carry); 5.0.0 takes pyarrow >= 21
pyarrow=$("$PY" -c 'import importlib.metadata as m; print(m.version("pyarrow"))' 2>/dev/null || echo none)
datasets_pin=datasets==5.2.0
if [[ $pyarrow == none ]]; then
  say "[setup] FAIL: no pyarrow in $PY (the library needs it; it is too large to carry)"; exit 1
elif [[ ${pyarrow%%.*} -lt 24 ]]; then
  datasets_pin=datasets==5.0.0
  [[ ${pyarrow%%.*} -lt 21 ]] && say "[setup] warning: pyarrow $pyarrow is older than any carried datasets wants (21)"
fi
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
     --target "$WORK/site-packages" --find-links .gpu-wheels -r .gpu-wheels/requirements.txt "$datasets_pin" \
     >>"$LOG" 2>&1; then
  say "[setup] FAIL: pip could not install the carried wheels (see $LOG)"; tail -20 "$LOG"; exit 1
fi
say "[setup] installed $(ls "$WORK/site-packages" | grep -c dist-info) carried wheels ($datasets_pin for pyarrow $pyarrow)"
export PYTHONPATH="$WORK/site-packages:$REPO" PYTHONUNBUFFERED=1 HF_HOME="$WORK/hf" HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
# one node, one worker: NCCL's bootstrap needs no network interface but loopback
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}

# --- the tests -----------------------------------------------------------------------------------------------------
if (($#)); then
  args=("$@")
else
  mapfile -t args < <(grep -l 'pytest.mark.gpu' tests/test_*.py)
fi
left=$((BUDGET_S - SECONDS))
say "[setup] pytest -m gpu ${args[*]} (${left}s left)"
timeout -k 10 "$left" "$PY" -m pytest -m gpu -v -s -ra -p no:cacheprovider --durations=15 --log-level=INFO \
  --basetemp "$WORK/pytest" --junitxml "$(dirname "$LOG")/gpu_smoke.xml" "${args[@]}" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
((rc == 124 || rc == 137)) && say "[gpu_smoke] TIMEOUT: the budget of ${BUDGET_S}s ran out (pytest killed)" && rc=124
say "[gpu_smoke] exit $rc after ${SECONDS}s of ${BUDGET_S}s; $(uptime)"
exit "$rc"
