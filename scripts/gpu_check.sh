#!/usr/bin/env bash
# The GPU check: one script, planned for 5-6 minutes on an H200 (not yet timed there; every part has
# a time limit and the whole a 470 s budget, so it ends within 8 minutes).
#   kernel     the compiled Pallas attention kernel against the oracle (scripts/gpu_check_kernel.py:
#              the kernel test cases and GPU-sized ones, kv_splits 1, the default and a forced count)
#   attention  scripts/bench_attention.py on a small sweep (decode and mixed steps, batch 1/8/64,
#              context 4k/32k; the Pallas kernel with its default splits and with 1)
#   engine     scripts/bench_engine.py --no-transformers in bfloat16 (batch 1 and 4, 9 step programs)
#   server     scripts/smoke_server.py: `python -m imp_jax.server` on loopback, one chat answer through
#              the openai package and one through the anthropic package, a clean SIGTERM exit
# and prints ONE summary block. Results (summary.json, kernel/attention/engine/server.json, parts.log,
# server.log) go to $OUT when it is set (the device tool's folder), else bench_results/gpu_check/.
#
# The GPU machine has no network, lacks quart/hypercorn/pydantic/openai/anthropic/gguf, and takes at
# most 64 MiB of carried files per call (the working tree included), less than the SmolLM2 GGUF
# (94 MiB). So, once, here (with network and the GGUF in ~/.cache/imp_jax/models/):
#     echo /.whl/ >> .git/info/exclude; echo /.gpu_model/ >> .git/info/exclude   # if git does not ignore them yet
#     bash scripts/gpu_wheels.sh                  # .whl/: ~10 MB of wheels
#     python scripts/gpu_model.py prepare         # .gpu_model/: skeleton/ (config + tokenizer, 1.6 MB)
#                                                 #   and the GGUF in two parts (.0: 55 MiB, .1: 39 MiB)
# Then on the GPU, either
#   (a) one call, random weights of SmolLM2's shapes (same speed; answers are gibberish):
#         run  command: bash scripts/gpu_check.sh
#              carry:   [".whl", ".gpu_model/skeleton"]          timeout_s: 600
#   (b) the real SmolLM2, in two calls on one warm machine (it stays warm ~30 s after a call):
#         run  command: ls -l .gpu_model
#              carry:   [".gpu_model/SmolLM2-135M-Instruct.Q4_1.gguf.0"]                    timeout_s: 60
#         and at once after it:
#         run  command: bash scripts/gpu_check.sh
#              carry:   [".whl", ".gpu_model/SmolLM2-135M-Instruct.Q4_1.gguf.1",
#                        ".gpu_model/SmolLM2-135M-Instruct.Q4_1.gguf.sha256", ".gpu_model/skeleton"]
#                                                                                            timeout_s: 600
#       If the machine went back in between, part .0 is gone: the check falls back to random weights
#       and its summary says so.
#
# Options: --model auto|real|random|PATH (auto: the GGUF if whole or both parts are here, else random
# weights from the skeleton), --parts "kernel attention engine server", --budget SECONDS (470),
# --cpu-dry-run (here, no GPU: the interpreted kernel, tiny sizes, the wheels checked but not used).
set -uo pipefail
cd "$(dirname "$0")/.."

MODEL=auto
PARTS="kernel attention engine server"
BUDGET=470
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --parts) PARTS=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --cpu-dry-run) DRY=1; shift ;;
    *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

OUT_DIR=${OUT:-bench_results/gpu_check}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/parts.log
: > "$LOG"
STATUS=$(mktemp)
trap 'rm -f "$STATUS"' EXIT
START=$(date +%s)
PY=python3
GGUF=.gpu_model/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONUNBUFFERED=1

record() {  # name rc seconds note...
  local name=$1 rc=$2 secs=$3; shift 3
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$*" >> "$STATUS"
}

run_part() {  # name budget command...: run it under a time limit, log it, record its status
  local name=$1 budget=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  local limit=$(( budget < left ? budget : left ))
  if [ "$limit" -lt 20 ]; then
    record "$name" -1 0 "not run: the check's --budget of ${BUDGET}s is spent"
    echo "[$name] SKIP: no time left"; return
  fi
  echo "[$name] up to ${limit}s: $*"
  { echo "===== $name: $*"; } >> "$LOG"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  record "$name" "$rc" $(( $(date +%s) - t0 )) "exit status $rc"
  echo "[$name] exit status $rc after $(( $(date +%s) - t0 ))s"
  if [ "$rc" -ne 0 ]; then
    echo "----- last lines of $name's output:"; sed -n "/^===== $name:/,\$p" "$LOG" | tail -n 25
  fi
}

