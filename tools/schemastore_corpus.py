#!/usr/bin/env python3
"""schemastore_corpus.py -- real-world JSON Schemas with valid and invalid instances,
from the SchemaStore catalogue (github.com/SchemaStore/schemastore, Apache-2.0), for
`sh bench/schemastore.sh`.

From the pinned commit of a SchemaStore git directory it takes every schema
src/schemas/json/NAME.json that has JSON test instances (src/test/NAME/*.json: valid,
src/negative_test/NAME/*.json: invalid), at most 64 KB of schema and 3 instances of
each kind of at most 16 KB; an instance is kept only when the `jsonschema` package
agrees with its folder (valid or not) under the schema's own draft, and its keys are
put in the order the grammar engine writes them (tools/schema_suite.py's Orderer). It
writes bench/schemastore/corpus.jsonl.gz, one schema a line:

    {"name": "...", "schema": {...}, "valid": ["compact text", ...], "invalid": [...]}

Usage:
    sh scripts/venv.sh jsonschema     # once
    git clone --bare https://github.com/SchemaStore/schemastore /tmp/schemastore
    .venv/bin/python tools/schemastore_corpus.py --git /tmp/schemastore [--commit SHA] [--out FILE]

--git is a bare SchemaStore git directory (or a checkout's .git); --commit the pinned commit (default below).
"""
import argparse
import gzip
import json
import os
import subprocess
import sys

import jsonschema

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from schema_suite import Orderer  # noqa: E402

COMMIT = "3b6446ad8a077bac56f4a4796c0b7fd88927fc8e"
MAX_SCHEMA = 64 << 10
MAX_INSTANCE = 16 << 10
PER_KIND = 3


def git(d, *args):
    return subprocess.run(["git", "--git-dir", d, *args], check=True, capture_output=True).stdout


def tree(d, commit, path):
    """{name: (size, blob path)} of the files under path (recursive)."""
    out = {}
    for line in git(d, "ls-tree", "-r", "-l", commit, path).decode().splitlines():
        meta, _, name = line.partition("\t")
        size = meta.split()[3]
        out[name] = int(size) if size.isdigit() else 0
    return out


def instances(d, commit, files, folder, name):
    pre = f"src/{folder}/{name}/"
    got = []
    for f in sorted(f for f in files if f.startswith(pre) and f.endswith(".json") and "/" not in f[len(pre):]):
        if files[f] > MAX_INSTANCE:
            continue
        try:
            got.append(json.loads(git(d, "show", f"{commit}:{f}")))
        except (ValueError, subprocess.CalledProcessError):  # not JSON, or a blob the snapshot lacks
            continue
        if len(got) == PER_KIND:
            break
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--git", required=True, help="a SchemaStore git directory")
    ap.add_argument("--commit", default=COMMIT)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "schemastore",
                                                  "corpus.jsonl.gz"))
    a = ap.parse_args()
    schemas = tree(a.git, a.commit, "src/schemas/json")
    tests = tree(a.git, a.commit, "src/test")
    negs = tree(a.git, a.commit, "src/negative_test")
    names = sorted({f.split("/")[2] for f in tests} | {f.split("/")[2] for f in negs})
    out, dropped = [], 0
    for name in names:
        sp = f"src/schemas/json/{name}.json"
        if sp not in schemas or schemas[sp] > MAX_SCHEMA:
            continue
        try:
            schema = json.loads(git(a.git, "show", f"{a.commit}:{sp}"))
        except (ValueError, subprocess.CalledProcessError):
            continue
        if not isinstance(schema, dict):
            continue
        try:
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
            val = cls(schema)
            orderer = Orderer(schema)
        except Exception:  # noqa: BLE001 -- a schema jsonschema cannot load
            continue
        entry = {"name": name, "schema": schema, "valid": [], "invalid": []}
        for kind, folder, files in (("valid", "test", tests), ("invalid", "negative_test", negs)):
            for inst in instances(a.git, a.commit, files, folder, name):
                try:
                    ok = val.is_valid(inst)
                except Exception:  # noqa: BLE001 -- a remote $ref, a bad pattern for Python's re
                    dropped += 1
                    continue
                if ok != (kind == "valid"):
                    dropped += 1
                    continue
                try:
                    inst = orderer.order(schema, inst)
                except Exception:  # noqa: BLE001
                    pass
                entry[kind].append(json.dumps(inst, ensure_ascii=False, separators=(",", ":")))
        if entry["valid"] or entry["invalid"]:
            out.append(entry)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    text = "".join(json.dumps(e, ensure_ascii=False, separators=(",", ":")) + "\n" for e in out)
    with gzip.GzipFile(a.out, "wb", compresslevel=9, mtime=0) as f:  # the same bytes every run
        f.write(text.encode("utf-8"))
    nv = sum(len(e["valid"]) for e in out)
    ni = sum(len(e["invalid"]) for e in out)
    print(f"{a.out}: {len(out)} schemas, {nv} valid and {ni} invalid instances "
          f"({dropped} dropped: jsonschema disagrees or cannot tell), SchemaStore {a.commit[:12]}")


if __name__ == "__main__":
    main()
