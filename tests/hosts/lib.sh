# lib.sh -- hosts for tests: network namespaces joined by veth pairs on a
# bridge, each a "host" with its own address, its own host name and its own
# processes; sourced by tests/hosts.sh and bench/hosts_*.sh.
#
#   hosts_check              empty, or the reason hosts cannot be made here (on stdout)
#   hosts_up N               N hosts, 1..N, at $HOSTS_NET.1 .. $HOSTS_NET.N (/24), and a
#                            switch namespace holding the bridge; sets a trap that
#                            takes everything down on exit
#   hosts_down               every process in the namespaces killed, the namespaces
#                            (and with them the veths and the bridge) deleted
#   on H CMD...              CMD on host H (in its namespace, under its own host name)
#   addr H                   host H's address
#   shape H RATE DELAY       host H's egress: RATE (tc units: 10gbit, 1gbit) after DELAY
#                            (1ms, 500us); "shape H off" takes it away. The rate is a tbf
#                            on H's eth0; the delay netem under it, or where the kernel
#                            has no netem, a delay line at the switch (k3-netdelay on an
#                            NFQUEUE of what H puts on the bridge; needs iptables)
#   shape_check              empty, or the reason links cannot be shaped here (on stdout)
#   link H down|up           host H's cable at the switch: down is a silent cut (its
#                            carrier goes; the others see nothing but silence); up returns
#                            once the carrier is back (sourced by tests/hosts_pd.py's link too)
#   mpirun_on H ARGS...      OpenMPI's mpirun on host H, launching on the hosts its
#                            --host names (addresses) through tests/hosts/rsh
#
# Every address is in $HOSTS_NET.0/24 inside namespaces that have no link to
# the machine's own network namespace: nothing sent there can leave them.
# Names: k3h<pid>-<h> (hosts), k3h<pid>-sw (the switch), so several runs at
# once do not meet.
HOSTS_NET=${HOSTS_NET:-10.213.7}
HOSTS_PREFIX=${HOSTS_PREFIX:-k3h$$-}
HOSTS_N=0
HOSTS_NETDELAY=${HOSTS_NETDELAY:-build/k3-netdelay}
HOSTS_LIB_DIR=$(cd "$(dirname "${HOSTS_LIB:-tests/hosts/lib.sh}")" && pwd)

hosts_check() {
    if [ "$(id -u)" -ne 0 ]; then echo "not root (network namespaces need CAP_NET_ADMIN)"; return; fi
    command -v ip >/dev/null 2>&1 || { echo "no ip command (iproute2)"; return; }
    command -v unshare >/dev/null 2>&1 || { echo "no unshare command (util-linux)"; return; }
    local t="${HOSTS_PREFIX}probe"
    if ! ip netns add "$t" 2>/dev/null; then echo "ip netns add is not allowed here"; return; fi
    if ! ip -n "$t" link add k3probe type bridge 2>/dev/null; then
        ip netns del "$t" 2>/dev/null
        echo "cannot make a bridge inside a network namespace"
        return
    fi
    ip netns del "$t"
}

hosts_up() {
    local n=$1 sw="${HOSTS_PREFIX}sw" i
    trap 'hosts_down' EXIT
    trap 'exit 130' INT TERM
    ip netns add "$sw" || return 1
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge || return 1
    ip -n "$sw" link set br0 up
    for i in $(seq "$n"); do
        ip netns add "$HOSTS_PREFIX$i" || return 1
        ip link add eth0 netns "$HOSTS_PREFIX$i" type veth peer name "p$i" netns "$sw" || return 1
        ip -n "$HOSTS_PREFIX$i" link set lo up
        ip -n "$HOSTS_PREFIX$i" addr add "$HOSTS_NET.$i/24" dev eth0
        ip -n "$HOSTS_PREFIX$i" link set eth0 up
        ip -n "$sw" link set "p$i" master br0
        ip -n "$sw" link set "p$i" up
        HOSTS_N=$i
    done
    # until every host's address answers on every other (the bridge learns)
    for i in $(seq "$n"); do
        on "$i" sh -c "for t in \$(seq 100); do ip neigh >/dev/null; \
            ip -o addr show eth0 | grep -q 'inet.*tentative' || exit 0; sleep 0.05; done; exit 1" || return 1
    done
}

