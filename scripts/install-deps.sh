#!/bin/sh
# Installs the Debian packages k3 builds against, only when one is missing.
# Called by `make` (target `deps`); safe to run by hand. Needs root or sudo.
set -e
PKGS="build-essential pkg-config libpcre2-dev libjansson-dev libmicrohttpd-dev libcurl4-openssl-dev python3 openmpi-bin libopenmpi-dev libpng-dev libjpeg62-turbo-dev libwebp-dev libgif-dev libxxhash-dev libzmq3-dev libmsgpack-dev libssl-dev"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# optional: UCX (src/comm/ucx.c, build/ucxbench); k3 builds and its tests skip the UCX cases without it;
# iptables: the test hosts' link delay where the kernel has no netem (tests/hosts/lib.sh: shape)
OPTIONAL="libucx-dev iptables"
optional=""
for p in $OPTIONAL; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || optional="$optional $p"
done
[ -z "$missing$optional" ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
if [ -n "$missing" ]; then
    echo "install-deps: installing:$missing"
    $SUDO apt-get install -y -qq $missing
fi
if [ -n "$optional" ]; then
    echo "install-deps: installing (optional):$optional"
    $SUDO apt-get install -y -qq $optional || echo "install-deps: optional packages not installed:$optional (k3 builds without them)"
fi
