#!/usr/bin/env python3
"""Writes the tokenizer golden files under tests/golden/tokenizer/.

References: the `tiktoken` package for ids, built offline from the rank files
in data/tokenizers (copies of ../shared/data/tokenizers; no downloads), and the `regex` package for the
pieces of Kimi's split pattern. For each case NAME:

  NAME.txt          the input text (UTF-8 bytes, written as is)
  NAME.o200k.ids    tiktoken o200k_base encode_ordinary, ids separated by spaces
  NAME.cl100k.ids   the same with cl100k_base
  NAME.kimi.ids     Kimi's pat_str (docs/model.md §5) over the o200k ranks
  NAME.kimi.split   the byte lengths of the pieces of Kimi's pattern, in order

cases.txt lists the names. kimi-o200k/tokenizer_config.json names K3's special
tokens at o200k's n_ranks + offset, and chat_cases.json holds conversations
with the ids of a small re-implementation of encoding_k3's segment rules
(chat_ids below) on that tokenizer.

Checks made while writing (the script fails if one does not hold):
  - tiktoken accepts Kimi's pattern with `&&`, and the hand rewrite used by the
    C code, `(?:(?!\\p{Han})[...])`, gives the same ids on every case;
  - regex (VERSION1, needed for `&&`) splits every case identically with both
    spellings, its pieces cover the text, and encoding piece by piece gives
    tiktoken's ids, i.e. regex's pieces are tiktoken's pieces.

Usage: python3 tools/gen_tokenizer_goldens.py [--data data] [--corpus ../shared/data/corpus]

The corpus slices are cut from the gzipped corpora in --corpus when it is
given; without it the slices already committed (tests/golden/tokenizer/
corpus_*.txt) are read back, so a plain clone can regenerate every golden.
"""
import argparse
import gzip
import json
import os
import sys

import regex
import tiktoken
from tiktoken.load import load_tiktoken_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "golden", "tokenizer")

CONTRACTION = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)"""

# Kimi's pat_str exactly as tokenization_kimi.py writes it.
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+""" + CONTRACTION + "?",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*""" + CONTRACTION + "?",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# The same with each intersection written as a lookahead, as in pretok.c.
UP = r"""(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])"""
LO = r"""(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])"""
KIMI_PAT_REWRITTEN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?""" + UP + "*" + LO + "+" + CONTRACTION + "?",
    r"""[^\r\n\p{L}\p{N}]?""" + UP + "+" + LO + "*" + CONTRACTION + "?",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Offsets of K3's named specials after the ranks (docs/model.md §5:
# 163584 + offset in the real vocabulary).
SPECIALS = {
    0: ("[BOS]", True),
    1: ("[EOS]", True),
    2: ("<|end_of_msg|>", True),
    3: ("<|open|>", False),
    4: ("<|close|>", False),
    5: ("<|sep|>", False),
    21: ("<|media_placeholder|>", True),
    254: ("[UNK]", True),
    255: ("[PAD]", True),
}

