#!/bin/sh
# check-reference.sh -- `make check-reference`: k3 against implementations
# written by others (fla-core's naive KDA, transformers' KimiLinearForCausalLM
# and DeepseekV32Indexer). Needs PyPI; not part of `make test`.
#
#  1. a virtualenv in build/ref-venv (sharing the system torch/numpy when they
#     import) gets the pinned reference packages with pip;
#  2. tools/check_reference.py regenerates every golden and the Kimi-Linear
#     checkpoint into a temp dir, prints its own cross-checks (fla chunk vs
#     recurrent, transformers vs fla inside the model, decode vs prefill, reload)
#     and diffs the fresh files against the committed ones;
#  3. build/k3-test runs the C comparisons (tests/test_reference.c) on the
#     committed goldens, which step 2 has just proven current.
# Override the pins with REF_FLA=... REF_TRANSFORMERS=... (pip requirement
# specifiers, e.g. REF_TRANSFORMERS=transformers). Exit status 1 on any failure.
set -u
cd "$(dirname "$0")/.." || exit 1
VENV=${REF_VENV:-build/ref-venv}
FLA=${REF_FLA:-fla-core==0.6.0}
TRANSFORMERS=${REF_TRANSFORMERS:-transformers==5.24.0}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    echo "check-reference: creating $VENV"
    "$PY" -m venv --system-site-packages "$VENV" || exit 1
fi
echo "check-reference: pip install $FLA $TRANSFORMERS"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "$FLA" "$TRANSFORMERS" einops safetensors numpy || exit 1
"$VENV/bin/python" -c "import torch" 2>/dev/null ||
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch || exit 1

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
# one thread is plenty for these sizes, and keeps the run light on shared cores
OMP_NUM_THREADS=1 "$VENV/bin/python" tools/check_reference.py --out "$tmp" --compare . \
    >"$tmp/log" 2>&1 || status=1
# drop the library chatter (transformers' "falling back" notes, progress bars)
grep -v -e "falling back to its reference" -e "Loading weights" -e "Writing model shards" \
    -e "cpu_device_warning" -e "Warning" "$tmp/log"

echo "check-reference: C comparisons (build/k3-test reference)"
make -s build/k3-test || exit 1
build/k3-test reference || status=1
exit $status
