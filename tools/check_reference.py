#!/usr/bin/env python3
"""Goldens from implementations written by others, for tests/test_reference.c.

  python3 tools/check_reference.py --out DIR [--only kda,dsa,kimi]
  python3 tools/check_reference.py --out DIR --compare .     # also diff DIR against the repo

Writes, under DIR (the repository layout, so `--out .` refreshes the committed files):
  tests/golden/ref/kda.safetensors        fla's naive KDA (recurrent and chunked) + its gates
  tests/golden/ref/dsa.safetensors        DSA indexer scores and top-k sets (DeepSeek-V3.2)
  tests/golden/ref/kimi-linear-tiny.safetensors   ids + logits of transformers' KimiLinearForCausalLM
  tests/models/kimi-linear-tiny/          that model, written by transformers' save_pretrained

References (none of their code is copied into this repository):
  * fla-core (github.com/fla-org/flash-linear-attention): fla/ops/kda/naive.py
    `naive_recurrent_kda`, `naive_chunk_kda`; fla/ops/kda/gate.py `naive_kda_gate`,
    `naive_kda_lowerbound_gate`. Their function definitions are read out of the installed
    package with `ast` and executed in a scratch namespace, so the fla package itself (Triton)
    is never imported.
  * transformers: models/kimi_linear (KimiLinearForCausalLM; its reference PyTorch paths),
    models/deepseek_v32 (DeepseekV32Indexer).
  * DeepSeek-V3.2-Exp inference/model.py, class Indexer (the scoring formula, re-typed below in
    plain torch from docs/model.md §3.6; no RoPE since K3 is NoPE).

Random data comes from numpy's PCG64 with fixed seeds, so reruns are bit-identical for the same
torch build. Prints every cross-check it makes; exits 1 when one fails.
"""

import argparse
import ast
import importlib.util
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILS = []


def rel_l2(a, b):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def report(what, err, tol):
    ok = err <= tol
    print("  %-58s rel-L2 %.3g %s" % (what, err, "ok" if ok else "FAIL (> %g)" % tol))
    if not ok:
        FAILS.append(what)


def save(path, tensors):
    from safetensors.torch import save_file
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    os.chmod(path, 0o644)
    print("  wrote %s (%d tensors, %d bytes)" % (os.path.relpath(path), len(tensors),
                                                  os.path.getsize(path)))


# --------------------------------------------------------------------------- fla, without Triton

