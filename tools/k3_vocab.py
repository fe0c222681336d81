#!/usr/bin/env python3
"""k3_vocab.py -- a tokenizer directory the size of K3's, for timing the grammar engine.

K3's own vocabulary (163,584 ranks + 256 specials = 163,840 ids) is not in the
repository; this writes its shape: the first 163,584 ranks of o200k_base (a
rank prefix of a byte-level BPE is a valid BPE, as tools/make_checkpoint.py
uses it) and K3's specials after them (tools/k3ckpt.py), as tiktoken.model
and tokenizer_config.json, for `k3 grammar -m DIR` and `bench/grammar.sh`.

Usage: python3 tools/k3_vocab.py OUT_DIR
"""
import base64
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3ckpt  # noqa: E402

N_RANKS = 163584


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tokenizers", "o200k_base.tiktoken")
    ranks = []
    with open(src) as f:
        for line in f:
            if line.strip():
                ranks.append(base64.b64decode(line.split()[0]))
                if len(ranks) == N_RANKS:
                    break
    os.makedirs(out, exist_ok=True)
    k3ckpt._write_tokenizer(out, ranks, k3ckpt.special_tokens_k3(N_RANKS))
    print(f"{out}: {N_RANKS} ranks + 256 specials")


if __name__ == "__main__":
    main()
