"""PyTorch implementation of the K3.1 text model (docs/model.md §3) for training k3-mini.

Parameter names follow the checkpoint names of §4 (without the `language_model.` prefix),
except the routed experts, which are stacked per layer (`block_sparse_moe.experts_w{1,2,3}`,
[E, rows, cols]) and split into `experts.{e}.w{1,2,3}.weight` at export, and `A_log`, kept
[num_heads] here and zero-padded to [head_dim] at export.

KDA is trained with the chunked form of §3.3 (chunk 16, exponentials taken relative to the
chunk midpoint so that every factor stays below e^40 with the -5 gate bound; all products
are then finite in fp32). DSA layers are the gated NoPE MLA of §3.4 plus the lightning
indexer of §3.6; see `MLA.forward` for how the indexer is trained.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------- primitives


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms(x, self.weight, self.eps)


def situ(g, u, b1=4.0, b2=25.0):
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def linear(i, o):
    return nn.Linear(i, o, bias=False)


_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_fake(w):
    """Quantize-dequantize along the last dim in groups of 32, exactly like
    k3ckpt.mxfp4_quantize (E8M0 scale 2^(floor(log2 amax)-2), E2M1 RNE, saturating);
    straight-through gradient."""
    with torch.no_grad():
        shp = w.shape
        blk = w.reshape(*shp[:-1], shp[-1] // 32, 32)
        amax = blk.abs().amax(-1, keepdim=True)
        _, e = torch.frexp(amax)
        e = torch.where(amax > 0, e - 3, torch.full_like(e, -127)).clamp(-127, 127)
        scale = torch.ldexp(torch.ones_like(amax), e)
        m = blk.abs() / scale
        code = torch.zeros_like(m, dtype=torch.long)
        for i, t in enumerate(_MID):
            code += (m > t).long() if i % 2 == 0 else (m >= t).long()
        vals = torch.tensor(_E2M1, dtype=w.dtype)[code]
        q = (torch.sign(blk) * vals * scale).reshape(shp)
    return w + (q - w).detach()


# ----------------------------------------------------------------------------- KDA


def kda_recurrent(q, k, v, g, beta, S=None):
    """Token-by-token reference (§3.3 step 6). q,k,v,g: [B,T,H,d]; beta [B,T,H]."""
    B, T, H, d = q.shape
    if S is None:
        S = q.new_zeros(B, H, d, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        u = bt.unsqueeze(-1) * (vt - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1), S


def kda_chunk(q, k, v, g, beta, C=16, S=None):
    """Chunked KDA (§3.3 'Chunked form'); same result as kda_recurrent."""
    B, T, H, d = q.shape
    dv = v.shape[-1]
    pad = (-T) % C
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C

    def r(x):  # [B,T,H,e] -> [B,H,N,C,e]
        return x.reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)
    q, k, v, g = r(q), r(k), r(v), r(g)
    beta = beta.reshape(B, N, C, H).permute(0, 3, 1, 2)
    G = g.cumsum(-2)
    Gm = G[..., C // 2:C // 2 + 1, :]
    ep, en = torch.exp(G - Gm), torch.exp(Gm - G)
    kn = k * en
    L = torch.tril((k * ep) @ kn.transpose(-1, -2), -1) * beta.unsqueeze(-1)
    eye = torch.eye(C, dtype=q.dtype)
    Tm = torch.linalg.solve_triangular(eye + L, torch.diag_embed(beta), upper=False,
                                       unitriangular=True)
    eG = torch.exp(G)
    W = Tm @ (eG * k)
    U = Tm @ v
    Aqk = torch.tril((q * ep) @ kn.transpose(-1, -2))
    qg = q * eG
    kd = k * torch.exp(G[..., -1:, :] - G)
    gC = torch.exp(G[..., -1, :]).unsqueeze(-1)  # [B,H,N,d,1]
    if S is None:
        S = q.new_zeros(B, H, d, dv)
    outs = []
    for n in range(N):
        Vn = U[:, :, n] - W[:, :, n] @ S
        outs.append(qg[:, :, n] @ S + Aqk[:, :, n] @ Vn)
        S = gC[:, :, n] * S + kd[:, :, n].transpose(-1, -2) @ Vn
    o = torch.stack(outs, 2)  # [B,H,N,C,dv]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, dv)[:, :T]
    return o, S


class KDA(nn.Module):
    def __init__(self, D, H, dk, conv=4, lb=-5.0):
        super().__init__()
        self.H, self.dk, self.K, self.lb = H, dk, conv, lb
        inner = H * dk
        for n in ("q", "k", "v", "g"):
            setattr(self, n + "_proj", linear(D, inner))
        for n in ("q", "k", "v"):
            setattr(self, n + "_conv1d", nn.Conv1d(inner, inner, conv, groups=inner, bias=False))
        self.o_proj = linear(inner, D)
        self.f_a_proj = linear(D, dk)
        self.f_b_proj = linear(dk, inner)
        self.b_proj = linear(D, H)
        self.A_log = nn.Parameter(torch.zeros(H))
        # decay spectrum at init: -g = 5*sigmoid(dt) log-uniform in [1e-3, 0.5] per channel
        tgt = torch.exp(torch.empty(inner).uniform_(math.log(1e-3), math.log(0.5))) / -lb
        self.dt_bias = nn.Parameter(torch.log(tgt / (1 - tgt)))
        self.o_norm = RMSNorm(dk)

    def conv(self, x, m):
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.K - 1, 0)), m.weight, groups=x.shape[-1])
        return F.silu(y).transpose(1, 2)

    def forward(self, x, chunk=16):
        B, T, _ = x.shape
        H, dk = self.H, self.dk
        q = self.conv(self.q_proj(x), self.q_conv1d).view(B, T, H, dk)
        k = self.conv(self.k_proj(x), self.k_conv1d).view(B, T, H, dk)
        v = self.conv(self.v_proj(x), self.v_conv1d).view(B, T, H, dk)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        z = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, dk) + self.dt_bias.view(H, dk)
        g = self.lb * torch.sigmoid(torch.exp(self.A_log).view(H, 1) * z)
        beta = torch.sigmoid(self.b_proj(x))
        if chunk:
            o, _ = kda_chunk(q, k, v, g, beta, C=chunk)
        else:
            o, _ = kda_recurrent(q, k, v, g, beta)
        y = self.o_norm(o) * torch.sigmoid(self.g_proj(x).view(B, T, H, dk))
        return self.o_proj(y.reshape(B, T, H * dk))


# ----------------------------------------------------------------------------- MLA + DSA


class Indexer(nn.Module):
    def __init__(self, D, rq, HI, dI):
        super().__init__()
        self.HI, self.dI = HI, dI
        self.wq_b = linear(rq, HI * dI)
        self.wk = linear(D, dI)
        self.k_norm = nn.LayerNorm(dI, eps=1e-6)
        self.weights_proj = linear(D, HI)

    def forward(self, x, cq):
        """I(t,s) of §3.6 in fp32, no FP8/Hadamard: [B,T,T]."""
        B, T, _ = x.shape
        qI = self.wq_b(cq).view(B, T, self.HI, self.dI)
        kI = self.k_norm(self.wk(x))
        w = self.weights_proj(x) * (self.HI ** -0.5 * self.dI ** -0.5)
        s = torch.relu(torch.einsum("bthd,bsd->bths", qI, kI))
        return torch.einsum("bths,bth->bts", s, w)


class MLA(nn.Module):
    def __init__(self, D, H, rq, rkv, dn, dr, dv, index=None):
        super().__init__()
        self.H, self.rkv, self.dn, self.dr, self.dv = H, rkv, dn, dr, dv
        self.q_a_proj = linear(D, rq)
        self.q_a_layernorm = RMSNorm(rq, 1e-6)
        self.q_b_proj = linear(rq, H * (dn + dr))
        self.kv_a_proj_with_mqa = linear(D, rkv + dr)
        self.kv_a_layernorm = RMSNorm(rkv, 1e-6)
        self.kv_b_proj = linear(rkv, H * (dn + dv))
        self.g_proj = linear(D, H * dv)
        self.o_proj = linear(H * dv, D)
        self.topk = None
        if index:
            HI, dI, self.topk = index
            self.indexer = Indexer(D, rq, HI, dI)

    def forward(self, x, sparse=False):
        """Returns (out, indexer_loss, indexer_kl).

        Indexer training: its inputs (x, cq) are detached, so it never shapes the trunk; its
        loss is the cross-entropy from the detached, head-averaged *dense* causal attention
        distribution of this layer to softmax(I(t, s<=t)) (= KL + const). Dense attention is
        always computed for that target (T is small); when `sparse`, the main attention's
        softmax is restricted to the indexer's top-k (the exported model's DSA semantics)."""
        B, T, _ = x.shape
        H, dn, dr, dv = self.H, self.dn, self.dr, self.dv
        cq = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(cq).view(B, T, H, dn + dr).transpose(1, 2)
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[..., :self.rkv])
        kpe = ckv[..., self.rkv:]
        kv = self.kv_b_proj(c).view(B, T, H, dn + dv)
        k = torch.cat([kv[..., :dn], kpe.unsqueeze(2).expand(B, T, H, dr)], -1).transpose(1, 2)
        v = kv[..., dn:].transpose(1, 2)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2)) * (dn + dr) ** -0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        iloss = ikl = None
        if self.topk is not None:
            I = self.indexer(x.detach(), cq.detach()).masked_fill(~causal, float("-inf"))
            with torch.no_grad():
                p = torch.softmax(scores, -1).mean(1)
                ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
            logq = torch.log_softmax(I, -1).masked_fill(~causal, 0.0)
            iloss = -(p * logq).sum(-1).mean()
            ikl = iloss.detach() - ent
            if sparse and self.topk < T:
                sel = torch.zeros(B, T, T, dtype=torch.bool)
                sel.scatter_(-1, I.detach().topk(self.topk, -1).indices, True)
                scores = scores.masked_fill(~(sel & causal).unsqueeze(1), float("-inf"))
        o = torch.softmax(scores, -1) @ v  # [B,H,T,dv]
        o = o.transpose(1, 2) * torch.sigmoid(self.g_proj(x).view(B, T, H, dv))
        return self.o_proj(o.reshape(B, T, H * dv)), iloss, ikl


# ----------------------------------------------------------------------------- FFN


class MLP(nn.Module):
    def __init__(self, D, F_):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(D, F_), linear(D, F_), linear(F_, D)

    def forward(self, x):
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    def __init__(self, D, E):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, D))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))


class MoE(nn.Module):
    def __init__(self, D, E, K, L, F_, n_shared):
        super().__init__()
        self.E, self.K = E, K
        self.gate = Router(D, E)
        self.routed_expert_down_proj = linear(D, L)
        self.routed_expert_norm = RMSNorm(L)
        self.routed_expert_up_proj = linear(L, D)
        self.experts_w1 = nn.Parameter(torch.empty(E, F_, L))
        self.experts_w3 = nn.Parameter(torch.empty(E, F_, L))
        self.experts_w2 = nn.Parameter(torch.empty(E, L, F_))
        self.shared_experts = MLP(D, n_shared * F_)
        self.qat = False
        self.last_load = None

    def forward(self, x):
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        s = torch.sigmoid(xf @ self.gate.weight.t())
        idx = (s.detach() + self.gate.e_score_correction_bias).topk(self.K, -1).indices
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
        z = self.routed_expert_down_proj(xf)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // self.K
        counts = torch.bincount(flat, minlength=self.E)
        self.last_load = counts
        w1, w2, w3 = self.experts_w1, self.experts_w2, self.experts_w3
        if self.qat:
            w1, w2, w3 = mxfp4_fake(w1), mxfp4_fake(w2), mxfp4_fake(w3)
        zs = z[tok]
        # split/unbind (not slicing/indexing): their backward is one cat/stack instead of a
        # zero-filled full-size gradient per expert
        cl = counts.tolist()
        outs = []
        for seg, n, a, b, c in zip(zs.split(cl), cl, w1.unbind(0), w3.unbind(0), w2.unbind(0)):
            if n:
                outs.append(situ(seg @ a.t(), seg @ b.t()) @ c.t())
        ys = torch.cat(outs) * w.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros_like(z).index_add(0, tok, ys)
        y = self.routed_expert_up_proj(self.routed_expert_norm(y)) + self.shared_experts(xf)
        return y.view(shp)


# ----------------------------------------------------------------------------- model


def layer_kinds(tc):
    la = tc["linear_attn_config"]
    full = set(la["full_attn_layers"])
    return ["mla" if (i + 1) in full else "kda" for i in range(tc["num_hidden_layers"])]


class Layer(nn.Module):
    def __init__(self, tc, i):
        super().__init__()
        D = tc["hidden_size"]
        eps = tc["rms_norm_eps"]
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attention_res_norm = RMSNorm(D, eps)
        self.self_attention_res_proj = linear(D, 1)
        self.mlp_res_norm = RMSNorm(D, eps)
        self.mlp_res_proj = linear(D, 1)
        la = tc["linear_attn_config"]
        if layer_kinds(tc)[i] == "kda":
            self.self_attn = KDA(D, la["num_heads"], la["head_dim"],
                                 la["short_conv_kernel_size"], la["gate_lower_bound"])
        else:
            index = None
            if "index_topk" in tc and (i + 1) in tc.get("index_layers", la["full_attn_layers"]):
                index = (tc["index_n_heads"], tc["index_head_dim"], tc["index_topk"])
            self.self_attn = MLA(D, tc["num_attention_heads"], tc["q_lora_rank"],
                                 tc["kv_lora_rank"], tc["qk_nope_head_dim"],
                                 tc["qk_rope_head_dim"], tc["v_head_dim"], index)
        if i < tc["first_k_dense_replace"]:
            self.mlp = MLP(D, tc["intermediate_size"])
        else:
            self.block_sparse_moe = MoE(D, tc["num_experts"], tc["num_experts_per_token"],
                                        tc["routed_expert_hidden_size"],
                                        tc["moe_intermediate_size"], tc["num_shared_experts"])


def mix(Vs, norm, proj, eps):
    """AttnRes mix (§3.2): softmax over entries of <rms-normalized entry, norm.w ⊙ proj.w>."""
    V = torch.stack(Vs, 0)
    w = norm.weight * proj.weight[0]
    score = (V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * w).sum(-1)
    a = torch.softmax(score, 0)
    return (a.unsqueeze(-1) * V).sum(0)


class Trunk(nn.Module):
    def __init__(self, tc):
        super().__init__()
        D = tc["hidden_size"]
        self.embed_tokens = nn.Embedding(tc["vocab_size"], D)
        self.layers = nn.ModuleList(Layer(tc, i) for i in range(tc["num_hidden_layers"]))
        self.norm = RMSNorm(D, tc["rms_norm_eps"])
        self.output_attn_res_norm = RMSNorm(D, tc["rms_norm_eps"])
        self.output_attn_res_proj = linear(D, 1)


class K3Model(nn.Module):
    def __init__(self, tc):
        super().__init__()
        self.tc = tc
        self.kinds = layer_kinds(tc)
        self.model = Trunk(tc)
        self.lm_head = linear(tc["hidden_size"], tc["vocab_size"])
        self.init_weights()

    def init_weights(self, std=0.02):
        nl = self.tc["num_hidden_layers"]
        for n, p in self.named_parameters():
            if n.endswith("norm.weight") or n.endswith("k_norm.weight"):
                nn.init.ones_(p)
            elif n.endswith("k_norm.bias") or n.endswith("res_proj.weight"):
                nn.init.zeros_(p)
            elif "conv1d" in n:
                nn.init.uniform_(p, -0.5, 0.5)
            elif n.endswith("A_log") or n.endswith("dt_bias"):
                pass
            elif p.dim() >= 2:
                s = std
                if any(n.endswith(x) for x in ("o_proj.weight", "down_proj.weight",
                                                 "experts_w2", "routed_expert_up_proj.weight")):
                    s = std / math.sqrt(2 * nl)
                nn.init.normal_(p, 0.0, s)

    def moe_layers(self):
        return [l.block_sparse_moe for l in self.model.layers if hasattr(l, "block_sparse_moe")]

    def forward(self, ids, sparse=False, chunk=16):
        tc = self.tc
        eps = tc["rms_norm_eps"]
        bs = tc["attn_res_block_size"]
        m = self.model
        H = m.embed_tokens(ids)
        Bk = []
        ilosses, ikls = [], []
        for i, L in enumerate(m.layers):
            P_in = H
            X = P_in if not Bk else mix(Bk + [P_in], L.self_attention_res_norm,
                                        L.self_attention_res_proj, eps)
            if i % bs == 0:
                Bk.append(P_in)
                P = None
            else:
                P = P_in
            x = L.input_layernorm(X)
            if self.kinds[i] == "kda":
                A = L.self_attn(x, chunk=chunk)
            else:
                A, il, ik = L.self_attn(x, sparse=sparse)
                if il is not None:
                    ilosses.append(il)
                    ikls.append(ik)
            P = A if P is None else P + A
            Y = mix(Bk + [P], L.mlp_res_norm, L.mlp_res_proj, eps)
            y = L.post_attention_layernorm(Y)
            M = L.mlp(y) if hasattr(L, "mlp") else L.block_sparse_moe(y)
            H = P + M
        Z = mix(Bk + [H], m.output_attn_res_norm, m.output_attn_res_proj, eps)
        logits = self.lm_head(m.norm(Z))
        return logits, ilosses, ikls

    def param_counts(self):
        tc = self.tc
        total = sum(p.numel() for p in self.parameters())
        experts = sum(p.numel() for n, p in self.named_parameters() if "experts_w" in n)
        E, K = tc["num_experts"], tc["num_experts_per_token"]
        active = total - experts + experts * K // E
        embed = self.model.embed_tokens.weight.numel()
        return {"total": total, "active": active, "routed_experts": experts,
                "embedding": embed, "active_non_embedding": active - embed}
