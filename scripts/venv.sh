#!/bin/sh
# venv.sh -- prints the path of a Python that has the official `openai`
# client, for the end-to-end server tests: the repository's .venv, created
# (python3 -m venv .venv; pip install openai) when it is missing or lacks the
# package. Never installs anything system-wide. Messages go to stderr.
set -e
V=${K3_VENV:-.venv}
if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import openai" 2>/dev/null; then
    echo "$V/bin/python"
    exit 0
fi
[ -x "$V/bin/python" ] || python3 -m venv "$V" >&2
"$V/bin/python" -m pip install -q openai >&2
"$V/bin/python" -c "import openai" >&2
echo "$V/bin/python"
