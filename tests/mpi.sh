#!/bin/sh
# mpi.sh -- k3 across processes: the DSA top-k exchange alone, and
# the whole model under mpirun -- DCP 2 and 4 (both exchanges), EP 2, DCP 2 x
# EP 2 on 4 ranks -- against one process: prompt logits (k3 run
# --dump-logits) to rel-L2 1e-5 and the same greedy text, on the fp32 path
# (--quant f32: DCP merges each rank's attention in its own fp32 order, a
# 1e-7 difference that a rounding of the activations to BF16 or 8 bits
# downstream can turn into another token) with the f32 and the C8 cache;
# each rank's cache bytes 1/D of one process's; bad
# configurations, a rank that dies and a rank that hangs end every rank
# with a message, never a hang; under k3 serve a rank killed or stopped
# mid-stream gives the client its error event (tests/mpi_stream.py), and
# /health turns 503 while a step is stuck. Skipped (one line) when mpirun
# is missing.
# Usage: sh tests/mpi.sh build/k3 build/k3-test  (build/k3-cmp,
# build/k3-mpi-exchange and build/k3-mpi-batch beside them). Ends with `mpi: N passed, N failed, N skipped`.
K3=${1:-build/k3}
BUILD=$(dirname "$K3")
M=tests/models/tiny-dsa
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   mpi: $1"; }
bad() { fail=$((fail + 1)); echo "FAIL mpi: $1"; [ -n "$2" ] && sed 's/^/    /' "$2" | head -8; }

if ! command -v mpirun >/dev/null 2>&1; then
    echo "skip mpi: the whole suite: mpirun not found (scripts/install-deps.sh installs openmpi-bin)"
    echo "mpi: 0 passed, 0 failed, 1 skipped"
    exit 0
fi
# CI runs as root; this machine has 2 cores for up to 4 ranks
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# Under `make asan` LeakSanitizer reports OpenMPI's own allocations at exit
# (every leaked stack is inside libmpi/libopen-pal/MCA plugins; checked by
# hand): leak detection is off for the MPI processes only.
MPI="env ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 timeout 120 mpirun --oversubscribe --allow-run-as-root"

# a 40-token prompt: 5 x index_topk (8) of tiny-dsa
IDS=$(awk 'BEGIN { for (i = 0; i < 40; i++) printf "%s%d", (i ? "," : ""), (i * 37 + 11) % 1000 }')
RUN="run -m $M --ids $IDS -n 6 --temp 0 --threads 1"

for np in 2 3 4; do
    if $MPI -np $np "$BUILD/k3-mpi-exchange" >"$TMP/x" 2>&1 && grep -q " 0 failed" "$TMP/x"; then
        ok "top-k exchange on $np ranks ($(grep -o '[0-9]* passed' "$TMP/x"))"
    else
        bad "top-k exchange on $np ranks" "$TMP/x"
    fi
done

# the library with several sequences per batch, resets, rounds cut by max_batch
for cfg in "2" "3" "4" "2 ep" "4 ep"; do
    set -- $cfg
    if $MPI -np $1 "$BUILD/k3-mpi-batch" $M $2 >"$TMP/x" 2>&1 && grep -q " 0 failed" "$TMP/x"; then
        ok "batches of 3 sequences on $1 ranks ${2:-dcp}: logits = one process"
    else
        bad "batches of 3 sequences on $1 ranks ${2:-dcp}" "$TMP/x"
    fi
done

# compare NAME REF.bin REF.txt NP ARGS...: the distributed run against one process
compare() {
    name=$1 ref=$2 reftxt=$3 np=$4
    shift 4
    rm -f "$TMP/d.bin"
    if ! $MPI -np "$np" "$K3" $RUN "$@" --dump-logits "$TMP/d.bin" >"$TMP/d.txt" 2>"$TMP/d.err"; then
        bad "$name (exit)" "$TMP/d.err"
    elif ! "$BUILD/k3-cmp" "$ref" "$TMP/d.bin" 1e-5 >"$TMP/cmp" 2>&1; then
        bad "$name (logits)" "$TMP/cmp"
    elif ! cmp -s "$reftxt" "$TMP/d.txt"; then
        bad "$name (greedy text differs)" "$TMP/d.txt"
    else
        ok "$name: $(cut -d, -f1 "$TMP/cmp"), same greedy text"
    fi
}

