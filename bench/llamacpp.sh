#!/bin/sh
# llamacpp.sh -- k3 beside llama.cpp on the same weights, paired and alternated.
#
#   sh bench/llamacpp.sh LLAMA_DIR[:LLAMA_DIR2...] [GGUF...]
#
# LLAMA_DIR holds a llama.cpp build's llama-bench (the folder itself or its
# bin/); several builds (e.g. native and native without AMX) are separated by
# ':', and each GGUF runs on each build unless written NAME@FILE (then only on
# the build whose folder is named NAME). The GGUFs are the user's own
# conversions of the k3 checkpoint M (the commands are printed when none is
# given); this script downloads nothing, builds nothing, and is no part of
# `make test`.
#
# Each round runs, alternated (every second round in reverse order), one
# exclusive hold of the CPU lock for each k3 mode (`k3 bench --prompts PROMPTS
# --runs RUNS`, which prints its bandwidth and decode fraction) and one for each
# llama.cpp build x GGUF x prompt set (`llama-bench -t THREADS -p SET -r RUNS`,
# the decode `-n GEN` with the first set), each llama-bench run between two
# readings of the bandwidth k3 bench reads (`build/xcore 1 5`: the same
# k3_membw_read_gbps, 1 GB on 2 threads, without loading a model). Then:
# prefill tok/s at each length, prefill GFLOP/s counted with k3 bench's work
# count for both, decode tok/s and its fraction of the bandwidth (llama.cpp:
# the GGUF's bytes a token, read here from its header, x tok/s / the bandwidth
# around the run), and k3 / llama.cpp per round with the medians. A GGUF whose
# trunk holds Q8_0 pairs with the k3 modes of an 8-bit --quant, any other with
# the rest.
#
# Environment (defaults): M (bench/bench), K3 (build/k3), XCORE (build/xcore,
# `make xcore`), ROUNDS (3), THREADS (2), RUNS (3), PROMPTS (128,512,2048),
# PSETS ("128,512 2048": llama-bench's prompt sets, one hold each), PSETS_8BIT
# (PSETS: those of the 8-bit GGUFs), GEN (64), MODES ("best/none
# best/w8a8+w4a8": ISA/QUANT pairs for k3 bench), LOCK (/tmp/k3-cpu.lock), OUT
# (a new temporary folder: results.jsonl and the raw outputs stay there), FIRST
# (1: the first round's number; above 1 the rounds are added to OUT's
# results.jsonl, so rounds can be run apart), PY (.venv/bin/python or python3;
# the standard library only).
set -e
LL=${1:-}
if [ -z "$LL" ] || [ "$LL" = -h ] || [ "$LL" = --help ]; then
    sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
shift
M=${M:-bench/bench} K3=${K3:-build/k3} XCORE=${XCORE:-build/xcore} ROUNDS=${ROUNDS:-3} THREADS=${THREADS:-2} RUNS=${RUNS:-3}
PROMPTS=${PROMPTS:-128,512,2048} PSETS=${PSETS:-128,512 2048} GEN=${GEN:-64}
MODES=${MODES:-best/none best/w8a8+w4a8} LOCK=${LOCK:-/tmp/k3-cpu.lock}
HERE=$(dirname "$0")
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

bench_of() { # the llama-bench of a build folder
    for b in "$1/llama-bench" "$1/bin/llama-bench"; do
        if [ -x "$b" ]; then
            echo "$b"
            return 0
        fi
    done
    echo "llamacpp.sh: no llama-bench in $1 nor $1/bin" >&2
    return 1
}

if [ $# -eq 0 ]; then
    B=$(IFS=:; set -- $LL; echo "$1")
    Q=$(dirname "$(bench_of "$B")")/llama-quantize
    cat <<EOF
No GGUF given. Convert the checkpoint $M with llama.cpp's own converter (a
llama.cpp that has the kimi-k3 architecture; LLAMA_SOURCE is its source tree),
in a venv of its own (bench/llamacpp.py convert reads the checkpoint's own
tokenizer as kimi-k2's, which the converter would refuse), then run this script
again with the files:

  python3 -m venv /tmp/lcpp-venv
  /tmp/lcpp-venv/bin/pip install torch numpy safetensors sentencepiece tiktoken transformers pyyaml
  /tmp/lcpp-venv/bin/python $HERE/llamacpp.py convert LLAMA_SOURCE $M --outtype bf16 \\
      --outfile /tmp/bench-stored.gguf          # BF16 trunk, MXFP4 experts as stored
  $Q /tmp/bench-stored.gguf /tmp/bench-q8.gguf MXFP4_MOE
                                                # Q8_0 trunk, the MXFP4 experts kept
  sh $0 $LL /tmp/bench-stored.gguf /tmp/bench-q8.gguf
EOF
    exit 2
fi

[ -x "$K3" ] || { echo "llamacpp.sh: no $K3 (make build/k3)" >&2; exit 1; }
[ -x "$XCORE" ] || { echo "llamacpp.sh: no $XCORE (make xcore)" >&2; exit 1; }
[ -d "$M" ] || { echo "llamacpp.sh: no checkpoint $M (make bench-model)" >&2; exit 1; }
for g in "$@"; do
    [ -r "${g#*@}" ] || { echo "llamacpp.sh: cannot read ${g#*@}" >&2; exit 1; }
done
OLDIFS=$IFS
IFS=:
for d in $LL; do bench_of "$d" >/dev/null; done
IFS=$OLDIFS

OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
RES=$OUT/results.jsonl
FIRST=${FIRST:-1}
[ "$FIRST" -gt 1 ] || : >"$RES"

gguf_kind() { # 8bit or stored, from the GGUF's trunk types
    "$PY" "$HERE/llamacpp.py" bytes "$1" | sed -n 's/.*"kind": "\([a-z0-9]*\)".*/\1/p'
}

# the holds of one round, one a line: "k3 ISA QUANT" or "ll DIR GGUF PSET N"
HOLDS=$OUT/holds
: >"$HOLDS"
nm=0
for m in $MODES; do nm=$((nm + 1)); done
for g in "$@"; do
    only=
    case "$g" in *@*) only=${g%%@*} g=${g#*@} ;; esac
    sets=$PSETS
    [ "$(gguf_kind "$g")" = 8bit ] && sets=${PSETS_8BIT:-$PSETS}
    IFS=:
    for d in $LL; do
        IFS=$OLDIFS
        if [ -z "$only" ] || [ "$only" = "$(basename "$d")" ]; then
            n=$GEN
            for s in $sets; do
                echo "ll $d $g $s $n" >>"$HOLDS.ll"
                n=0
            done
        fi
        IFS=:
    done
    IFS=$OLDIFS
done
# interleave: a k3 mode, then a share of the llama.cpp holds, and so on
nl=$(wc -l <"$HOLDS.ll")
i=0
for m in $MODES; do
    i=$((i + 1))
    echo "k3 ${m%%/*} ${m#*/}" >>"$HOLDS"
    lo=$(((i - 1) * nl / nm + 1)) hi=$((i * nl / nm))
    [ "$hi" -ge "$lo" ] && sed -n "${lo},${hi}p" "$HOLDS.ll" >>"$HOLDS"
done
rm -f "$HOLDS.ll"

kind_of_quant() {
    case "$1" in
    *w8* | *q8* | *int8*) echo 8bit ;;
    *) echo stored ;;
    esac
}

