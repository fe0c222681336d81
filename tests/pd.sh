#!/bin/sh
# pd.sh -- prefill and decode apart, end to end, and who may reach what: tests/pd_serve.py (the
# official openai client in the project's .venv, made by scripts/venv.sh when missing: instances
# behind k3 serve --role proxy against colocated ones, the faults, and with mpirun a decode (and a
# prefill) instance under --dcp 2); tests/secure.py (the transfer port, kv_transfer_params, the
# proxy's hardening, ids, image budgets); and the server's robustness suite (tests/serve_robust.py)
# run unchanged against the proxy (tests/pd_as_serve.py: a prefill, a decode instance and the proxy
# as one k3 serve); tests/pd_serve.py again with --kv-transport ucx (the rows by one-sided UCX gets;
# skipped without UCX). Ends with `pd: N passed, N failed, N skipped`. Usage: sh tests/pd.sh build/k3
K3=${1:-build/k3}
err=$(mktemp)
out=$(mktemp)
trap 'rm -f "$err" "$out"' EXIT
# every instance and proxy of a deployment shares the transfer secret
K3_KV_TRANSFER_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export K3_KV_TRANSFER_SECRET
pass=0
fail=0
skip=0
# runs a suite, shows its lines (NAME: as LABEL:), adds its closing `NAME: N passed, N failed[,
# N skipped]` to the totals
suite() {
    name=$1
    label=$2
    shift 2
    "$@" >"$out" 2>&1
    grep -E "^(ok|FAIL|skip) |^    " "$out" | sed "s/^\(ok  \|FAIL\|skip\) $name: /\1 $label: /"
    line=$(grep -E "^$name: [0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?\$" "$out" | tail -n 1 | tr -d ,)
    p=$(echo "$line" | awk '{print $2}')
    f=$(echo "$line" | awk '{print $4}')
    k=$(echo "$line" | awk '{print $6 + 0}')
    if [ -z "$p" ]; then
        echo "FAIL pd: the $name suite did not finish"
        tail -5 "$out" | sed 's/^/    /'
        fail=$((fail + 1))
    else
        pass=$((pass + p))
        fail=$((fail + f))
        skip=$((skip + k))
    fi
}
if PY=$(sh scripts/venv.sh openai 2>"$err"); then
    mpi=
    command -v mpirun >/dev/null 2>&1 && mpi=--mpi
    suite pd pd timeout 600 "$PY" tests/pd_serve.py "$K3" $mpi
    suite pd "pd (ucx)" timeout 600 "$PY" tests/pd_serve.py "$K3" $mpi --kv-transport ucx
    suite secure secure timeout 600 "$PY" tests/secure.py "$K3"
    # the proxy under the server's robustness suite, unchanged
    K3_BIN=$K3
    export K3_BIN
    suite robust "robust (proxy)" timeout 600 "$PY" tests/serve_robust.py tests/pd_as_serve.py
else
    echo "FAIL pd: a Python with the openai client (scripts/venv.sh)"
    sed 's/^/    /' "$err"
    fail=$((fail + 1))
fi
echo "pd: $pass passed, $fail failed, $skip skipped"
