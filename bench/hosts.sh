#!/bin/sh
# hosts.sh -- the figures of docs/hosts.md across network-namespace hosts (tests/hosts/lib.sh):
#   ucx  UCX one-sided gets against a TCP stream of the same bytes: on one host (build/ucxbench
#        local: shared memory and loopback tcp) and between two hosts, unshaped and over shaped
#        links (10 Gb/s with 1 ms each way, 1 Gb/s with 5 ms); rounds alternate the transports
#   mpi  k3 bench under mpirun on 2 hosts (bench/bench-dsa, DCP 2 x EP 2, one rank a host): the
#        bytes each rank moves per decoded token, by kind, against `k3 plan`'s formulas; what
#        crossed each host's link per decoded token (two runs of 8 and 24 tokens: the difference
#        is the decode alone); decode time per token over each link shape, TCP BTL (and the UCX
#        PML unshaped)
#   pd   the prefill -> decode transfer of 1k, 8k and 32k tokens of bench/bench-dsa across hosts
#        against the link's rate, and a decode stream's inter-token latency while the largest
#        lands (bench/hosts_pd.py; today's TCP transport)
# Each timed step holds the CPU lock exclusively by itself (LOCK, default /tmp/k3-cpu.lock; LOCK=
# for none) and prints the load and the memory bandwidth state (build/xcore) it met; preparation
# (a 32k prefill) holds it shared.
# Usage: sh bench/hosts.sh build/k3 ucx|mpi|pd      (root: network namespaces; make bench-model)
#   SHAPES='none;10gbit 1ms;1gbit 5ms'  the link shapes;  MB=268435456  ucx bytes
#   MODEL=bench/bench-dsa  CTX=4096  (mpi)
#   PD_TOKENS=1024,8192,32768  PD_RUNS=3  PD_QUANT=w8a8+w4a8 (the weights; the cache moved is C8 either way)
#   PD_THREADS=1  (pd)
K3=${1:-build/k3}
PART=${2:-ucx}
BUILD=$(dirname "$K3")
HOSTS_LIB=tests/hosts/lib.sh
# every instance and the proxy of a PD deployment share the transfer secret (docs/pd.md)
K3_KV_TRANSFER_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export K3_KV_TRANSFER_SECRET
HOSTS_NETDELAY=$BUILD/k3-netdelay
. tests/hosts/lib.sh
export HOSTS_PREFIX HOSTS_NET HOSTS_NETDELAY
LOCK=${LOCK-/tmp/k3-cpu.lock}
SHAPES=${SHAPES:-none;10gbit 1ms;1gbit 5ms}
MB=${MB:-268435456}
why=$(hosts_check)
[ -n "$why" ] && { echo "bench/hosts.sh: cannot make hosts here: $why"; exit 1; }
hosts_up 4 || exit 1
why=$(shape_check)
[ -n "$why" ] && { echo "bench/hosts.sh: links cannot be shaped here: $why"; exit 1; }

# the lock on fd 9: exclusive while timing, shared while preparing
[ -n "$LOCK" ] && exec 9>>"$LOCK"
hold() { [ -z "$LOCK" ] || flock "$1" 9; }
state() {
    bw=$([ -x "$BUILD/xcore" ] && "$BUILD/xcore" 1 10 2>/dev/null | tail -1 | awk '{ print $1, "/", $3, "GB/s" }')
    echo "-- $1: load $(cut -d' ' -f1-3 /proc/loadavg); memory bandwidth, 1 / 2 threads: ${bw:-(build/xcore not built)}"
}
shape_both() {
    sp=$1
    [ "$sp" = none ] && sp=off
    for h in 1 2 3 4; do shape "$h" $sp || exit 1; done
}

case $PART in
ucx)
    hold -x
    state "exclusive"
    echo "== one host: build/ucxbench local ($MB bytes)"
    "$BUILD/ucxbench" local --bytes "$MB" --runs 5 2>&1 | grep -v "UCX  WARN"
    echo "$SHAPES" | tr ';' '\n' | while read -r sh; do
        shape_both "$sh"
        b=$MB
        case $sh in 1gbit*) b=$((MB / 4)) ;; esac
        echo "== host 1 <- host 2, link: $sh"
        out=$(mktemp)
        on 2 "$BUILD/ucxbench" serve --bind "$(addr 2):0" --bytes "$b" >"$out" 2>&1 &
        for i in $(seq 200); do grep -q serving "$out" && break; sleep 0.05; done
        port=$(sed -n 's/.*serving [0-9]* bytes on [0-9.]*:\([0-9]*\).*/\1/p' "$out")
        on 1 "$BUILD/ucxbench" get --connect "$(addr 2):$port" --bytes "$b" --runs 5 --tls tcp --check --stop 2>&1 |
            grep -v "UCX  WARN"
        wait
        rm -f "$out"
    done
    state "end"
    hold -u
    ;;
