#!/bin/sh
# amx_check.sh -- on a machine with AMX: the AMX kernels' tests on the unit
# (test_amx runs them there and emulated), then amxbench on one thread and
# on two, timed alone (flock -x). Prints the machine's state first.
#   sh bench/amx_check.sh [extra amxbench env, e.g. AB_MB=1200]
set -e
grep -m1 "model name" /proc/cpuinfo
grep -o -w 'amx_tile\|amx_bf16\|amx_int8\|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '
echo
uptime
flock -s /tmp/k3-cpu.lock make -j2 build/k3-test amxbench >/dev/null
build/k3-test amx
for t in 1 2; do
    env "$@" flock -x /tmp/k3-cpu.lock build/amxbench "$t"
done
uptime
