"""Shared by the tools/official_*.py generators: Moonshot's own K3 code, as
the PyPI wheel llmcompressor==0.14.0.1 ships it under
llmcompressor/modeling/kimi_k3/, imported as a package of its own ("kimi_k3")
so that llmcompressor's __init__ (and its loguru dependency) stays out.

    from official_common import kimi_k3, official_tokenizer
"""
import importlib
import json
import os
import sys
import types

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
KIMI_DIR = os.path.join(
    ROOT, ".venv/lib/python3.11/site-packages/llmcompressor/modeling/kimi_k3")


def kimi_k3(module):
    """Imports kimi_k3.<module> from the wheel's folder."""
    if "kimi_k3" not in sys.modules:
        if not os.path.isdir(KIMI_DIR):
            sys.exit(f"{KIMI_DIR} is missing: pip install llmcompressor==0.14.0.1 --no-deps")
        pkg = types.ModuleType("kimi_k3")
        pkg.__path__ = [KIMI_DIR]
        sys.modules["kimi_k3"] = pkg
    return importlib.import_module("kimi_k3." + module)


def official_tokenizer(model_dir):
    """The official TikTokenTokenizer over model_dir's tiktoken.model, with
    the specials of its tokenizer_config.json, as AutoTokenizer would build
    it from a K3 checkpoint."""
    from tokenizers import AddedToken

    tk = kimi_k3("tokenization_kimi")
    cfg = json.load(open(os.path.join(model_dir, "tokenizer_config.json")))
    added = {int(k): AddedToken(v["content"], special=v.get("special", True))
             for k, v in cfg["added_tokens_decoder"].items()}
    return tk.TikTokenTokenizer(
        os.path.join(model_dir, "tiktoken.model"),
        bos_token=cfg.get("bos_token", "[BOS]"), eos_token=cfg.get("eos_token", "[EOS]"),
        unk_token=cfg.get("unk_token"), pad_token=cfg.get("pad_token"),
        additional_special_tokens=cfg.get("additional_special_tokens"),
        added_tokens_decoder=added)
