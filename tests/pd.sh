#!/bin/sh
# pd.sh -- prefill and decode apart, end to end (tests/pd_serve.py: the
# official openai client in the project's .venv, made by scripts/venv.sh when
# missing): instances behind k3 serve --role proxy against colocated ones,
# the faults, and with mpirun a decode (and a prefill) instance under --dcp 2.
# Ends with `pd: N passed, N failed, N skipped`. Usage: sh tests/pd.sh build/k3
K3=${1:-build/k3}
err=$(mktemp)
trap 'rm -f "$err"' EXIT
if PY=$(sh scripts/venv.sh openai 2>"$err"); then
    mpi=
    command -v mpirun >/dev/null 2>&1 && mpi=--mpi
    timeout 600 "$PY" tests/pd_serve.py "$K3" $mpi || true
else
    echo "FAIL pd: a Python with the openai client (scripts/venv.sh)"
    sed 's/^/    /' "$err"
    echo "pd: 0 passed, 1 failed, 0 skipped"
fi
