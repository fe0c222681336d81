#!/bin/sh
# Installs what `make test-browser` needs beside the build: Debian's chromium
# (headless, driven over its DevTools pipe by tests/browser_ui.py) and a font
# for the screenshot. Only when missing; not needed by `make` or `make test`.
# Needs root or sudo.
set -e
PKGS="chromium fonts-dejavu-core"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "install-browser-deps: installing:$missing"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $missing
