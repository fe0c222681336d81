#!/bin/sh
# kvstore.sh -- the disk tier across processes (tests/kvstore/driver.c): a
# prompt computed cold and saved by one process is loaded by another (a
# restart) and by two at once (instances sharing the directory), and their
# logits equal the cold run's byte for byte, on tiny (fp32, C8) and tiny-dsa
# past the indexer's top-k; two processes writing the same keys at once
# leave one file per key; a full disk (a 256 KB tmpfs, needs root) is a
# failed save and a miss with the cold run's logits; `k3 cache ls|clear`;
# the KV events (tests/kv_events.py); the tier behind k3 serve (tests/kv_disk.py); the router in
# front of colocated instances (tests/kv_router.py). Ends with
# `kvstore: N passed, N failed, N skipped`.
# Usage: sh tests/kvstore.sh build/k3  (build/k3-kvs-driver beside it)
K3=${1:-build/k3}
BUILD=$(dirname "$K3")
DRV=$BUILD/k3-kvs-driver
TMP=$(mktemp -d)
MNT=""
cleanup() {
    [ -n "$MNT" ] && { umount "$MNT" 2>/dev/null; rmdir "$MNT" 2>/dev/null; }
    rm -rf "$TMP"
}
trap cleanup EXIT
pass=0
fail=0
skip=0
ok() { pass=$((pass + 1)); echo "ok   kvstore: $1"; }
bad() { fail=$((fail + 1)); echo "FAIL kvstore: $1"; [ -n "$2" ] && sed 's/^/    /' "$2" | head -8; }
skipped() { skip=$((skip + 1)); echo "skip kvstore: $1"; }
# tally OUT PREFIX WHAT: a Python suite's lines (`ok   PREFIX: ...`) as this suite's, its
# summary (`PREFIX: N passed, N failed, N skipped`) added to the counts
tally() {
    grep -E "^(ok|FAIL|skip) |^    " "$1" | sed "s/^\(ok  \|FAIL\|skip\) $2: /\1 kvstore: $3: /"
    line=$(grep -E "^$2: [0-9]+ passed" "$1")
    if [ -n "$line" ]; then
        set -- $line
        pass=$((pass + $2))
        fail=$((fail + $4))
        skip=$((skip + $6))
    else
        fail=$((fail + 1))
        echo "FAIL kvstore: $3: the test did not finish"
        tail -5 "$1" | sed 's/^/    /'
    fi
}

# roundtrip NAME MODEL KV N SPLIT SEED: saved by one process, loaded by a second, then by two at once
roundtrip() {
    d=$TMP/$1
    mkdir -p "$d"
    if ! timeout 120 "$DRV" save "$d/cache" "$2" "$3" "$4" "$5" "$6" "$d/cold.f32" >"$d/out" 2>"$d/err"; then
        bad "$1: the cold run and save" "$d/err"
        return
    fi
    if timeout 120 "$DRV" load "$d/cache" "$2" "$3" "$4" "$5" "$6" "$d/warm.f32" >"$d/out" 2>"$d/err" &&
        grep -q "^hit $5$" "$d/out" && cmp -s "$d/cold.f32" "$d/warm.f32"; then
        ok "$1: a restart hits $5 tokens on disk with the cold run's logits"
    else
        bad "$1: a restart hits $5 tokens on disk with the cold run's logits" "$d/err"
    fi
    timeout 120 "$DRV" load "$d/cache" "$2" "$3" "$4" "$5" "$6" "$d/w1.f32" >"$d/o1" 2>"$d/e1" &
    p1=$!
    timeout 120 "$DRV" load "$d/cache" "$2" "$3" "$4" "$5" "$6" "$d/w2.f32" >"$d/o2" 2>"$d/e2"
    r2=$?
    wait $p1
    r1=$?
    if [ $r1 -eq 0 ] && [ $r2 -eq 0 ] && grep -q "^hit $5$" "$d/o1" && grep -q "^hit $5$" "$d/o2" &&
        cmp -s "$d/cold.f32" "$d/w1.f32" && cmp -s "$d/cold.f32" "$d/w2.f32"; then
        ok "$1: two instances load from the shared directory at once"
    else
        bad "$1: two instances load from the shared directory at once" "$d/e1"
    fi
}

roundtrip "tiny f32" tests/models/tiny f32 87 80 1
roundtrip "tiny c8" tests/models/tiny c8 96 80 2
roundtrip "tiny-dsa f32 past the top-k" tests/models/tiny-dsa f32 150 128 3
roundtrip "tiny-dsa c8 past the top-k" tests/models/tiny-dsa c8 133 112 4

# two processes writing the same keys at once
d=$TMP/writers
mkdir -p "$d"
timeout 120 "$DRV" save "$d/cache" tests/models/tiny f32 200 192 5 "$d/a.f32" >/dev/null 2>"$d/e1" &
p1=$!
timeout 120 "$DRV" save "$d/cache" tests/models/tiny f32 200 192 5 "$d/b.f32" >/dev/null 2>"$d/e2"
r2=$?
wait $p1
r1=$?
"$K3" cache ls "$d/cache" --json >"$d/ls" 2>"$d/err"
if [ $r1 -eq 0 ] && [ $r2 -eq 0 ] && python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
m = d["models"][0]
assert d["tmp_files"] == 0 and d["bad_files"] == 0 and d["counter_bytes"] == d["bytes"], d
assert m["runs"] == 6 and m["snapshots"] == 1 and m["tokens"] == 192, m
' "$d/ls" 2>>"$d/err" && "$DRV" load "$d/cache" tests/models/tiny f32 200 192 5 "$d/w.f32" >"$d/out" 2>>"$d/err" &&
    grep -q "^hit 192$" "$d/out" && cmp -s "$d/a.f32" "$d/w.f32"; then
    ok "two processes writing the same keys leave one file each, nothing in tmp/"
