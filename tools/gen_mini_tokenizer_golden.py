#!/usr/bin/env python3
"""Goldens for k3's tokenizer on the trained vocabulary of models/k3-mini:
tiktoken, built from the same tiktoken.model with Kimi's split pattern,
encodes a slice of every held-out file; tests/test_tokenizer_mini.c checks
that k3 produces the same ids.

    python3 tools/gen_mini_tokenizer_golden.py   # writes tests/golden/tokenizer-mini/
"""
import os
import sys

import tiktoken
from tiktoken.load import load_tiktoken_bpe

sys.path.insert(0, os.path.dirname(__file__))
from gen_tokenizer_goldens import KIMI_PAT  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
OUT = os.path.join(ROOT, "tests/golden/tokenizer-mini")


def main():
    ranks = load_tiktoken_bpe(os.path.join(ROOT, "models/k3-mini/tiktoken.model"))
    enc = tiktoken.Encoding("k3mini", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens={})
    os.makedirs(OUT, exist_ok=True)
    extra = "Han 汉字测试 and かな, emoji 👍🏽, CRLF\r\nlines, digits 1234567, I'M they'll don't.\n"
    for name in sorted(os.listdir(os.path.join(ROOT, "data/heldout"))):
        text = open(os.path.join(ROOT, "data/heldout", name), encoding="utf-8").read()[:6000] + extra
        base = os.path.join(OUT, name[:-4])
        with open(base + ".txt", "w", encoding="utf-8", newline="") as f:
            f.write(text)
        ids = enc.encode_ordinary(text)
        assert enc.decode(ids) == text
        with open(base + ".ids", "w") as f:
            f.write(" ".join(map(str, ids)) + "\n")
        print(name, len(text), "chars", len(ids), "ids")


if __name__ == "__main__":
    main()