HAND = {
    "chinese": "中华人民共和国成立于一九四九年十月一日。北京是中国的首都，也是全国的政治中心、文化中心和国际交往中心。"
               "学而时习之，不亦说乎？有朋自远方来，不亦乐乎？人不知而不愠，不亦君子乎？\n"
               "长江是亚洲第一长河，全长约六千三百公里，流经青海、西藏、四川、云南、重庆、湖北、湖南、江西、安徽、江苏和上海。",
    "mixed_han_latin": "我喜欢用Python写代码，尤其是PyTorch和CUDA kernel。GPT-4o的tokenizer叫o200k_base，"
                       "Kimi K3用的是tiktoken格式的BPE（163584个token）。版本v2.1.0发布于2026年7月。iPhone很贵吗?",
    "japanese": "東京都は日本の首都です。ひらがなとカタカナ、そして漢字を混ぜて書きます。「こんにちは」と彼は言った。"
                "ｶﾀｶﾅ（半角）もあります。〆切は〇月々日。コンピューター・サイエンスを勉強しています。",
    "korean": "대한민국의 수도는 서울입니다. 한국어 텍스트를 토큰화합니다! 안녕하세요? 저는 학생이에요. "
              "ᄒᆞᆫ글 옛한글 자모도 있습니다.",
    "emoji": "Hello 👋🏽 world 👨‍👩‍👧‍👦 family, flags 🇯🇵🇫🇷🇧🇷 🏳️‍🌈 and ❤️‍🔥, keycaps 1️⃣ #️⃣, "
             "skin 👍🏿👍🏻, 🧑‍💻 coder, text♥︎ vs emoji♥️, 😀😃😄😁 run.",
    "crlf": "line one\r\nline two\r\n\r\nlone CR\rnext\r\r\n  \r\n\tend\r\nend?\r\n!\r\n\r\n\r\n  x\r",
    "whitespace": "tabs\t\tand  spaces   \n  \n\n\t\n   trailing   \nx  \t y\u00a0z\u3000w \u2028 v\u0085u"
                  "\u180eq \u200br\x0b\x0cs   \n\n   \t\t  \u2003\u2003word  x  \u180e y \u180e\n  \u180e",
    "digits": "1234567890123 and 12 345 6789, 3.14159, -42, 1e10, 0x7fff, ９８７６ (fullwidth), ٣٤٥ (Arabic-Indic), "
              "²³ superscripts, Ⅻ roman, ½ fraction, 1,000,000.00 and 00001. " + "31415926535897932384626433" * 3,
    "contractions": "I'M sure they'll come. Don't! DON'T. We've, you're, he'd, it's, 'tis, I'LL, THEY'RE, she'S, "
                    "'S, ’s curly, WE'VE, You'Re, x'ſ ſ 'ſ x'ſt 'K 'k don’t can't.",
    "accented": "Crème brûlée à la française, naïve café, São Paulo, Ångström, Dvořák, Łódź, İstanbul, ǅemal Ǆ ǆ, "
                "ﬁnancial ligature, Straße STRASSE, Ærøskøbing, Þórr, ỳêữ.",
    "arabic_cyrillic": "مرحبا بالعالم! هذا نص عربي مع أرقام ١٢٣. Привет, мир! Это русский текст. Ёлка, ЁЛКА, "
                       "Україна, Ґ. שלום עולם. Γειά σου Κόσμε, ΑΘΗΝΑ.",
    "combining": "e\u0301 vs \u00e9, a\u0308\u0304, Z\u0351\u0324a\u0307\u0330l\u0352g\u0334o, \u0301 leading mark, "
                 "\u0301\u0302 two, क्षत्रिय (Devanagari), ﷺ, ห้าม (Thai), ṩ̄, n\u0303o\u0303",
    "code": "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\nif __name__ == '__main__':\n"
            "\tprint(f(3))\n/* C */ int main(void) { return 0; }\n// path: /usr/local/bin/python3\n"
            "URL https://example.com/a/b?q=1&r=2#frag  <div class=\"x\">&amp;</div>\n    \n",
    "controls": "\x00a\x01b\x1c\x1d\x1e\x1fc\x7f d\ufeffe\u00adf\u200dg\ue000h",
    "han_scripts": "。、「」〆〇々〻・ー 漢字。漢字、かな〆〇々 三〇〇 〡〢〣 ㊀ ⺀ ⻳ 𠀀𠀁 𪜀 abc漢def 漢'sX",
    "long_runs": "a" * 3000 + " " + "Z" * 1000 + "!" * 2000 + " " + "ab" * 800 + "\n" + "1234567890" * 50
                 + " " + "xyz" * 400 + "\n\n" + " " * 700 + "x" + "\t" * 300 + "\n",
}

CORPUS = ["austen", "brown", "kjv", "mobydick", "sotu"]
SLICE_BYTES = 3000


