#!/bin/sh
# hosts.sh -- k3 across separate network hosts: network namespaces joined by
# veth pairs on a bridge (tests/hosts/lib.sh), each with its own address and
# host name, nothing reachable outside them.
#   - mpirun across two hosts (OpenMPI's rsh agent: tests/hosts/rsh): k3 run
#     --dcp 2 with the TCP BTL and with the UCX PML (UCX_TLS=tcp): logits =
#     one process, and the bytes crossed host 2's link;
#   - UCX one-sided gets across two hosts, checksummed (build/ucxbench --check);
#   - prefill, decode and the proxy on different hosts (tests/hosts_pd.py):
#     same text as colocated, failover, links cut mid-transfer and back,
#     a decode host killed mid-stream, /metrics of both sides at baseline;
#   - a host lost under mpirun (k3 serve --ep 2 across two hosts): its
#     processes killed, or its link cut, mid-stream: the client's stream ends
#     with the error event naming the failure, every process on both hosts ends.
# --full (make test-hosts) adds the same checks over shaped links (tc: 1 Gb/s
# with 5 ms each way, 10 Gb/s with 1 ms; the delay by netem, or where the
# kernel has none by build/k3-netdelay at the switch; a round trip checks it)
# and a cut link that comes back.
# Skipped, with the reason, where network namespaces cannot be made (not
# root, no CAP_NET_ADMIN, no ip). Ends with `hosts: N passed, N failed`.
# Usage: sh tests/hosts.sh build/k3 [--full]
K3=${1:-build/k3}
FULL=
[ "$2" = "--full" ] && FULL=1
BUILD=$(dirname "$K3")
HOSTS_LIB=tests/hosts/lib.sh
HOSTS_NETDELAY=$BUILD/k3-netdelay
. tests/hosts/lib.sh
# every instance and the proxy of a PD deployment share the transfer secret (docs/pd.md)
K3_KV_TRANSFER_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export K3_KV_TRANSFER_SECRET
export HOSTS_PREFIX HOSTS_NET HOSTS_NETDELAY
pass=0
fail=0
skip=0
ok() { pass=$((pass + 1)); echo "ok   hosts: $1"; }
bad() { fail=$((fail + 1)); echo "FAIL hosts: $1"; [ -n "$2" ] && sed 's/^/    /' "$2" | head -12; }
skipped() { skip=$((skip + 1)); echo "skip hosts: $1"; }
finish() {
    if [ "$skip" -gt 0 ]; then echo "hosts: $pass passed, $fail failed, $skip skipped"
    else echo "hosts: $pass passed, $fail failed"; fi
    [ "$fail" -eq 0 ]
    exit
}

why=$(hosts_check)
if [ -n "$why" ]; then
    skipped "every case: network namespaces cannot be made here: $why"
    finish
fi
command -v mpirun >/dev/null 2>&1 || { skipped "every case: mpirun not found (openmpi-bin)"; finish; }
TMP=$(mktemp -d)
trap 'hosts_down; rm -rf "$TMP"' EXIT
hosts_up 4 || { bad "making 4 hosts (ip netns, veth, bridge)"; finish; }
ok "4 hosts at $(addr 1)..$(addr 4) on one bridge, each in its own network namespace"

M=tests/models/tiny-dsa
IDS=$(awk 'BEGIN { for (i = 0; i < 40; i++) printf "%s%d", (i ? "," : ""), (i * 37 + 11) % 1000 }')
RUN="run -m $M --ids $IDS -n 6 --temp 0 --threads 1 --quant none --kv-cache f32"
"$K3" $RUN --dump-logits "$TMP/ref.bin" >"$TMP/ref.txt" 2>"$TMP/ref.err" || bad "one-process reference" "$TMP/ref.err"
rx() { ip -n "$HOSTS_PREFIX$1" -s -j link show eth0 | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["stats64"]["rx"]["bytes"])'; }
MPI_TCP="--mca pml ob1 --mca btl tcp,self"
MPI_UCX="--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any --mca osc ^ucx -x UCX_TLS=tcp,self -x UCX_NET_DEVICES=eth0"

# the ranks are on the two hosts: each names its host
if mpirun_on 1 --host "$(addr 1),$(addr 2)" -np 2 hostname >"$TMP/h" 2>&1 && [ "$(sort "$TMP/h" | tr '\n' ' ')" = "host1 host2 " ]; then
    ok "mpirun on host 1 starts rank 1 on host 2 through the rsh agent"
else bad "mpirun across hosts" "$TMP/h"; fi

