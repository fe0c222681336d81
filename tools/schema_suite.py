#!/usr/bin/env python3
"""schema_suite.py -- the JSON Schema Test Suite as cases for the grammar engine.

Reads the official suite (json-schema-org/JSON-Schema-Test-Suite, MIT) for draft
2020-12 and writes tests/golden/grammar/suite.json, which tests/test_grammar.c
runs in `make test` (no network, no Python there):

    [{"file": "minLength.json", "group": "...", "schema": "{...}",
      "tests": [{"description": "...", "valid": true, "texts": ["compact", "indented"]}]}]

Each instance is written twice, as json.dumps writes it compactly and with
indent=2 (ensure_ascii=False, the way a model writes JSON), with the keys of
every object put in the order the grammar engine expects them: the schema's
properties in the schema's order (following $ref, allOf and the anyOf/oneOf
branch that validates), then the required ones it does not list, then the
others as they were. The order of keys does not change validity; the script
checks that with the `jsonschema` package anyway (its verdict must agree with
the suite's for every text, or the case is dropped and reported).

Valid instances the engine refuses on purpose carry "stricter": REASON (the
STRICTER table below: formats enforced where the suite treats them as
annotations, and the corners of formats it does not take). With --k3 BIN each
case also records "compiles": whether `BIN grammar` compiles its schema, so
that the test notices a schema that stops (or starts) compiling.

Usage:
    sh scripts/venv.sh jsonschema     # once
    git clone --bare https://github.com/json-schema-org/JSON-Schema-Test-Suite /tmp/jsts
    .venv/bin/python tools/schema_suite.py --suite /tmp/jsts [--out FILE] [--k3 build/k3]

--suite is a checkout of the suite or its bare git directory (its HEAD is read).
"""
import argparse
import json
import os
import subprocess
import sys

import jsonschema

FORMATS = ["date", "time", "date-time", "email", "uuid", "uri", "ipv4", "ipv6", "duration", "json-pointer"]
SKIP = {"refRemote.json", "vocabulary.json"}  # remote documents / metaschemas: nothing to constrain

# (file, test description substring) -> why the engine refuses that valid instance
STRICTER = [
    ("format.json", "only an annotation by default",
     "format is enforced (the suite reads it as an annotation here)"),
    ("optional/format/email.json", "quoted string", "email: a dot-atom local part only"),
    ("optional/format/email.json", "address-literal", "email: a host name after the @ only"),
    ("optional/format/time.json", "valid leap second", "a leap second only as 23:59:60 with Z or +00:00"),
    ("optional/format/date-time.json", "leap second, with minus offset",
     "a leap second only as 23:59:60 with Z or +00:00"),
    ("optional/float-overflow.json", "valid if optional overflow", "no exponent notation with multipleOf"),
    ("optional/bignum.json", "bignum is", "a number has at most 16 integer digits (common/json_text.h)"),
]


def suite_files(path):
    """(name, text) of the draft 2020-12 files the cases come from."""
    names = []
    if os.path.isdir(os.path.join(path, "tests")):
        root = os.path.join(path, "tests", "draft2020-12")
        for f in sorted(os.listdir(root)):
            if f.endswith(".json") and f not in SKIP:
                names.append((f, open(os.path.join(root, f), encoding="utf-8").read()))
        for f in FORMATS + ["../ecmascript-regex", "../non-bmp-regex", "../bignum", "../float-overflow"]:
            p = os.path.normpath(os.path.join(root, "optional", "format", f + ".json"))
            if os.path.exists(p):
                names.append(("optional/" + os.path.relpath(p, os.path.join(root, "optional")),
                              open(p, encoding="utf-8").read()))
        return names
    git = ["git", "--git-dir", path]
    listing = subprocess.run(git + ["ls-tree", "-r", "--name-only", "HEAD", "tests/draft2020-12"],
                             check=True, capture_output=True, text=True).stdout.split()
    want = []
    for f in listing:
        rel = f[len("tests/draft2020-12/"):]
        if "/" not in rel and rel.endswith(".json") and rel not in SKIP:
            want.append(rel)
        elif rel.startswith("optional/format/") and rel[len("optional/format/"):-5] in FORMATS:
            want.append(rel)
        elif rel in ("optional/ecmascript-regex.json", "optional/non-bmp-regex.json", "optional/bignum.json",
                     "optional/float-overflow.json"):
            want.append(rel)
    for rel in sorted(want):
        text = subprocess.run(git + ["show", "HEAD:tests/draft2020-12/" + rel], check=True,
                              capture_output=True).stdout.decode("utf-8")
        names.append((rel, text))
    return names


