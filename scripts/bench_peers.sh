#!/usr/bin/env bash
# Serving benchmark: imp_jax against llama.cpp's llama-server on the same GGUF, same client, same run.
#
#   bash scripts/bench_peers.sh [build|quantize|run|all]        (default: all)
#
# build: llama.cpp's llama-server, llama-bench and llama-quantize, compiled once from the source vendored in
#        the llama-cpp-python sdist (pip download --no-binary :all:), cached under $PEERS_DIR
#        (default $IMP_JAX_HOME/peers, else ~/.cache/imp_jax/peers); about 9 minutes of 2 cores.
#        Not -DGGML_NATIVE=ON: a VM's CPUID may list AMX (Sapphire Rapids) that its kernel does not
#        enable, and -march=native binaries then die of an illegal instruction. The instruction sets are
#        named from /proc/cpuinfo instead (llama_isa: AVX/AVX2/FMA/F16C, AVX-512 F/VBMI/VNNI/BF16 and
#        AVX-VNNI where listed, AMX off), and the binaries cached per set.
#        Nothing of llama.cpp is written into the repository.
# quantize: the formats people download, made by llama-quantize from the default SmolLM2 GGUF (its Q4_1
#        weights, dequantised: --allow-requantize) into $PEERS_DIR/models: SmolLM2-135M-Instruct.Q4_K_M.gguf
#        .Q6_K.gguf and .IQ4_XS.gguf; prints their paths. Serve or benchmark one with MODEL=<path> ... run.
# run:   time to /ready (cold: empty caches; warm) for both servers, ROUNDS rounds of scripts/bench_serving.py,
#        each against llama-server and then imp_jax (every IMP_GEMMS mode) at the same concurrency levels
#        with unique prompts, so a shared machine's load drifts over both alike, then ROUNDS rounds of
#        batch 1: llama-bench's tg128/pp512, then imp_jax's (scripts/bench_engine.py, wall clock); writes
#        bench_results/peers/*.json (serving_*.cC.rN.json per round) and prints the table for docs/PERF.md
#        (scripts/peers_table.py: medians over the rounds, with their spread).
#
# Environment: MODEL (GGUF path; default: the SmolLM2 alias resolved by imp_jax), LEVELS ("1 8 32"),
# REQUESTS (per level, default "8 32 64"), INPUT_LEN (128), OUTPUT_LEN (128), THREADS (2), ROUNDS (3),
# PORT_LLAMA (18180), PORT_IMP (18181), OUT_DIR (bench_results/peers), SKIP_COLD=1 to skip the cold
# imp_jax start (it clears imp_jax's compilation and kernel caches into a temporary home), IMP_GEMMS
# ("auto": imp_jax's --gemm modes to serve and measure, each warm, in this order; auto is the default,
# cpu_q8 on a quantised GGUF; e.g. "auto exact" adds the exact float32 products).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
HOME_DIR="${IMP_JAX_HOME:-$HOME/.cache/imp_jax}"
PEERS_DIR="${PEERS_DIR:-$HOME_DIR/peers}"
LLAMA_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
THREADS="${THREADS:-2}"
LEVELS="${LEVELS:-1 8 32}"
REQUESTS="${REQUESTS:-8 32 64}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
PORT_LLAMA="${PORT_LLAMA:-18180}"
PORT_IMP="${PORT_IMP:-18181}"
OUT_DIR="${OUT_DIR:-bench_results/peers}"
IMP_GEMMS="${IMP_GEMMS:-auto}"
ROUNDS="${ROUNDS:-3}"
CTX=16384
SERVER_PID=""
NP=32

log() { echo "# $(date -u +%H:%M:%S) $*" >&2; }

# llama.cpp's x86 instruction sets, named from this CPU's /proc/cpuinfo flags rather than -march=native
# (GGML_NATIVE), which would also emit the AMX tiles a VM may list but not enable. ISA_TAG names the set
# (the binaries' cache directory); ISA_FLAGS are the cmake options.
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has_flag() { [[ "$cpu_flags" == *" $1 "* ]]; }
onoff() { if has_flag "$1"; then echo ON; else echo OFF; fi; }
ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
           -DGGML_SSE42="$(onoff sse4_2)" -DGGML_BMI2="$(onoff bmi2)" -DGGML_AVX_VNNI="$(onoff avx_vnni)"
           -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
ISA_TAG=avx2
if has_flag avx512f; then
    ISA_FLAGS+=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI="$(onoff avx512vbmi)" -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
                -DGGML_AVX512_BF16="$(onoff avx512_bf16)")
    ISA_TAG=avx512
