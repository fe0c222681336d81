#!/bin/sh
# hosts.sh -- the figures of docs/hosts.md across network-namespace hosts (tests/hosts/lib.sh):
#   ucx  UCX one-sided gets against a TCP stream of the same bytes: on one host (build/ucxbench
#        local: shared memory and loopback tcp) and between two hosts, unshaped and over tc-shaped
#        links (10 Gb/s with 1 ms, 1 Gb/s with 5 ms)
#   mpi  k3 bench under mpirun on 4 hosts (DCP 2 x EP 2, bench/bench-dsa): the bytes each rank moves
#        per decoded token, by kind, against `k3 plan`'s formulas, and what crossed each host's link
#   pd   the prefill -> decode transfer of 1k, 8k (and with PD_TOKENS, more) tokens of
#        bench/bench-dsa across hosts against the link's rate, and a decode stream's ITL while the
#        largest lands (bench/hosts_pd.py)
# Run each part under the CPU lock (figures are taken alone): flock -x /tmp/k3-cpu.lock sh bench/hosts.sh build/k3 ucx
# Needs root (network namespaces); make bench-model for bench/bench-dsa.
K3=${1:-build/k3}
PART=${2:-ucx}
BUILD=$(dirname "$K3")
HOSTS_LIB=tests/hosts/lib.sh
# every instance and the proxy of a PD deployment share the transfer secret (docs/pd.md)
K3_KV_TRANSFER_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export K3_KV_TRANSFER_SECRET
. tests/hosts/lib.sh
why=$(hosts_check)
[ -n "$why" ] && { echo "bench/hosts.sh: cannot make hosts here: $why"; exit 1; }
hosts_up 4 || exit 1
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
MB=${MB:-268435456}

case $PART in
ucx)
    echo "== one host: build/ucxbench local ($MB bytes)"
    "$BUILD/ucxbench" local --bytes "$MB" --runs 5 2>&1 | grep -v "UCX  WARN"
    for sh in none "10gbit 1ms" "1gbit 5ms"; do
        for h in 1 2; do shape $h $sh; done
        b=$MB
        [ "$sh" = "1gbit 5ms" ] && b=$((MB / 4))
        echo "== host 1 <- host 2, link: $sh"
        out=$(mktemp)
        on 2 "$BUILD/ucxbench" serve --bind "$(addr 2):7700" --bytes "$b" >"$out" 2>&1 &
        for i in $(seq 200); do grep -q serving "$out" && break; sleep 0.05; done
        rm -f "$out"
        on 1 "$BUILD/ucxbench" get --connect "$(addr 2):7700" --bytes "$b" --runs 5 --tls tcp --check --stop 2>&1 |
            grep -v "UCX  WARN"
        wait
    done
    ;;
mpi)
    M=${MODEL:-bench/bench-dsa}
    CTX=${CTX:-4096}
    H="$(addr 1),$(addr 2),$(addr 3),$(addr 4)"
    rx() { ip -n "$HOSTS_PREFIX$1" -s -j link show eth0 | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["stats64"]["rx"]["bytes"])'; }
    for tr in "--mca pml ob1 --mca btl tcp,self" \
        "--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any --mca osc ^ucx -x UCX_TLS=tcp,self -x UCX_NET_DEVICES=eth0"; do
        echo "== mpirun -np 4 on hosts 1-4 ($tr): k3 bench -m $M --dcp 2 --ep 2 --contexts $CTX"
        r="$(rx 1) $(rx 2) $(rx 3) $(rx 4)"
        mpirun_on 1 --host "$H" -np 4 $tr "$K3" bench -m "$M" --mmap --dcp 2 --ep 2 --contexts "$CTX" --runs 3 \
            --decode-tokens 8 --kv-cache c8 2>&1 | grep -v "^k3 bench: rank\|seed"
        echo "bytes each host's link received during the whole job (load, fill, warm-up and the runs): $(echo "$r" |
            { read a b c d; echo "$(($(rx 1) - a)) $(($(rx 2) - b)) $(($(rx 3) - c)) $(($(rx 4) - d))"; })"
    done
    "$K3" plan --config "$M/config.json" --dcp 2 --ep 2 --context "$CTX" --kv-cache c8
    ;;
pd)
    on 1 python3 bench/hosts_pd.py "$K3" "$HOSTS_PREFIX" "$HOSTS_NET" --model "${MODEL:-bench/bench-dsa}" \
        --tokens "${PD_TOKENS:-1024,8192}" --runs 3 --kv-cache c8 --itl
    ;;
*)
    echo "usage: sh bench/hosts.sh build/k3 ucx|mpi|pd"
    exit 2
    ;;
esac
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