for kv in f32 c8; do
    "$K3" $RUN --quant f32 --kv-cache $kv --dump-logits "$TMP/ref_$kv.bin" >"$TMP/ref_$kv.txt" 2>"$TMP/ref.err" ||
        bad "one-process reference ($kv)" "$TMP/ref.err"
    Q="--quant f32 --kv-cache $kv"
    compare "$kv dcp 2" "$TMP/ref_$kv.bin" "$TMP/ref_$kv.txt" 2 $Q --dcp 2
    compare "$kv dcp 4 allgather" "$TMP/ref_$kv.bin" "$TMP/ref_$kv.txt" 4 $Q --dcp 4
    compare "$kv dcp 4 butterfly" "$TMP/ref_$kv.bin" "$TMP/ref_$kv.txt" 4 $Q --dcp 4 --dcp-topk-exchange butterfly
    compare "$kv ep 2" "$TMP/ref_$kv.bin" "$TMP/ref_$kv.txt" 2 $Q --ep 2
    compare "$kv dcp 2 x ep 2 on 4 ranks" "$TMP/ref_$kv.bin" "$TMP/ref_$kv.txt" 4 $Q --dcp 2 --ep 2
done
compare "f32 dcp 3 (4 heads: every partial gathered)" "$TMP/ref_f32.bin" "$TMP/ref_f32.txt" 3 --quant f32 \
    --kv-cache f32 --dcp 3
compare "f32 dcp 2, interleave 4, 2 threads" "$TMP/ref_f32.bin" "$TMP/ref_f32.txt" 2 --quant f32 --kv-cache f32 \
    --dcp 2 --dcp-interleave 4 --threads 2
# EP runs each owner's experts over the same rows in the same order: exact
# in the default mode too (BF16 dot products where the CPU has them)
"$K3" $RUN --dump-logits "$TMP/ref_def.bin" >"$TMP/ref_def.txt" 2>"$TMP/ref.err" ||
    bad "one-process reference (default mode)" "$TMP/ref.err"
compare "default mode ep 2" "$TMP/ref_def.bin" "$TMP/ref_def.txt" 2 --ep 2

# images under mpirun (vision-tiny: no routed experts, so DCP): rank 0
# encodes, the rows go to the other ranks with the batch; logits and text =
# one process
VT=tests/models/vision-tiny
VI=tests/golden/vision/images
VRUN="run -m $VT --quant none --temp 0 -n 6 --threads 1 --image $VI/rgb_200x130.png --image $VI/photo_67x45.jpg"
"$K3" $VRUN --dump-logits "$TMP/vref.bin" "Which is brighter?" >"$TMP/vref.txt" 2>"$TMP/ref.err" ||
    bad "one-process image reference" "$TMP/ref.err"
rm -f "$TMP/d.bin"
if $MPI -np 2 "$K3" $VRUN --dcp 2 --dump-logits "$TMP/d.bin" "Which is brighter?" >"$TMP/d.txt" 2>"$TMP/d.err" &&
    "$BUILD/k3-cmp" "$TMP/vref.bin" "$TMP/d.bin" 1e-5 >"$TMP/cmp" 2>&1 && cmp -s "$TMP/vref.txt" "$TMP/d.txt"; then
    ok "run --image x2 --dcp 2: $(cut -d, -f1 "$TMP/cmp"), same greedy text"
else
    bad "run --image x2 --dcp 2" "$TMP/d.err"
    sed 's/^/    /' "$TMP/cmp" 2>/dev/null | head -3
fi

# k3 bench's counters against the formulas
for ex in allgather butterfly; do
    $MPI -np 4 "$K3" bench -m $M --dcp 4 --dcp-topk-exchange $ex --contexts 64 --runs 1 --decode-tokens 2 \
        --quant none --kv-cache f32 >"$TMP/b" 2>&1
    if [ "$(grep -c -- "-- agree" "$TMP/b")" -eq 5 ] && ! grep -q DIFFER "$TMP/b"; then
        ok "bench dcp 4 $ex: top-k and LSE bytes (rank 0, and all 4 ranks summed) and the collectives a token agree with the formulas"
    else bad "bench dcp 4 $ex: counters against the formulas" "$TMP/b"; fi
