#!/bin/sh
# run.sh -- the whole suite for `make test`: the C unit and model tests
# (build/k3-test), then the CLI checks (tests/cli.sh), then the fuzzers
# (fuzz/run.sh, a few seconds each; skipped without clang), then MPI
# (tests/mpi.sh), prefill/decode apart (tests/pd.sh), the disk tier
# (tests/kvstore.sh) and several hosts (tests/hosts.sh), then one closing line
# with the totals: `N passed, N failed, N skipped` (a check that cannot run
# here, a missing clang, mpirun or network namespaces, says `skip` with its
# reason and counts there, never as passed). Exit status 1 if anything failed.
# Usage: sh tests/run.sh build/k3-test build/k3
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$1" | tee "$log"
sh tests/cli.sh "$2" | tee -a "$log"
# the fuzzers, a few seconds each on their seed corpus (fuzz/run.sh)
sh fuzz/run.sh "${FUZZ_DIR:-build-fuzz}" "${FUZZ_TEST_TIME:-3}" | tee -a "$log"
# several processes under mpirun (tests/mpi.sh)
sh tests/mpi.sh "$2" | tee -a "$log"
# prefill and decode apart behind the proxy (tests/pd.sh)
sh tests/pd.sh "$2" | tee -a "$log"
# the disk tier across processes and the KV events (tests/kvstore.sh)
sh tests/kvstore.sh "$2" | tee -a "$log"
# several hosts: network namespaces (tests/hosts.sh; skipped where they cannot be made)
sh tests/hosts.sh "$2" | tee -a "$log"
R="cli|fuzz|mpi|pd|kvstore|hosts"
RE="^(($R): )?[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$"
sum() { grep -E "$RE" "$log" | sed -E "s/^($R): //; s/,//g" | awk -v f="$1" '{s += $f} END {print s + 0}'; }
p=$(sum 1)
f=$(sum 3)
s=$(sum 5)
# a runner that crashed before its summary counts as a failure
[ "$(grep -cE "$RE" "$log")" -eq 7 ] || f=$((f + 1))
echo "$p passed, $f failed, $s skipped"
[ "$f" -eq 0 ]
