#!/usr/bin/env python3
"""Deterministic random Kimi K3 checkpoints in the released layout (docs/model.md §§2, 4, 6.1).

  python3 tools/make_checkpoint.py --preset tiny|tiny-dsa|bench|bench-dsa --out DIR [--seed N]

Every tensor is drawn from its own generator seeded by (seed, crc32(name)), so the output does
not depend on generation order and tensors are produced one at a time (bench stays memory-sane).
The tokenizer is a prefix of o200k_base's ranks (a rank prefix of a byte-level BPE is itself a
valid BPE: 256 single bytes first, then merges) followed by K3's 256 special ids.
"""

import argparse
import os
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3ckpt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
O200K = os.path.join(ROOT, "data", "tokenizers", "o200k_base.tiktoken")


def load_ranks(path, n):
    import base64
    ranks = []
    with open(path) as f:
        for line in f:
            if len(ranks) == n:
                break
            b64, r = line.split()
            if int(r) != len(ranks):
                raise SystemExit("%s: ranks not contiguous at %s" % (path, r))
            ranks.append(base64.b64decode(b64))
    if len(ranks) != n or any(len(b) != 1 for b in ranks[:256]):
        raise SystemExit("%s: need %d ranks, the first 256 single bytes" % (path, n))
    return ranks


def kda_mla_lists(n_layers, every=4):
    full = [i + 1 for i in range(n_layers) if i % every == every - 1 or i == n_layers - 1]
    kda = [i + 1 for i in range(n_layers) if (i + 1) not in full]
    return kda, full