done
# DCP and EP together: the collectives a token (k3 plan's latency term) and the EP source rank's bytes
$MPI -np 2 "$K3" bench -m $M --dcp 2 --ep 2 --contexts 64 --runs 1 --decode-tokens 2 --quant none --kv-cache f32 \
    >"$TMP/b" 2>&1
if grep -q "collectives per token, rank 0: measured .* -- agree" "$TMP/b" && grep -q "EP per token, rank 0" "$TMP/b" &&
    ! grep -q DIFFER "$TMP/b"; then
    ok "bench dcp 2 ep 2: $(sed -n 's/.*collectives per token, rank 0: \(.*\) -- agree/\1/p' "$TMP/b") collectives a token"
else bad "bench dcp 2 ep 2: collectives against the formula" "$TMP/b"; fi

$MPI -np 2 "$K3" bench -m $M --dcp 2 --contexts 64,128 --runs 1 --decode-tokens 2 --quant none --kv-cache f32 \
    --json >"$TMP/j" 2>/dev/null
python3 -c 'import json,sys
d = json.load(open(sys.argv[1]))
for c in d["contexts"]:
    assert c["comm"]["topk_exchange"]["recv_per_token"] == c["topk_formula_bytes"] > 0
    assert c["comm"]["lse_merge"]["recv_per_token"] == c["lse_formula_bytes"] > 0 and c["decode_ms"] > 0
    a, n = c["comm_all_ranks"], c["ranks_summed"]
    assert n == 2 and a["topk_exchange"]["recv_per_token"] == n * c["topk_formula_bytes"]
    assert a["lse_merge"]["recv_per_token"] == n * c["lse_formula_bytes"]
    assert all(a[k]["sent_per_token"] == a[k]["recv_per_token"] for k in a)' "$TMP/j" 2>"$TMP/jerr" &&
    ok "bench --json under mpirun: counters = formulas (rank 0, and summed over the ranks)" || bad "bench --json under mpirun" "$TMP/jerr"

# each rank's cache is 1/D of one process's (1024 and 1000 tokens: whole blocks)
mem() { grep "^$1 bytes per rank:" "$2" | cut -d: -f2; }
"$K3" run -m $M --ids 1,2,3 -n 0 --ctx 1024 --show-memory >/dev/null 2>"$TMP/m1"
one=$(mem cache "$TMP/m1")
one_e=$(mem expert "$TMP/m1")
$MPI -np 4 "$K3" run -m $M --ids 1,2,3 -n 0 --ctx 1024 --show-memory --dcp 4 --threads 1 >/dev/null 2>"$TMP/m4"
ranks=$(mem cache "$TMP/m4")
if [ -n "$one" ] && [ "$(echo $ranks | wc -w)" -eq 4 ] && echo $ranks | tr ' ' '\n' | awk -v s="$one" '$1 * 4 != s { bad = 1 } END { exit bad }'; then
    ok "dcp 4: cache bytes per rank $ranks = $one / 4"
else
    bad "dcp 4: cache bytes per rank '$ranks', one process '$one'" "$TMP/m4"
fi
$MPI -np 2 "$K3" run -m $M --ids 1,2,3 -n 0 --ctx 1000 --show-memory --ep 2 --threads 1 >/dev/null 2>"$TMP/m2"
"$K3" run -m $M --ids 1,2,3 -n 0 --ctx 1000 --show-memory >/dev/null 2>"$TMP/m1b"
ranks=$(mem expert "$TMP/m2")
if [ -n "$one_e" ] && [ "$(echo $ranks | wc -w)" -eq 2 ] && echo $ranks | tr ' ' '\n' | awk -v s="$one_e" '$1 * 2 != s { bad = 1 } END { exit bad }'; then
    ok "ep 2: routed-expert bytes per rank $ranks = $one_e / 2"
else
    bad "ep 2: expert bytes per rank '$ranks', one process '$one_e'" "$TMP/m2"
fi