# mpi_case NAME TRANSPORT-FLAGS: k3 run --dcp 2 across hosts 1 and 2 against one process
mpi_case() {
    name=$1
    shift
    rm -f "$TMP/d.bin"
    r0=$(rx 2)
    if ! timeout 300 sh -c '. "$0"; mpirun_on "$@"' "$HOSTS_LIB" 1 --host "$(addr 1),$(addr 2)" -np 2 "$@" "$K3" $RUN --dcp 2 --dump-logits "$TMP/d.bin" \
        >"$TMP/d.txt" 2>"$TMP/d.err" </dev/null; then
        bad "$name (exit)" "$TMP/d.err"
    elif ! "$BUILD/k3-cmp" "$TMP/ref.bin" "$TMP/d.bin" 1e-5 >"$TMP/cmp" 2>&1; then
        bad "$name (logits)" "$TMP/cmp"
    elif ! cmp -s "$TMP/ref.txt" "$TMP/d.txt"; then
        bad "$name (greedy text differs)" "$TMP/d.txt"
    else
        ok "$name: $(cut -d, -f1 "$TMP/cmp"), same greedy text; host 2's link received $(($(rx 2) - r0)) B"
    fi
}
mpi_case "dcp 2 across hosts 1, 2 (TCP BTL)" $MPI_TCP
mpi_case "dcp 2 across hosts 1, 2 (UCX PML over tcp)" $MPI_UCX

# UCX one-sided gets across hosts: host 2 offers 32 MiB, host 1 gets them (checked), and the TCP stream
if [ -x "$BUILD/ucxbench" ]; then
    on 2 "$BUILD/ucxbench" serve --bind "$(addr 2):0" --bytes 33554432 >"$TMP/us" 2>&1 &
    for i in $(seq 100); do grep -q serving "$TMP/us" && break; sleep 0.05; done
    up=$(sed -n 's/.*serving [0-9]* bytes on [0-9.]*:\([0-9]*\).*/\1/p' "$TMP/us")
    if grep -q "skipped" "$TMP/us"; then skipped "UCX across hosts: $(cat "$TMP/us")"
    elif [ -n "$up" ] && on 1 "$BUILD/ucxbench" get --connect "$(addr 2):$up" --bytes 33554432 --runs 1 --tls tcp \
        --check --stop >"$TMP/ug" 2>&1; then
        ok "UCX gets across hosts, checksummed: $(grep 'ucx get' "$TMP/ug" | awk '{print $4, $5}'), TCP stream $(grep 'tcp stream' "$TMP/ug" | awk '{print $3, $4}')"
    else bad "UCX gets across hosts" "$TMP/ug"; fi
    hosts_kill 2
else skipped "UCX across hosts: $BUILD/ucxbench not built"; fi

# prefill / decode / proxy on different hosts
on 1 python3 tests/hosts_pd.py "$K3" "$HOSTS_PREFIX" "$HOSTS_NET" >"$TMP/pd" 2>&1
sed -n 's/^ok   hosts-pd: /ok   hosts: pd: /p; s/^FAIL hosts-pd: /FAIL hosts: pd: /p' "$TMP/pd"
pass=$((pass + $(grep -c '^ok   hosts-pd' "$TMP/pd")))
fail=$((fail + $(grep -c '^FAIL hosts-pd' "$TMP/pd")))
grep -q "^hosts-pd: [0-9]* passed" "$TMP/pd" || bad "hosts_pd.py ended without its summary" "$TMP/pd"
for h in 1 2 3 4; do hosts_kill $h; done

# a host lost under mpirun: k3 serve --ep 2, rank 0 on host 1, rank 1 on host 2; a stream from
# host 1; then host 2's processes killed, or its link cut. For a cut, both hosts give up on a
# silent peer's unacknowledged data after ~15 s (net.ipv4.tcp_retries2=5, per namespace; Linux's
# default, 15, is ~15 minutes) and OpenMPI's daemons probe an idle link every 2 s (keepalive):
# without them mpirun and the far host's daemon outlive the job until the link comes back.
for h in 1 2; do ip netns exec "$HOSTS_PREFIX$h" sysctl -q -w net.ipv4.tcp_retries2=5; done
KEEP="--mca oob_tcp_keepalive_time 3 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3"
SRV="serve -m $M --host $(addr 1) --port 0 --threads 1 --max-num-seqs 4 --ep 2"
port_of() { sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9]*\).*/\1/p' "$1" | head -1; }
wait_port() { for i in $(seq 300); do p=$(port_of "$1"); [ -n "$p" ] && { echo "$p"; return; }; sleep 0.1; done; }
wait_line() { for i in $(seq 300); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done; return 1; }
# lost NAME ACTION EXPECT: ACTION (kill | cut) once the stream runs; EXPECT: the ending's pattern
lost() {
    name=$1 action=$2 expect=$3
    : >"$TMP/s"
    mpirun_on 1 --host "$(addr 1),$(addr 2)" -np 2 $MPI_TCP $KEEP "$K3" $SRV --dist-timeout 5 >/dev/null \
        2>"$TMP/s" </dev/null &
    mpid=$!
    p=$(wait_port "$TMP/s")
    [ -z "$p" ] && { bad "$name: the server did not start" "$TMP/s"; kill $mpid; wait $mpid; return; }
    on 1 timeout 90 python3 tests/mpi_stream.py "$p" --host "$(addr 1)" >"$TMP/c" 2>&1 &
    cpid=$!
    wait_line "$TMP/c" '^started' || bad "$name: no stream" "$TMP/c"
    t0=$(date +%s)
    if [ "$action" = kill ]; then hosts_kill 2; else link 2 down; fi
    wait $cpid
    t1=$(date +%s)
    # every process on both hosts ends (the link still down for a cut)
    for i in $(seq 600); do
        [ -z "$(ip netns pids "${HOSTS_PREFIX}1")$(ip netns pids "${HOSTS_PREFIX}2")" ] && break
        sleep 0.1
    done
    left="$(ip netns pids "${HOSTS_PREFIX}1") $(ip netns pids "${HOSTS_PREFIX}2")"
    t2=$(date +%s)
    wait $mpid
    rc=$?
    link 2 up
    if grep -q "^ending: $expect" "$TMP/c" && [ "$rc" -ne 0 ] && [ -z "$(echo $left)" ]; then
        ok "$name: the client's stream ends after $((t1 - t0)) s with '$(sed -n 's/^ending: //p' "$TMP/c" | cut -c1-110)'; every process on both hosts gone after $((t2 - t0)) s (mpirun exit $rc)"
    else
        bad "$name (mpirun exit $rc, processes left: '$(echo $left)')" "$TMP/c"
        sed 's/^/    /' "$TMP/s" | grep -v '^    *$' | tail -6
        [ -n "$(echo $left)" ] && kill -KILL $left 2>/dev/null
    fi
}
lost "serve --ep 2 across hosts: host 2's processes killed mid-stream" kill "error 503 "
lost "serve --ep 2 across hosts: host 2's link cut mid-stream" cut "error 503 the engine failed: dist: rank 0: .* got no answer within 5 s"

