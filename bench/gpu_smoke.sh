#!/usr/bin/env bash
# GPU smoke test: the project's CUDA paths that no test on a CPU machine runs, with their figures, in under 8 minutes
# on the lent GPU machine (one H200; torch 2.11 + transformers preinstalled; no vLLM, no Prefect, no registry).
#
# Sections (bench/gpu_smoke.py, one process each, in this order; the tiny store feeds the train/launch sections):
#   env              python / torch / CUDA / package versions (which came from the carried wheels), the library
#                    imports, GPU name, NCCL version, bf16 8192^3 matmul TFLOP/s
#   preflight_locks  lock names (gpu-<CUDA_VISIBLE_DEVICES id>), cuda_preflight passes idle and refuses with 30% of
#                    the card held (naming GPU processes via pynvml / nvidia-smi); a second process is refused the
#                    GPU lock while it is held and gets it once released
#   extract_tiny     prepare (bundled stdlib chats) -> extract_hidden_states on the bundled verifier, device cuda,
#                    bf16, one injected OOM (oom_injector) at the first forward: the budget halves, the model stays
#                    loaded (model_loads 1); stored states vs an independent bf16 forward; vocab mapping
#   extract_big      a random Llama (hidden 1024 x 16 layers, vocab 32000: ~0.5 GB bf16) built on the GPU, 160
#                    samples of 256-2048 tokens at a 16384-token budget, OOMs injected at forwards 1 and 3 (budget
#                    16384 -> 8192 -> 4096); states vs an independent forward; then a REAL CUDA OOM: the process is
#                    capped (set_per_process_memory_fraction) below what the largest batches need
#   train_tiny       train_draft on one GPU (bf16 autocast) on the tiny store; its first 5 steps again in float32 on
#                    the CPU (same losses within 3%); StepLoader(pin_memory=True) batches are page-locked
#   train_big        train_draft on the big store: 2048-token packed rows x 4 per step, 7 TTT steps, 2 loader
#                    threads: step time, tok/s, CUDA peak (max_memory_allocated) vs the training memory plan
#                    (eagle3/train/memory.py if present, else "memory plan not available"); pinned vs pageable H2D
#   fp8              the tiny data extracted again into an FP8 store (float8_e4m3fn + a float32 scale per token and
#                    state); batches stay quantized (pinned) until Batch.to dequantizes them on the GPU (= the CPU
#                    dequantization); train_draft on it: losses within 10% of the bf16 store's (train_tiny)
#   launch_ddp       torch elastic launch (eagle3/train/launch.py) with one nccl worker, parallel=ddp (launch_fsdp:
#   launch_fsdp      fsdp): the draft is wrapped (DDP / FSDP2 fully_shard) and its losses equal those of the
#                    single-process run of train_tiny (2e-3 relative)
#
# Output: each section prints `[section] ok: ...` / `[section] FAIL: ...` / `[section] <figures>` lines, then
# `RESULT <section> PASS|FAIL key=value ...` (tok_s tokens/s; step_ms median optimizer step; peak_alloc_GiB /
# peak_reserved_GiB the CUDA peak of that section; state_err the worst relative L2 error of stored states; vs_cpu_rel /
# vs_single loss differences). A summary table closes the run: status, section, seconds, figures. TIMEOUT = the
# section ran past its limit (killed with its process group); SKIP = the total budget was spent before it started.
# The exit status is 1 when any section is not PASS. The library's own log lines (OOM halvings, progress) and any
# traceback go to the full log ($OUT/gpu_smoke.log when $OUT is set, else $WORK/gpu_smoke.log); a failed section's
# last 30 log lines are printed.
#
# Time: a total budget (GPU_SMOKE_BUDGET_S, default 450 s: setup included) and a per-section limit; a section gets
# min(its limit, what is left). Wheels (not on the image): `bash bench/gpu_smoke_wheels.sh` here first (~11.5 MB into
# .gpu-wheels/, git-ignored); they install with pip --no-index --target into $WORK/site-packages, put on PYTHONPATH
# ahead of the image's site-packages (not a venv: the image's python3 is itself a venv, /opt/torch/.venv, and a venv
# made from it with --system-site-packages would see the base interpreter's packages, not torch).
#
# With the device tool (one call; estimated 4-5 minutes on the H200, never measured there, at most 450 s + 10 s of
# kill grace by the budget, plus the machine's start; $OUT/gpu_smoke.log and $OUT/summary.txt come back). The tool
# sends the checkout the session started in: run the wheels script in THAT checkout, then
#     run(command="bash bench/gpu_smoke.sh", carry=[".gpu-wheels"], timeout_s=540)
# and give_back unless rerunning at once (15 minutes of device time per session leave room for one rerun).
# Here, without a GPU, the same sections at tiny sizes on the CPU, in an interpreter that sees only the GPU image's
# packages (KINDS.md's list) plus the carried wheels:
#     bash bench/gpu_smoke.sh --cpu-dry-run
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODE=gpu
[[ ${1:-} == --cpu-dry-run ]] && MODE=cpu
if [[ $MODE == gpu ]]; then
  BUDGET_S=${GPU_SMOKE_BUDGET_S:-450}
  PY=${GPU_SMOKE_PYTHON:-python3}
  LIMITS=(env:60 preflight_locks:60 extract_tiny:90 extract_big:150 train_tiny:120 train_big:120 fp8:90
          launch_ddp:90 launch_fsdp:90)
