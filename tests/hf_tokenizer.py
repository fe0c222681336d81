#!/usr/bin/env python3
"""hf_tokenizer.py -- the Hugging Face tokenizer every k3 checkpoint ships
(tools/hf_tokenizer/tokenization_k3.py) against k3's own, id for id.

For models/k3-mini and each checkpoint under tests/models/ with a tokenizer:
AutoTokenizer.from_pretrained(dir, trust_remote_code=True) -- with torch
blocked from import, so it is proven to need none -- encodes real text
(data/heldout/) and tricky strings (specials' names as text, long whitespace
runs past the 25,000 slicing limit, a text past the 400,000-code-point chunk,
non-ASCII scripts, emoji, control characters) to the ids `k3 tokenize -m DIR`
prints, and decodes them back to the text `k3 tokenize --decode` writes.

Usage: python tests/hf_tokenizer.py build/k3     (transformers + tiktoken;
`make test-hf-tokenizer`). Ends with `hf-tokenizer: N passed, N failed`.
"""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile


# `import torch` fails and find_spec("torch") says none, even where torch is
# installed: what transformers sees on a machine without it
sys.modules["torch"] = None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
# nothing from the network, nothing written under ~
HF_HOME = tempfile.mkdtemp(prefix="k3-hf-")
atexit.register(shutil.rmtree, HF_HOME, True)
os.environ.update(HF_HOME=HF_HOME, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                  TRANSFORMERS_VERBOSITY="error")

import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

K3 = sys.argv[1] if len(sys.argv) > 1 else "build/k3"
DIRS = ["models/k3-mini"] + sorted(
    os.path.join("tests/models", d) for d in os.listdir("tests/models")
    if os.path.isfile(os.path.join("tests/models", d, "tiktoken.model")))


def o200k_dir():
    """A tokenizer of the released size: o200k's 199,998 ranks with K3's
    specials after them (tests/golden/tokenizer/kimi-o200k), set up by
    tools/hf_tokenizer/install.py as a released checkpoint would be."""
    d = os.path.join(HF_HOME, "kimi-o200k")
    os.makedirs(d)
    shutil.copy("data/tokenizers/o200k_base.tiktoken", os.path.join(d, "tiktoken.model"))
    shutil.copy("tests/golden/tokenizer/kimi-o200k/tokenizer_config.json", d)
    sys.path.insert(0, "tools/hf_tokenizer")
    import install
    install.install(d)
    return d

passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok   hf-tokenizer: {name}")
    else:
        failed += 1
        print(f"FAIL hf-tokenizer: {name}")
        if detail:
            print("    " + str(detail)[:600].replace("\n", "\n    "))


def k3_encode(d, text):
    r = subprocess.run([K3, "tokenize", "-m", d], input=text.encode("utf-8"), capture_output=True, timeout=300)
    if r.returncode:
        raise RuntimeError(r.stderr.decode(errors="replace"))
    return [int(x) for x in r.stdout.split()]


def k3_decode(d, ids):
    r = subprocess.run([K3, "tokenize", "-m", d, "--decode"], input=" ".join(map(str, ids)).encode(),
                       capture_output=True, timeout=300)
    if r.returncode:
        raise RuntimeError(r.stderr.decode(errors="replace"))
    return r.stdout


def texts(specials):
    real = {}
    for f in sorted(os.listdir("data/heldout")):
        with open(os.path.join("data/heldout", f), encoding="utf-8") as fh:
            real[f] = fh.read()
    tricky = {
        "specials as text": " ".join(specials) + "[BOS]hello<|end_of_msg|>\n" + "".join(specials[:8]),
        "reserved names as text": "<|reserved_token_800|><|reserved_token_99999|> <|im_end|>",
        "whitespace": " \t\n\r\n  \u00a0\u2003\u3000x  \n\n\n   y\x0b\x0c\x1c\x85end   ",
        "spaces past the run limit": "a" + " " * 30001 + "b" + "\u3000" * 26000 + "c",
        "newlines past the run limit": "x" * 25001 + "\n" * 30000 + "y\r\n" * 9000,
        "a text past one chunk": ("ab " * 150000) + "z" * 70000 + "\u65e5\u672c\u8a9e" * 9000,
        "non-ASCII": "h\u00e9llo w\u00f6rld, na\u00efve caf\u00e9 \u0645\u0631\u062d\u0628\u0627 \u043f\u0440\u0438\u0432\u0435\u0442 "
                     "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4 e\u0301 \u0915\u094d\u0937 \u00df\u1e9e",
        "emoji": "\U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7"
                 " \u2764\ufe0f x\U0001f389y \U0001f9d1\U0001f3ff\u200d\U0001f4bb",
        "digits and punctuation": "3.14159265 1,000,000 -42 ++-- ... !!! ??? \"quoted\" 'it's' I'LL WE'VE",
        "control characters": "a\x00b\x01c\x07\x1b[0m\x7f",
        "empty": "",
        "code": "def f(x):\n    return {'a': [1, 2], \"b\": x ** 2}  # comment\n\tif x:\n\t\tpass\n",
    }
    return real, tricky


