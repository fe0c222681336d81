#!/bin/sh
# accuracy.sh -- perplexity and top-1 agreement with fp32 of every fast mode
# on the trained default model's held-out text (issue: accuracy of the fast
# modes). Usage: sh bench/accuracy.sh [model dir] [text]
M=${1:-models/k3-mini}
T=${2:-data/heldout/austen.txt}
K3=build/k3
for mode in "none f32" "none c8" "w8a8 f32" "w8a8-mxfp8 f32" "w4a8 f32" "w8a8+w4a8 f32" "w8a8+w4a8 c8" "w8a8-mxfp8+w4a8 c8"; do
    set -- $mode
    $K3 eval -m "$M" --text "$T" --ctx 512 --max-tokens ${N:-4000} --quant "$1" --kv-cache "$2" --compare-fp32 2>/dev/null | tr '\n' ' '
    echo
done
