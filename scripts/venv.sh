#!/bin/sh
# venv.sh -- makes sure the project's local Python environment (.venv at the
# repository root) exists and holds the given packages, installing only what
# is missing. Prints the environment's python on stdout, so callers can do
#     PY=$(sh scripts/venv.sh numpy) && "$PY" tools/make_checkpoint.py ...
# Usage: sh scripts/venv.sh [PACKAGE[=IMPORT_NAME]]...   (e.g. numpy regex)
# Everything it reports goes to stderr. Needs python3 (with venv/ensurepip)
# and, when a package is missing, PyPI.
set -e
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${K3_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
    command -v python3 >/dev/null 2>&1 || { echo "venv.sh: python3 not found (apt-get install python3 python3-venv)" >&2; exit 1; }
    echo "venv.sh: creating $VENV" >&2
    python3 -m venv "$VENV" >&2 || { echo "venv.sh: python3 -m venv failed (apt-get install python3-venv)" >&2; exit 1; }
fi
missing=""
for spec in "$@"; do
    pkg=${spec%%=*}
    mod=${spec#*=}
    "$PY" -c "import $mod" 2>/dev/null || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
    echo "venv.sh: installing into $VENV:$missing" >&2
    "$PY" -m pip install -q $missing >&2 || { echo "venv.sh: pip install$missing failed (needs PyPI)" >&2; exit 1; }
fi
echo "$PY"
