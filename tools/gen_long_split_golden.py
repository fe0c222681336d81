#!/usr/bin/env python3
"""Writes tests/golden/tokenizer-long/long_split.txt: the id count and the
64-bit FNV-1a hash of the ids of one long synthetic text, encoded the way
Kimi's tokenization_kimi.py encodes long text (chunks of 400,000 code points,
each cut so no slice holds more than 25,000 consecutive whitespace or
non-whitespace code points; tiktoken with Kimi's pattern on each slice), over
the o200k ranks of data/tokenizers. tests/test_hostile.c builds the same text
(RECIPE below) and checks the same two numbers.

Usage: python3 tools/gen_long_split_golden.py   (needs tiktoken and regex)
"""
import os
import sys

import tiktoken
from tiktoken.load import load_tiktoken_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gen_tokenizer_goldens as g  # noqa: E402

RECIPE = [("x", 30001), (" ", 25001), ("h\u00e9llo w\u00f6rld, ", 1), ("\u3000", 26000),
          ("\u65e5\u672c\u8a9e", 9000), ("\n", 30000), ("ab ", 150000), ("z", 70000)]


def split(s, m):
    """tokenization_kimi.py's _split_whitespaces_or_nonwhitespaces."""
    cur_len, cur_sp, start = 0, (s[0].isspace() if s else False), 0
    for i, ch in enumerate(s):
        sp = ch.isspace()
        if cur_sp ^ sp:
            cur_len, cur_sp = 1, sp
        else:
            cur_len += 1
            if cur_len > m:
                yield s[start:i]
                start, cur_len = i, 1
    yield s[start:]


def main():
    enc = tiktoken.Encoding("kimi_o200k", pat_str=g.KIMI_PAT, special_tokens={},
                            mergeable_ranks=load_tiktoken_bpe(os.path.join(ROOT, "data", "tokenizers",
                                                                           "o200k_base.tiktoken")))
    text = "".join(p * n for p, n in RECIPE)
    ids = []
    for i in range(0, len(text), 400_000):
        for sub in split(text[i:i + 400_000], 25_000):
            ids.extend(enc.encode_ordinary(sub))
    h = 0xcbf29ce484222325
    for v in ids:
        for b in int(v).to_bytes(4, "little"):
            h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    out = os.path.join(ROOT, "tests", "golden", "tokenizer-long", "long_split.txt")
    with open(out, "w") as f:
        f.write("%d %d %016x\n" % (len(text), len(ids), h))
    print("%s: %d code points, %d ids, fnv1a %016x" % (os.path.relpath(out, ROOT), len(text), len(ids), h))


if __name__ == "__main__":
    main()
