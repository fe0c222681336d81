#!/usr/bin/env python3
"""llamacpp.py -- the helper of bench/llamacpp.sh (standard library only).

  llamacpp.py bytes FILE.gguf     bytes a decoded token reads from a GGUF and its
                                  tensor types: every tensor once, the routed
                                  experts' (*_exps) at expert_used_count of
                                  expert_count, the token embedding one row
  llamacpp.py table RESULTS.jsonl the rounds and medians of a bench/llamacpp.sh run
  llamacpp.py convert LLAMA_SOURCE CHECKPOINT [converter options]
                                  llama.cpp's convert_hf_to_gguf.py (run it in a
                                  venv with torch, transformers, tiktoken) on a k3
                                  checkpoint whose tokenizer it does not know: a
                                  checkpoint's own BPE with Kimi's split pattern
                                  (tokenization_k3.py) is read as kimi-k2's, its
                                  ranks and specials where the converter looks

The GGUF header is read here (the format is small and fixed: header, key/value
pairs, tensor infos); nothing of llama.cpp is imported.
"""
import json
import statistics
import struct
import sys

# ggml type id -> (name, elements a block, bytes a block)
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2),
    39: ("MXFP4", 32, 17),
}

# GGUF value types: id -> struct format (scalars); 8 string, 9 array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class Reader:
    def __init__(self, f):
        self.f = f

    def get(self, fmt):
        n = struct.calcsize("<" + fmt)
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError("truncated GGUF header")
        return struct.unpack("<" + fmt, b)[0]

    def string(self):
        n = self.get("Q")
        if n > 1 << 20:
            raise ValueError("GGUF string of %d bytes" % n)
        return self.f.read(n).decode("utf-8", "replace")

    def value(self, vt):
        if vt in SCALARS:
            return self.get(SCALARS[vt])
        if vt == 8:
            return self.string()
        if vt == 9:
            et, n = self.get("I"), self.get("Q")
            if et in SCALARS:  # skip scalar arrays (the vocabulary) without decoding them
                self.f.seek(n * struct.calcsize("<" + SCALARS[et]), 1)
                return None
            return [self.value(et) for _ in range(n)]
        raise ValueError("unknown GGUF value type %d" % vt)


def gguf_info(path):
    with open(path, "rb") as f:
        r = Reader(f)
        if f.read(4) != b"GGUF":
            raise ValueError("%s: not a GGUF file" % path)
        version = r.get("I")
        if version < 2:
            raise ValueError("%s: GGUF version %d is not supported" % (path, version))
        n_tensors, n_kv = r.get("Q"), r.get("Q")
        kv = {}
        for _ in range(n_kv):
            key = r.string()
            val = r.value(r.get("I"))
            if not isinstance(val, list):
                kv[key] = val
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.get("Q") for _ in range(r.get("I"))]
            t = r.get("I")
            r.get("Q")  # offset
            tensors.append((name, dims, t))
    return kv, tensors


def tensor_bytes(dims, t):
    if t not in GGML_TYPES:
        raise ValueError("ggml type %d unknown to this reader" % t)
    _, blk, size = GGML_TYPES[t]
    n = 1
    for d in dims:
        n *= d
    return n // blk * size, dims[0] // blk * size


