#!/bin/sh
# Installs the Debian packages k3 builds against, only when one is missing.
# Called by `make` (target `deps`); safe to run by hand. Needs root or sudo.
set -e
PKGS="build-essential pkg-config libpcre2-dev libjansson-dev libmicrohttpd-dev libcurl4-openssl-dev python3 openmpi-bin libopenmpi-dev libpng-dev libjpeg62-turbo-dev libwebp-dev libgif-dev libssl-dev"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "install-deps: installing:$missing"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq $missing
