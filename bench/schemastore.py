"""schemastore.py -- `k3 grammar --json` over the real-world schemas of
bench/schemastore/corpus.jsonl.gz (tools/schemastore_corpus.py gathers them from a pinned
SchemaStore commit), with the o200k vocabulary of data/tokenizers/.

For every schema: compile, then feed its valid and invalid instances (compact JSON, keys in
the grammar's order) token by token, timing every mask. A schema that does not answer in
TIMEOUT seconds counts as "no answer". Prints:

  schemas: compiled / refused (by construct) / no answer
  instances: valid accepted / valid refused, invalid rejected / invalid accepted
  compile ms and mask us: p50 / p99 / max (masks pooled over every step of every text)
  the refusals by construct, and the slowest schemas

Usage: python3 bench/schemastore.py build/k3 [TIMEOUT_S] [--lock] [--only NAME] [--json OUT]
--lock runs each schema under `flock -x /tmp/k3-cpu.lock` (short exclusive holds, so the
times are the machine's, not the other users'). Nothing here is asserted: a measurement.
"""
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CORPUS = os.path.join(ROOT, "bench", "schemastore", "corpus.jsonl.gz")
VOCAB = ["--vocab", os.path.join(ROOT, "data", "tokenizers", "o200k_base.tiktoken"), "--pattern", "o200k"]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def construct(msg):
    """The construct a refusal names: the keyword, the format, or the message without its path."""
    m = re.search(r"keyword '([^']+)'", msg)
    if m:
        return m.group(1)
    m = re.search(r"format '([^']+)'", msg)
    if m:
        return "format " + m.group(1)
    if "$ref" in msg and ("remote" in msg or "outside" in msg or "another document" in msg):
        return "$ref to another document"
    msg = re.sub(r"^[^ ]*: ", "", msg)
    msg = re.sub(r"'[^']*'", "'...'", msg)
    msg = re.sub(r"[0-9]+", "N", msg)
    return msg[:90]


def main():
    args = sys.argv[1:]
    k3 = args[0] if args else "build/k3"
    timeout = float(args[1]) if len(args) > 1 and not args[1].startswith("--") else 120.0
    lock = "--lock" in args
    only = args[args.index("--only") + 1] if "--only" in args else None
    out_json = args[args.index("--json") + 1] if "--json" in args else None
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        corpus = [json.loads(line) for line in f]
    if only:
        corpus = [e for e in corpus if only in e["name"]]
    compiled = refused = no_answer = 0
    va = vr = ir = ia = 0
    compile_ms, masks, refusals, slow, rows = [], [], {}, [], []
    t_all = time.time()
    with tempfile.TemporaryDirectory() as d:
        sp, tp, mp = os.path.join(d, "s.json"), os.path.join(d, "t.jsonl"), os.path.join(d, "m.txt")
        for e in corpus:
            with open(sp, "w", encoding="utf-8") as f:
                json.dump(e["schema"], f, ensure_ascii=False)
            texts = e["valid"] + e["invalid"]
            with open(tp, "w", encoding="utf-8") as f:
                for t in texts:
                    f.write(json.dumps(t, ensure_ascii=False) + "\n")
            if os.path.exists(mp):
                os.remove(mp)
            cmd = [k3, "grammar", *VOCAB, "--json-schema", sp, "--compact", "--test", tp, "--json", "--times", mp]
            if lock:
                cmd = ["flock", "-x", "/tmp/k3-cpu.lock", "timeout", "-s", "KILL", str(timeout), *cmd]
            else:
                cmd = ["timeout", "-s", "KILL", str(timeout), *cmd]
            t0 = time.time()
            r = subprocess.run(cmd, capture_output=True, text=True)
            took = time.time() - t0
            row = {"name": e["name"], "seconds": round(took, 3)}
            try:
                j = json.loads(r.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                j = None
            if j is None:
                no_answer += 1
                row["result"] = "no answer" if r.returncode in (124, 137, -9) else f"exit {r.returncode}"
                row["stderr"] = r.stderr[-200:]
                slow.append((took, e["name"], row["result"]))
                rows.append(row)
                continue
            if not j.get("compiled"):
                refused += 1
                c = construct(j.get("error") or "")
                refusals[c] = refusals.get(c, 0) + 1
                row["result"] = "refused: " + (j.get("error") or "")[:200]
                rows.append(row)
                continue
            compiled += 1
            compile_ms.append(j["compile_ms"])
            res = j.get("results", [])
            nv = len(e["valid"])
            for i, x in enumerate(res):
                ok = x.get("accepted")
                if i < nv:
                    va += bool(ok)
                    vr += not ok
                else:
                    ir += not ok
                    ia += bool(ok)
            if os.path.exists(mp):
                with open(mp) as f:
                    ts = [float(x) for x in f.read().split()]
                masks += ts
                row["mask_us_max"] = max(ts, default=0)
            row["result"] = "compiled"
            row["compile_ms"] = j["compile_ms"]
            slow.append((took, e["name"], "compiled"))
            rows.append(row)
    n = len(corpus)
    print(f"{n} schemas (SchemaStore, bench/schemastore/corpus.jsonl.gz), o200k, --compact, timeout {timeout:.0f} s, "
          f"{'each under flock -x' if lock else 'shared machine'}; {time.time() - t_all:.0f} s in all")
    print(f"  compiled {compiled}, refused {refused}, no answer {no_answer}")
    print(f"  valid instances: {va} accepted, {vr} refused; invalid instances: {ir} rejected, {ia} accepted")
    print(f"  compile ms: p50 {pct(compile_ms, .5):.2f}, p99 {pct(compile_ms, .99):.2f}, "
          f"max {max(compile_ms, default=float('nan')):.2f}")
    print(f"  mask us ({len(masks)} masks): p50 {pct(masks, .5):.1f}, p99 {pct(masks, .99):.1f}, "
          f"max {max(masks, default=float('nan')):.1f}")
    print("  refusals by construct: " + "; ".join(f"{k} {v}" for k, v in sorted(refusals.items(),
                                                                                 key=lambda kv: -kv[1])))
    print("  slowest: " + "; ".join(f"{nm} {t:.1f} s ({w})" for t, nm, w in sorted(slow, reverse=True)[:8]))
    if out_json:
        with open(out_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