mpi)
    M=${MODEL:-bench/bench-dsa}
    CTX=${CTX:-4096}
    OUT=$(mktemp -d)
    rx() { ip -n "$HOSTS_PREFIX$1" -s -j link show eth0 | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["stats64"]["rx"]["bytes"])'; }
    TCP="--mca pml ob1 --mca btl tcp,self"
    UCX="--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any --mca osc ^ucx -x UCX_TLS=tcp,self -x UCX_NET_DEVICES=eth0"
    # one job: rank 0 on host 1, rank 1 on host 2; N decoded tokens a run, 3 runs + a warm-up
    job() {
        tag=$1 n=$2
        shift 2
        a=$(rx 1) b=$(rx 2)
        mpirun_on 1 --host "$(addr 1),$(addr 2)" -np 2 "$@" "$K3" bench -m "$M" --mmap --dcp 2 --ep 2 \
            --contexts "$CTX" --runs 3 --decode-tokens "$n" --kv-cache c8 >"$OUT/$tag.$n" 2>"$OUT/$tag.$n.err" </dev/null ||
            { echo "k3 bench failed:"; tail -5 "$OUT/$tag.$n.err"; }
        echo "$(($(rx 1) - a)) $(($(rx 2) - b))" >"$OUT/$tag.$n.rx"
    }
    echo "$SHAPES" | tr ';' '\n' | while read -r sh; do
        shape_both "$sh"
        for tr in TCP UCX; do
            [ "$tr" = UCX ] && [ "$sh" != none ] && continue
            eval "flags=\$$tr"
            tag=$(echo "$tr-$sh" | tr ' ' '_')
            hold -x
            state "exclusive"
            echo "== mpirun -np 2 on hosts 1, 2 ($tr), link $sh: k3 bench -m $M --dcp 2 --ep 2 --contexts $CTX, 8 and 24 tokens a run"
            job "$tag" 8 $flags
            job "$tag" 24 $flags
            state "end"
            hold -u
            grep -v "^k3 bench: rank\|seed" "$OUT/$tag.24"
            python3 - "$OUT/$tag" <<'EOF'
import re, sys
p = sys.argv[1]
def ms(n):
    return float(re.search(r"decode ([0-9.]+) ms/token", open("%s.%d" % (p, n)).read()).group(1))
r8 = [int(x) for x in open(p + ".8.rx").read().split()]
r24 = [int(x) for x in open(p + ".24.rx").read().split()]
# 4 runs (3 + the warm-up) of each length: the difference is 4 x 16 decoded tokens
per = [(b - a) / (4 * 16) for a, b in zip(r8, r24)]
print("  decode %.1f ms/token (8-token runs) %.1f ms/token (24-token runs); each link received per decoded "
      "token (24-token job - 8-token job) / 64: host 1 %.0f B, host 2 %.0f B" % (ms(8), ms(24), per[0], per[1]))
EOF
        done
    done
    shape_both off
    echo "== k3 plan for the same layout"
    "$K3" plan --config "$M/config.json" --dcp 2 --ep 2 --context "$CTX" --kv-cache c8
    rm -rf "$OUT"
    ;;
pd)
    on 1 python3 bench/hosts_pd.py "$K3" "$HOSTS_PREFIX" "$HOSTS_NET" --model "${MODEL:-bench/bench-dsa}" \
        --tokens "${PD_TOKENS:-1024,8192,32768}" --runs "${PD_RUNS:-3}" --kv-cache c8 --quant "${PD_QUANT:-w8a8+w4a8}" \
        --threads "${PD_THREADS:-1}" --itl --shapes "$SHAPES" \
        ${LOCK:+--lock "$LOCK"} 9>&-
    ;;
*)
    echo "usage: sh bench/hosts.sh build/k3 ucx|mpi|pd"
    exit 2
    ;;
esac
