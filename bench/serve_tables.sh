#!/bin/sh
# serve_tables.sh -- serving figures per kernel table, alternated: for each
# round and each table, a `k3 serve --isa TABLE` on MODEL, then `k3 bench serve`
# (random prompts, --ignore-eos, a fresh --seed a run so no prompt hits the
# prefix cache) at each input length and concurrency; then `k3 bench
# throughput` prompt-heavy at concurrency 16 and 1. Prints one line a
# measurement and the medians over the rounds with each table's ratio to the
# first one's.
#
#   sh bench/serve_tables.sh [MODEL] [ROUNDS]     (defaults: bench/bench 1)
#   TABLES="avx512-nobf16 best" LENS="128 2048" CONCS="1 16" OUT=16 TP_IN=1024 \
#       sh bench/serve_tables.sh bench/bench 2
#
# A run at concurrency C sends max(4, C) requests (one wave at 16). The port is
# the server's own (--port 0, read from its log); the server binds 127.0.0.1.
M=${1:-bench/bench} R=${2:-1}
K3=${K3:-build/k3}
TABLES=${TABLES:-avx512-nobf16 best} LENS=${LENS:-128 2048} CONCS=${CONCS:-1 16} OUT=${OUT:-16}
TP_IN=${TP_IN:-1024} TP_OUT=${TP_OUT:-16} TP_N=${TP_N:-16} THREADS=${THREADS:-2}
tmp=$(mktemp -d)
trap 'kill $spid 2>/dev/null; rm -rf "$tmp"' EXIT INT TERM
seed=100
for r in $(seq 1 "$R"); do
    for t in $TABLES; do
        $K3 serve -m "$M" --threads "$THREADS" --isa "$t" --port 0 --max-num-seqs 16 2>"$tmp/log" &
        spid=$!
        port=
        while [ -z "$port" ] && kill -0 $spid 2>/dev/null; do
            port=$(sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$tmp/log" | head -1)
            [ -z "$port" ] && sleep 0.2
        done
        [ -z "$port" ] && { echo "k3 serve --isa $t did not start:"; tail -3 "$tmp/log"; exit 1; }
        for n in $LENS; do
            for c in $CONCS; do
                np=$((c > 4 ? c : 4))
                seed=$((seed + 1))
                $K3 bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$M" --random-input-len "$n" \
                    --random-output-len "$OUT" --num-prompts $np --max-concurrency "$c" --ignore-eos \
                    --seed $seed --json >"$tmp/out" 2>"$tmp/err" || { echo "bench serve failed:"; cat "$tmp/err"; exit 1; }
                python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('serve', sys.argv[2], sys.argv[3], sys.argv[4], r['median_ttft_ms'], r['output_throughput'], r['median_tpot_ms'])" \
                    "$tmp/out" "$t" "$n" "$c" | tee -a "$tmp/all"
            done
        done
        kill $spid
        wait $spid 2>/dev/null
        spid=
        for c in 16 1; do
            np=$((c > 4 ? TP_N : 4))
            $K3 bench throughput -m "$M" --threads "$THREADS" --isa "$t" --num-prompts $np --max-concurrency $c \
                --input-len "$TP_IN" --output-len "$TP_OUT" --seed $r --json 2>/dev/null >"$tmp/out" ||
                { echo "bench throughput failed"; exit 1; }
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('tput', sys.argv[2], sys.argv[3], sys.argv[4], r['ttft_ms']['median'], r['total_token_throughput'], r['tpot_ms']['median'])" \
                "$tmp/out" "$t" "$TP_IN" "$c" | tee -a "$tmp/all"
        done
    done
done
python3 - "$tmp/all" $TABLES <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    kind, t, n, c, ttft, tput, tpot = line.split()
    rows.setdefault((kind, n, c), {}).setdefault(t, []).append((float(ttft), float(tput), float(tpot)))
tables = sys.argv[2:]
print("medians (tok/s: output for serve, total for tput); ratios to %s" % tables[0])
for (kind, n, c), by in rows.items():
    base = [statistics.median(x[k] for x in by[tables[0]]) for k in range(3)] if tables[0] in by else None
    for t in tables:
        if t not in by:
            continue
        m = [statistics.median(x[k] for x in by[t]) for k in range(3)]
        ratio = "" if t == tables[0] or not base else "  TTFT %.2fx faster, tok/s %.2fx" % (base[0] / m[0], m[1] / base[1])
        print("%-5s in %-5s c%-3s %-14s TTFT %9.1f ms  tok/s %8.2f  TPOT %7.1f ms%s" % (kind, n, c, t, m[0], m[1], m[2], ratio))
for t in tables:  # the engine's batching gain: prompt-heavy c16 over c1
    hi = [k for k in rows if k[0] == "tput" and k[2] == "16" and t in rows[k]]
    lo = [k for k in rows if k[0] == "tput" and k[2] == "1" and t in rows[k]]
    if hi and lo:
        a = statistics.median(x[1] for x in rows[hi[0]][t])
        b = statistics.median(x[1] for x in rows[lo[0]][t])
        print("tput c16/c1 %-14s %.2fx" % (t, a / b))
PY
