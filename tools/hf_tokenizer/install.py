#!/usr/bin/env python3
"""Makes a checkpoint's tokenizer loadable by Hugging Face's AutoTokenizer:
copies tokenization_k3.py (beside this file) into DIR and points
DIR/tokenizer_config.json at it (auto_map.AutoTokenizer, tokenizer_class),
leaving every other field as it was. DIR must hold tiktoken.model and
tokenizer_config.json (the layout of the released checkpoints and of every
checkpoint k3's tools write). Running it again changes nothing.

    python3 tools/hf_tokenizer/install.py DIR [DIR...]

then, with transformers and tiktoken installed:

    AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)

No third-party module is needed to install (the standard library only).
"""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "tokenization_k3.py")
MODULE = "tokenization_k3"
CLASS = "K3Tokenizer"


def install(model_dir):
    """Copies the module and sets auto_map / tokenizer_class; returns the
    fields it changed (empty when the directory was already set up)."""
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    for need in ("tiktoken.model", "tokenizer_config.json"):
        if not os.path.isfile(os.path.join(model_dir, need)):
            raise FileNotFoundError(f"{model_dir}: no {need}")
    dst = os.path.join(model_dir, MODULE + ".py")
    if not os.path.isfile(dst) or open(dst, "rb").read() != open(SOURCE, "rb").read():
        shutil.copyfile(SOURCE, dst)
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    changed = []
    auto_map = cfg.get("auto_map")
    if not isinstance(auto_map, dict):
        auto_map = {}
    want = [f"{MODULE}.{CLASS}", None]
    if auto_map.get("AutoTokenizer") != want:
        auto_map["AutoTokenizer"] = want
        changed.append("auto_map")
    if cfg.get("tokenizer_class") != CLASS:
        changed.append("tokenizer_class")
    if changed:
        cfg["auto_map"] = auto_map
        cfg["tokenizer_class"] = CLASS
        tmp = cfg_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, cfg_path)
    return changed


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    for d in argv:
        try:
            changed = install(d)
        except (OSError, ValueError) as e:
            print(f"install.py: {e}", file=sys.stderr)
            return 1
        print(f"{d}: {MODULE}.py{' + ' + ', '.join(changed) if changed else ' (already set)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
