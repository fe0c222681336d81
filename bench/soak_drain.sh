#!/bin/sh
# soak_drain.sh -- `k3 serve` loses no request: CLIENTS streaming clients for DURATION seconds
# (bench/soak_clients.py: completions and chat, random prompts and lengths, greedy, every
# completed stream checked against its whole answer), a fraction of them leaving mid-stream, then
# SIGTERM while they keep going. Prints the server's RSS every 10 s and the counts: started,
# completed correct, aborted by the client, ended by the drain, refused by the drain (503),
# wrong and lost (both must be 0), and the server's exit status (must be 0).
# Usage: sh bench/soak_drain.sh [MODEL] [DURATION_S] [CLIENTS] [DISCONNECT]
#        (defaults: models/k3-mini 600 64 0.1; SERVE_ARGS adds server options)
# A timing-sensitive load test: run it alone (flock -x /tmp/k3-cpu.lock sh bench/soak_drain.sh).
M=${1:-models/k3-mini} D=${2:-600} C=${3:-64} F=${4:-0.1}
K3=${K3:-build/k3}
log=$(mktemp)
$K3 serve -m "$M" --port 0 --threads 1 $SERVE_ARGS 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$log"' EXIT
for i in $(seq 1 200); do grep -q listening "$log" && break; sleep 0.2; done
port=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$log")
[ -n "$port" ] || { cat "$log"; exit 1; }
grep '^k3 serve: ' "$log" | grep -v Avg
python3 bench/soak_clients.py "$port" "$pid" "$D" --clients "$C" --disconnect "$F" >"$log.c"
crc=$?
wait $pid
src=$?
grep -v '^{' "$log.c"
tail -1 "$log.c" | python3 -c '
import json, sys
r = json.load(sys.stdin)
print("started %(started)d: completed correct %(completed)d, aborted by the client %(aborted)d, ended by the drain %(drained)d, "
      "refused by the drain (503) %(refused)d, wrong %(wrong)d, lost %(lost)d; %(started_before_sigterm)d started before "
      "SIGTERM, the server exited %(exit_after_sigterm_s).1f s after it" % r)
rss = [v for _, v in r["rss_kb"]]
if rss:
    n = len(rss)
    print("RSS MB: start %.1f, min %.1f, max %.1f; after the first third %.1f..%.1f" % (
        rss[0] / 1024, min(rss) / 1024, max(rss) / 1024, min(rss[n // 3:]) / 1024, max(rss[n // 3:]) / 1024))
for e in r["lost_examples"]:
    print("  example:", e)'
grep -E 'shutting down|shut down|failed' "$log"
echo "server exit status $src"
rm -f "$log.c"
[ $crc -eq 0 ] && [ $src -eq 0 ] && echo "soak: ok" || { echo "soak: FAILED"; exit 1; }