# --- packages: the carried wheels (none are needed here, where the dry run only checks them)
t0=$(date +%s)
if ls .whl/*.whl > /dev/null 2>&1; then
  if [ "$DRY" = 1 ]; then
    check=$(mktemp -d)
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$check" --python-version 3.12 \
      --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any .whl/*.whl >> "$LOG" 2>&1
    rc=$?; rm -rf "$check"
    record install "$rc" $(( $(date +%s) - t0 )) "$(ls .whl/*.whl | wc -l) wheels install for CPython 3.12 (checked, not used)"
  else
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >> "$LOG" 2>&1
    rc=$?
    record install "$rc" $(( $(date +%s) - t0 )) "$(ls .whl/*.whl | wc -l) wheels into /tmp/site"
  fi
else
  record install 1 0 "no .whl/: run scripts/gpu_wheels.sh here and carry .whl"
fi
# the working tree first: its code wins over the project wheel, which only brings its metadata
if [ "$DRY" = 1 ]; then export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"; fi

# --- the model: the real GGUF when it is here whole or in both parts, else random weights
t0=$(date +%s)
model_path="" model_label=""
join_gguf() {
  [ -f "$GGUF" ] && return 0
  if [ -f "$GGUF.0" ] && [ -f "$GGUF.1" ]; then
    cat "$GGUF.0" "$GGUF.1" > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
    if [ -f "$GGUF.sha256" ] && ! (cd "$(dirname "$GGUF")" && sha256sum -c --quiet "$(basename "$GGUF").sha256"); then
      rm -f "$GGUF"; model_note="the joined GGUF fails its sha256"; return 1
    fi
    return 0
  fi
  local parts
  parts=$(cd "$(dirname "$GGUF")" 2>/dev/null && ls "$(basename "$GGUF")".[01] 2>/dev/null | tr '\n' ' ')
  model_note="no whole GGUF at $GGUF; its parts here: ${parts:-none}"
  return 1
}
random_model() {
  [ -d .gpu_model/skeleton ] || { model_note="$model_note; no .gpu_model/skeleton either"; return 1; }
  $PY scripts/gpu_model.py random .gpu_model/skeleton .gpu_model/random >> "$LOG" 2>&1 || return 1
  model_path=.gpu_model/random
}
model_note=""
case "$MODEL" in
  auto)
    if join_gguf; then model_path=$GGUF model_label="SmolLM2-135M-Instruct Q4_1 (real weights)"
    elif random_model; then model_label="SmolLM2 shapes, random weights ($model_note)"
    fi ;;
  real) join_gguf && model_path=$GGUF model_label="SmolLM2-135M-Instruct Q4_1 (real weights)" ;;
  random) random_model && model_label="SmolLM2 shapes, random weights" ;;
  *) model_path=$MODEL model_label=$MODEL ;;
esac
if [ -n "$model_path" ]; then
  record model 0 $(( $(date +%s) - t0 )) "$model_label"
else
  model_label="none"
  record model 1 $(( $(date +%s) - t0 )) "no model: $model_note"
fi

# --- the parts
for part in $PARTS; do
  case "$part" in
    kernel)
      if [ "$DRY" = 1 ]; then run_part kernel 100 $PY scripts/gpu_check_kernel.py --interpret --out "$OUT_DIR/kernel.json"
      else run_part kernel 100 $PY scripts/gpu_check_kernel.py --out "$OUT_DIR/kernel.json"; fi ;;
    attention)
      if [ "$DRY" = 1 ]; then
        run_part attention 120 $PY scripts/bench_attention.py --quick --modes decode --out "$OUT_DIR/attention.json"
      else
        run_part attention 120 $PY scripts/bench_attention.py --modes decode mixed --batches 1 8 64 \
          --contexts 4096 32768 --iters 10 --splits auto 1 --out "$OUT_DIR/attention.json"
      fi ;;
    engine)
      if [ -z "$model_path" ]; then record engine -1 0 "not run: no model"; continue; fi
      if [ "$DRY" = 1 ]; then sizes="--batches 1 --prompt-len 16 --output-len 8 --max-num-batched-tokens 32"
      else sizes="--batches 1 4 --prompt-len 128 --output-len 64 --max-num-batched-tokens 32"; fi
      # shellcheck disable=SC2086
      run_part engine 170 $PY scripts/bench_engine.py --model "$model_path" --no-transformers --dtype bfloat16 \
        $sizes --out "$OUT_DIR/engine.json" ;;
    server)
      if [ -z "$model_path" ]; then record server -1 0 "not run: no model"; continue; fi
      run_part server 130 $PY scripts/smoke_server.py --model "$model_path" --log "$OUT_DIR/server.log" \
        --out "$OUT_DIR/server.json" --ready-timeout 100 ;;
    *) echo "unknown part $part" >&2 ;;
  esac
done

device=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
$PY scripts/gpu_check_summary.py "$OUT_DIR" "$STATUS" "$model_label" "${device:-no GPU} (total $(( $(date +%s) - START ))s)"
