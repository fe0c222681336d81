#!/bin/sh
# run.sh -- runs each libFuzzer harness for SECONDS seconds on its seed corpus
# (fuzz/corpus/NAME), new inputs going to DIR/corpus/NAME (the seeds stay as
# committed). Prints one line per harness with libFuzzer's run count, then
# `fuzz: N passed, N failed, N skipped`. A crash leaves its input in DIR/crash-NAME-*.
# Usage: sh fuzz/run.sh DIR SECONDS      (DIR: where make built the harnesses)
# Without clang `make` builds nothing: each harness is a skip with that reason.
DIR=${1:-build-fuzz}
T=${2:-5}
NAMES="safetensors config tiktoken chat image grammar"
pass=0
fail=0
if [ ! -x "$DIR/fuzz_config" ]; then
    n=0
    for name in $NAMES; do
        echo "skip fuzz_$name: clang not found (install clang and libclang-rt-14-dev to run the fuzzers)"
        n=$((n + 1))
    done
    echo "fuzz: 0 passed, 0 failed, $n skipped"
    exit 0
fi
for name in $NAMES; do
    mkdir -p "$DIR/corpus/$name"
    log="$DIR/fuzz_$name.log"
    if "$DIR/fuzz_$name" -max_total_time="$T" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$DIR/crash-$name-" "$DIR/corpus/$name" "fuzz/corpus/$name" >"$log" 2>&1; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
        cov=$(grep -a -o 'cov: [0-9]*' "$log" | tail -n 1)
        pass=$((pass + 1))
        echo "ok   fuzz_$name: $runs runs in ${T}s, $cov"
    else
        fail=$((fail + 1))
        echo "FAIL fuzz_$name (see $log)"
        grep -E "ERROR|SUMMARY|==[0-9]+==" "$log" | head -5 | sed 's/^/    /'
    fi
done
echo "fuzz: $pass passed, $fail failed, 0 skipped"
[ $fail -eq 0 ]