# expect_fail NAME PATTERN NP ARGS...: exits non-zero (not a timeout), PATTERN
# on stderr exactly once (rank 0 alone says it)
expect_fail() {
    name=$1 pat=$2 np=$3
    shift 3
    $MPI -np "$np" "$K3" "$@" >"$TMP/out" 2>"$TMP/err" </dev/null
    rc=$?
    n=$(grep -c -- "$pat" "$TMP/err")
    if [ $rc -eq 0 ] || [ $rc -ge 124 ]; then
        bad "$name (exit $rc)" "$TMP/err"
    elif [ "$n" -ne 1 ]; then
        bad "$name ('$pat' printed $n times)" "$TMP/err"
    else
        ok "$name"
    fi
}
expect_fail "--dcp 3 on 2 ranks" "does not divide the 2 ranks" 2 $RUN --dcp 3
expect_fail "--ep 3 does not divide 16 experts" "does not divide the 16 routed experts" 3 $RUN --ep 3
expect_fail "butterfly needs a power of two" "power-of-two" 3 $RUN --dcp 3 --dcp-topk-exchange butterfly
expect_fail "rank 0 refuses a bad prompt, all ranks end" "out of range" 2 run -m $M --ids 1,2,99999 -n 2 --dcp 2 --threads 1
expect_fail "a hanging rank: the others time out" "got no answer within 3 s" 2 $RUN --dcp 2 --dist-timeout 3 --dist-test-hang 1
# a dead rank: mpirun ends the job (no message of ours to look for)
$MPI -np 2 "$K3" $RUN --dcp 2 --dist-test-die 1 >/dev/null 2>"$TMP/err" </dev/null
rc=$?
if [ $rc -ne 0 ] && [ $rc -lt 124 ]; then ok "a dead rank ends the job (exit $rc)"; else bad "a dead rank (exit $rc)" "$TMP/err"; fi
# without mpirun
if "$K3" $RUN --dcp 2 >/dev/null 2>"$TMP/err"; then bad "--dcp 2 without mpirun"; else
    grep -q "mpirun" "$TMP/err" && ok "--dcp 2 without mpirun says to use mpirun" || bad "--dcp 2 without mpirun" "$TMP/err"
fi

