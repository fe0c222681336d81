#!/bin/sh
# kvstore.sh -- the prefix cache's figures (docs/kvstore.md), each timed part under an exclusive
# hold of the machine's lock (LOCK, default /tmp/k3-cpu.lock; LOCK= for none), each preceded by the
# load and the memory bandwidth `k3 bench` measures (the state the figures met).
#   sh bench/kvstore.sh [ttft|load|itl|replay|all]   (build/k3; bench/bench from `make bench-model`)
# ttft: TTFT of an 8k-token prompt on bench/bench cold, RAM hit, disk hit after a restart (pages
#   dropped), the load's read rate against the directory's raw sequential read (RUNS=3, medians;
#   TOKENS=8192, MODEL=bench/bench, DIR=a directory on the disk to measure, default $TMPDIR; the
#   files go in a directory made inside it and removed at the end).
# load: one cold prefill of TOKENS, then RUNS restarts each loading it with O_DIRECT and through the
#   page cache (--kv-cache-buffered), alternated: the load's rate against the raw sequential read.
# itl: decode ITL p50 / p99 of two streams in the windows where a prompt of ITL_TOKENS+1 (513) loads
#   from disk while another one is saved (CYCLES=6 windows), against the same traffic without the
#   disk tier (RAM hits); RUNS pairs, alternated (ITL_MODES="disk buffered ram": the tier with
#   O_DIRECT, through the page cache, and without it; the order rotates by the run: the first server
#   after the setup meets the directory just written, and its windows run slower whatever its mode).
# replay: 8 conversations x 10 turns (CONVS, TURNS), each round shuffled, over two instances of MODEL
#   behind k3 serve --role router, cache_aware against round_robin: hit rate, TTFT p50 / p99
#   (SYS_WORDS=600 words of system prompt, TOOL_WORDS=120 of tool output a turn; on models/k3-mini,
#   whose context is 4096 tokens: SYS_WORDS=350 TOOL_WORDS=60).
K3=${K3:-build/k3}
MODEL=${MODEL:-bench/bench}
TOKENS=${TOKENS:-8192}
RUNS=${RUNS:-3}
LOCK=${LOCK-/tmp/k3-cpu.lock}
if [ -n "$DIR" ]; then # the caller's directory: the files of each run go in a directory made in it
    mkdir -p "$DIR" && DIR=$(mktemp -d "$DIR/k3-kvbench.XXXXXX") || exit 1
else
    DIR=$(mktemp -d "${TMPDIR:-/tmp}/k3-kvbench.XXXXXX")
fi
PY=${PY:-python3}
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
if [ "$what" = load ]; then
    # the disk hit's load with O_DIRECT against the page cache, alternated (one cold prefill first)
    hold -x
    state "exclusive"
    $PY bench/kv_bench.py "$K3" load "$MODEL" "$TOKENS" "$RUNS" "$DIR"
    state "end"
    hold -u
fi
if [ "$what" = itl ] || [ "$what" = all ]; then
    # RUNS pairs (with the tier, without), each in its own exclusive hold
    for run in $(seq "$RUNS"); do
        hold -x
        state "exclusive"
        ROTATE=$((run - 1)) $PY bench/kv_bench.py "$K3" itl "$MODEL" "${ITL_TOKENS:-512}" 1 "$DIR" ${CYCLES:-6}
        state "end"
        hold -u
    done
fi
if [ "$what" = replay ] || [ "$what" = all ]; then
    # RUNS pairs, the two policies alternated, each run in its own exclusive hold
    for run in $(seq "$RUNS"); do
        for policy in cache_aware round_robin; do
            hold -x
            state "exclusive"
            $PY bench/kv_bench.py "$K3" replay "$MODEL" "${CONVS:-8}" "${TURNS:-10}" "$policy" 7 ${SYS_WORDS:-600} ${TOOL_WORDS:-120}
            state "end"
            hold -u
        done
    done
fi
rm -rf "$DIR"
