#!/bin/sh
# grammar.sh -- the grammar engine's speed on the agent schemas of
# bench/grammar/ (tools/agent_schemas.py writes them): every schema compiled
# and its texts fed token by token through `k3 grammar`, the mask of every
# step timed. Prints, pooled over all schemas: the mask time per token (mean,
# p50, p99, max), the median compile time, the texts accepted, and the
# schemas that did not compile with their errors.
# Usage: sh bench/grammar.sh [K3] [VOCAB ARGS...]
#   default: build/k3 --vocab data/tokenizers/o200k_base.tiktoken --pattern o200k
# Time it alone: flock -x /tmp/k3-cpu.lock sh bench/grammar.sh
K3=${1:-build/k3}
[ $# -gt 0 ] && shift
[ $# -eq 0 ] && set -- --vocab data/tokenizers/o200k_base.tiktoken --pattern o200k
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
: >"$TMP/all"
: >"$TMP/compile"
: >"$TMP/errors"
texts=0 accepted=0 schemas=0
for s in bench/grammar/[0-9]*.json; do
    t=${s%.json}.jsonl
    schemas=$((schemas + 1))
    "$K3" grammar "$@" --json-schema "$s" --test "$t" --json --times "$TMP/t" >"$TMP/out" 2>"$TMP/err" || {
        echo "$s: k3 grammar failed: $(cat "$TMP/err")"; continue; }
    cat "$TMP/t" >>"$TMP/all"
    sed -n 's/.*"compile_ms": \([0-9.e+-]*\).*/\1/p' "$TMP/out" >>"$TMP/compile"
    if grep -q '"compiled": false' "$TMP/out"; then
        echo "$s: $(sed -n 's/.*"error": "\([^"]*\)".*/\1/p' "$TMP/out")" >>"$TMP/errors"
    fi
    n=$(grep -o '"accepted": [a-z]*' "$TMP/out" | wc -l)
    a=$(grep -o '"accepted": true' "$TMP/out" | wc -l)
    texts=$((texts + n)); accepted=$((accepted + a))
done
sort -g "$TMP/all" >"$TMP/sorted"
sort -g "$TMP/compile" >"$TMP/csorted"
awk -v texts="$texts" -v acc="$accepted" -v schemas="$schemas" -v cfile="$TMP/csorted" '
    { v[NR] = $1; s += $1 }
    END {
        n = NR
        while ((getline c < cfile) > 0) cm[++nc] = c
        printf "schemas %d, texts %d accepted %d\n", schemas, texts, acc
        if (n) printf "mask per token: n %d mean %.1f us p50 %.1f us p99 %.1f us max %.1f us\n", n, s / n, v[int((n - 1) * 0.5) + 1], v[int((n - 1) * 0.99) + 1], v[n]
        if (nc) printf "compile: median %.3f ms max %.3f ms\n", cm[int((nc - 1) / 2) + 1], cm[nc]
    }' "$TMP/sorted"
if [ -s "$TMP/errors" ]; then echo "not compiled:"; cat "$TMP/errors"; fi