def corpus_slices(corpus):
    """Two slices of about SLICE_BYTES from each corpus file, cut at lines;
    without a corpus directory, the committed slices."""
    out = {}
    for name in CORPUS:
        if corpus is None:
            for k in range(2):
                path = os.path.join(OUT, f"corpus_{name}_{k}.txt")
                if not os.path.isfile(path):
                    raise SystemExit(f"{path} is missing: restore it with `git checkout -- {os.path.relpath(path, ROOT)}` "
                                     "or cut fresh slices with --corpus ../shared/data/corpus")
                out[f"corpus_{name}_{k}"] = open(path, "rb").read().decode("utf-8")
            continue
        path = os.path.join(corpus, name + ".txt.gz")
        if not os.path.isfile(path):
            raise SystemExit(f"{path} is missing (the corpora are in ../shared/data/corpus; "
                             "leave --corpus out to reuse the committed slices)")
        data = gzip.open(path).read()
        for k, frac in enumerate((0.31, 0.77)):
            start = data.index(b"\n", int(len(data) * frac)) + 1
            end = data.index(b"\n", start + SLICE_BYTES) + 1
            if end - start > SLICE_BYTES + 400:  # a long line (sotu): cut at a space
                end = data.index(b" ", start + SLICE_BYTES)
            out[f"corpus_{name}_{k}"] = data[start:end].decode("utf-8")
    return out


def byte_split(pattern, text):
    """Pieces of text as (start, length) in UTF-8 bytes."""
    pieces, pos, at = [], 0, 0
    for m in regex.finditer(pattern, text, flags=regex.V1):
        if m.start() != pos:
            raise SystemExit(f"regex left a gap at {pos}..{m.start()}")
        b = len(m.group().encode("utf-8"))
        pieces.append((at, b))
        at += b
        pos = m.end()
    if pos != len(text):
        raise SystemExit("regex did not reach the end of the text")
    return pieces


def encoding(data, name, pat_str=None):
    base = os.path.join(data, "tokenizers", name)
    for ext in (".json", ".tiktoken"):
        if not os.path.isfile(base + ext):
            raise SystemExit(f"{base + ext} is missing: it is committed as data/tokenizers/{name}{ext} "
                             "(restore it with `git checkout -- data/tokenizers`)")
    meta = json.load(open(base + ".json"))
    return tiktoken.Encoding(name if pat_str is None else name + "_kimi",
                             pat_str=meta["pat_str"] if pat_str is None else pat_str,
                             mergeable_ranks=load_tiktoken_bpe(base + ".tiktoken"),
                             special_tokens={})


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def ids_text(ids):
    return (" ".join(map(str, ids)) + "\n").encode()


# ---- chat (encoding_k3 segment rules) --------------------------------------

def esc(v):
    return v.replace("&", "&amp;").replace('"', "&quot;")


def chat_segments(msgs, add_generation_prompt, thinking):
    """The conversation as ("ctl", name) and ("txt", text) segments."""
    segs = []

    def open_tag(name, attrs=()):
        segs.append(("ctl", "<|open|>"))
        segs.append(("txt", name))
        for k, v in attrs:
            segs.extend([("txt", " " + k), ("txt", '="'), ("txt", esc(v)), ("txt", '"')])
        segs.append(("ctl", "<|sep|>"))

    def block(name, body):
        open_tag(name)
        segs.append(("txt", body))
        segs.append(("ctl", "<|close|>"))
        segs.append(("txt", name))
        segs.append(("ctl", "<|sep|>"))

    for m in msgs:
        open_tag("message", [("role", m["role"])])
        content = m.get("content") or ""
        if m["role"] == "assistant":
            if m.get("reasoning") is not None:
                block("think", m["reasoning"])
            block("response", content)
        else:
            segs.append(("txt", content))
        segs.append(("ctl", "<|close|>"))
        segs.append(("txt", "message"))
        segs.append(("ctl", "<|sep|>"))
        segs.append(("ctl", "<|end_of_msg|>"))
    if add_generation_prompt:
        open_tag("message", [("role", "assistant")])
        open_tag("think" if thinking else "response")
    return segs


def chat_ids(enc, special_id, msgs, add_generation_prompt, thinking):
    ids = []
    for kind, s in chat_segments(msgs, add_generation_prompt, thinking):
        ids.extend([special_id[s]] if kind == "ctl" else enc.encode_ordinary(s))
    return ids


