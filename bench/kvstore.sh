#!/bin/sh
# kvstore.sh -- the prefix cache's figures (docs/kvstore.md), each timed part under an exclusive
# hold of the machine's lock (LOCK, default /tmp/k3-cpu.lock; LOCK= for none), each preceded by the
# load and the memory bandwidth `k3 bench` measures (the state the figures met).
#   sh bench/kvstore.sh [ttft|replay|all]   (build/k3; bench/bench from `make bench-model`)
# ttft: TTFT of an 8k-token prompt on bench/bench cold, RAM hit, disk hit after a restart (pages
#   dropped), the load's read rate against the directory's raw sequential read (RUNS=3, medians;
#   TOKENS=8192, MODEL=bench/bench, DIR=a directory on the disk to measure, default $TMPDIR).
# replay: 8 conversations x 10 turns, each round shuffled, over two instances of bench/bench behind
#   k3 serve --role router, cache_aware against round_robin: hit rate, TTFT p50 / p99.
K3=${K3:-build/k3}
MODEL=${MODEL:-bench/bench}
TOKENS=${TOKENS:-8192}
RUNS=${RUNS:-3}
LOCK=${LOCK-/tmp/k3-cpu.lock}
DIR=${DIR:-$(mktemp -d "${TMPDIR:-/tmp}/k3-kvbench.XXXXXX")}
PY=python3
what=${1:-all}
[ -n "$LOCK" ] && exec 9>>"$LOCK"
hold() { [ -z "$LOCK" ] || flock "$1" 9; }
state() {
    bw=$("$K3" bench -m tests/models/tiny --runs 1 --prompts 16 --decode-tokens 1 --membw-mb 512 2>/dev/null |
        grep "^memory bandwidth")
    echo "-- $1: load $(cut -d' ' -f1-3 /proc/loadavg); ${bw:-memory bandwidth: (k3 bench failed)}"
}
if [ "$what" = ttft ] || [ "$what" = all ]; then
    hold -x
    state "exclusive"
    $PY bench/kv_bench.py "$K3" ttft "$MODEL" "$TOKENS" "$RUNS" "$DIR"
    state "end"
    hold -u
fi
if [ "$what" = replay ] || [ "$what" = all ]; then
    for policy in cache_aware round_robin; do
        hold -x
        state "exclusive"
        $PY bench/kv_bench.py "$K3" replay "$MODEL" "${CONVS:-8}" "${TURNS:-10}" "$policy" 7
        state "end"
        hold -u
    done
fi
rm -rf "$DIR"