def gguf_bytes(path):
    kv, tensors = gguf_info(path)
    arch = kv.get("general.architecture", "")
    n_exp = kv.get(arch + ".expert_count", 0)
    n_used = kv.get(arch + ".expert_used_count", 0)
    total = active = 0
    types = {}
    for name, dims, t in tensors:
        full, row = tensor_bytes(dims, t)
        total += full
        key = "experts" if "_exps" in name else "trunk"
        types.setdefault(key, set()).add(GGML_TYPES[t][0])
        if name.startswith("token_embd"):
            active += row
        elif "_exps" in name and n_exp:
            active += full * n_used / n_exp
        else:
            active += full
    return {
        "file": path, "arch": arch, "bytes_total": total, "bytes_per_token": int(active),
        "experts": "%s of %s" % (n_used, n_exp),
        "types": {k: sorted(v) for k, v in types.items()},
        # the trunk's widest type names the GGUF's kind: 8-bit or as stored
        "kind": "8bit" if "Q8_0" in types.get("trunk", ()) else "stored",
    }


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def table(path):
    k3, ll = [], []
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                (k3 if rec["who"] == "k3" else ll).append(rec)
    prompts = sorted({p["tokens"] for r in k3 for p in r["prefill"]})
    # work a token at each prompt length: k3 bench's count (work GFLOP/s / tok/s)
    work = {}
    for n in prompts:
        work[n] = med([p["work_gflops"] / p["tok_s"] for r in k3 for p in r["prefill"]
                       if p["tokens"] == n and p["tok_s"] > 0])
    rounds = sorted({r["round"] for r in k3 + ll})

    def k3_row(r):
        d = {p["tokens"]: p["tok_s"] for p in r["prefill"]}
        return d, r["decode_tok_s"], r["bandwidth_fraction"], r.get("decode_mem_bw_gbps", r["mem_bw_gbps"])

    def ll_rows(cfg, rnd):
        d, dec, fr, bws = {}, None, None, []
        for r in ll:
            if r["config"] != cfg or r["round"] != rnd:
                continue
            bws += [r["bw_before"], r["bw_after"]]
            for t in r["tests"]:
                if t["n_gen"] == 0:
                    d[t["n_prompt"]] = t["avg_ts"]
                elif t["n_prompt"] == 0:
                    dec = t["avg_ts"]
                    fr = r["bytes_per_token"] * dec / 1e9 / (0.5 * (r["bw_before"] + r["bw_after"]))
        return d, dec, fr, med(bws)

    k3cfg = sorted({r["config"] for r in k3}, key=lambda c: [r["config"] for r in k3].index(c))
    llcfg = sorted({r["config"] for r in ll}, key=lambda c: [r["config"] for r in ll].index(c))
    kind_of = {r["config"]: r["kind"] for r in k3 + ll}
    print("work a token (k3 bench's count, GFLOP): " + ", ".join("%d: %.3f" % (n, work[n]) for n in prompts))
    hdr = "%-34s %5s " % ("config", "round") + " ".join("%9s" % ("pp%d" % n) for n in prompts)
    hdr += " %9s %9s %7s %6s" % ("GFLOP/s", "tg tok/s", "of bw", "GB/s")
    print("\nper round (prefill tok/s; GFLOP/s at 512 or the largest; decode b=1 tok/s and its fraction of")
    print("the bandwidth read around the decode runs, GB/s: k3 bench's median of them, llama.cpp's before/after)")
    print(hdr)
    per = {}
    gi = 512 if 512 in prompts else prompts[-1]
    for cfg in k3cfg + llcfg:
        for rnd in rounds:
            if cfg in k3cfg:
                rs = [r for r in k3 if r["config"] == cfg and r["round"] == rnd]
                if not rs:
                    continue
                d, dec, fr, bw = k3_row(rs[0])
            else:
                d, dec, fr, bw = ll_rows(cfg, rnd)
                if not d and dec is None:
                    continue
            per[(cfg, rnd)] = (d, dec, fr)
            g = d.get(gi, float("nan")) * work.get(gi, float("nan"))
            print("%-34s %5d " % (cfg, rnd) + " ".join("%9.1f" % d.get(n, float("nan")) for n in prompts)
                  + " %9.1f %9.2f %7.3f %6.1f" % (g, dec if dec else float("nan"), fr if fr else float("nan"), bw))
    print("\nmedians over the rounds")
    print(hdr)
    medians = {}
    for cfg in k3cfg + llcfg:
        rs = [per[(cfg, r)] for r in rounds if (cfg, r) in per]
        if not rs:
            continue
        d = {n: med([x[0][n] for x in rs if n in x[0]]) for n in prompts}
        dec = med([x[1] for x in rs if x[1]])
        fr = med([x[2] for x in rs if x[2]])
        medians[cfg] = (d, dec, fr)
        print("%-34s %5s " % (cfg, "med") + " ".join("%9.1f" % d[n] for n in prompts)
              + " %9.1f %9.2f %7.3f" % (d.get(gi, float("nan")) * work.get(gi, float("nan")), dec, fr))
    print("\nk3 / llama.cpp, same kind of weights (per round, then the median of the rounds' ratios)")
    for kc in k3cfg:
        for lc in llcfg:
            if kind_of[kc] != kind_of[lc]:
                continue
            cols = ["pp%d" % n for n in prompts] + ["tg", "of bw"]
            print("%s / %s" % (kc, lc))
            ratios = {c: [] for c in cols}
            for rnd in rounds:
                if (kc, rnd) not in per or (lc, rnd) not in per:
                    continue
                a, b = per[(kc, rnd)], per[(lc, rnd)]
                line = []
                for n in prompts:
                    v = a[0].get(n, 0) / b[0][n] if b[0].get(n) else float("nan")
                    ratios["pp%d" % n].append(v)
                    line.append("pp%d %.2f" % (n, v))
                for c, i in (("tg", 1), ("of bw", 2)):
                    v = a[i] / b[i] if a[i] and b[i] else float("nan")
                    ratios[c].append(v)
                    line.append("%s %.2f" % (c, v))
                print("  round %d: %s" % (rnd, ", ".join(line)))
            print("  median: " + ", ".join("%s %.2fx" % (c, med(ratios[c])) for c in cols))


def convert(src, args):
    import os
    import runpy

    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    import conversion.base as base  # llama.cpp's, from LLAMA_SOURCE
    import transformers

    def pre(self, tokenizer):
        return "kimi-k2"

    base.TextModel.get_vocab_base_pre = pre
    orig = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(*a, **k):
        t = orig(*a, **k)
        if not hasattr(t, "model") and hasattr(t, "_enc"):  # K3Tokenizer: tiktoken inside
            t.model = t._enc
            t.special_tokens = {b.decode(): i for i, b in t._special_bytes.items()}
            t.eos_id = t.eos_token_id
        return t

    transformers.AutoTokenizer.from_pretrained = from_pretrained
    sys.argv = [os.path.join(src, "convert_hf_to_gguf.py")] + args
    runpy.run_path(sys.argv[0], run_name="__main__")


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "convert":
        convert(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 3 and sys.argv[1] == "bytes":
        print(json.dumps(gguf_bytes(sys.argv[2])))
    elif len(sys.argv) == 3 and sys.argv[1] == "table":
        table(sys.argv[2])
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