else
    ISA_FLAGS+=(-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
fi
has_flag avx_vnni && ISA_TAG+=-avxvnni
has_flag avx512_vnni && ISA_TAG+=-vnni
BIN_DIR="$PEERS_DIR/llama.cpp-$LLAMA_VERSION-$ISA_TAG/bin"

build() {
    if [[ -x "$BIN_DIR/llama-server" && -x "$BIN_DIR/llama-bench" && -x "$BIN_DIR/llama-quantize" ]]; then
        log "llama.cpp $LLAMA_VERSION already built: $BIN_DIR"
        return
    fi
    local src="$PEERS_DIR/src"
    mkdir -p "$src" "$BIN_DIR"
    local sdist="$src/llama_cpp_python-$LLAMA_VERSION.tar.gz"
    if [[ ! -f "$sdist" ]]; then
        log "downloading the llama-cpp-python $LLAMA_VERSION sdist"
        pip download --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_VERSION" -d "$src" >&2
    fi
    local tree="$src/llama_cpp_python-$LLAMA_VERSION"
    [[ -d "$tree" ]] || tar xzf "$sdist" -C "$src"
    local lc="$tree/vendor/llama.cpp"
    local bdir="$lc/build-$ISA_TAG"
    log "configuring $lc (server on; web UI, curl, OpenSSL, tests, examples off; ${ISA_FLAGS[*]})"
    cmake -S "$lc" -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DBUILD_SHARED_LIBS=OFF "${ISA_FLAGS[@]}" >&2
    log "building llama-server, llama-bench and llama-quantize (about 9 minutes on 2 cores)"
    local t0=$SECONDS
    cmake --build "$bdir" --target llama-server llama-bench llama-quantize -j "$(nproc)" >&2
    cp "$bdir/bin/llama-server" "$bdir/bin/llama-bench" "$bdir/bin/llama-quantize" "$BIN_DIR/"
    log "built in $((SECONDS - t0)) s: $BIN_DIR"
}

quantize() {
    local src out_dir="$PEERS_DIR/models" type
    src=$(MODEL="" model_path)
    mkdir -p "$out_dir"
    for type in Q4_K_M Q6_K IQ4_XS; do
        local out="$out_dir/SmolLM2-135M-Instruct.$type.gguf"
        if [[ ! -f "$out" ]]; then
            log "llama-quantize $src -> $out"
            "$BIN_DIR/llama-quantize" --allow-requantize "$src" "$out.tmp" "$type" "$THREADS" >"$out.log" 2>&1
            mv "$out.tmp" "$out"
        fi
        echo "$out"
    done
}

model_path() {
    if [[ -n "${MODEL:-}" ]]; then echo "$MODEL"; return; fi
    python -c 'from imp_jax.model.formats.hub import resolve_model; print(resolve_model("smollm2-135m-instruct").path)'
}

# time_to_ready NAME URL LOG CMD...: start CMD, poll URL until 200, write OUT_DIR/ready_NAME.json; leaves it running
# (its pid in SERVER_PID).
time_to_ready() {
    local name=$1 url=$2 logf=$3
    shift 3
    local t0
    t0=$(date +%s.%N)
    "$@" >"$logf" 2>&1 &
    SERVER_PID=$!
    until curl -sf -o /dev/null "$url"; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then log "$name died; see $logf"; tail -20 "$logf" >&2; exit 1; fi
        sleep 0.2
    done
    local secs
    secs=$(python -c "print(round($(date +%s.%N) - $t0, 2))")
    echo "{\"name\": \"$name\", \"ready_s\": $secs}" >"$OUT_DIR/ready_$name.json"
    log "$name ready in $secs s"
}

# wait_compiled URL: poll imp_jax's /health until its background compiles are done (programs_compiled
# = programs_total), so that the load test does not share the cores with them.
wait_compiled() {
    local t0=$SECONDS
    until python -c "import json, sys, urllib.request; d = json.load(urllib.request.urlopen(sys.argv[1]));
sys.exit(0 if d.get('programs_compiled') == d.get('programs_total') else 1)" "$1" 2>/dev/null; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then log "the server died"; exit 1; fi
        sleep 1
    done
    log "every program compiled ($((SECONDS - t0)) s after ready)"
}

stop_server() {
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
}

serve_bench() {  # serve_bench LABEL URL OUT ROUND: OUT.cC.rROUND.json per concurrency level C
    local label=$1 url=$2 out=$3 round=$4 reqs=($REQUESTS) levels=($LEVELS) i
    for i in "${!levels[@]}"; do
        python scripts/bench_serving.py --url "$url" --label "$label" --concurrency "${levels[$i]}" \
            --requests "${reqs[$i]}" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ban-tokens $BAN \
            --out "$out.c${levels[$i]}.r$round.json"
    done
}

run() {
    local gguf
    gguf=$(model_path)
    mkdir -p "$OUT_DIR"
    rm -f "$OUT_DIR"/*.json
    BAN=$(python -c "
import gguf, sys
r = gguf.GGUFReader(sys.argv[1])
ids = {int(r.fields[k].parts[-1][0]) for k in ('tokenizer.ggml.eos_token_id',) if k in r.fields}
toks = [bytes(p).decode() for p in (r.fields['tokenizer.ggml.tokens'].parts[i] for i in r.fields['tokenizer.ggml.tokens'].data)]
ids |= {toks.index(t) for t in ('<|endoftext|>', '<|im_end|>') if t in toks}
print(' '.join(map(str, sorted(ids))))" "$gguf")
    log "model $gguf; EOS ids banned: $BAN; load average $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "{\"date\": \"$(date -u '+%Y-%m-%d %H:%M UTC')\", \"commit\": \"$(git rev-parse --short HEAD)\", \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\", \"nproc\": $(nproc), \"loadavg_start\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"model\": \"$gguf\", \"llama_cpp_python\": \"$LLAMA_VERSION\", \"llama_isa\": \"$ISA_TAG\", \"threads\": $THREADS, \"input_len\": $INPUT_LEN, \"output_len\": $OUTPUT_LEN, \"rounds\": $ROUNDS, \"imp_gemms\": \"$IMP_GEMMS\"}" >"$OUT_DIR/run.json"

    # llama.cpp: the server's cold start (its first: it keeps no caches)
    local lurl="http://127.0.0.1:$PORT_LLAMA"
    local lcmd=("$BIN_DIR/llama-server" -m "$gguf" -t "$THREADS" -c "$CTX" -np "$NP" --host 127.0.0.1 --port "$PORT_LLAMA")
    time_to_ready llama_cold "$lurl/health" "$OUT_DIR/llama_server_cold.log" "${lcmd[@]}"
    stop_server

    local iurl="http://127.0.0.1:$PORT_IMP"
    local icmd=(python -m imp_jax.server --model "$gguf" --host 127.0.0.1 --port "$PORT_IMP" --max-num-seqs "$NP")
    # imp_jax: cold in a fresh IMP_JAX_HOME (no compiled programs, no built kernels), then warm from
    # what that start left there, once per --gemm mode and round; SKIP_COLD=1 starts from the usual home
    local run_home="${IMP_JAX_HOME:-}"
    if [[ "${SKIP_COLD:-0}" != 1 ]]; then
        run_home=$(mktemp -d)
        IMP_JAX_HOME="$run_home" time_to_ready imp_cold "$iurl/ready" "$OUT_DIR/imp_server_cold.log" "${icmd[@]}"
        stop_server
    fi

    # the load test in rounds, llama-server then imp_jax in each, so that a shared machine's load drifts
    # over both alike; peers_table.py takes the medians and shows the spread
    local gemm suffix round
    for ((round = 1; round <= ROUNDS; round++)); do
        log "round $round of $ROUNDS; load average $(cut -d' ' -f1-3 /proc/loadavg)"
        time_to_ready "llama_warm.r$round" "$lurl/health" "$OUT_DIR/llama_server.r$round.log" "${lcmd[@]}"
        serve_bench llama-server "$lurl" "$OUT_DIR/serving_llama" "$round"
        stop_server
        for gemm in $IMP_GEMMS; do
            suffix=$([[ "$gemm" == auto ]] && echo "" || echo "_$gemm")   # the default mode keeps the plain names
            IMP_JAX_HOME="$run_home" time_to_ready "imp_warm$suffix.r$round" "$iurl/ready" \
                "$OUT_DIR/imp_server$suffix.r$round.log" "${icmd[@]}" --gemm "$gemm"
            wait_compiled "$iurl/health"   # serving starts before every program is; the load test measures after
            serve_bench "imp_jax$suffix" "$iurl" "$OUT_DIR/serving_imp$suffix" "$round"
            stop_server
        done
    done
    # batch 1, llama-bench then imp_jax in each round (the VM's speed drifts: both sides meet it alike):
    # pp512 and tg128 from an empty context and after 512 tokens; imp_jax's tg128 is the wall clock of its
    # decode steps, one token each (speculation off, as llama-bench), after a 16-token and a 512-token prompt
    for ((round = 1; round <= ROUNDS; round++)); do
        log "batch 1, round $round of $ROUNDS: llama-bench pp512 / tg128, $THREADS threads"
        "$BIN_DIR/llama-bench" -m "$gguf" -t "$THREADS" -p 512 -n 128 -d 0,512 -r 1 -o json \
            >"$OUT_DIR/llama_bench.r$round.json"
        for gemm in $IMP_GEMMS; do
            suffix=$([[ "$gemm" == auto ]] && echo "" || echo "_$gemm")
            log "batch 1, round $round: imp_jax --gemm $gemm (bench_engine)"
            IMP_JAX_HOME="$run_home" python scripts/bench_engine.py --model "$gguf" --batches 1 --prompt-len 16 \
                --long-context 512 --output-len 128 --max-num-batched-tokens 512 --prompts random \
                --speculative off --no-transformers --gemm "$gemm" --out "$OUT_DIR/imp_engine$suffix.r$round.json" >&2
        done
    done
    [[ "${SKIP_COLD:-0}" == 1 ]] || rm -rf "$run_home"
    python -c "import json, sys; d = json.load(open(sys.argv[1])); d['loadavg_end'] = open('/proc/loadavg').read().split()[:3]; json.dump(d, open(sys.argv[1], 'w'))" "$OUT_DIR/run.json"
    python scripts/peers_table.py "$OUT_DIR"
}

trap 'stop_server 2>/dev/null' EXIT
case "${1:-all}" in
    build) build ;;
    quantize) build; quantize ;;
    run) run ;;
    all) build; run ;;
    *) echo "usage: $0 [build|quantize|run|all]" >&2; exit 2 ;;
esac
