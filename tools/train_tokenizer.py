#!/usr/bin/env python3
"""Train k3-mini's byte-level BPE tokenizer (tiktoken.model format) on the training split.

    python3 tools/train_tokenizer.py --out models/k3-mini/tiktoken.model [--ranks 7936]

Words come from Kimi's split regex (docs/model.md §5, KIMI_PAT in train_data.py) applied by
HF `tokenizers` (Split pre-tokenizer, Oniguruma; checked equal to python-`regex` V1 on the
corpus), mapped to bytes with the GPT-2 ByteLevel alphabet, and trained with HF's BpeTrainer
(deterministic: single-threaded, fixed input order). Output: ranks 0..255 = the single bytes
(rank b = byte b), then one rank per merge in merge order (`base64(token_bytes) rank` lines).

Verification (--verify, on by default): tiktoken.Encoding(pat_str=KIMI_PAT, mergeable_ranks=
file) round-trips the held-out text and the whole training text; every rank's bytes encode to
exactly that one rank (reachable); the python-regex V1 split covers the text (it was checked equal to the HF split).
"""
import argparse
import base64
import hashlib
import os
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic, and the box has 2 cores

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_data  # noqa: E402


def bytes_to_unicode():
    """GPT-2 ByteLevel byte -> printable char map (what HF ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def train(texts, n_ranks):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(train_data.KIMI_PAT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_ranks, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])

    # line-aligned chunks, so no word is split across two chunks
    def chunks():
        for t in texts:
            pos = 0
            while pos < len(t):
                j = t.find("\n", pos + (1 << 16))
                j = len(t) if j < 0 else j + 1
                yield t[pos:j]
                pos = j
    tok.train_from_iterator(chunks(), trainer=trainer)
    import json
    model = json.loads(tok.to_str())["model"]
    merges = model["merges"]
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    ranks = [bytes([b]) for b in range(256)]
    seen = set(ranks)
    for m in merges:
        a, b = m.split(" ") if isinstance(m, str) else m
        tb = bytes(u2b[c] for c in a + b)
        if tb in seen:
            raise SystemExit(f"duplicate token bytes {tb!r}")
        seen.add(tb)
        ranks.append(tb)
    return ranks


def write_ranks(ranks, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for r, tb in enumerate(ranks):
            f.write(f"{base64.b64encode(tb).decode()} {r}\n")


def bpe(piece, ranks):
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def verify(path, split):
    import regex
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(path)
    enc = tiktoken.Encoding("k3mini", pat_str=train_data.KIMI_PAT, mergeable_ranks=ranks,
                            special_tokens={})
    # reachability: BPE-encoding a rank's own bytes (tiktoken's rule: merge the adjacent pair
    # whose concatenation has the lowest rank, leftmost first) must give that rank alone
    unreach = []
    for tb, r in ranks.items():
        ids = bpe(tb, ranks)
        if ids != [r]:
            unreach.append((r, tb, ids))
    print(f"ranks {len(ranks)}; unreachable {len(unreach)}", unreach[:5])
    tot_b = tot_t = 0
    for name, (tr, ho) in split.items():
        ids = enc.encode_ordinary(ho)
        assert enc.decode(ids) == ho, f"round-trip failed on held-out {name}"
        words = regex.findall("(?V1)" + train_data.KIMI_PAT, ho)
        assert "".join(words) == ho
        ntr = len(enc.encode_ordinary(tr))
        assert len(enc.decode_bytes(enc.encode_ordinary(tr[:200000]))) == len(tr[:200000].encode())
        b = len(ho.encode())
        print(f"  {name}: held-out {b:,} B -> {len(ids):,} tok ({b/len(ids):.2f} B/tok); "
              f"train {ntr:,} tok")
        tot_b += b
        tot_t += len(ids)
    misc = "Hello, World! It's 12345 — “quotes” café 中文 日本語 🙂\r\n\ttabs  end"
    assert enc.decode(enc.encode_ordinary(misc)) == misc
    print(f"  held-out total {tot_b/tot_t:.2f} B/tok; round-trips OK")
    return not unreach


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(train_data.ROOT, "models/k3-mini/tiktoken.model"))
    ap.add_argument("--ranks", type=int, default=8192 - 256)
    ap.add_argument("--no-verify", action="store_true")
    a = ap.parse_args()
    split = train_data.load_split()
    t0 = time.time()
    ranks = train([split[n][0] for n in train_data.CORPORA], a.ranks)
    assert len(ranks) == a.ranks, (len(ranks), a.ranks)
    write_ranks(ranks, a.out)
    h = hashlib.sha256(open(a.out, "rb").read()).hexdigest()
    print(f"trained {len(ranks)} ranks in {time.time()-t0:.1f}s -> {a.out} sha256 {h}")
    if not a.no_verify and not verify(a.out, split):
        raise SystemExit("verification failed")


if __name__ == "__main__":
    main()
