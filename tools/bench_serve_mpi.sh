#!/bin/sh
# bench_serve_mpi.sh -- `k3 bench serve` at concurrency 1 and 4 against one
# `k3 serve`, in one process (NP 0) or under mpirun -np NP; prints the server's
# startup lines (cache bytes per rank under mpirun), one line of figures per
# concurrency, and the summed DCP exchange bytes of /metrics; then SIGTERMs
# rank 0 (which ends every rank).
# Usage: sh tools/bench_serve_mpi.sh MODEL NP [serve options, e.g. --dcp 2 --ep 2]
# Env: K3 (default build/k3), IN (256), OUT (32), N (16 prompts per concurrency).
# c1 uses --seed 1 and c4 --seed 4, so the second run does not hit the first's
# prompts in the prefix cache.
M=$1 np=$2
shift 2
K3=${K3:-build/k3} IN=${IN:-256} OUT=${OUT:-32} N=${N:-16}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
L=$(mktemp)
J=$(mktemp)
trap 'rm -f "$L" "$J"' EXIT
if [ "$np" -gt 0 ]; then
    mpirun --oversubscribe --allow-run-as-root -np "$np" "$K3" serve -m "$M" --port 0 "$@" >/dev/null 2>"$L" </dev/null &
else
    "$K3" serve -m "$M" --port 0 "$@" >/dev/null 2>"$L" </dev/null &
fi
pid=$!
p=
for i in $(seq 1200); do
    p=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$L" | head -1)
    [ -n "$p" ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
done
grep "^k3 serve: " "$L" | grep -v listening
[ -n "$p" ] || { echo "the server did not start"; cat "$L"; exit 1; }
for c in 1 4; do
    "$K3" bench serve --base-url "http://127.0.0.1:$p" --tokenizer "$M" --random-input-len "$IN" \
        --random-output-len "$OUT" --num-prompts "$N" --max-concurrency $c --seed $c --ignore-eos --json >"$J" 2>/dev/null
    python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
print("c%s: %d done, output %.1f tok/s, median TTFT %.1f ms, TPOT %.2f ms, ITL %.2f ms" % (sys.argv[2],
      d["completed"], d["output_throughput"], d["median_ttft_ms"], d["median_tpot_ms"], d["median_itl_ms"]))' "$J" $c
done
python3 - "$p" <<'PY'
import sys, urllib.request
t = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=30).read().decode()
v = {l.rsplit(" ", 1)[0]: l.rsplit(" ", 1)[1] for l in t.splitlines() if l.startswith("k3:dist_bytes_total")}
if v:
    print("all ranks, received: " + ", ".join("%s %s B" % (k, v['k3:dist_bytes_total{kind="%s",dir="received"}' % k])
                                            for k in ("topk_exchange", "lse_merge", "ep_dispatch", "ep_combine")))
PY
# SIGTERM to rank 0: the k3 serve process (or, under mpirun, the one whose rank is 0)
if [ "$np" -eq 0 ]; then
    kill -TERM $pid
else
    todo=$pid # rank 0 among mpirun's descendants
    while [ -n "$todo" ]; do
        next=
        for q in $todo; do
            if tr '\0' '\n' </proc/$q/environ 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=0; then
                kill -TERM $q
                next=
                break
            fi
            next="$next $(pgrep -P $q | tr '\n' ' ')"
        done
        todo=$(echo $next)
    done
fi
wait $pid
