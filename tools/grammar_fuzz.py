#!/usr/bin/env python3
"""grammar_fuzz.py -- random texts from the grammar engine, judged by an outside validator.

For every schema of bench/grammar/ and every compiling schema of
tests/golden/grammar/suite.json, `k3 grammar --compact --sample N` writes
random texts the grammar allows (tokens picked uniformly among the allowed
ones at each step); each must parse as JSON and validate against its schema
with the `jsonschema` package. Prints the failures and a count; exit status 1
if any text was invalid. This is the check that the engine never allows an
instance the schema rejects, on far more instances than the suites hold.

Usage: .venv/bin/python tools/grammar_fuzz.py [--k3 build/k3] [--n 20] [--seed 1]
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import jsonschema

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
VOCAB = os.path.join(ROOT, "data", "tokenizers", "o200k_base.tiktoken")


def samples(k3, schema_text, n, seed, compact):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        f.write(schema_text)
        path = f.name
    cmd = [k3, "grammar", "--vocab", VOCAB, "--pattern", "o200k", "--json-schema", path, "--sample", str(n), "--seed",
           str(seed), "--max-tokens", "600"]
    if compact:
        cmd.append("--compact")
    r = subprocess.run(cmd, capture_output=True, text=True)
    os.unlink(path)
    out = []
    for line in r.stdout.split("\n"):
        if not line.startswith('"') or line.endswith("(cut at --max-tokens)"):
            continue
        out.append(json.loads(line))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k3", default=os.path.join(ROOT, "build", "k3"))
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    cases = []
    for p in sorted(glob.glob(os.path.join(ROOT, "bench", "grammar", "[0-9]*.json"))):
        cases.append((os.path.basename(p), open(p, encoding="utf-8").read()))
    for c in json.load(open(os.path.join(ROOT, "tests", "golden", "grammar", "suite.json"), encoding="utf-8")):
        if c.get("compiles"):
            cases.append((c["file"] + ": " + c["group"], c["schema"]))
    checked = bad = 0
    for name, text in cases:
        schema = json.loads(text)
        v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
        for compact in (True, False):
            for s in samples(a.k3, text, a.n, a.seed, compact):
                checked += 1
                try:
                    inst = json.loads(s)
                except ValueError as e:
                    bad += 1
                    print(f"{name}: not JSON ({e}): {s[:200]!r}")
                    continue
                try:
                    errs = list(v.iter_errors(inst))
                except Exception as e:  # a pattern Python's re cannot read (ECMA-only syntax)
                    print(f"{name}: skipped: the validator fails: {e}")
                    break
                if errs:
                    bad += 1
                    print(f"{name}: invalid ({errs[0].message[:120]}): {s[:300]!r}")
    print(f"{checked} random texts from {len(cases)} schemas, {bad} invalid")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
