#!/bin/sh
# surfaces.sh -- k3 bench serve through /v1/chat/completions, /v1/responses and
# /v1/messages on one server: the same random prompts (IN tokens of text), OUT
# tokens each (ignore_eos), at each concurrency, ROUNDS times in turn; prints one
# line per run and the medians per surface and concurrency.
#
# Usage: flock -x /tmp/k3-cpu.lock sh bench/surfaces.sh [MODEL [IN OUT N16 ROUNDS]]
#   MODEL   checkpoint (default bench/bench)
#   IN OUT  prompt and output tokens (default 128 64)
#   N16     prompts at concurrency 16 (default 16; concurrency 1 runs 8)
#   ROUNDS  runs per surface and concurrency (default 3); SEED (default 1) is the
#           first round's dataset seed. On 2 cores and bench/bench a round
#           takes ~3.5 min: hold the lock for one round at a time (ROUNDS=1
#           SEED=1, 2, 3) and take the medians of the printed lines.
# The prefix cache is off, so no run reads the prompts an earlier one cached;
# --no-thinking gives the three the same prompt (chat and Responses think by
# default, with a ~150-token effort message; Anthropic's thinking is off).
set -e
K3=${K3:-build/k3}
MODEL=${1:-bench/bench}
IN=${2:-128}
OUT=${3:-64}
N16=${4:-16}
ROUNDS=${5:-3}
PORT=${PORT:-18901}
SEED=${SEED:-1}
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
for r in $(seq "$SEED" $((SEED + ROUNDS - 1))); do
    for c in 1 16; do
        n=$([ $c -eq 1 ] && echo 8 || echo "$N16")
        # the surfaces' order turns each round, so none is always the first after a change
        case $((r % 3)) in
            1) order="chat responses messages" ;;
            2) order="responses messages chat" ;;
            *) order="messages chat responses" ;;
        esac
        for ep in $order; do
            "$K3" bench serve --base-url "http://127.0.0.1:$PORT" --endpoint $ep --tokenizer "$MODEL" \
                --random-input-len "$IN" --random-output-len "$OUT" --num-prompts "$n" --max-concurrency $c \
                --ignore-eos --no-thinking --seed "$r" --json >"$TMP/$ep.$c.$r.json"
            python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], sys.argv[4], \
'ok=%d fail=%d in_tok=%d out_tok=%d ttft_med=%.1f ms tpot_med=%.2f ms out_tok_s=%.1f' % (j['completed'], \
j['failed'], j['total_input_tokens'], j['total_output_tokens'], j['median_ttft_ms'], j['median_tpot_ms'], \
j['output_throughput']))" "$TMP/$ep.$c.$r.json" "$ep" "c=$c" "round=$r"
        done
    done
done
echo "# $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$TMP" "$ROUNDS" "$SEED" <<'PY'
import json, statistics, sys
tmp, rounds, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for c in (1, 16):
    for ep in ("chat", "responses", "messages"):
        js = [json.load(open(f"{tmp}/{ep}.{c}.{r}.json")) for r in range(seed, seed + rounds)]
        print(f"median of {rounds}: {ep:9s} c={c:2d} TTFT {statistics.median(j['median_ttft_ms'] for j in js):8.1f} ms"
              f"  TPOT {statistics.median(j['median_tpot_ms'] for j in js):7.2f} ms")
PY
