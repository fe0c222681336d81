#!/bin/sh
# measure.sh -- the measurements quoted in docs/performance.md, in one go.
# Needs the bench checkpoint (1.9 GB, ~20 s to write):
#   python3 tools/make_checkpoint.py --preset bench-dsa --out /tmp/bench-dsa
# Usage: sh bench/measure.sh /tmp/bench-dsa [default-quant]
# Run on an otherwise idle machine: a second process on a 2-core machine
# halves the figures. The decode fraction compares each run with the
# bandwidth measured just before it, since this machine's bandwidth drifts.
set -e
M=${1:?model dir}
Q=${2:-w8a8+w4a8}
K3=build/k3
echo "== fp32 reference (stored weights, fp32 cache)"
$K3 bench -m "$M" --quant none --kv-cache f32 --json --profile
echo "== default: $Q, C8 cache"
$K3 bench -m "$M" --quant "$Q" --kv-cache c8 --json --profile
echo "== long context, default mode (DSA vs the same layers dense)"
$K3 bench -m "$M" --quant "$Q" --kv-cache c8 --long-context --runs 3 --prompts 128 --decode-tokens 4
