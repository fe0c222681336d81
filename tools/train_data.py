"""Corpus loading and the train / held-out split shared by train_tokenizer.py and train.py.

Corpora: ../shared/data/corpus/*.txt.gz (relative to the repo root). Each file is decoded as
UTF-8, a leading BOM is dropped, CRLF -> LF, and Moby Dick loses its Project Gutenberg
header and licence trailer. The last ~2% of each file (at least 50 KB), cut at a line
boundary, is held out; it is written to data/heldout/<corpus>.txt by `--write-heldout`.
"""
import gzip
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS_DIR = os.environ.get("K3_CORPUS_DIR", os.path.join(ROOT, "..", "shared", "data", "corpus"))
HELDOUT_DIR = os.path.join(ROOT, "data", "heldout")
CORPORA = ["austen", "brown", "kjv", "mobydick", "sotu"]
HELDOUT_FRAC = 0.02
HELDOUT_MIN = 50_000  # bytes (characters; the corpora are nearly all ASCII)

# Kimi's pre-tokenizer split regex (docs/model.md §5). Python `regex` needs VERSION1 for the
# `&&` set intersections (in V0 they silently mean something else).
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def load_corpus(name):
    path = os.path.join(CORPUS_DIR, name + ".txt.gz")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is missing: training reads the full corpora of the project's shared "
                         "material (../shared/data/corpus, 26.5 MB, not in the repository); "
                         "set K3_CORPUS_DIR to a folder holding austen/brown/kjv/mobydick/sotu.txt.gz")
    with gzip.open(path, "rb") as f:
        text = f.read().decode("utf-8")
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    if name == "mobydick":
        start = text.index("*** START OF THIS PROJECT GUTENBERG EBOOK")
        text = text[text.index("\n", start) + 1:]
        end = text.find("End of Project Gutenberg")
        if end < 0:
            end = text.index("*** END OF THIS PROJECT GUTENBERG EBOOK")
        text = text[:end]
    return text.strip("\n") + "\n"


def split_corpus(text):
    """(train, heldout): heldout = the last max(2%, 50 KB), starting at a line boundary."""
    n = max(int(len(text) * HELDOUT_FRAC), HELDOUT_MIN)
    cut = text.rfind("\n", 0, len(text) - n) + 1  # back to a line start: >= n chars held out
    return text[:cut], text[cut:]


def load_split():
    """{name: (train_text, heldout_text)} for all corpora."""
    return {name: split_corpus(load_corpus(name)) for name in CORPORA}


def write_heldout():
    os.makedirs(HELDOUT_DIR, exist_ok=True)
    total = 0
    for name, (tr, ho) in load_split().items():
        with open(os.path.join(HELDOUT_DIR, name + ".txt"), "w", encoding="utf-8") as f:
            f.write(ho)
        total += len(ho.encode("utf-8"))
        print(f"{name}: train {len(tr):,} chars, heldout {len(ho):,} chars")
    print(f"heldout total {total:,} bytes")


if __name__ == "__main__":
    if "--write-heldout" in sys.argv:
        write_heldout()
