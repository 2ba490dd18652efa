#!/usr/bin/env bash
# A/B of two imp_jax servers on the same model: which flags (or which checkout) serve faster.
#
#   bash scripts/bench_server_ab.sh MODEL ROUNDS "FLAGS_A" "FLAGS_B" [DIR_A] [DIR_B]
#
# Each round starts server A, waits until every step program is compiled, runs scripts/bench_serving.py at
# each of LEVELS ("C:REQUESTS ...", default "1:4 8:16 32:32": 1 / 8 / 32 streams, 4 / 16 / 32 requests;
# 128-token prompts, 64 tokens out, EOS ids 0 and 2 banned), stops
# it, then does the same for B; the prompts' seed depends on the round and the level only, so A and B get the
# same prompts within a round and fresh ones (no prefix-cache hits) in the next. DIR_A / DIR_B: checkouts
# to run each server from (default: this one), e.g. a `git worktree` of the commit before a change.
# Prints one line per round, server and level (tok/s, TTFT and TPOT percentiles) and writes
# bench_results/ab/{A,B}.cC.rN.json; read the rounds side by side, the VM's speed drifts between them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL=$1 ROUNDS=$2 FLAGS_A=$3 FLAGS_B=$4 DIR_A=${5:-$ROOT} DIR_B=${6:-$ROOT}
PORT=${PORT:-18191}
LEVELS=${LEVELS:-1:4 8:16 32:32}
OUT=${OUT_DIR:-$ROOT/bench_results/ab}
mkdir -p "$OUT"
pid=
trap '[[ -n "$pid" ]] && kill "$pid" 2>/dev/null' EXIT

ready() {   # every step program compiled (serving starts before; the load test measures after)
    for _ in $(seq 600); do
        python -c "import json, sys, urllib.request; d = json.load(urllib.request.urlopen(sys.argv[1]));
sys.exit(0 if d.get('state') == 'ready' and d.get('programs_compiled') == d.get('programs_total') else 1)" \
            "http://127.0.0.1:$PORT/health" 2>/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || { echo "server $1 died: $OUT/$1.server.log" >&2; exit 1; }
        sleep 1
    done
    echo "server $1 not ready after 600 s" >&2; exit 1
}

for ((r = 1; r <= ROUNDS; r++)); do
    for v in A B; do
        flags=$FLAGS_A dir=$DIR_A
        [[ $v == B ]] && flags=$FLAGS_B dir=$DIR_B
        # shellcheck disable=SC2086  # the flags are words
        (cd "$dir" && exec env PYTHONPATH="$dir" python -m imp_jax.server --model "$MODEL" --host 127.0.0.1 \
            --port "$PORT" --max-num-seqs 32 $flags) >"$OUT/$v.server.log" 2>&1 &
        pid=$!
        ready $v
        for level in $LEVELS; do
            c=${level%%:*} n=${level##*:}
            line=$(python "$ROOT/scripts/bench_serving.py" --url "http://127.0.0.1:$PORT" --concurrency "$c" \
                --requests "$n" --input-len 128 --output-len 64 --ban-tokens 0 2 --seed $((100 * r + c)) \
                --out "$OUT/$v.c$c.r$r.json" | tail -1)
            echo "round $r $v ($flags) c=$c: $line"
        done
        kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
    done
done
