#!/usr/bin/env bash
# The GPU check: one command, for an H100/H200, planned for 5-6 minutes (not yet timed on a GPU: every
# part has a time limit and the whole a 470 s budget, so it ends within 8 minutes). Parts, in order:
#   install    the carried wheels (.whl/) into /tmp/site: the GPU image lacks the server's packages
#   model      random float16 weights shaped like a 1B Llama (hidden 2048, 16 layers, 32/8 heads of 64,
#              MLP 8192) with SmolLM2's tokenizer and vocabulary, made from the carried skeleton
#              (scripts/gpu_model.py)
#   kernel     the compiled Pallas attention kernel against the oracle on 14 shapes at kv splits 1,
#              default and forced; a failing variant rerun under the other Mosaic GPU lowering mode
#              (scripts/gpu_check_kernel.py)
#   attention  decode (and mixed) attention GB/s of the Pallas kernel, XLA and jax's own Triton paged
#              attention against the device bandwidth of an x + 1 measured in the same run
#              (scripts/bench_attention.py)
#   engine     load time, compile time per program, device memory, tok/s at 1/8/32/128 streams and of
#              one stream at a 2k context (scripts/bench_engine.py, bfloat16)
#   logits     the model's logits with Pallas vs XLA attention on the same weights
#              (scripts/gpu_check_logits.py)
#   server     `python -m imp_jax.server` on loopback: one chat answer through the openai package and one
#              through the anthropic package, scripts/bench_serving.py at concurrency 1 and 128, a clean
#              SIGTERM exit (scripts/smoke_server.py; its engine is the engine part's, so its programs come
#              from the compilation cache)
# then prints ONE summary block (scripts/gpu_check_summary.py). Results (summary.json, the parts' JSON,
# parts.log, server.log) go to $OUT when it is set (the device tool's folder), else bench_results/gpu_check/.
#
# The GPU machine has no network and takes at most 64 MiB of carried files per call. So, once, here:
#     bash scripts/gpu_wheels.sh                    # .whl/: ~10 MB of wheels
#     python scripts/gpu_model.py skeleton          # .gpu_model/skeleton/: config + tokenizer, ~2 MB
# (both ignored by git), then one call of the device tool:
#     run  command: bash scripts/gpu_check.sh
#          carry:   [".whl", ".gpu_model/skeleton"]          timeout_s: 600
#
# Options: --parts "install model kernel attention engine logits server" (a subset; install and model
# always run), --budget SECONDS (470), --model PATH (serve this model instead of random weights),
# --fail PART (that part fails without running: tests/test_gpu_check.py checks a failure is reported),
# --cpu-dry-run (here, no GPU: every part at tiny sizes, the kernels interpreted, a tiny Llama made from
# SmolLM2's cached tokenizer, the wheels checked for CPython 3.12 but not used, skipped when absent).
set -uo pipefail
cd "$(dirname "$0")/.."

PARTS="kernel attention engine logits server"
BUDGET=470
DRY=0
MODEL=""
FAIL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --parts) PARTS=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --fail) FAIL=$2; shift 2 ;;
    --cpu-dry-run) DRY=1; shift ;;
    *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

OUT_DIR=${OUT:-bench_results/gpu_check}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/parts.log
: > "$LOG"
STATUS=$(mktemp)
WORK=$(mktemp -d)   # the random model (2 GB on the GPU): never under $OUT, which travels back
trap 'rm -rf "$STATUS" "$WORK"' EXIT
START=$(date +%s)
PY=python3
export PYTHONUNBUFFERED=1

record() {  # name rc seconds note...   (rc -1: not run, a failure; -2: skipped by design)
  local name=$1 rc=$2 secs=$3; shift 3
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$*" >> "$STATUS"
}

run_part() {  # name budget command...: run it under a time limit, log it, record its status
  local name=$1 budget=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  local limit=$(( budget < left ? budget : left ))
  if [ "$limit" -lt 20 ]; then
    record "$name" -1 0 "not run: the check's --budget of ${BUDGET}s is spent"
    echo "[$name] NOT RUN: no time left"; return
  fi
  if [ "$name" = "$FAIL" ]; then set -- sh -c "echo 'forced failure (--fail $name)'; exit 1"; fi
  echo "[$name] up to ${limit}s: $*"
  echo "===== $name: $*" >> "$LOG"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  record "$name" "$rc" $(( $(date +%s) - t0 )) "exit status $rc"
  echo "[$name] exit status $rc after $(( $(date +%s) - t0 ))s"
  if [ "$rc" -ne 0 ]; then
    echo "----- last lines of $name's output:"; sed -n "/^===== $name:/,\$p" "$LOG" | tail -n 25
  fi
}

