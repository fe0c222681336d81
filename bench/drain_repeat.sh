#!/bin/sh
# drain_repeat.sh -- the SIGTERM drain test of tests/serve_robust.py (8 streams and
# 4 whole answers cut by the server) N times in a row, pinned to one core
# (taskset -c CORE: the engine thread, the HTTP threads and the client share
# it, so which thread wakes first varies run to run). Prints each failure's
# first lines and `drain: P passed, F failed of N`.
# Usage: sh bench/drain_repeat.sh [N] [CORE] [K3]     (defaults 50, 0, build/k3)
N=${1:-50}
CORE=${2:-0}
K3=${3:-build/k3}
PY=$(sh scripts/venv.sh openai) || exit 1
pass=0
fail=0
i=0
while [ $i -lt "$N" ]; do
    i=$((i + 1))
    out=$(taskset -c "$CORE" "$PY" tests/serve_robust.py "$K3" "SIGTERM with 8 streams" 2>&1)
    if echo "$out" | grep -q "^ok   robust: SIGTERM with 8 streams"; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "run $i:"
        echo "$out" | grep -A3 "^FAIL" | head -4 | cut -c1-300 | sed 's/^/    /'
    fi
done
echo "drain: $pass passed, $fail failed of $N"