CHATS = [
    ("system_user_think", [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the weather in Beijing?"},
    ], True, True),
    ("multi_turn_no_think", [
        {"role": "system", "content": "You are Kimi."},
        {"role": "user", "content": "Say hi in Chinese."},
        {"role": "assistant", "content": "你好！", "reasoning": "The user wants 你好."},
        {"role": "user", "content": "And in Japanese?\n"},
    ], True, False),
    ("escapes_and_specials_as_text", [
        {"role": 'tool "x" & <y>', "content": "literal <|open|>message<|sep|> & \"quotes\" stay text"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "no reasoning field"},
        {"role": "assistant", "content": "empty reasoning", "reasoning": ""},
    ], False, False),
    ("generation_prompt_only", [], True, True),
    ("unicode_content", [
        {"role": "user", "content": "emoji 👨‍👩‍👧 and CRLF\r\nand   spaces  \n\n"},
        {"role": "assistant", "content": " leading space", "reasoning": "  思考中…  "},
    ], True, True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(ROOT, "data"),
                    help="folder holding tokenizers/ (default: the repository's data/)")
    ap.add_argument("--corpus", default=None,
                    help="folder of the gzipped corpora to cut slices from (default: the committed slices)")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)

    o200k = encoding(args.data, "o200k_base")
    cl100k = encoding(args.data, "cl100k_base")
    kimi = encoding(args.data, "o200k_base", KIMI_PAT)
    kimi_rw = encoding(args.data, "o200k_base", KIMI_PAT_REWRITTEN)

    cases = dict(HAND)
    cases.update(corpus_slices(args.corpus))
    for name, text in cases.items():
        raw = text.encode("utf-8")
        k_ids = kimi.encode_ordinary(text)
        if kimi_rw.encode_ordinary(text) != k_ids:
            raise SystemExit(f"{name}: the rewritten Kimi pattern changes tiktoken's ids")
        pieces = byte_split(KIMI_PAT, text)
        if byte_split(KIMI_PAT_REWRITTEN, text) != pieces:
            raise SystemExit(f"{name}: regex splits the two Kimi spellings differently")
        by_piece = []
        for start, n in pieces:
            by_piece.extend(kimi._encode_single_piece(raw[start:start + n]))
        if by_piece != k_ids:
            raise SystemExit(f"{name}: regex's Kimi pieces are not tiktoken's")
        base = os.path.join(OUT, name)
        write(base + ".txt", raw)
        write(base + ".o200k.ids", ids_text(o200k.encode_ordinary(text)))
        write(base + ".cl100k.ids", ids_text(cl100k.encode_ordinary(text)))
        write(base + ".kimi.ids", ids_text(k_ids))
        write(base + ".kimi.split", ids_text(n for _, n in pieces))
    write(os.path.join(OUT, "cases.txt"), "".join(n + "\n" for n in cases).encode())

    # The synthetic Kimi tokenizer: o200k ranks + 256 specials.
    n_ranks = o200k.n_vocab  # no specials registered: max rank + 1
    cfg = {"added_tokens_decoder": {
        str(n_ranks + off): {"content": name, "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": special}
        for off, (name, special) in sorted(SPECIALS.items())}}
    os.makedirs(os.path.join(OUT, "kimi-o200k"), exist_ok=True)
    write(os.path.join(OUT, "kimi-o200k", "tokenizer_config.json"),
          (json.dumps(cfg, indent=2, ensure_ascii=False) + "\n").encode())

    special_id = {name: n_ranks + off for off, (name, _) in SPECIALS.items()}
    chats = []
    for name, msgs, gen, think in CHATS:
        chats.append({"name": name, "messages": msgs, "add_generation_prompt": gen,
                      "thinking": think, "ids": chat_ids(kimi, special_id, msgs, gen, think)})
    write(os.path.join(OUT, "chat_cases.json"),
          (json.dumps(chats, ensure_ascii=False) + "\n").encode())

    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"{len(cases)} cases, {len(chats)} chats, {total} bytes in {os.path.relpath(OUT, ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
