#!/bin/sh
# surfaces.sh -- k3 bench serve through /v1/chat/completions, /v1/responses and
# /v1/messages on one server: the same random prompts (IN tokens of text), OUT
# tokens each (ignore_eos), at each concurrency, ROUNDS times in turn; prints one
# line per run and the medians per surface and concurrency.
#
# Usage: flock -x /tmp/k3-cpu.lock sh bench/surfaces.sh [MODEL [IN OUT N16 ROUNDS]]
#   MODEL   checkpoint (default /work/bench/bench)
#   IN OUT  prompt and output tokens (default 128 64)
#   N16     prompts at concurrency 16 (default 32; concurrency 1 runs 6)
#   ROUNDS  runs per surface and concurrency (default 3)
# The prefix cache is off, so no run reads the prompts an earlier one cached;
# --no-thinking gives the three the same prompt (chat and Responses think by
# default, with a ~150-token effort message; Anthropic's thinking is off).
set -e
K3=${K3:-build/k3}
MODEL=${1:-/work/bench/bench}
IN=${2:-128}
OUT=${3:-64}
N16=${4:-32}
ROUNDS=${5:-3}
PORT=${PORT:-18901}
TMP=$(mktemp -d)
"$K3" serve -m "$MODEL" --port "$PORT" --no-prefix-cache >"$TMP/serve.log" 2>&1 &
SRV=$!
trap 'kill $SRV 2>/dev/null; wait $SRV 2>/dev/null; rm -rf "$TMP"' EXIT INT TERM
for i in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 0.5
done
# one warm-up request per surface (page-in of the weights, first allocations)
for ep in chat responses messages; do
    "$K3" bench serve --base-url "http://127.0.0.1:$PORT" --endpoint $ep --tokenizer "$MODEL" \
        --random-input-len "$IN" --random-output-len 8 --num-prompts 2 --ignore-eos --no-thinking --json >/dev/null
done
echo "# $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) model $MODEL in $IN out $OUT"
for r in $(seq 1 "$ROUNDS"); do
    for c in 1 16; do
        n=$([ $c -eq 1 ] && echo 6 || echo "$N16")
        for ep in chat responses messages; do
            "$K3" bench serve --base-url "http://127.0.0.1:$PORT" --endpoint $ep --tokenizer "$MODEL" \
                --random-input-len "$IN" --random-output-len "$OUT" --num-prompts "$n" --max-concurrency $c \
                --ignore-eos --no-thinking --seed "$r" --json >"$TMP/$ep.$c.$r.json"
            python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], sys.argv[4], \
'ok=%d fail=%d ttft_med=%.1f ms tpot_med=%.2f ms out_tok_s=%.1f' % (j['completed'], j['failed'], \
j['median_ttft_ms'], j['median_tpot_ms'], j['output_throughput']))" "$TMP/$ep.$c.$r.json" "$ep" "c=$c" "round=$r"
        done
    done
done
echo "# $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$TMP" "$ROUNDS" <<'PY'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
for c in (1, 16):
    for ep in ("chat", "responses", "messages"):
        js = [json.load(open(f"{tmp}/{ep}.{c}.{r}.json")) for r in range(1, rounds + 1)]
        print(f"median of {rounds}: {ep:9s} c={c:2d} TTFT {statistics.median(j['median_ttft_ms'] for j in js):8.1f} ms"
              f"  TPOT {statistics.median(j['median_tpot_ms'] for j in js):7.2f} ms")
PY