def main():
    DIRS.append(o200k_dir())
    print(f"    transformers {transformers.__version__}, checkpoints: {', '.join(DIRS)}")
    for d in DIRS:
        cfg = json.load(open(os.path.join(d, "tokenizer_config.json"), encoding="utf-8"))
        check(f"{d}: tokenizer_config.json names tokenization_k3",
              cfg.get("auto_map", {}).get("AutoTokenizer", [None])[0] == "tokenization_k3.K3Tokenizer"
              and os.path.isfile(os.path.join(d, "tokenization_k3.py")), cfg.get("auto_map"))
        try:
            tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
        except Exception as e:  # noqa: BLE001
            check(f"{d}: AutoTokenizer loads", False, repr(e))
            continue
        n_vocab = tok.n_ranks + 256
        vocab = None
        if os.path.isfile(os.path.join(d, "config.json")):
            mc = json.load(open(os.path.join(d, "config.json")))
            vocab = mc.get("vocab_size", mc.get("text_config", {}).get("vocab_size"))
        check(f"{d}: AutoTokenizer loads ({type(tok).__name__}, {len(tok)} ids, torch not imported)",
              type(tok).__name__ == "K3Tokenizer" and len(tok) == n_vocab and sys.modules.get("torch") is None
              and (vocab is None or vocab >= n_vocab), (len(tok), vocab))
        names = [t.content for i, t in sorted(tok.added_tokens_decoder.items())]
        named = [s for s in names if not s.startswith("<|reserved_token_")]
        real, tricky = texts(named)
        bad = []
        for name, text in list(real.items()) + list(tricky.items()):
            want = k3_encode(d, text)
            got = tok.encode(text, add_special_tokens=False)
            if got != want:
                i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                bad.append(f"{name}: {len(got)} vs k3 {len(want)} ids, first difference at {i}: "
                           f"{got[i:i + 5]} vs {want[i:i + 5]}")
                continue
            if tok(text)["input_ids"] != want:
                bad.append(f"{name}: tok(text) differs from encode (special tokens added?)")
            back = tok.decode(got)
            if back != text or k3_decode(d, want) != text.encode("utf-8"):
                bad.append(f"{name}: decode does not give the text back")
        n = len(real) + len(tricky)
        check(f"{d}: {n - len(bad)}/{n} texts encode and decode id for id as k3 "
              f"({sum(len(t) for t in real.values())} chars of data/heldout)", not bad, "\n".join(bad))
        # the specials: ids decode to their names (as k3 --decode writes
        # them), skip_special_tokens drops those marked special, and with
        # split_special_tokens=False a name in the text reads as its id
        ids = list(range(tok.n_ranks, n_vocab))
        check(f"{d}: the 256 special ids decode to their names as k3",
              tok.decode(ids).encode("utf-8") == k3_decode(d, ids) and tok.decode(ids) == "".join(names))
        eos = tok.convert_tokens_to_ids("[EOS]")
        hello = tok.encode("hello", add_special_tokens=False)
        check(f"{d}: skip_special_tokens drops [BOS]/[EOS]",
              tok.decode([tok.bos_token_id] + hello + [eos], skip_special_tokens=True) == "hello")
        check(f"{d}: split_special_tokens=False reads named specials",
              tok.encode("[BOS]hello<|end_of_msg|>", add_special_tokens=False, split_special_tokens=False)
              == [tok.bos_token_id] + hello + [tok.convert_tokens_to_ids("<|end_of_msg|>")])
        # save_pretrained into a new directory loads again the same
        with tempfile.TemporaryDirectory() as out:
            tok.save_pretrained(out)  # writes tokenization_k3.py and auto_map itself
            again = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
            t = tricky["non-ASCII"] + tricky["specials as text"]
            check(f"{d}: save_pretrained + from_pretrained round trip",
                  again.encode(t, add_special_tokens=False) == tok.encode(t, add_special_tokens=False)
                  and len(again) == len(tok))
    check("torch was never imported", sys.modules.get("torch") is None)
    print(f"hf-tokenizer: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