else
    bad "two processes writing the same keys leave one file each, nothing in tmp/" "$d/err"
fi

# k3 cache ls / clear
if "$K3" cache ls "$d/cache" >"$d/ls" 2>"$d/err" && grep -q "quant none kv f32 block 16 dcp 0/1: 6 runs (172.03 KB, 12 blocks, 192 tokens), 1 snapshots" "$d/ls"; then
    ok "k3 cache ls"
else
    bad "k3 cache ls" "$d/ls"
fi
if "$K3" cache clear "$d/cache" >"$d/out" 2>"$d/err" && grep -q "removed 7 files" "$d/out" &&
    "$K3" cache ls "$d/cache" | grep -q ": 0 files, 0 B (shared counter: 0 B)"; then
    ok "k3 cache clear"
else
    bad "k3 cache clear" "$d/out"
fi
if "$K3" cache ls "$TMP/nonexistent" >/dev/null 2>"$d/err"; then bad "k3 cache ls of no directory fails"
elif grep -q "No such file" "$d/err"; then ok "k3 cache ls of no directory: one message"
else bad "k3 cache ls of no directory: one message" "$d/err"; fi

# a full disk: a 256 KB tmpfs holds the blocks but not the snapshot
if [ "$(id -u)" -ne 0 ]; then
    skipped "full disk (mounting a tmpfs needs root)"
else
    MNT=$(mktemp -d /tmp/k3-kvs-full.XXXXXX)
    if ! mount -t tmpfs -o size=256k tmpfs "$MNT" 2>"$TMP/mnt.err"; then
        skipped "full disk (mount -t tmpfs failed: $(head -1 "$TMP/mnt.err"))"
        rmdir "$MNT"
        MNT=""
    else
        d=$TMP/full
        mkdir -p "$d"
        # a filler so the snapshot (130 KB) cannot fit
        head -c 150000 /dev/zero >"$MNT/filler"
        "$DRV" save "$MNT/cache" tests/models/tiny f32 87 80 1 "$d/cold.f32" >/dev/null 2>"$d/err"
        r=$?
        if [ $r -eq 0 ] && grep -q "No space left on device" "$d/err" && [ -z "$(ls -A "$MNT/cache/tmp")" ]; then
            ok "a full disk: the save fails with its reason, nothing left in tmp/"
        else
            bad "a full disk: the save fails with its reason, nothing left in tmp/" "$d/err"
        fi
        if "$DRV" load "$MNT/cache" tests/models/tiny f32 87 80 1 "$d/warm.f32" >"$d/out" 2>"$d/err" &&
            grep -q "^hit 0$" "$d/out" && cmp -s "$d/cold.f32" "$d/warm.f32"; then
            ok "a full disk: a miss, the cold run's logits"
        else
            bad "a full disk: a miss, the cold run's logits" "$d/err"
        fi
        umount "$MNT" && rmdir "$MNT" && MNT=""
    fi
fi

# the KV events, decoded with vLLM's field layout (pyzmq and msgspec in the project's .venv)
if PY=$(sh scripts/venv.sh pyzmq=zmq msgspec 2>"$TMP/venv.err"); then
    timeout 300 "$PY" tests/kv_events.py "$BUILD/k3-kvev-driver" >"$TMP/ev.out" 2>&1
    cat "$TMP/ev.out"
    pass=$((pass + $(grep -c "^ok " "$TMP/ev.out")))
    fail=$((fail + $(grep -c "^FAIL " "$TMP/ev.out")))
    grep -q "^ok .*the driver exits cleanly" "$TMP/ev.out" || { fail=$((fail + 1)); echo "FAIL kvstore: kv events: the test did not finish"; }
else
    skipped "kv events (a Python with pyzmq and msgspec: $(tail -1 "$TMP/venv.err"))"
fi

# the tier through k3 serve: cold = RAM hit = disk hit (a restart, a second instance), the faults,
# tenants, the events against /metrics (tests/kv_disk.py; K3_TEST_ISA=NAME passes --isa NAME to
# k3 serve, to run the equality checks on another kernel table)
if PY=$(sh scripts/venv.sh pyzmq=zmq msgspec 2>"$TMP/venv.err"); then
    timeout 600 "$PY" tests/kv_disk.py "$K3" ${K3_TEST_ISA:+--isa "$K3_TEST_ISA"} >"$TMP/disk.out" 2>&1
    tally "$TMP/disk.out" kvdisk "disk tier"
else
    skipped "disk tier through k3 serve (a Python with pyzmq and msgspec: $(tail -1 "$TMP/venv.err"))"
fi

# the router in front of colocated instances: affinity, failover and balance (tests/kv_router.py)
timeout 300 python3 tests/kv_router.py "$K3" >"$TMP/router.out" 2>&1
tally "$TMP/router.out" kvrouter router

echo "kvstore: $pass passed, $fail failed, $skip skipped"