# k3 serve under mpirun against one process (tests/mpi_serve.py): --ep 2,
# --dcp 2 (the engine's global block tables on every rank's 1/D cache; the
# 150-token prompt is over index_topk, so DSA selection runs) and --dcp 2
# --ep 2 on 4 ranks, on the fp32 path (--quant f32, as above); rank 0 ends
# on SIGTERM and lets the others go: mpirun exits 0
port_of() { sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$1" | head -1; }
wait_port() { for i in $(seq 300); do p=$(port_of "$1"); [ -n "$p" ] && { echo "$p"; return; }; sleep 0.1; done; }
SRV="serve -m $M --quant f32 --port 0 --threads 1 --max-num-seqs 4 --cache-tokens 16384"
timeout 300 "$K3" $SRV >/dev/null 2>"$TMP/s1" </dev/null &
spid=$!
trap 'kill $mpid $spid 2>/dev/null; rm -rf "$TMP"' EXIT
p1=$(wait_port "$TMP/s1")
# rank0_of PID: the process of MPI rank 0 among PID's descendants (not a
# pattern match: other checkouts may run the same commands at the same time)
rank0_of() {
    todo=$1
    while [ -n "$todo" ]; do
        next=
        for q in $todo; do
            tr '\0' '\n' </proc/$q/environ 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=0 && { echo $q; return; }
            next="$next $(pgrep -P $q | tr '\n' ' ')"
        done
        todo=$(echo $next)
    done
}
# serve_check NP GROW ARGS...: the server under mpirun -np NP with ARGS against
# the one-process server; GROW: the counter kinds that must grow in /metrics
serve_check() {
    np=$1 grow=$2
    shift 2
    name="serve $*"
    $MPI -np "$np" "$K3" $SRV "$@" >/dev/null 2>"$TMP/s2" </dev/null &
    mpid=$!
    p2=$(wait_port "$TMP/s2")
    echo "$(sed -n 's/.*DCP \([0-9]*\) .*cache \([0-9]*\) bytes per rank.*/\1 \2/p' "$TMP/s2")" >>"$TMP/cachebytes"
    if [ -n "$p2" ] && [ -n "$p1" ] && timeout 100 python3 tests/mpi_serve.py "$p2" "$p1" --metrics --grow "$grow" >"$TMP/c" 2>&1; then
        ok "$name: $(grep -c '^ok' "$TMP/c") client checks (greedy text = one process, prefix-cache hit, two in flight, /metrics $grow grow)"
    else
        bad "$name (ports '$p2' '$p1')" "$TMP/c"
        sed 's/^/    /' "$TMP/s2" | tail -5
    fi
    # SIGTERM to rank 0 (the k3 process whose rank is 0)
    r0=$(rank0_of $mpid)
    [ -n "$r0" ] && kill -TERM "$r0"
    wait $mpid
    rc=$?
    if [ -n "$r0" ] && [ $rc -eq 0 ] && grep -q "shutting down" "$TMP/s2"; then ok "$name: SIGTERM on rank 0 ends every rank (exit 0)"
    else bad "$name: SIGTERM on rank 0 (rank 0 pid '$r0', exit $rc)" "$TMP/s2"; fi
}
serve_check 2 ep_dispatch,ep_combine --ep 2
serve_check 2 topk_exchange,lse_merge --dcp 2
serve_check 4 topk_exchange,lse_merge,ep_dispatch,ep_combine --dcp 2 --ep 2
# preemption under DCP: a 320-token pool for four requests at once
$MPI -np 2 "$K3" serve -m $M --quant f32 --port 0 --threads 1 --max-num-seqs 4 --cache-tokens 320 --dcp 2 >/dev/null \
    2>"$TMP/s2" </dev/null &
mpid=$!
p2=$(wait_port "$TMP/s2")
if [ -n "$p2" ] && [ -n "$p1" ] && timeout 100 python3 tests/mpi_serve.py "$p2" "$p1" --preempt >"$TMP/c" 2>&1; then
    ok "serve --dcp 2: $(sed 's/^ok   //' "$TMP/c")"
else
    bad "serve --dcp 2 preemption (ports '$p2' '$p1')" "$TMP/c"
fi
r0=$(rank0_of $mpid)
[ -n "$r0" ] && kill -TERM "$r0"
wait $mpid
kill $spid 2>/dev/null
# the cache bytes per rank each server printed: DCP 2's are half of DCP 1's
if awk 'NR == 1 { one = $2 } NF == 2 && $2 * $1 != one { bad = 1 } END { exit bad || NR != 3 || one < 1 }' "$TMP/cachebytes"; then
    ok "serve: cache bytes per rank $(cut -d' ' -f2 "$TMP/cachebytes" | tr '\n' ' ')(DCP 1, 2, 2): 1/D"
else
    bad "serve: cache bytes per rank (DCP, bytes): $(tr '\n' ';' <"$TMP/cachebytes")"
fi
# chat with images against k3 serve --dcp 2 on vision-tiny
VSRV="serve -m $VT --port 0 --threads 1 --max-num-seqs 4"
timeout 120 "$K3" $VSRV >/dev/null 2>"$TMP/s1" </dev/null &
spid=$!
$MPI -np 2 "$K3" $VSRV --dcp 2 >/dev/null 2>"$TMP/s2" </dev/null &
mpid=$!
p1=$(wait_port "$TMP/s1")
p2=$(wait_port "$TMP/s2")
if [ -n "$p2" ] && [ -n "$p1" ] && grep -q "images on" "$TMP/s2" &&
    timeout 100 python3 tests/mpi_serve.py "$p2" "$p1" --images "$VI/rgb_200x130.png,$VI/photo_67x45.jpg" >"$TMP/c" 2>&1; then
    ok "serve --dcp 2 with images: $(grep -c '^ok' "$TMP/c") chat checks (greedy text = one process)"
else
    bad "serve --dcp 2 with images (ports '$p2' '$p1')" "$TMP/c"
    sed 's/^/    /' "$TMP/s2" | tail -3
fi
kill $spid 2>/dev/null
r0=$(rank0_of $mpid)
[ -n "$r0" ] && kill -TERM "$r0"
wait $mpid
# a rank that hangs under serve: the request fails, rank 0 names the
# collective and ends the job (non-zero, not the timeout)
$MPI -np 2 "$K3" $SRV --ep 2 --dist-timeout 3 --dist-test-hang 1 >/dev/null 2>"$TMP/s3" </dev/null &
mpid=$!
p3=$(wait_port "$TMP/s3")
[ -n "$p3" ] && timeout 30 python3 -c 'import sys, urllib.request
try: urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:%s/v1/completions" % sys.argv[1], b"{\"prompt\": [1, 2, 3], \"max_tokens\": 2}", {"Content-Type": "application/json"}), timeout=25)
except Exception: pass' "$p3"
wait $mpid
rc=$?
if [ $rc -ne 0 ] && [ $rc -lt 124 ] && grep -q "the engine failed: .*got no answer within 3 s" "$TMP/s3"; then
    ok "serve --ep 2: a hanging rank fails the request and ends the job (exit $rc)"
