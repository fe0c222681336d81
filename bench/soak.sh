#!/bin/sh
# soak.sh -- a soak of `k3 serve`: N requests of random lengths (input and
# output uniform in [x/10, 1.9x]), 10% of the clients dropping their stream
# after 1-4 chunks, through `k3 bench serve`; checks 0 failed among the rest,
# every block back in the pool, nothing running, and prints the server's
# resident memory after a warm-up round and after each soak round.
# Usage: sh bench/soak.sh [MODEL] [N] [ROUNDS]   (defaults: tests/models/tiny 2000 2)
# SERVE_ARGS adds server options (e.g. "--cache-tokens 16384 --snapshot-mb 16", so
# the prefix cache's pool and snapshot budget fill during the warm-up: RSS grows
# until they are full, by design, then stays flat).
M=${1:-tests/models/tiny} N=${2:-2000} R=${3:-2}
K3=${K3:-build/k3}
log=$(mktemp)
$K3 serve -m "$M" --port 0 --threads 1 $SERVE_ARGS 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$log"' EXIT
for i in $(seq 1 100); do grep -q listening "$log" && break; sleep 0.2; done
port=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$log")
[ -n "$port" ] || { cat "$log"; exit 1; }
url=http://127.0.0.1:$port
rss() { sed -n 's/^VmRSS:[[:space:]]*\([0-9]*\) kB/\1/p' /proc/$pid/status; }
run() {
    $K3 bench serve --base-url "$url" --tokenizer "$M" --random-input-len 64 --random-output-len 32 \
        --random-range-ratio 0.9 --num-prompts "$1" --max-concurrency 32 --disconnect-fraction 0.1 \
        --seed "$2" --timeout 120 --json
}
echo "warm-up: $(run ${WARMUP:-200} 1 | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["completed"], "completed", r["failed"], "failed", r["disconnected"], "disconnected")'), RSS $(rss) kB"
bad=0
for r in $(seq 1 "$R"); do
    out=$(run "$N" $((r + 1)))
    sleep 0.5
    m=$(curl -s "$url/metrics")
    used=$(echo "$m" | sed -n 's/^k3:kv_blocks_used{[^}]*} \(.*\)/\1/p')
    running=$(echo "$m" | sed -n 's/^vllm:num_requests_running{[^}]*} \(.*\)/\1/p')
    aborts=$(echo "$m" | sed -n 's/^vllm:request_success_total{finished_reason="abort"[^}]*} \(.*\)/\1/p')
    snap=$(echo "$m" | sed -n 's/^k3:kda_snapshot_bytes{[^}]*} \(.*\)/\1/p')
    echo "round $r: $(echo "$out" | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["completed"], "completed", r["failed"], "failed", r["disconnected"], "disconnected", "%.1f s" % r["duration"])'), blocks used $used, running $running, aborts so far $aborts, KDA snapshots $snap bytes, RSS $(rss) kB"
    echo "$out" | grep -q '"failed":0,' || bad=1
    [ "$used" = "0" ] && [ "$running" = "0" ] || bad=1
done
[ $bad -eq 0 ] && echo "soak: ok" || { echo "soak: FAILED"; exit 1; }
