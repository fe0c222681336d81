#!/bin/sh
# serve_vs_run.sh -- TTFT and TPOT at concurrency 1: `k3 bench serve` against
# `k3 serve` next to `k3 run` on a prompt of the same length, interleaved
# (run, serve, run, serve, ...) so both meet the same machine state; prints
# each pair and the medians. Usage: sh bench/serve_vs_run.sh MODEL URL [ROUNDS] [IN] [OUT]
# (a `k3 serve -m MODEL --threads 2` must listen at URL). k3 run's TPOT is
# its decode time over its ng - 1 decode passes (it prints ng tokens / time).
M=$1 URL=$2 R=${3:-5} IN=${4:-128} OUT=${5:-64}
K3=${K3:-build/k3}
V=$($K3 info -m "$M" | sed -n 's/^vocab \([0-9]*\).*/\1/p')
tmp=$(mktemp)
for i in $(seq 1 "$R"); do
    ids=$(python3 -c "import random; random.seed($i); print(','.join(str(random.randrange(0, $V - 300)) for _ in range($IN - 1)))")
    $K3 run -m "$M" --ids "$ids" -n "$OUT" --temp 0 --repeat-penalty 1 --threads 2 2>&1 >/dev/null | tail -1 |
        sed -n 's/^prompt \([0-9]*\) tokens, prefill \([0-9.]*\) tok\/s, decode \([0-9]*\) tokens at \([0-9.]*\) tok\/s.*/run \1 \2 \4 \3/p' >>"$tmp"
    $K3 bench serve --base-url "$URL" --tokenizer "$M" --random-input-len "$IN" --random-output-len "$OUT" \
        --num-prompts 4 --max-concurrency 1 --ignore-eos --seed $((1000 + i)) --json |
        python3 -c "import json,sys; r=json.load(sys.stdin); print('serve', r['total_input_tokens']/4, r['median_ttft_ms'], r['median_tpot_ms'])" >>"$tmp"
done
python3 - "$tmp" <<'PY'
import statistics, sys
run, srv = [], []
for line in open(sys.argv[1]):
    f = line.split()
    if f[0] == "run":
        n, pre, dec, ng = int(f[1]), float(f[2]), float(f[3]), int(f[4])
        # k3 run's rate is ng tokens over the ng - 1 forward passes after the prefill (the first
        # token comes from the prefill's logits); TPOT, as bench serve takes it, is per pass
        run.append((n / pre * 1000, 1000 / dec * ng / max(ng - 1, 1)))
    else:
        srv.append((float(f[2]), float(f[3])))
for i, (a, b) in enumerate(zip(run, srv)):
    print(f"round {i + 1}: k3 run TTFT {a[0]:.2f} ms TPOT {a[1]:.2f} ms | k3 serve TTFT {b[0]:.2f} ms TPOT {b[1]:.2f} ms")
mr = [statistics.median(x[k] for x in run) for k in (0, 1)]
ms = [statistics.median(x[k] for x in srv) for k in (0, 1)]
print(f"median: k3 run TTFT {mr[0]:.2f} ms TPOT {mr[1]:.2f} ms; k3 serve TTFT {ms[0]:.2f} ms TPOT {ms[1]:.2f} ms; "
      f"serve/run TTFT {ms[0] / mr[0]:.3f} TPOT {ms[1] / mr[1]:.3f}")
PY
rm -f "$tmp"