class Orderer:
    """Puts the keys of an instance in the order the grammar engine writes them."""

    def __init__(self, root):
        self.root = root
        self.validator = jsonschema.Draft202012Validator(root, format_checker=jsonschema.FormatChecker())

    def resolve(self, ref):
        if ref in ("#", ""):
            return self.root
        if not ref.startswith("#/"):
            return None
        cur = self.root
        for tok in ref[2:].split("/"):
            tok = tok.replace("~1", "/").replace("~0", "~")
            if isinstance(cur, dict) and tok in cur:
                cur = cur[tok]
            elif isinstance(cur, list) and tok.isdigit() and int(tok) < len(cur):
                cur = cur[int(tok)]
            else:
                return None
        return cur

    def valid(self, schema, inst):
        try:
            sub = self.validator.evolve(schema=schema)
            return sub.is_valid(inst)
        except Exception:
            return False

    def flat(self, schema, inst, depth=0):
        """The list of plain schemas (no $ref/allOf/anyOf/oneOf) that apply, in merge order."""
        if depth > 40 or not isinstance(schema, dict):
            return [schema] if isinstance(schema, dict) else []
        out = []
        rest = {k: v for k, v in schema.items() if k not in ("$ref", "allOf", "anyOf", "oneOf")}
        if "$ref" in schema:
            t = self.resolve(schema["$ref"])
            if t is not None:
                out += self.flat(t, inst, depth + 1)
        out.append(rest)
        for b in schema.get("allOf", []):
            out += self.flat(b, inst, depth + 1)
        for key in ("oneOf", "anyOf"):
            for b in schema.get(key, []):
                if self.valid(b, inst):
                    out += self.flat(b, inst, depth + 1)
                    break
        return out

    def order(self, schema, inst, depth=0):
        if depth > 60:
            return inst
        parts = self.flat(schema, inst)
        for p in parts:  # a const/enum object is written in its own key order
            for v in ([p["const"]] if "const" in p else []) + list(p.get("enum") or []):
                if isinstance(v, (dict, list)) and self.valid({"const": v}, inst):
                    return _like(v, inst)
        if isinstance(inst, dict):
            keys, props, pattern, addl = [], {}, [], []
            for p in parts:
                for k, v in (p.get("properties") or {}).items():
                    if k not in props:
                        props[k] = []
                        keys.append(k)
                    props[k].append(v)
            for p in parts:
                for k in p.get("required") or []:
                    if isinstance(k, str) and k not in props:
                        props[k] = []
                        keys.append(k)
                pattern += list((p.get("patternProperties") or {}).items())
                if "additionalProperties" in p:
                    addl.append(p["additionalProperties"])
            ordered = [k for k in keys if k in inst] + [k for k in inst if k not in props]
            out = {}
            for k in ordered:
                subs = list(props.get(k, []))
                import re
                for pat, s in pattern:
                    try:
                        if re.search(pat, k):
                            subs.append(s)
                    except re.error:
                        pass
                if not props.get(k) and not any(True for pat, _ in pattern if _safe_search(pat, k)):
                    subs += addl
                out[k] = self.order({"allOf": [s for s in subs if isinstance(s, dict)]}, inst[k], depth + 1)
            return out
        if isinstance(inst, list):
            prefix, items = [], []
            for p in parts:
                pi = p.get("prefixItems")
                if isinstance(pi, list) and not prefix:
                    prefix = pi
                if isinstance(p.get("items"), list) and not prefix:
                    prefix = p["items"]
                elif isinstance(p.get("items"), dict):
                    items.append(p["items"])
            out = []
            for i, v in enumerate(inst):
                s = prefix[i] if i < len(prefix) and isinstance(prefix[i], dict) else {"allOf": items}
                out.append(self.order(s, v, depth + 1))
            return out
        return inst


def _like(model, inst):
    """inst with its keys in the order of the equal value model."""
    if isinstance(inst, dict) and isinstance(model, dict):
        return {k: _like(model[k], inst[k]) for k in model if k in inst}
    if isinstance(inst, list) and isinstance(model, list) and len(inst) == len(model):
        return [_like(m, i) for m, i in zip(model, inst)]
    return inst


def _safe_search(pat, k):
    import re
    try:
        return re.search(pat, k) is not None
    except re.error:
        return False


def compiles(k3, schema_text):
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        f.write(schema_text)
        path = f.name
    vocab = os.path.join(os.path.dirname(__file__), "..", "data", "tokenizers", "o200k_base.tiktoken")
    r = subprocess.run([k3, "grammar", "--vocab", vocab, "--pattern", "o200k", "--json-schema", path, "--json"],
                       capture_output=True, text=True)
    os.unlink(path)
    return json.loads(r.stdout)["compiled"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", required=True, help="a checkout of the suite or its bare git directory")
    ap.add_argument("--k3", help="a built k3 binary: record whether each schema compiles")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "golden", "grammar",
                                                  "suite.json"))
    a = ap.parse_args()
    cases, dropped = [], 0
    for name, text in suite_files(a.suite):
        for group in json.loads(text):
            schema = group["schema"]
            try:
                orderer = Orderer(schema)
            except Exception as e:  # a schema jsonschema itself cannot load
                print(f"{name}: {group['description']}: skipped ({e})", file=sys.stderr)
                continue
            tests = []
            for t in group["tests"]:
                inst = orderer.order(schema, t["data"]) if isinstance(schema, dict) else t["data"]
                texts = [json.dumps(inst, ensure_ascii=False, separators=(",", ":")),
                         json.dumps(inst, ensure_ascii=False, indent=2)]
                ok = True
                for s in texts:
                    try:
                        verdict = orderer.validator.is_valid(json.loads(s))
                    except Exception:
                        verdict = None
                    if verdict is not None and verdict != t["valid"]:
                        ok = False
                if not ok:
                    # jsonschema disagrees with the suite (an optional format it does not check):
                    # the suite is the judge; keep it, but say so
                    print(f"{name}: {group['description']}: {t['description']}: jsonschema disagrees",
                          file=sys.stderr)
                entry = {"description": t["description"], "valid": t["valid"], "texts": texts}
                for f, sub, why in STRICTER:
                    if f == name and sub in t["description"] and t["valid"]:
                        entry["stricter"] = why
                tests.append(entry)
            # the schema as text: jansson refuses integers beyond 64 bits, the engine says why
            case = {"file": name, "group": group["description"], "schema": json.dumps(schema, ensure_ascii=False)}
            if a.k3:
                case["compiles"] = compiles(a.k3, case["schema"])
            case["tests"] = tests
            cases.append(case)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")
    n = sum(len(c["tests"]) for c in cases)
    print(f"{a.out}: {len(cases)} schemas, {n} instances ({dropped} dropped)")


if __name__ == "__main__":
    main()
