#!/usr/bin/env python3
"""Export a tools/train.py checkpoint to the released K3 layout, and verify it.

    python3 tools/train_export.py --ckpt runs/k3mini/ckpt.pt --out models/k3-mini
    python3 tools/train_export.py --ckpt ... --out models/k3-mini --verify [--windows 24]
        [--reference] [--samples]

Layout (k3ckpt.write_checkpoint): nested config.json (model_type kimi_k3, text_config
kimi_linear, 1-based layer lists, index_* fields = DSA, compressed-tensors mxfp4), trunk BF16,
routed experts MXFP4 (weight_packed/weight_scale U8), conv / A_log (zero-padded to head_dim) /
dt_bias / o_norm / e_score_correction_bias F32, `language_model.` prefix, tiktoken.model,
tokenizer_config.json.

--verify: held-out loss of the fp32 training weights vs. the exported weights read back
(BF16-rounded trunk, MXFP4-dequantized experts) with the same PyTorch model.
--reference: logits of tools/reference.py on the exported model vs. this PyTorch model on a
64-token (and a 100-token, exercising the top-k) held-out sequence.
--samples: sample generations (plain text and --chat format) from the exported weights.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3ckpt  # noqa: E402
import train_data  # noqa: E402
from train import encode_corpora, evaluate, load_tokenizer  # noqa: E402
from train_model import K3Model  # noqa: E402

ROOT = train_data.ROOT
_EXP = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.)experts_w([123])$")


def load_ckpt(path):
    ck = torch.load(path, map_location="cpu", weights_only=False)
    model = K3Model(ck["config"]["text_config"])
    model.load_state_dict(ck["model"])
    model.eval()
    return ck, model


def export_tensors(model):
    tc = model.tc
    dk = tc["linear_attn_config"]["head_dim"]
    out = {}
    for n, t in model.state_dict().items():
        a = t.detach().float().numpy()
        m = _EXP.match(n)
        if m:
            for e in range(a.shape[0]):
                out[f"{m.group(1)}experts.{e}.w{m.group(2)}.weight"] = np.ascontiguousarray(a[e])
        elif n.endswith("self_attn.A_log"):
            p = np.zeros(dk, np.float32)
            p[:a.shape[0]] = a
            out[n] = p
        else:
            out[n] = a
    return out


def export(model, cfg, tok_path, out_dir):
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(tok_path)
    order = sorted(ranks, key=ranks.get)
    assert [ranks[b] for b in order] == list(range(len(order)))
    tok = (order, k3ckpt.special_tokens_k3(len(order)))
    sizes = k3ckpt.write_checkpoint(out_dir, cfg, export_tensors(model), tok)
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"exported to {out_dir}: {sizes}, dir total {total/1e6:.2f} MB")
    assert total <= 50e6, "export larger than 50 MB"
    return total


def load_exported(out_dir, tc):
    """A K3Model holding the exported weights as read back (BF16 values, dequantized MXFP4)."""
    st = k3ckpt.read_safetensors(os.path.join(out_dir, "model.safetensors"))
    model = K3Model(tc)
    sd = model.state_dict()
    new = {}
    for n, t in sd.items():
        m = _EXP.match(n)
        if m:
            ws = []
            for e in range(t.shape[0]):
                b = f"language_model.{m.group(1)}experts.{e}.w{m.group(2)}"
                if b + ".weight_packed" in st:
                    ws.append(k3ckpt.mxfp4_dequantize(st[b + ".weight_packed"], st[b + ".weight_scale"]))
                else:
                    ws.append(st[b + ".weight"])
            new[n] = torch.from_numpy(np.stack(ws))
        else:
            a = st["language_model." + n]
            if n.endswith("self_attn.A_log"):
                a = a[:t.shape[0]]
            new[n] = torch.from_numpy(np.array(a, dtype=np.float32)).reshape(t.shape)
    model.load_state_dict(new)
    model.eval()
    return model


@torch.no_grad()
def generate(model, ids, n, eos=None, temp=0.8, top_k=40, seed=0, ctx=256):
    g = torch.Generator().manual_seed(seed)
    ids = list(ids)
    for _ in range(n):
        x = torch.tensor([ids[-ctx:]])
        logits = model(x, sparse=True)[0][0, -1]
        if temp <= 0:
            nxt = int(logits.argmax())
        else:
            v, i = torch.topk(logits / temp, top_k)
            nxt = int(i[torch.multinomial(torch.softmax(v, -1), 1, generator=g)])
        ids.append(nxt)
        if eos is not None and nxt == eos:
            break
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", default=os.path.join(ROOT, "models/k3-mini"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "models/k3-mini/tiktoken.model"))
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--windows", type=int, default=0, help="held-out windows per corpus (0=all)")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--samples", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ck, model = load_ckpt(a.ckpt)
    cfg = ck["config"]
    tc = cfg["text_config"]
    print(f"checkpoint: step {ck.get('step')} tokens {ck.get('tokens')} params {ck['params']}")
    if not a.no_export:
        with open(a.tokenizer, "rb") as f:
            tok_bytes = f.read()
        tmp = tempfile.NamedTemporaryFile(delete=False, suffix=".model")
        tmp.write(tok_bytes)
        tmp.close()
        export(model, cfg, tmp.name, a.out)
        os.unlink(tmp.name)
    enc = load_tokenizer(os.path.join(a.out, "tiktoken.model"))
    ctx = ck["args"]["ctx"]
    if a.verify or a.reference or a.samples:
        qm = load_exported(a.out, tc)
    if a.verify:
        _, _, ho = encode_corpora(enc)
        t = time.time()
        r32 = evaluate(model, ho, ctx, a.windows or None, sparse=True)
        rq = evaluate(qm, ho, ctx, a.windows or None, sparse=True)
        print(f"held-out loss ({'all' if not a.windows else a.windows} windows of {ctx}/corpus, "
              f"sparse DSA) [{time.time()-t:.0f}s]")
        print(f"  {'corpus':10s} {'fp32':>8s} {'export':>8s} {'ppl(exp)':>9s}")
        for k in r32:
            print(f"  {k:10s} {r32[k]:8.4f} {rq[k]:8.4f} {np.exp(rq[k]):9.2f}")
    if a.reference:
        _, _, ho = encode_corpora(enc)
        for n in (64, 100):
            ids = ho["austen"][1000:1000 + n].tolist()
            with tempfile.TemporaryDirectory() as td:
                of = os.path.join(td, "l.f32")
                t = time.time()
                subprocess.run([sys.executable, os.path.join(ROOT, "tools/reference.py"), "-m",
                                a.out, "--ids", ",".join(map(str, ids)), "--out", of,
                                "--dtype", "f32"], check=True)
                ref = np.fromfile(of, dtype="<f4").reshape(n, -1)
            with torch.no_grad():
                mine = qm(torch.tensor([ids]), sparse=True)[0][0].numpy()
            rel = np.linalg.norm(mine - ref) / np.linalg.norm(ref)
            rows = np.linalg.norm(mine - ref, axis=1) / np.linalg.norm(ref, axis=1)
            agree = (mine.argmax(1) == ref.argmax(1)).mean()
            print(f"reference.py vs PyTorch, {n} tokens: rel-L2 {rel:.2e} (worst position "
                  f"{rows.argmax()} {rows.max():.2e}), argmax agreement {agree*100:.1f}% "
                  f"[{time.time()-t:.0f}s]")
    if a.samples:
        sp = {v: k for k, v in k3ckpt.special_tokens_k3(enc.n_vocab).items()}
        inv = {v: k for k, v in sp.items()}

        def dec(ids):
            return "".join(inv[i] if i in inv else enc.decode([i]) for i in ids)
        for p in ["It is a truth universally acknowledged, that",
                  "Call me Ishmael.", "In the beginning",
                  "Mr. Speaker, Mr. Vice President, Members of Congress,"]:
            ids = enc.encode_ordinary(p)
            out = generate(qm, ids, 60, seed=1)
            print(f"--- {p!r}\n{dec(out)}\n")
        import train_chat
        ce = train_chat.ChatEncoder(enc, sp)
        for q in ["Continue this passage:\n\nIt is a truth universally acknowledged, that a "
                  "single man in possession of a good fortune, must be in want of a wife.",
                  "What does Genesis 1:3 say?"]:
            for think in (False, True):
                ids = ce.msg("user", q)
                ids += [sp["<|open|>"]] + ce.t("message") + ce.t(" role") + ce.t('="') + \
                    ce.t("assistant") + ce.t('"') + [sp["<|sep|>"]]
                ids += [sp["<|open|>"]] + ce.t("think" if think else "response") + [sp["<|sep|>"]]
                out = generate(qm, ids, 120, eos=sp["<|end_of_msg|>"], seed=1)
                print(f"--- chat (thinking={think}) {q!r}\n{dec(out[len(ids):])}\n")


if __name__ == "__main__":
    main()