else bad "serve --ep 2: a hanging rank (exit $rc)" "$TMP/s3"; fi
# rank_of PID R: the process of MPI rank R among PID's descendants
rank_of() {
    todo=$1
    while [ -n "$todo" ]; do
        next=
        for q in $todo; do
            tr '\0' '\n' </proc/$q/environ 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && { echo $q; return; }
            next="$next $(pgrep -P $q | tr '\n' ' ')"
        done
        todo=$(echo $next)
    done
}
# wait_line FILE PATTERN: until FILE has a line matching PATTERN (30 s at most)
wait_line() { for i in $(seq 300); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done; return 1; }
# a rank killed mid-stream: mpirun ends the job (SIGTERM to rank 0, SIGKILL a second later);
# rank 0 ends the stream at once with the error event, [DONE] and the body's end
$MPI -np 2 "$K3" $SRV --ep 2 >/dev/null 2>"$TMP/s4" </dev/null &
mpid=$!
p4=$(wait_port "$TMP/s4")
if [ -n "$p4" ]; then
    timeout 60 python3 tests/mpi_stream.py "$p4" >"$TMP/c4" 2>&1 &
    cpid=$!
    wait_line "$TMP/c4" '^started' && r1=$(rank_of $mpid 1) && [ -n "$r1" ] && kill -KILL "$r1"
    wait $cpid
fi
wait $mpid
rc=$?
if grep -q "^ending: error 503 the server is shutting down" "$TMP/c4" 2>/dev/null && [ $rc -ne 0 ] && [ $rc -ne 124 ]; then
    ok "serve --ep 2: a rank killed mid-stream: the client gets the error event and [DONE] (job exit $rc)"
else bad "serve --ep 2: a rank killed mid-stream (job exit $rc)" "$TMP/c4"; sed 's/^/    /' "$TMP/s4" | tail -4; fi
# a rank stopped mid-stream: /health turns 503 once the step has run past --step-timeout, the
# collective's deadline (--dist-timeout) fails the engine, the stream gets the engine's message,
# the job ends non-zero
$MPI -np 2 "$K3" $SRV --ep 2 --dist-timeout 6 --step-timeout 2 >/dev/null 2>"$TMP/s5" </dev/null &
mpid=$!
p5=$(wait_port "$TMP/s5")
r1=
if [ -n "$p5" ]; then
    timeout 60 python3 tests/mpi_stream.py "$p5" --health >"$TMP/c5" 2>&1 &
    cpid=$!
    wait_line "$TMP/c5" '^started' && r1=$(rank_of $mpid 1) && [ -n "$r1" ] && sleep 0.5 && kill -STOP "$r1"
    wait $cpid
fi
wait $mpid
rc=$?
[ -n "$r1" ] && kill -CONT "$r1" 2>/dev/null
if grep -q "^health: 503 the engine has been in one step for" "$TMP/c5" && ! grep -q "(after 0 x 200)" "$TMP/c5" &&
    grep -q "^ending: error 503 the engine failed: .*within 6 s" "$TMP/c5" && [ $rc -ne 0 ] && [ $rc -lt 124 ]; then
    ok "serve --ep 2: a stopped rank: /health 503 past --step-timeout, the stream gets the engine's message (exit $rc)"
else bad "serve --ep 2: a stopped rank (exit $rc)" "$TMP/c5"; sed 's/^/    /' "$TMP/s5" | tail -4; fi
expect_fail "serve --dcp 2 refuses a block size not a multiple of D x I" "block size 24 is not a multiple of --dcp 2 x --dcp-interleave 16" \
    2 serve -m $M --port 0 --dcp 2 --dcp-interleave 16 --block-size 24 --threads 1

echo "mpi: $pass passed, $fail failed, 0 skipped"
[ "$fail" -eq 0 ]