# --- install: the carried wheels (the dry run only checks they install for the GPU image's CPython 3.12)
if ! ls .whl/*.whl > /dev/null 2>&1; then
  if [ "$DRY" = 1 ]; then record install -2 0 "skipped: no .whl/ here (this machine's packages are used)"
  else record install 1 0 "no .whl/: run scripts/gpu_wheels.sh here and carry .whl"; fi
elif [ "$DRY" = 1 ]; then
  run_part install 60 $PY -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" \
    --python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any .whl/*.whl
else
  run_part install 60 $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
# the working tree first: its code wins over the project wheel, which only brings its metadata
if [ "$DRY" = 1 ]; then export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"; fi

# --- model: random weights from a skeleton (the carried one, else made here from the cached SmolLM2)
model_cmd() {  # size skeleton_dir: the command that makes the random model
  echo "[ -f $2/config.json ] || $PY scripts/gpu_model.py skeleton --size $1 --dest $2 || exit 1;
        $PY scripts/gpu_model.py random $2 $WORK/random"
}
model_path=$WORK/random
if [ -n "$MODEL" ]; then record model -2 0 "given: $MODEL"; model_path=$MODEL
elif [ "$DRY" = 1 ]; then run_part model 60 bash -c "$(model_cmd tiny "$WORK/skeleton")"
else run_part model 90 bash -c "$(model_cmd 1b .gpu_model/skeleton)"; fi
[ -f "$model_path/config.json" ] || [ -n "$MODEL" ] || model_path=""

# --- the parts (sizes: the GPU run's, or the dry run's tiny ones)
if [ "$DRY" = 1 ]; then
  KERNEL_ARGS="--interpret --other-mode-always"
  ATTENTION_ARGS="--quick --modes decode --batches 1 --contexts 100"
  ENGINE="--batches 1 2 --prompt-len 16 --output-len 8 --max-num-batched-tokens 2 --long-context 48"   # 2 programs
  SERVER="--max-num-seqs 2 --max-num-batched-tokens 2 --max-model-len 72"
  SERVING="--serving-concurrency 1 8 --serving-requests 8 --serving-input-len 16 --serving-output-len 4"
  LOGITS="--prompt-len 20 --decode-steps 3"
else
  KERNEL_ARGS=""
  ATTENTION_ARGS="--modes decode mixed --batches 1 8 64 --contexts 4096 32768 --iters 10 --splits auto 1"
  ENGINE="--batches 1 8 32 128 --prompt-len 128 --output-len 64 --max-num-batched-tokens 256 --long-context 2048"
  SERVER="--max-num-seqs 128 --max-num-batched-tokens 256 --max-model-len 2128"   # = the engine part's
  SERVING="--serving-concurrency 1 128 --serving-input-len 128 --serving-output-len 64"
  LOGITS="--prompt-len 200 --decode-steps 8"
fi
token_range() {  # bench_serving's prompt ids: ordinary tokens of the model's vocabulary
  $PY -c "import json, sys; v = json.load(open(sys.argv[1]))['vocab_size']; print(min(1000, v // 4), min(30000, v))" \
    "$model_path/config.json" 2> /dev/null || echo "1000 30000"
}
for part in $PARTS; do
  if [ -z "$model_path" ] && [[ " engine logits server " == *" $part "* ]]; then
    record "$part" -1 0 "not run: no model"; continue
  fi
  # shellcheck disable=SC2086
  case "$part" in
    kernel) run_part kernel 100 $PY scripts/gpu_check_kernel.py $KERNEL_ARGS --out "$OUT_DIR/kernel.json" ;;
    attention) run_part attention 80 $PY scripts/bench_attention.py $ATTENTION_ARGS --out "$OUT_DIR/attention.json" ;;
    engine) run_part engine 130 $PY scripts/bench_engine.py --model "$model_path" --no-transformers \
              --dtype bfloat16 $ENGINE --out "$OUT_DIR/engine.json" ;;
    logits) run_part logits 70 $PY scripts/gpu_check_logits.py --model "$model_path" $LOGITS --out "$OUT_DIR/logits.json" ;;
    server) run_part server 110 $PY scripts/smoke_server.py --model "$model_path" --log "$OUT_DIR/server.log" \
              --out "$OUT_DIR/server.json" --ready-timeout 90 $SERVING --serving-token-range $(token_range) \
              --serving-out "$OUT_DIR/serving.json" -- $SERVER --dtype bfloat16 ;;
    *) echo "unknown part $part" >&2; record "$part" 2 0 "unknown part" ;;
  esac
done

device=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
tokenizer=$($PY -c "import json, sys; v = json.load(open(sys.argv[1]))['vocab_size']
print('SmolLM2 tokenizer' if v == 49152 else f'a {v}-token BPE: no SmolLM2 skeleton')" "$model_path/config.json" 2> /dev/null)
label=$([ -n "$MODEL" ] && echo "$MODEL" || { [ "$DRY" = 1 ] && echo "tiny Llama" || echo "1B Llama shapes"; })
label="$label${tokenizer:+, $tokenizer}$([ -z "$MODEL" ] && echo ", random weights")"
$PY scripts/gpu_check_summary.py "$OUT_DIR" "$STATUS" "$label" "${device:-no GPU} (total $(( $(date +%s) - START ))s)"
