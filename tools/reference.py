#!/usr/bin/env python3
"""Plain PyTorch reference forward for Kimi K3 (and the kimi_linear family), written straight
from docs/model.md section 3. Token-at-a-time, no shortcuts, CPU.

  python3 tools/reference.py -m DIR --ids 1,2,3 --out logits.f32 [--dtype f64|f32]

Writes the logits of every position as little-endian float32 [n, vocab].
Independent of k3ckpt.py: weights are read with the `safetensors` package and MXFP4 is
dequantized here from the spec.
"""

import argparse
import json
import math
import os
import sys

import torch
from safetensors import safe_open


# --------------------------------------------------------------------------- weights

class Weights:
    def __init__(self, model_dir, dtype):
        self.dtype = dtype
        idx = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(idx):
            with open(idx) as f:
                wm = json.load(f)["weight_map"]
            files = sorted(set(wm.values()))
        else:
            files = ["model.safetensors"]
        self.where = {}
        self.handles = []
        for fn in files:
            h = safe_open(os.path.join(model_dir, fn), framework="pt")
            self.handles.append(h)
            for k in h.keys():
                self.where[k] = h
        self.cache = {}

    def has(self, name):
        return ("language_model." + name) in self.where or name in self.where

    def raw(self, name):
        for n in ("language_model." + name, name):
            if n in self.where:
                return self.where[n].get_tensor(n)
        raise KeyError(name)

    def __call__(self, name):
        if name not in self.cache:
            self.cache[name] = self.raw(name).to(self.dtype)
        return self.cache[name]

    def expert(self, name):
        """Routed expert matrix `name` (without .weight): MXFP4 packed+scale, or plain .weight."""
        if name in self.cache:
            return self.cache[name]
        if self.has(name + ".weight_packed"):
            w = mxfp4_to_float(self.raw(name + ".weight_packed"), self.raw(name + ".weight_scale"))
        else:
            w = self.raw(name + ".weight")
        self.cache[name] = w.to(self.dtype)
        return self.cache[name]


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def mxfp4_to_float(packed, scale):
    """compressed-tensors mxfp4-pack-quantized -> float64 [rows, cols] (spec section 4)."""
    packed = packed.to(torch.int64)
    scale = scale.to(torch.int64)
    rows, half = packed.shape
    cols = 2 * half
    assert scale.shape == (rows, cols // 32), (scale.shape, packed.shape)
    if (scale == 255).any():
        raise ValueError("MXFP4 scale 255 (NaN)")
    lo = packed & 0xF          # column 2j
    hi = (packed >> 4) & 0xF   # column 2j+1
    nib = torch.stack([lo, hi], dim=2).reshape(rows, cols)
    mag = torch.tensor(E2M1, dtype=torch.float64)[nib & 7]
    val = torch.where((nib & 8) != 0, -mag, mag)
    mult = torch.pow(torch.tensor(2.0, dtype=torch.float64), (scale - 127).to(torch.float64))
    return val * mult.repeat_interleave(32, dim=1)


# --------------------------------------------------------------------------- primitives

def rms(x, w, eps):
    return w * (x / torch.sqrt(torch.mean(x * x) + eps))


def sigmoid(x):
    return torch.sigmoid(x)


def silu(x):
    return x * torch.sigmoid(x)


def softplus(x):
    return torch.nn.functional.softplus(x)


def softmax(x):
    x = x - x.max()
    e = torch.exp(x)
    return e / e.sum()


# --------------------------------------------------------------------------- model

class Ref:
    def __init__(self, model_dir, dtype=torch.float64):
        with open(os.path.join(model_dir, "config.json")) as f:
            root = json.load(f)
        c = root.get("text_config", root)
        self.c = c
        self.W = Weights(model_dir, dtype)
        self.dtype = dtype
        self.D = c["hidden_size"]
        self.V = c["vocab_size"]
        self.L = c["num_hidden_layers"]
        self.eps = c.get("rms_norm_eps", 1e-5)
        la = c.get("linear_attn_config") or {}
        self.la = la
        full = la.get("full_attn_layers")
        kda = la.get("kda_layers")
        self.kind = []
        for i in range(self.L):
            if full is not None and (i + 1) in full:
                self.kind.append("mla")
            elif kda is not None and (i + 1) in kda:
                self.kind.append("kda")
            elif full is None and kda is None:
                self.kind.append("mla")
            else:
                raise ValueError("layer %d is in neither kda_layers nor full_attn_layers" % i)
        if c.get("mla_use_nope") is False:
            raise NotImplementedError("RoPE MLA (mla_use_nope=false) is not supported")
        self.attn_res = c.get("attn_res_block_size") is not None
        self.dsa = all(k in c for k in ("index_n_heads", "index_head_dim", "index_topk"))
        idx_layers = c.get("index_layers")
        self.dsa_layer = [self.kind[i] == "mla" and self.dsa and
                          (idx_layers is None or (i + 1) in idx_layers) for i in range(self.L)]
        act = c.get("hidden_act", "silu")
        if act == "situ":
            b1 = c.get("activation_situ_beta") or 1.0  # official _get_situ_activation_params
            b2 = c.get("activation_situ_linear_beta")

            def glu(g, u):
                left = b1 * torch.tanh(g / b1) * torch.sigmoid(g)
                right = u if b2 is None else b2 * torch.tanh(u / b2)
                return left * right
        elif act in ("silu", "swiglu"):
            def glu(g, u):
                return silu(g) * u
        else:
            raise NotImplementedError("hidden_act " + act)
        self.glu = glu

    # ---------------------------------------------------------------- AttnRes mix
    def mix(self, P, B, prefix):
        w = self.W(prefix + "_norm.weight") * self.W(prefix + "_proj.weight")[0]
        Vs = list(B) + [P]
        scores = torch.stack([torch.sum(v / torch.sqrt(torch.mean(v * v) + self.eps) * w) for v in Vs])
        a = softmax(scores)
        out = torch.zeros_like(P)
        for ae, v in zip(a, Vs):
            out = out + ae * v
        return out

    # ---------------------------------------------------------------- KDA
    def kda(self, i, x, st):
        W, la = self.W, self.la
        p = "model.layers.%d.self_attn." % i
        H, d = la["num_heads"], la["head_dim"]
        K = la.get("short_conv_kernel_size", 4)
        outs = {}
        for nm in "qkv":
            xhat = W(p + nm + "_proj.weight") @ x
            win = st.setdefault("conv_" + nm, [torch.zeros_like(xhat) for _ in range(K - 1)])
            cw = W(p + nm + "_conv1d.weight")          # [C, 1, K]
            acc = torch.zeros_like(xhat)
            taps = win + [xhat]                        # taps[j] = input at t-(K-1)+j
            for j in range(K):
                acc = acc + cw[:, 0, j] * taps[j]
            outs[nm] = silu(acc)
            st["conv_" + nm] = taps[1:]
        z = W(p + "f_b_proj.weight") @ (W(p + "f_a_proj.weight") @ x)
        z = z + W(p + "dt_bias")
        A_log = W(p + "A_log").reshape(-1)
        beta = sigmoid(W(p + "b_proj.weight") @ x)
        if la.get("use_full_rank_gate", True) and self.W.has(p + "g_proj.weight"):
            og = W(p + "g_proj.weight") @ x
        else:
            og = W(p + "g_b_proj.weight") @ (W(p + "g_a_proj.weight") @ x)
        lb = la.get("gate_lower_bound")
        onw = W(p + "o_norm.weight")
        if "S" not in st:
            st["S"] = [torch.zeros(d, d, dtype=self.dtype) for _ in range(H)]
        ys = []
        for h in range(H):
            sl = slice(h * d, (h + 1) * d)
            q = outs["q"][sl]
            k = outs["k"][sl]
            v = outs["v"][sl]
            q = q / torch.sqrt(torch.sum(q * q) + 1e-6) * (d ** -0.5)
            k = k / torch.sqrt(torch.sum(k * k) + 1e-6)
            zh = z[sl]
            if lb is not None:
                g = lb * sigmoid(torch.exp(A_log[h]) * zh)
            else:
                g = -torch.exp(A_log[h]) * softplus(zh)
            S = st["S"][h]                              # S[k][v]
            S = torch.exp(g)[:, None] * S
            u = beta[h] * (v - S.t() @ k)
            S = S + torch.outer(k, u)
            o = S.t() @ q
            st["S"][h] = S
            ys.append(rms(o, onw, self.eps) * sigmoid(og[sl]))
        return W(p + "o_proj.weight") @ torch.cat(ys)

    # ---------------------------------------------------------------- MLA (+ DSA)
    def mla(self, i, x, st, t):
        W, c = self.W, self.c
        p = "model.layers.%d.self_attn." % i
        H = c["num_attention_heads"]
        dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        kvl = c["kv_lora_rank"]
        if c.get("q_lora_rank"):
            cq = rms(W(p + "q_a_proj.weight") @ x, W(p + "q_a_layernorm.weight"), 1e-6)
            q = W(p + "q_b_proj.weight") @ cq
        else:
            cq = None
            q = W(p + "q_proj.weight") @ x
        ckv = W(p + "kv_a_proj_with_mqa.weight") @ x
        cl = rms(ckv[:kvl], W(p + "kv_a_layernorm.weight"), 1e-6)
        kpe = ckv[kvl:kvl + dr]
        st.setdefault("c", []).append(cl)
        st.setdefault("kpe", []).append(kpe)
        n = len(st["c"])
        assert n == t + 1
        allowed = list(range(n))
        if self.dsa_layer[i]:
            allowed = self.indexer(i, x, cq, st, t)
        kvb = W(p + "kv_b_proj.weight")
        gate = sigmoid(W(p + "g_proj.weight") @ x) if c.get("mla_use_output_gate", False) else None
        outs = []
        for h in range(H):
            qh = q[h * (dn + dr):(h + 1) * (dn + dr)]
            Wuk = kvb[h * (dn + dv):h * (dn + dv) + dn]
            Wuv = kvb[h * (dn + dv) + dn:(h + 1) * (dn + dv)]
            scores = []
            vals = []
            for s in allowed:
                kh = torch.cat([Wuk @ st["c"][s], st["kpe"][s]])
                scores.append(torch.dot(qh, kh) / math.sqrt(dn + dr))
                vals.append(Wuv @ st["c"][s])
            pr = softmax(torch.stack(scores))
            o = torch.zeros(dv, dtype=self.dtype)
            for ps, vs in zip(pr, vals):
                o = o + ps * vs
            if gate is not None:
                o = o * gate[h * dv:(h + 1) * dv]
            outs.append(o)
        return W(p + "o_proj.weight") @ torch.cat(outs)

    def indexer(self, i, x, cq, st, t):
        W, c = self.W, self.c
        ix = "model.layers.%d.self_attn.indexer." % i
        HI, dI, topk = c["index_n_heads"], c["index_head_dim"], c["index_topk"]
        if cq is None:
            raise NotImplementedError("DSA indexer needs q_lora_rank")
        qI = (W(ix + "wq_b.weight") @ cq).reshape(HI, dI)
        kraw = W(ix + "wk.weight") @ x
        mu = kraw.mean()
        var = ((kraw - mu) ** 2).mean()
        kI = (kraw - mu) / torch.sqrt(var + 1e-6) * W(ix + "k_norm.weight") + W(ix + "k_norm.bias")
        st.setdefault("kI", []).append(kI)
        wts = (W(ix + "weights_proj.weight") @ x) * (HI ** -0.5) * (dI ** -0.5)
        scores = []
        for s in range(t + 1):
            tot = torch.zeros((), dtype=self.dtype)
            for h in range(HI):
                tot = tot + wts[h] * torch.relu(torch.dot(qI[h], st["kI"][s]))
            scores.append(float(tot))
        m = min(topk, t + 1)
        order = sorted(range(t + 1), key=lambda s: (-scores[s], s))
        sel = sorted(order[:m])
        st.setdefault("sel", []).append(sel)          # kept for diagnostics
        st.setdefault("iscore", []).append(scores)
        return sel

    # ---------------------------------------------------------------- FFN
    def ffn(self, i, x):
        W, c = self.W, self.c
        p = "model.layers.%d." % i
        E = c.get("num_experts")
        moe = (E is not None and i >= c.get("first_k_dense_replace", 0)
               and i % c.get("moe_layer_freq", 1) == 0)
        if not moe:
            return W(p + "mlp.down_proj.weight") @ self.glu(W(p + "mlp.gate_proj.weight") @ x,
                                                            W(p + "mlp.up_proj.weight") @ x)
        b = p + "block_sparse_moe."
        k = c["num_experts_per_token"]
        logits = W(b + "gate.weight") @ x
        fn = c.get("moe_router_activation_func", "sigmoid")
        s = sigmoid(logits) if fn == "sigmoid" else softmax(logits)
        biased = s + W(b + "gate.e_score_correction_bias") if self.W.has(b + "gate.e_score_correction_bias") else s
        ng, tg = c.get("num_expert_group", 1) or 1, c.get("topk_group", 1) or 1
        cand = list(range(E))
        if ng > tg:
            gs = E // ng
            gscore = []
            for g in range(ng):
                vals = sorted((float(biased[e]) for e in range(g * gs, (g + 1) * gs)), reverse=True)
                gscore.append(sum(vals[:2]))
            keep = sorted(range(ng), key=lambda g: (-gscore[g], g))[:tg]
            cand = [e for e in range(E) if e // gs in keep]
        sel = sorted(cand, key=lambda e: (-float(biased[e]), e))[:k]
        w = torch.stack([s[e] for e in sel])
        if c.get("moe_renormalize", True) and k > 1:  # official KimiMoEGate
            w = w / (w.sum() + 1e-20)
        w = w * c.get("routed_scaling_factor", 1.0)
        latent = c.get("routed_expert_hidden_size") is not None and self.W.has(b + "routed_expert_down_proj.weight")
        z = W(b + "routed_expert_down_proj.weight") @ x if latent else x
        y = torch.zeros_like(z)
        for wk, e in zip(w, sel):
            ep = b + "experts.%d." % e
            ye = self.W.expert(ep + "w2") @ self.glu(self.W.expert(ep + "w1") @ z, self.W.expert(ep + "w3") @ z)
            y = y + wk * ye
        if latent:
            if c.get("latent_moe_use_norm", True):
                y = rms(y, W(b + "routed_expert_norm.weight"), self.eps)
            y = W(b + "routed_expert_up_proj.weight") @ y
        if c.get("num_shared_experts"):
            sp = b + "shared_experts."
            y = y + W(sp + "down_proj.weight") @ self.glu(W(sp + "gate_proj.weight") @ x, W(sp + "up_proj.weight") @ x)
        self.last_route = sel
        return y

    # ---------------------------------------------------------------- whole model
    def forward(self, ids):
        W = self.W
        states = [dict() for _ in range(self.L)]
        emb = W("model.embed_tokens.weight")
        tied = self.c.get("tie_word_embeddings", False) or not W.has("lm_head.weight")
        head = emb if tied else W("lm_head.weight")
        out = torch.zeros(len(ids), self.V, dtype=torch.float32)
        bs = self.c.get("attn_res_block_size")
        for t, tok in enumerate(ids):
            if not 0 <= tok < emb.shape[0]:
                raise ValueError("token id %d out of range" % tok)
            Hs = emb[tok].clone()
            B = []
            for i in range(self.L):
                p = "model.layers.%d." % i
                if self.attn_res:
                    P_in = Hs
                    X = P_in if not B else self.mix(P_in, B, p + "self_attention_res")
                    if i % bs == 0:
                        B.append(P_in)
                        P = torch.zeros_like(P_in)
                    else:
                        P = P_in
                else:
                    X = Hs
                    P = Hs
                xa = rms(X, W(p + "input_layernorm.weight"), self.eps)
                if self.kind[i] == "kda":
                    A = self.kda(i, xa, states[i])
                else:
                    A = self.mla(i, xa, states[i], t)
                P = P + A
                Y = self.mix(P, B, p + "mlp_res") if self.attn_res else P
                M = self.ffn(i, rms(Y, W(p + "post_attention_layernorm.weight"), self.eps))
                Hs = P + M
            Z = self.mix(Hs, B, "model.output_attn_res") if self.attn_res else Hs
            out[t] = (head @ rms(Z, W("model.norm.weight"), self.eps)).to(torch.float32)
        self.states = states
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--ids", required=True, help="comma-separated token ids, or @FILE")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=["f64", "f32"], default="f64")
    args = ap.parse_args()
    s = args.ids
    if s.startswith("@"):
        with open(s[1:]) as f:
            s = f.read()
    ids = [int(v) for v in s.replace("\n", ",").split(",") if v.strip()]
    torch.set_num_threads(1)
    ref = Ref(args.model, torch.float64 if args.dtype == "f64" else torch.float32)
    logits = ref.forward(ids)
    logits.numpy().astype("<f4").tofile(args.out)
    am = logits.argmax(dim=1).tolist()
    print("%d tokens, vocab %d -> %s; argmax %s" % (len(ids), ref.V, args.out, am), file=sys.stderr)


if __name__ == "__main__":
    main()