def load_fla_functions():
    """fla's torch reference functions, taken from the installed package's source files."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("fla-core is not installed (pip install fla-core)")
    base = list(spec.submodule_search_locations)[0]
    from einops import rearrange
    ns = {"torch": torch, "F": F, "rearrange": rearrange}
    want = {"ops/kda/naive.py": ["naive_recurrent_kda", "naive_chunk_kda"],
            "ops/kda/gate.py": ["naive_kda_gate", "naive_kda_lowerbound_gate"]}
    for rel, names in want.items():
        path = os.path.join(base, rel)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        if len(found) != len(names):
            raise SystemExit("%s: expected functions %s" % (path, names))
        exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), ns)
    from importlib.metadata import version
    print("fla-core %s (%s)" % (version("fla-core"), base))
    return ns


def l2norm(x, eps=1e-6):
    # fla's l2norm (and transformers' copy of it): eps inside the sqrt
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


# --------------------------------------------------------------------------- 1. KDA vs fla

KDA_T = (1, 37, 130)
KDA_H, KDA_K, KDA_V = 2, 32, 32
KDA_LB = -5.0


def gen_kda(out, fla):
    print("KDA: fla naive_recurrent_kda / naive_chunk_kda, B=1 H=%d K=V=%d" % (KDA_H, KDA_K))
    rng = np.random.default_rng(20261129)
    H, K, V = KDA_H, KDA_K, KDA_V
    t = {}
    for T in KDA_T:
        # inputs shared by both gate forms (only the decay g differs)
        r = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))
        q = l2norm(r(1, T, H, K))
        k = l2norm(r(1, T, H, K))
        v = r(1, T, H, V)
        z = r(1, T, H, K)  # f_b_proj(f_a_proj(x)), before dt_bias
        A_log = torch.from_numpy(np.log(rng.uniform(1, 16, H)).astype(np.float32))
        dt = torch.from_numpy(rng.uniform(1e-3, 1e-1, H * K).astype(np.float32))
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # fla's init: inverse softplus
        beta = torch.sigmoid(r(1, T, H))
        S0 = 0.5 * r(1, H, K, V)
        p = "T%d." % T
        # k3's convention: q arrives already scaled by K^-0.5 (fla scales inside)
        t[p + "q"] = (q * K ** -0.5)[0]
        t[p + "k"] = k[0]
        t[p + "v"] = v[0]
        t[p + "z"] = z[0]
        t[p + "A_log"] = A_log
        t[p + "dt_bias"] = dt_bias
        t[p + "beta"] = beta[0]
        t[p + "S0"] = S0[0]  # [H, K, V]: S[k][v], the same layout as k3
        for form in ("softplus", "sigmoid"):
            case = p + form
            if form == "softplus":
                g = fla["naive_kda_gate"](z, A_log, dt_bias)
            else:
                g = fla["naive_kda_lowerbound_gate"](z, A_log, dt_bias, lower_bound=KDA_LB)
            o_r, S_r = fla["naive_recurrent_kda"](q, k, v, g, beta, scale=K ** -0.5,
                                                  initial_state=S0, output_final_state=True)
            # naive_chunk_kda needs T % chunk == 0: pad with k = v = q = 0, g = 0, beta = 0,
            # tokens that leave the state exactly unchanged and whose outputs are dropped.
            chunk = {}
            for C in (16, 64):
                P = -T % C
                pad = lambda x: F.pad(x, (0, 0) * (x.dim() - 2) + (0, P))
                o_c, S_c = fla["naive_chunk_kda"](pad(q), pad(k), pad(v), pad(g),
                                                  F.pad(beta, (0, 0, 0, P)), scale=K ** -0.5,
                                                  initial_state=S0, output_final_state=True,
                                                  chunk_size=C)
                chunk[C] = (o_c[:, :T], S_c)
                report("%s: fla chunk(%d) vs fla recurrent, o" % (case, C), rel_l2(o_c[:, :T], o_r), 1e-5)
                report("%s: fla chunk(%d) vs fla recurrent, S" % (case, C), rel_l2(S_c, S_r), 1e-5)
            t[case + ".g"] = g[0]
            t[case + ".o_rec"] = o_r[0]
            t[case + ".S_rec"] = S_r[0]
            t[case + ".o_chunk"] = chunk[64][0][0]
            t[case + ".S_chunk"] = chunk[64][1][0]
    t["lower_bound"] = torch.tensor([KDA_LB])
    save(os.path.join(out, "tests/golden/ref/kda.safetensors"), t)


# --------------------------------------------------------------------------- 2. DSA indexer

DSA_T, DSA_HI, DSA_DI, DSA_Q, DSA_D = 64, 8, 32, 32, 64
DSA_TOPK = (8, 16)


def deepseek_index_scores(q, k, w_raw):
    """DeepSeek-V3.2-Exp inference/model.py Indexer.forward, fp32, no RoPE, no FP8/Hadamard
    (docs/model.md §3.6): I(t,s) = Σ_h w[t,h]·H^-0.5·d^-0.5 · ReLU(q[t,h]·k[s]), s ≤ t."""
    T, HI, dI = q.shape
    w = w_raw * HI ** -0.5 * dI ** -0.5
    dots = torch.einsum("thd,sd->ths", q.double(), k.double())
    sc = (w.double()[:, :, None] * dots.clamp_min(0)).sum(1)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return sc.masked_fill(~mask, float("-inf")), mask


def gen_dsa(out):
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    import transformers
    print("DSA: transformers %s DeepseekV32Indexer + DeepSeek-V3.2 formula, T=%d H_I=%d d_I=%d"
          % (transformers.__version__, DSA_T, DSA_HI, DSA_DI))
    cfg = DeepseekV32Config(hidden_size=DSA_D, q_lora_rank=DSA_Q, index_n_heads=DSA_HI,
                            index_head_dim=DSA_DI, index_topk=max(DSA_TOPK), qk_rope_head_dim=16,
                            vocab_size=64)
    for seed in range(1, 100):  # the first seed without a near-tie at any selection boundary
        rng = np.random.default_rng(7000 + seed)
        torch.manual_seed(seed)
        idx = DeepseekV32Indexer(cfg, 0).float().eval()
        with torch.no_grad():
            for p in idx.parameters():
                p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
                        * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
            idx.k_norm.weight.add_(1.0)
        x = torch.from_numpy(rng.standard_normal((1, DSA_T, DSA_D)).astype(np.float32))
        qr = torch.from_numpy(rng.standard_normal((1, DSA_T, DSA_Q)).astype(np.float32))
        with torch.no_grad():
            q = idx.wq_b(qr).view(DSA_T, DSA_HI, DSA_DI)
            k = idx.k_norm(idx.wk(x))[0]
            w = idx.weights_proj(x)[0]
        sc, mask = deepseek_index_scores(q, k, w)
        margin = math.inf
        for kk in DSA_TOPK:
            for t in range(kk, DSA_T):
                row = sc[t, : t + 1].sort(descending=True).values
                margin = min(margin, float((row[kk - 1] - row[kk]) / row.abs().max()))
        if margin > 1e-4:
            break
    print("  seed %d: smallest relative gap at a top-k boundary %.3g" % (seed, margin))
    t = {"q": q, "k": k, "weights": w,
         "scores": sc.float().masked_fill(~mask, 0.0)}  # only s <= t is meaningful
    # transformers' indexer with RoPE disabled (cos = 1, sin = 0: K3 is NoPE)
    cos = torch.ones(1, DSA_T, cfg.qk_rope_head_dim)
    sin = torch.zeros(1, DSA_T, cfg.qk_rope_head_dim)
    for kk in DSA_TOPK:
        idx.index_topk = kk
        with torch.no_grad():
            hf = idx(x, qr, (cos, sin), mask[None], None)[0]
        sel = torch.full((DSA_T, kk), -1, dtype=torch.int32)
        bad = 0
        for tt in range(DSA_T):
            n = min(kk, tt + 1)
            ours = sorted(sc[tt].topk(n).indices.tolist())
            # rows with fewer than k past tokens: transformers also returns masked (-inf) slots
            theirs = sorted(s for s in hf[tt].tolist() if s <= tt)
            bad += ours != theirs
            sel[tt, :n] = torch.tensor(ours, dtype=torch.int32)
        print("  top-%d: transformers' selection == DeepSeek formula on %d/%d rows %s"
              % (kk, DSA_T - bad, DSA_T, "ok" if not bad else "FAIL"))
        if bad:
            FAILS.append("DSA top-%d sets" % kk)
        t["sel.k%d" % kk] = sel
    save(os.path.join(out, "tests/golden/ref/dsa.safetensors"), t)


# --------------------------------------------------------------------------- 3. Kimi-Linear

KIMI_CONFIG = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=32,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mla_use_nope=True,
    linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2,
                        "head_dim": 32, "short_conv_kernel_size": 4},
    first_k_dense_replace=1, intermediate_size=256,
    num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=64,
    moe_renormalize=True, routed_scaling_factor=2.446, num_expert_group=2, topk_group=1,
    hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False, model_max_length=4096,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
KIMI_N_IDS = 24


def kimi_init(model, rng):
    """Weights that make every path matter: O(1) activations, non-trivial norms, correction
    biases that change which experts win, decays across the useful range."""
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            shape = tuple(p.shape)
            if name.endswith("A_log"):
                v = np.log(rng.uniform(1, 16, shape))
            elif name.endswith("dt_bias"):
                dt = rng.uniform(1e-3, 1e-1, shape)
                v = dt + np.log(-np.expm1(-dt))
            elif "norm" in name:
                v = rng.uniform(0.5, 1.5, shape)
            elif "conv1d" in name:
                v = 0.5 * rng.standard_normal(shape)
            elif "embed_tokens" in name:
                v = rng.standard_normal(shape)
            else:  # linear weights [out, in] (experts [E, out, in]): unit-gain
                v = rng.standard_normal(shape) / math.sqrt(shape[-1])
            p.copy_(torch.from_numpy(v.astype(np.float32)))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.from_numpy(rng.uniform(-0.1, 0.1, tuple(b.shape)).astype(np.float32)))


def router_margin(model, ids):
    """Smallest gap between the k-th and (k+1)-th biased router score over all MoE layers and
    tokens (after the group stage): a tiny gap would let fp32 rounding flip a selection."""
    gaps = []

    def hook(mod, inp, out):
        x = inp[0].reshape(-1, mod.hidden_dim).float()
        s = torch.sigmoid(F.linear(x, mod.weight.float())) + mod.e_score_correction_bias
        G = mod.num_group
        gs = s.view(-1, G, mod.num_experts // G).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(mod.topk_group, -1).indices, 1)
        s = s.masked_fill(keep.repeat_interleave(mod.num_experts // G, 1) == 0, -1e9)
        top = s.topk(mod.top_k + 1, -1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))
        if G > 1:
            g2 = gs.sort(-1, descending=True).values
            gaps.append(float((g2[:, mod.topk_group - 1] - g2[:, mod.topk_group]).min()))

    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter
    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, KimiLinearTopkRouter)]
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    return min(gaps)


def fla_kda_patches(fla):
    """Replacements for transformers' chunk/recurrent KDA functions built on fla's naive
    kernels (same signature subset): an independent second path for the KDA core."""
    def chunk(query, key, value, g, beta, chunk_size=64, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False, **kw):
        dt = query.dtype
        q, k, v, g, b = [x.float() for x in (query, key, value, g, beta)]
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        T = q.shape[1]
        P = -T % chunk_size
        pad = lambda x: F.pad(x, (0, 0) * (x.dim() - 2) + (0, P))
        o, S = fla["naive_chunk_kda"](pad(q), pad(k), pad(v), pad(g), F.pad(b, (0, 0, 0, P)),
                                      initial_state=initial_state,
                                      output_final_state=output_final_state, chunk_size=chunk_size)
        return o[:, :T].to(dt), S

    def recurrent(query, key, value, g, beta, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel=False, **kw):
        dt = query.dtype
        q, k, v, g, b = [x.float() for x in (query, key, value, g, beta)]
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        o, S = fla["naive_recurrent_kda"](q, k, v, g, b, initial_state=initial_state,
                                          output_final_state=output_final_state)
        return o.to(dt), S
    return chunk, recurrent


def gen_kimi(out, fla):
    import transformers
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    import transformers.models.kimi_linear.modeling_kimi_linear as mkl
    print("Kimi-Linear: transformers %s KimiLinearForCausalLM (torch reference paths)"
          % transformers.__version__)
    # transformers binds fla's Triton kernels when `fla` imports; main() hides fla, so the
    # model runs transformers' own PyTorch paths (it logs "falling back to its reference").
    assert sys.modules.get("fla", 0) is None, "fla must be hidden before transformers loads"
    cfg = KimiLinearConfig(**KIMI_CONFIG)
    for seed in range(1, 100):
        torch.manual_seed(seed)
        model = KimiLinearForCausalLM(cfg).float().eval()
        rng = np.random.default_rng(31000 + seed)
        kimi_init(model, rng)
        ids = torch.from_numpy(rng.integers(3, cfg.vocab_size, (1, KIMI_N_IDS)))
        margin = router_margin(model, ids)
        if margin > 1e-4:
            break
    print("  seed %d: smallest router top-k margin %.3g" % (seed, margin))
    with torch.no_grad():
        logits = model(ids).logits[0].float()

    # the KDA core through fla's naive kernels instead of transformers' own torch code
    saved = (mkl.chunk_kimi_delta_attention, mkl.recurrent_kimi_delta_attention)
    mkl.chunk_kimi_delta_attention, mkl.recurrent_kimi_delta_attention = fla_kda_patches(fla)
    try:
        with torch.no_grad():
            logits_fla = model(ids).logits[0].float()
    finally:
        mkl.chunk_kimi_delta_attention, mkl.recurrent_kimi_delta_attention = saved
    report("logits: transformers KDA path vs fla naive_chunk_kda", rel_l2(logits_fla, logits), 1e-5)

    # token-by-token decode with transformers' cache (recurrent KDA, conv update path)
    with torch.no_grad():
        outs, cache = [], None
        for i in range(KIMI_N_IDS):
            o = model(ids[:, i:i + 1], cache=cache, use_cache=True)
            cache = o.cache
            outs.append(o.logits[0, -1])
    report("logits: transformers decode (cache) vs prefill", rel_l2(torch.stack(outs), logits), 1e-5)

    mdir = os.path.join(out, "tests/models/kimi-linear-tiny")
    os.makedirs(mdir, exist_ok=True)
    model.save_pretrained(mdir, safe_serialization=True)
    if os.path.exists(os.path.join(mdir, "generation_config.json")):
        os.remove(os.path.join(mdir, "generation_config.json"))  # k3 reads config + weights only
    for f in os.listdir(mdir):
        os.chmod(os.path.join(mdir, f), 0o644)
    print("  wrote %s (%d bytes of safetensors)" % (
        os.path.relpath(mdir), os.path.getsize(os.path.join(mdir, "model.safetensors"))))
    # what was written must reload to the same model
    back = KimiLinearForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits_back = back(ids).logits[0].float()
    report("logits: reloaded with from_pretrained vs in memory", rel_l2(logits_back, logits), 0.0)
    save(os.path.join(out, "tests/golden/ref/kimi-linear-tiny.safetensors"),
         {"ids": ids[0].to(torch.int32), "logits": logits})


# --------------------------------------------------------------------------- compare with the repo

def compare(out, repo):
    """Fresh goldens vs the committed ones: the committed files must still be what today's
    references produce (up to rounding of a different torch build)."""
    from safetensors.torch import load_file
    print("compare %s with %s" % (out, repo))
    files = ["tests/golden/ref/kda.safetensors", "tests/golden/ref/dsa.safetensors",
             "tests/golden/ref/kimi-linear-tiny.safetensors",
             "tests/models/kimi-linear-tiny/model.safetensors"]
    for rel in files:
        a_path, b_path = os.path.join(out, rel), os.path.join(repo, rel)
        if not os.path.exists(a_path):
            continue
        if not os.path.exists(b_path):
            print("  %s: missing in the repo" % rel)
            FAILS.append(rel)
            continue
        a, b = load_file(a_path), load_file(b_path)
        if sorted(a) != sorted(b):
            print("  %s: tensor names differ: %s" % (rel, sorted(set(a) ^ set(b))[:8]))
            FAILS.append(rel)
            continue
        worst = 0.0
        for n in a:
            if a[n].dtype in (torch.int32, torch.int64):
                worst = max(worst, 0.0 if torch.equal(a[n], b[n]) else math.inf)
            else:
                worst = max(worst, rel_l2(a[n], b[n]))
        report("%s: fresh vs committed (worst tensor)" % rel, worst, 1e-6)
    cj = "tests/models/kimi-linear-tiny/config.json"
    if os.path.exists(os.path.join(out, cj)):
        with open(os.path.join(out, cj)) as f1, open(os.path.join(repo, cj)) as f2:
            a, b = json.load(f1), json.load(f2)
        a.pop("transformers_version", None)
        b.pop("transformers_version", None)
        same = a == b
        print("  %-58s %s" % (cj + ": fresh vs committed", "same" if same else "FAIL (differs)"))
        if not same:
            FAILS.append(cj)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="root to write tests/golden/ref and tests/models under")
    ap.add_argument("--only", default="kda,dsa,kimi")
    ap.add_argument("--compare", metavar="REPO", help="diff the fresh files against REPO's")
    a = ap.parse_args()
    # transformers would bind fla's Triton kernels when `fla` imports; hide it so the model
    # runs transformers' own reference code (fla's naive functions are loaded from source).
    print("torch %s, numpy %s" % (torch.__version__, np.__version__))
    fla = load_fla_functions()
    sys.modules["fla"] = None
    only = a.only.split(",")
    if "kda" in only:
        gen_kda(a.out, fla)
    if "dsa" in only:
        gen_dsa(a.out)
    if "kimi" in only:
        gen_kimi(a.out, fla)
    if a.compare:
        compare(a.out, a.compare)
    if FAILS:
        print("check_reference: %d check(s) failed: %s" % (len(FAILS), ", ".join(FAILS)))
        sys.exit(1)
    print("check_reference: all reference cross-checks passed")


if __name__ == "__main__":
    main()