# every process in a namespace, killed (SIGTERM, then SIGKILL after 2 s)
hosts_kill() {
    local ns="$HOSTS_PREFIX$1" p i
    p=$(ip netns pids "$ns" 2>/dev/null)
    [ -z "$p" ] && return 0
    kill -TERM $p 2>/dev/null
    for i in $(seq 20); do
        [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && return 0
        sleep 0.1
    done
    kill -KILL $(ip netns pids "$ns" 2>/dev/null) 2>/dev/null
    return 0
}

hosts_down() {
    local i
    for i in $(seq "$HOSTS_N"); do hosts_kill "$i"; done
    hosts_kill sw # the delay lines
    for i in $(seq "$HOSTS_N"); do ip netns del "$HOSTS_PREFIX$i" 2>/dev/null; done
    ip netns del "${HOSTS_PREFIX}sw" 2>/dev/null
    HOSTS_N=0
}

addr() { echo "$HOSTS_NET.$1"; }

on() {
    local h=$1
    shift
    ip netns exec "$HOSTS_PREFIX$h" unshare --uts sh -c 'hostname "$0"; exec "$@"' "host$h" "$@"
}

# tc units; DELAY one way, on the host's egress (a flow between two shaped hosts
# sees RATE and an RTT of twice DELAY)
shape() {
    local h=$1 ns="$HOSTS_PREFIX$1"
    ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null
    netdelay_off "$h"
    [ "$2" = off ] && return 0
    # the token bucket's burst: at least one millisecond at RATE, and a 64 KiB segment
    local bps burst
    bps=$(echo "$2" | awk '/gbit$/ { print $1 * 1e9; next } /mbit$/ { print $1 * 1e6; next } { print $1 }')
    burst=$(awk -v b="$bps" 'BEGIN { x = b / 8 / 1000; if (x < 131072) x = 131072; printf "%d", x * 2 }')
    ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: tbf rate "$2" burst "$burst" latency 100ms || return 1
    [ "$(echo "$3" | awk '{ print $1 + 0 }')" = 0 ] && return 0 # the rate alone
    ip netns exec "$ns" tc qdisc add dev eth0 parent 1:1 handle 10: netem delay "$3" limit 100000 2>/dev/null && return 0
    netdelay_on "$h" "$3"
}

# the delay line of host H's cable at the switch: what H sends into the bridge
# goes through netfilter queue H, held DELAY by k3-netdelay
netdelay_on() {
    local sw="${HOSTS_PREFIX}sw" us
    us=$(echo "$2" | awk '/us$/ { print $1 + 0; next } /ms$/ { print $1 * 1000; next } /s$/ { print $1 * 1e6; next } { print -1 }')
    [ "$us" -ge 0 ] 2>/dev/null || { echo "shape: bad delay '$2' (10ms, 500us)" >&2; return 1; }
    ip netns exec "$sw" sysctl -q -w net.bridge.bridge-nf-call-iptables=1 || return 1
    ip netns exec "$sw" "$HOSTS_NETDELAY" "$1" "$us" || return 1
    ip netns exec "$sw" iptables -A FORWARD -m physdev --physdev-in "p$1" -j NFQUEUE --queue-num "$1" --queue-bypass
}

netdelay_off() {
    local sw="${HOSTS_PREFIX}sw" p
    command -v iptables >/dev/null 2>&1 &&
        ip netns exec "$sw" iptables -D FORWARD -m physdev --physdev-in "p$1" -j NFQUEUE --queue-num "$1" \
            --queue-bypass 2>/dev/null
    for p in $(ip netns pids "$sw" 2>/dev/null); do
        [ "$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | awk '{ print $2 }')" = "$1" ] && kill -TERM "$p"
    done
    return 0
}

# where a delay can be made: netem, or iptables and k3-netdelay (the caller made the hosts)
shape_check() {
    local ns="${HOSTS_PREFIX}sw"
    ip netns exec "$ns" tc qdisc add dev br0 root netem delay 1ms 2>/dev/null &&
        { ip netns exec "$ns" tc qdisc del dev br0 root; return; }
    command -v iptables >/dev/null 2>&1 || { echo "no netem qdisc in this kernel and no iptables (Debian's iptables) for the delay line"; return; }
    [ -x "$HOSTS_NETDELAY" ] || { echo "no netem qdisc in this kernel and $HOSTS_NETDELAY is not built"; return; }
    ip netns exec "$ns" iptables -L FORWARD >/dev/null 2>&1 || echo "no netem qdisc in this kernel and iptables does not work here"
}

# up: once H's eth0 has its carrier again, the neighbour entries the cut left failed or
# half-resolved (the hosts kept trying to reach H) are flushed on every host, as a host
# does when its link comes back: a new connection must not inherit them (its SYN would
# wait on an ARP entry whose probes the cut used up and fail with EHOSTUNREACH, and
# OpenMPI's daemon does not retry such a connect: mpirun then waits for it forever)
link() {
    local i
    ip -n "${HOSTS_PREFIX}sw" link set "p$1" "$2" || return 1
    [ "$2" = up ] || return 0
    for i in $(seq 100); do
        ip -n "$HOSTS_PREFIX$1" link show eth0 | grep -q 'LOWER_UP' && break
        sleep 0.02
    done
    for i in $(ip netns list | sed -n "s/^${HOSTS_PREFIX}\([0-9][0-9]*\)\( .*\)*$/\1/p"); do
        ip -n "$HOSTS_PREFIX$i" neigh flush dev eth0 nud failed 2>/dev/null
        ip -n "$HOSTS_PREFIX$i" neigh flush dev eth0 nud incomplete 2>/dev/null
    done
    return 0
}

# OpenMPI across the hosts: mpirun runs on host H; its daemons on the other
# hosts start through the rsh agent (tests/hosts/rsh: address -> namespace);
# the out-of-band and the TCP BTL use eth0 only. A daemon that does not report
# within 60 s fails the job with OpenMPI's message (its default is to wait forever).
mpirun_on() {
    local h=$1
    shift
    on "$h" env K3_HOSTS_PREFIX="$HOSTS_PREFIX" K3_HOSTS_NET="$HOSTS_NET" \
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        mpirun --allow-run-as-root --oversubscribe --mca plm_rsh_agent "$HOSTS_LIB_DIR/rsh" \
        --mca plm_rsh_no_tree_spawn 1 --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0 \
        --mca orte_startup_timeout 60 "$@"
}