for g in "$@"; do
    g=${g#*@}
    "$PY" "$HERE/llamacpp.py" bytes "$g" >"$OUT/$(basename "$g").bytes.json"
    echo "GGUF $g: $(cat "$OUT/$(basename "$g").bytes.json")"
done
echo "holds a round (in this order, reversed every second round):"
sed 's/^/  /' "$HOLDS"
grep -m1 "model name" /proc/cpuinfo || true
uptime

r=$FIRST
while [ "$r" -lt $((FIRST + ROUNDS)) ]; do
    if [ $((r % 2)) -eq 0 ]; then order=$(tac "$HOLDS"); else order=$(cat "$HOLDS"); fi
    echo "$order" | while read -r who a b c d; do
        if [ "$who" = k3 ]; then
            cfg="k3 --isa $a --quant $b"
            echo "== round $r: $cfg ($(date -u +%H:%M:%S))"
            j=$(flock -x "$LOCK" "$K3" bench -m "$M" --threads "$THREADS" --isa "$a" --quant "$b" \
                --prompts "$PROMPTS" --runs "$RUNS" --json 2>"$OUT/k3.err") || {
                cat "$OUT/k3.err" >&2
                exit 1
            }
            echo "$j" >"$OUT/r$r-k3-$a-$b.json"
            printf '{"who": "k3", "round": %d, "config": "%s", "kind": "%s", %s\n' \
                "$r" "$cfg" "$(kind_of_quant "$b")" "${j#\{}" >>"$RES"
            echo "$j" | sed 's/, "prefill": \[/\n  prefill [/; s/\], "decode_tok_s"/]\n  decode_tok_s/; s/, "bytes_per_token_stored.*"bandwidth_fraction"/ ... bandwidth_fraction/; s/, "bandwidth_fraction_min.*//'
        else
            lb=$(bench_of "$a")
            gb=$(basename "$b" .gguf)
            cfg="llama.cpp $(basename "$a") $gb"
            nflag="-n $d"
            [ "$d" -gt 0 ] || nflag="-n 0"
            echo "== round $r: $cfg -p $c $nflag ($(date -u +%H:%M:%S))"
            raw=$OUT/r$r-$(basename "$a")-$gb-p$c.jsonl
            flock -x "$LOCK" sh -c '
                "$1" 1 5 >"$4.bw0"
                "$5" -m "$6" -t "$3" -p "$7" $8 -r "$9" -o jsonl >"$4" 2>"$4.err" || { cat "$4.err" >&2; exit 1; }
                "$1" 1 5 >"$4.bw1"
            ' sh "$XCORE" "$M" "$THREADS" "$raw" "$lb" "$b" "$c" "$nflag" "$RUNS"
            bw0=$(awk 'NR == 2 { print $(NF - 1) }' "$raw.bw0")
            bw1=$(awk 'NR == 2 { print $(NF - 1) }' "$raw.bw1")
            bj=$OUT/$(basename "$b").bytes.json
            bpt=$(sed -n 's/.*"bytes_per_token": \([0-9]*\).*/\1/p' "$bj")
            kind=$(sed -n 's/.*"kind": "\([a-z0-9]*\)".*/\1/p' "$bj")
            tests=$(paste -sd, "$raw")
            printf '{"who": "llama", "round": %d, "config": "%s", "kind": "%s", "bytes_per_token": %s, "bw_before": %s, "bw_after": %s, "tests": [%s]}\n' \
                "$r" "$cfg" "$kind" "$bpt" "${bw0:-0}" "${bw1:-0}" "$tests" >>"$RES"
            sed -n 's/.*"n_prompt": \([0-9]*\), "n_gen": \([0-9]*\).*"avg_ts": \([0-9.]*\).*/  pp \1 tg \2: \3 tok\/s/p' "$raw"
            echo "  bandwidth ${bw0:-?} GB/s before, ${bw1:-?} after"
        fi
    done
    r=$((r + 1))
done
uptime
echo "results: $RES"
"$PY" "$HERE/llamacpp.py" table "$RES"
