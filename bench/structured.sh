#!/bin/sh
# structured.sh -- TPOT with every request constrained by a JSON schema against the same
# requests unconstrained, through k3 serve and k3 bench serve, rounds interleaved.
# Usage: sh bench/structured.sh [MODEL [ROUNDS [CONCURRENCY [IN [OUT [THREADS]]]]]]
#   (defaults: bench/bench 2 16 128 64 2). Time it under the exclusive lock:
#   flock -x /tmp/k3-cpu.lock sh bench/structured.sh
# The schema (bench/structured_rf.json) is a ticket: a bounded title, an enum, a short
# array, then free notes, so every constrained request still generates OUT tokens
# (--ignore-eos) and walks the structure first. Rounds alternate the order (ABBA).
# Prints each run's median TPOT and the engine's grammar counters from /metrics
# (k3:grammar_seconds_total, k3:grammar_masks_total).
set -e
K3=${K3:-build/k3}
MODEL=${1:-bench/bench}
ROUNDS=${2:-2}
CONC=${3:-16}
IN=${4:-128}
OUT=${5:-64}
THREADS=${6:-2}
RF=bench/structured_rf.json
LOG=$(mktemp)
"$K3" serve -m "$MODEL" --port 0 --threads "$THREADS" 2>"$LOG" &
PID=$!
trap 'kill $PID 2>/dev/null; rm -f "$LOG"' EXIT
i=0
while ! grep -q "listening on" "$LOG"; do
    i=$((i + 1)); [ $i -lt 600 ] || { cat "$LOG"; exit 1; }
    sleep 0.5
done
URL=$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' "$LOG")
bench() { # $1: seed, rest: extra options
    s=$1; shift
    "$K3" bench serve --base-url "$URL" --tokenizer "$MODEL" --random-input-len "$IN" --random-output-len "$OUT" \
        --num-prompts "$CONC" --max-concurrency "$CONC" --ignore-eos --seed "$s" --json "$@"
}
tpot() { sed -n 's/.*"median_tpot_ms": *\([0-9.]*\).*/\1/p'; }
grammar() {
    curl -s "$URL/metrics" | awk '/^k3:grammar_(seconds|masks|steps)_total/ {printf "%s=%s ", $1, $2} END {print ""}' |
        sed 's/{[^}]*}//g'
}
# warm-up: the vocabulary's grammar tables, the schema's compile, the weights' pages
bench 1000 --response-format @"$RF" >/dev/null
bench 1001 >/dev/null
echo "after warm-up: $(grammar)"
r=1
while [ $r -le "$ROUNDS" ]; do
    # ABBA: odd rounds unconstrained first, even rounds constrained first
    if [ $((r % 2)) -eq 1 ]; then
        a=$(bench $((2 * r)) | tpot)
        b=$(bench $((2 * r + 1)) --response-format @"$RF" | tpot)
    else
        b=$(bench $((2 * r + 1)) --response-format @"$RF" | tpot)
        a=$(bench $((2 * r)) | tpot)
    fi
    echo "round $r: TPOT unconstrained $a ms, constrained $b ms, ratio $(echo "$b $a" | awk '{printf "%.4f", $1 / $2}')  ($(grammar))"
    r=$((r + 1))
done
echo "end: $(grammar)"
