#!/bin/sh
# measure.sh -- the measurements quoted in docs/performance.md, in one go.
# Needs the bench checkpoints (1.9 GB each, ~20 s each to write):
#   python3 tools/make_checkpoint.py --preset bench-dsa --out /tmp/bench-dsa
# Usage: sh bench/measure.sh /tmp/bench-dsa [default-quant]
# Run on a quiet machine: the figures are medians of 5 runs, but a second
# process on a 2-core machine halves them.
set -e
M=${1:?model dir}
Q=${2:-w8a8+w4a8}
K3=build/k3
echo "== fp32 (stored weights, fp32 cache)"
$K3 bench -m "$M" --json --profile
echo "== $Q, C8 cache"
$K3 bench -m "$M" --quant "$Q" --kv-cache c8 --json --profile
echo "== long context, fp32 cache (DSA vs the same layers dense)"
$K3 bench -m "$M" --long-context --runs 3 --prompts 128 --decode-tokens 4