else  # 2 shared CPU cores: slower than the GPU at tiny sizes too (imports, spawned workers)
  BUDGET_S=${GPU_SMOKE_BUDGET_S:-1500}
  PY=${GPU_SMOKE_PYTHON:-.venv/bin/python}
  LIMITS=(env:120 preflight_locks:120 extract_tiny:240 extract_big:240 train_tiny:300 train_big:300 fp8:300
          launch_ddp:240 launch_fsdp:240)
fi
WORK=${GPU_SMOKE_WORK:-$(mktemp -d /tmp/gpu-smoke.XXXXXX)}
mkdir -p "$WORK"
LOG=${OUT:+$OUT/gpu_smoke.log}
LOG=${LOG:-$WORK/gpu_smoke.log}
SUMMARY=${OUT:+$OUT/summary.txt}
SUMMARY=${SUMMARY:-$WORK/summary.txt}
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

# --- interpreter and wheels ------------------------------------------------------------------------------------
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
say "[setup] mode $MODE; $("$PY" --version 2>&1) at $(command -v "$PY"); work $WORK; budget ${BUDGET_S}s; $(uptime)"
case $pyver in
  3.10|3.11|3.12|3.13) ;;
  *) say "[setup] FAIL: python '$pyver': the carried wheels cover CPython 3.10-3.13"; exit 1 ;;
esac
if [[ ! -f .gpu-wheels/requirements.txt ]]; then
  say "[setup] FAIL: .gpu-wheels/ missing: run 'bash bench/gpu_smoke_wheels.sh' here and carry .gpu-wheels"; exit 1
fi
# datasets 5.2 needs pyarrow >= 24; the image's pyarrow is used (too large to carry); 5.0.0 takes pyarrow >= 21
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
say "[setup] installed $(ls "$WORK/site-packages" | grep -c dist-info) carried wheels" \
  "($datasets_pin for pyarrow $pyarrow)"
if [[ $MODE == cpu ]]; then
  PY=$("$PY" bench/gpu_smoke.py h200-view "$WORK/h200" 2>>"$LOG")
  [[ -x $PY ]] || { say "[setup] FAIL: could not build the GPU-image view (see $LOG)"; exit 1; }
  echo "[setup] $(grep '^h200-view' "$LOG" | tail -1 | cut -c1-600)"
fi
export PYTHONPATH="$WORK/site-packages:$REPO" PYTHONUNBUFFERED=1 EAGLE3_LOCK_DIR="$WORK/locks" HF_HOME="$WORK/hf" \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
# one node, one worker: NCCL's bootstrap needs no network, and the VM's other interfaces lead nowhere
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}

# --- sections ----------------------------------------------------------------------------------------------------
declare -A STATUS SECS FIGS
ORDER=()
for item in "${LIMITS[@]}"; do
  name=${item%%:*}; limit=${item##*:}; ORDER+=("$name")
  left=$((BUDGET_S - SECONDS))
  if ((left < 20)); then
    STATUS[$name]=SKIP; SECS[$name]=0; FIGS[$name]="total budget spent"; say "[$name] SKIP: budget spent"; continue
  fi
  ((limit > left)) && limit=$left
  echo "===== $name (limit ${limit}s)" >>"$LOG"
  t0=$SECONDS
  timeout -k 10 "$limit" "$PY" bench/gpu_smoke.py --mode "$MODE" --work "$WORK" "$name" \
    2>>"$WORK/$name.err" | tee "$WORK/$name.out"
  rc=${PIPESTATUS[0]}
  SECS[$name]=$((SECONDS - t0))
  cat "$WORK/$name.out" "$WORK/$name.err" >>"$LOG" 2>/dev/null
  result=$(grep '^RESULT ' "$WORK/$name.out" | tail -1)
  if ((rc == 124 || rc == 137)); then
    STATUS[$name]=TIMEOUT; FIGS[$name]="killed after ${limit}s"
  elif [[ -n $result ]]; then
    STATUS[$name]=$(cut -d' ' -f3 <<<"$result"); FIGS[$name]=$(cut -d' ' -f4- <<<"$result")
    ((rc != 0)) && [[ ${STATUS[$name]} == PASS ]] && STATUS[$name]=FAIL
  else
    STATUS[$name]=FAIL; FIGS[$name]="exit $rc without a RESULT line"
  fi
  if [[ ${STATUS[$name]} != PASS ]]; then
    echo "[$name] last log lines:"; tail -30 "$WORK/$name.err" | cut -c1-400 | sed "s/^/[$name]   /"
  fi
done

# --- summary -----------------------------------------------------------------------------------------------------
failed=0
for name in "${ORDER[@]}"; do [[ ${STATUS[$name]} == PASS ]] || failed=$((failed + 1)); done
{
  echo "===== gpu_smoke summary: mode $MODE, ${SECONDS}s of ${BUDGET_S}s budget; $(uptime)"
  for name in "${ORDER[@]}"; do
    printf '%-7s %-16s %4ss  %s\n' "${STATUS[$name]}" "$name" "${SECS[$name]}" "${FIGS[$name]}"
  done
  if ((failed)); then echo "RESULT: FAIL ($failed of ${#ORDER[@]} sections not PASS)"; else echo "RESULT: PASS"; fi
  [[ $MODE == cpu ]] && echo "(CPU dry run: tiny sizes, CUDA-only checks skipped as their lines say)"
} | tee "$SUMMARY" | tee -a "$LOG"
exit $((failed > 0))