why=$(shape_check)
if [ -n "$FULL" ] && [ -n "$why" ]; then
    skipped "the cases over shaped links: $why"
elif [ -n "$FULL" ]; then
    # the same over shaped links: 1 Gb/s with 5 ms each way (RTT 10 ms), then 10 Gb/s with 1 ms
    for sh in "1gbit 5ms" "10gbit 1ms"; do
        for h in 1 2 3 4; do shape $h $sh 2>"$TMP/tc" || bad "shaping host $h's link ($sh)" "$TMP/tc"; done
        # the shaping holds: a connection refused by host 2 (its RST) takes the two delays
        d=$(echo "$sh" | awk '{ print $2 + 0 }')
        rtt=$(on 1 python3 -c 'import socket, sys, time
s = socket.socket()
s.settimeout(5)
t = time.time()
try: s.connect((sys.argv[1], 1))
except OSError: pass
print("%.1f" % ((time.time() - t) * 1e3))' "$(addr 2)")
        if awk -v r="$rtt" -v d="$d" 'BEGIN { exit !(r >= 2 * d) }'; then ok "links shaped $sh: a round trip from host 1 to host 2 takes $rtt ms"
        else bad "links shaped $sh: a round trip from host 1 to host 2 takes $rtt ms, not >= $((2 * d)) ms"; fi
        mpi_case "dcp 2 across hosts 1, 2 over $sh links (TCP BTL)" $MPI_TCP
        mpi_case "dcp 2 across hosts 1, 2 over $sh links (UCX PML)" $MPI_UCX
        on 1 python3 tests/hosts_pd.py "$K3" "$HOSTS_PREFIX" "$HOSTS_NET" >"$TMP/pd" 2>&1
        sed -n "s/^ok   hosts-pd: /ok   hosts: pd over $sh: /p; s/^FAIL hosts-pd: /FAIL hosts: pd over $sh: /p" "$TMP/pd"
        pass=$((pass + $(grep -c '^ok   hosts-pd' "$TMP/pd")))
        fail=$((fail + $(grep -c '^FAIL hosts-pd' "$TMP/pd")))
        for h in 1 2 3 4; do hosts_kill $h; done
    done
    for h in 1 2 3 4; do shape $h off; done
fi
if [ -n "$FULL" ]; then
    # a cut that comes back before the deadline: the job goes on, the stream finishes
    : >"$TMP/s"
    mpirun_on 1 --host "$(addr 1),$(addr 2)" -np 2 $MPI_TCP $KEEP "$K3" $SRV --dist-timeout 30 >/dev/null \
        2>"$TMP/s" </dev/null &
    mpid=$!
    p=$(wait_port "$TMP/s")
    body='{"prompt": "Hello", "max_tokens": 64, "ignore_eos": true, "temperature": 0}'
    on 1 python3 -c 'import sys, urllib.request, json
r = urllib.request.urlopen(urllib.request.Request("http://%s/v1/completions" % sys.argv[1], sys.argv[2].encode(), {"Content-Type": "application/json"}), timeout=60)
print(json.load(r)["usage"]["completion_tokens"])' "$(addr 1):$p" "$body" >"$TMP/r" 2>&1 &
    cpid=$!
    link 2 down
    sleep 2 # the outage: a cut this long, not a test of timing (the answer is polled below)
    link 2 up
    wait $cpid
    if [ "$(cat "$TMP/r")" = 64 ]; then ok "serve --ep 2: host 2's link cut for 2 s and back: the request finishes (64 tokens), no restart"
    else bad "serve --ep 2: a 2 s cut" "$TMP/r"; fi
    hosts_kill 1
    hosts_kill 2
    wait $mpid
fi
finish