def preset_config(preset):
    if preset.startswith("tiny"):
        n_ranks = 768
        cfg = k3ckpt.make_config(n_ranks)           # spec 6.1 values
        if preset == "tiny-dsa":
            cfg["text_config"].update(index_n_heads=2, index_head_dim=32, index_topk=8)
        return cfg, n_ranks
    if preset.startswith("bench"):
        n_ranks = 32512
        L = 16
        kda, full = kda_mla_lists(L)
        cfg = k3ckpt.make_config(
            n_ranks, hidden_size=2048, num_hidden_layers=L,
            num_attention_heads=16, num_key_value_heads=16,
            q_lora_rank=768, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            linear_attn_config={"num_heads": 16, "head_dim": 128, "short_conv_kernel_size": 4,
                                "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                                "kda_layers": kda, "full_attn_layers": full},
            attn_res_block_size=4, intermediate_size=5632,
            num_experts=64, num_experts_per_token=8, num_shared_experts=2,
            moe_intermediate_size=384, routed_expert_hidden_size=1024,
            max_position_embeddings=262144)
        if preset == "bench-dsa":
            cfg["text_config"].update(index_n_heads=16, index_head_dim=128, index_topk=2048)
        return cfg, n_ranks
    raise SystemExit("unknown preset " + preset)


class Gen:
    def __init__(self, seed):
        self.seed = seed

    def rng(self, name):
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def normal(self, name, shape, std, mean=0.0):
        def f():
            a = self.rng(name).standard_normal(shape, dtype=np.float32)
            a *= np.float32(std)
            if mean:
                a += np.float32(mean)
            return a
        return k3ckpt.lazy(shape, f)

    def uniform(self, name, shape, lo, hi):
        return k3ckpt.lazy(shape, lambda: self.rng(name).uniform(lo, hi, shape).astype(np.float32))

    def fixed(self, shape, fn):
        return k3ckpt.lazy(shape, fn)


def build_tensors(cfg, gen, fast_experts):
    tc = cfg["text_config"]
    D = tc["hidden_size"]
    V = tc["vocab_size"]
    la = tc["linear_attn_config"]
    Hk, dk, K = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    Hm = tc["num_attention_heads"]
    ql, kvl = tc["q_lora_rank"], tc["kv_lora_rank"]
    dn, dr, dv = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    E, mi, lat = tc["num_experts"], tc["moe_intermediate_size"], tc["routed_expert_hidden_size"]
    ns = tc["num_shared_experts"]
    full = set(la["full_attn_layers"])
    dsa = "index_n_heads" in tc
    sD = 1.0 / np.sqrt(D)           # std that maps a unit-rms vector to a unit-rms output
    T = {}

    def lin(name, out_f, in_f, gain=1.0):
        # gain * N(0, 1/in): output rms ~ gain for unit-rms input; for D=256 and gain 0.32
        # this is the spec's N(0, 0.02).
        T[name] = gen.normal(name, (out_f, in_f), gain / np.sqrt(in_f))

    def norm(name, n):
        T[name] = gen.normal(name, (n,), 0.1, mean=1.0)

    def res(prefix):
        norm(prefix + "_norm.weight", D)
        # res_proj: score_e = sum_d w[d] * v_e[d]/rms(v_e); std 1.5/sqrt(D) gives score spreads of
        # a few units at any D, so the AttnRes softmax is neither uniform nor one-hot.
        T[prefix + "_proj.weight"] = gen.normal(prefix + "_proj.weight", (1, D), 1.5 * sD)

    m = "model."
    T[m + "embed_tokens.weight"] = gen.normal(m + "embed_tokens.weight", (V, D), 1.0)
    norm(m + "norm.weight", D)
    res(m + "output_attn_res")
    lin("lm_head.weight", V, D, 1.0)

    for i in range(tc["num_hidden_layers"]):
        p = "model.layers.%d." % i
        norm(p + "input_layernorm.weight", D)
        norm(p + "post_attention_layernorm.weight", D)
        res(p + "self_attention_res")
        res(p + "mlp_res")
        a = p + "self_attn."
        if (i + 1) in full:
            lin(a + "q_a_proj.weight", ql, D)
            norm(a + "q_a_layernorm.weight", ql)
            # q and k each ~1.3 rms per element -> scores with std ~1.7 after 1/sqrt(dn+dr)
            lin(a + "q_b_proj.weight", Hm * (dn + dr), ql, 1.3)
            lin(a + "kv_a_proj_with_mqa.weight", kvl + dr, D, 1.3)
            norm(a + "kv_a_layernorm.weight", kvl)
            # per head rows [W_UK (dn) | W_UV (dv)]; k_nope ~1.3 rms, v ~1 rms
            lin(a + "kv_b_proj.weight", Hm * (dn + dv), kvl, 1.3)
            lin(a + "g_proj.weight", Hm * dv, D, 1.0)
            lin(a + "o_proj.weight", D, Hm * dv, 1.0)
            if dsa:
                HI, dI = tc["index_n_heads"], tc["index_head_dim"]
                ix = a + "indexer."
                lin(ix + "wq_b.weight", HI * dI, ql, 1.0)
                lin(ix + "wk.weight", dI, D, 1.0)
                T[ix + "k_norm.weight"] = gen.normal(ix + "k_norm.weight", (dI,), 0.3, mean=1.0)
                T[ix + "k_norm.bias"] = gen.normal(ix + "k_norm.bias", (dI,), 0.3)
                lin(ix + "weights_proj.weight", HI, D, 3.0)
        else:
            di = Hk * dk
            for nm in "qkv":
                lin(a + nm + "_proj.weight", di, D)
                T[a + nm + "_conv1d.weight"] = gen.normal(a + nm + "_conv1d.weight", (di, 1, K), 0.5)
            lin(a + "g_proj.weight", di, D, 1.0)
            lin(a + "o_proj.weight", D, di, 1.0)
            lin(a + "f_a_proj.weight", dk, D)
            lin(a + "f_b_proj.weight", di, dk)
            lin(a + "b_proj.weight", Hk, D, 1.0)
            na = max(dk, Hk)

            def alog(name=a + "A_log", n=na):
                v = np.zeros(n, np.float32)
                v[:Hk] = np.log(gen.rng(name).uniform(1.0, 16.0, Hk))
                return v
            T[a + "A_log"] = gen.fixed((na,), alog)
            T[a + "dt_bias"] = gen.normal(a + "dt_bias", (di,), 0.1)
            norm(a + "o_norm.weight", dk)
        moe = i >= tc["first_k_dense_replace"] and i % tc["moe_layer_freq"] == 0
        if not moe:
            I = tc["intermediate_size"]
            lin(p + "mlp.gate_proj.weight", I, D, 1.0)
            lin(p + "mlp.up_proj.weight", I, D, 1.0)
            lin(p + "mlp.down_proj.weight", D, I, 1.0)
            continue
        b = p + "block_sparse_moe."
        lin(b + "gate.weight", E, D, 1.0)
        T[b + "gate.e_score_correction_bias"] = gen.uniform(b + "gate.e_score_correction_bias", (E,), -0.1, 0.1)
        lin(b + "routed_expert_down_proj.weight", lat, D, 1.0)
        norm(b + "routed_expert_norm.weight", lat)
        lin(b + "routed_expert_up_proj.weight", D, lat, 1.0)
        sh = ns * mi
        lin(b + "shared_experts.gate_proj.weight", sh, D, 1.0)
        lin(b + "shared_experts.up_proj.weight", sh, D, 1.0)
        lin(b + "shared_experts.down_proj.weight", D, sh, 1.0)
        for e in range(E):
            for w, (r, c) in (("w1", (mi, lat)), ("w3", (mi, lat)), ("w2", (lat, mi))):
                nm = b + "experts.%d.%s.weight" % (e, w)
                if fast_experts:
                    # bench: random codes and scales straight away (quantizing 1.5e9 floats is slow)
                    def pk(nm=nm, r=r, c=c):
                        return gen.rng(nm + "_packed").integers(0, 256, (r, c // 2), dtype=np.uint8)

                    def sc(nm=nm, r=r, c=c):
                        # |e2m1| averages ~2.6; 2^(s-127) ~ 1/(2.6 sqrt(c)) keeps unit-rms outputs
                        s0 = 127 - int(round(np.log2(2.6 * np.sqrt(c))))
                        return (s0 + gen.rng(nm + "_scale").integers(-1, 2, (r, c // 32))).astype(np.uint8)
                    T[nm[:-len(".weight")] + ".weight_packed"] = k3ckpt.lazy((r, c // 2), pk, np.uint8)
                    T[nm[:-len(".weight")] + ".weight_scale"] = k3ckpt.lazy((r, c // 32), sc, np.uint8)
                else:
                    def ew(nm=nm, r=r, c=c):
                        g = gen.rng(nm)
                        a_ = g.standard_normal((r, c), dtype=np.float32) / np.float32(np.sqrt(c))
                        row = np.exp(g.normal(0.0, 0.5, (r, 1))).astype(np.float32)
                        blk = np.exp(g.normal(0.0, 0.7, (r, c // 32))).astype(np.float32)
                        return a_ * row * np.repeat(blk, 32, axis=1)
                    T[nm] = k3ckpt.lazy((r, c), ew)
    return T


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=["tiny", "tiny-dsa", "bench", "bench-dsa"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=O200K, help="tiktoken rank file to take the rank prefix from")
    ap.add_argument("--shard-mb", type=float, default=None,
                    help="shard size in MB (default: single file for tiny, 1024 MB for bench)")
    ap.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    args = ap.parse_args()
    if not os.path.isfile(args.tokenizer):
        sys.exit("make_checkpoint.py: the rank file %s is missing; it is committed in the repository "
                 "as data/tokenizers/o200k_base.tiktoken (restore it with `git checkout -- data/tokenizers`) "
                 "or give another with --tokenizer FILE" % args.tokenizer)
    t0 = time.time()
    cfg, n_ranks = preset_config(args.preset)
    bench = args.preset.startswith("bench")
    ranks = load_ranks(args.tokenizer, n_ranks)
    tensors = build_tensors(cfg, Gen(args.seed), fast_experts=bench)
    shard = args.shard_mb * 1e6 if args.shard_mb else (1024e6 if bench else None)
    last = [0.0]

    def progress(done, total):
        # one line on stderr, redrawn in place on a terminal, every 2 s elsewhere
        now = time.time()
        tty = sys.stderr.isatty()
        if done < total and now - last[0] < (0.2 if tty else 2.0):
            return
        last[0] = now
        el = now - t0
        left = el * (total - done) / done if done else 0.0
        msg = "%s: %.0f/%.0f MB written, %.0f s, about %.0f s left" % (
            args.out, done / 1e6, total / 1e6, el, left)
        sys.stderr.write(("\r" + msg + "\x1b[K") if tty else (msg + "\n"))
        if tty and done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    sizes = k3ckpt.write_checkpoint(args.out, cfg, tensors, (ranks, k3ckpt.special_tokens_k3(n_ranks)),
                                    shard_bytes=shard and int(shard),
                                    progress=None if args.quiet else progress)
    total = sum(sizes.values())
    print("%s: %d tensors, %s, %.1f MB in %d file(s), %.1fs" % (
        args.out, len(tensors), args.preset, total / 1e6, len(sizes), time.time() - t0))


if __name__ == "__main__":
    main()
