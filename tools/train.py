#!/usr/bin/env python3
"""Train k3-mini (K3.1 architecture, docs/model.md §3) on the training split of the corpora.

    python3 tools/train.py --out runs/k3mini --minutes 70 [--preset mini]

Writes <out>/log.txt (train / held-out loss), <out>/ckpt.pt (every --ckpt-every seconds and at
the end; export with tools/train_export.py). The schedule is time-based: warm-up, then cosine
decay of the learning rate over the wall-clock budget; the DSA layers train dense until
--sparse-from (fraction of the budget), then with attention restricted to the indexer's top-k;
the routed experts train with MXFP4 fake-quantization (straight-through) from --qat-from.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_chat  # noqa: E402
import train_data  # noqa: E402
from train_model import K3Model  # noqa: E402

PRESETS = {
    # d_model 256, 8 layers KDA KDA KDA DSA KDA KDA KDA DSA, 8 experts top-2 + 2 shared
    "mini": dict(
        hidden_size=256, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=96,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        linear_attn_config={"num_heads": 4, "head_dim": 48, "short_conv_kernel_size": 4,
                            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                            "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]},
        attn_res_block_size=4, first_k_dense_replace=1, moe_layer_freq=1,
        intermediate_size=512, num_experts=8, num_experts_per_token=2, num_shared_experts=2,
        moe_intermediate_size=128, routed_expert_hidden_size=128,
        index_n_heads=2, index_head_dim=32, index_topk=64,
    ),
}


def text_config(preset, n_ranks, ctx):
    import k3ckpt
    cfg = k3ckpt.make_config(n_ranks, max_position_embeddings=4096, **PRESETS[preset])
    return cfg


def load_tokenizer(path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(path)
    return tiktoken.Encoding("k3mini", pat_str=train_data.KIMI_PAT, mergeable_ranks=ranks,
                             special_tokens={})


def encode_corpora(enc):
    split = train_data.load_split()
    tr = {n: np.array(enc.encode_ordinary(t), dtype=np.int32) for n, (t, _) in split.items()}
    ho = {n: np.array(enc.encode_ordinary(h), dtype=np.int32) for n, (_, h) in split.items()}
    return split, tr, ho


@torch.no_grad()
def evaluate(model, ho, T, max_windows=None, sparse=True, bs=16):
    """Mean next-token loss per corpus over non-overlapping windows of T tokens."""
    model.eval()
    res = {}
    for name, ids in ho.items():
        n = (len(ids) - 1) // T
        if max_windows:
            n = min(n, max_windows)
        tot, cnt = 0.0, 0
        for s in range(0, n, bs):
            w = [ids[j * T: j * T + T + 1] for j in range(s, min(n, s + bs))]
            x = torch.from_numpy(np.stack(w)).long()
            logits, _, _ = model(x[:, :-1], sparse=sparse)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                   reduction="sum")
            tot += loss.item()
            cnt += x[:, 1:].numel()
        res[name] = tot / cnt
    model.train()
    res["all"] = sum(res.values()) / len(res)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/k3mini")
    ap.add_argument("--tokenizer", default="models/k3-mini/tiktoken.model")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--override", default="{}", help="JSON text_config overrides")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--bias-gamma", type=float, default=5e-3)
    ap.add_argument("--idx-weight", type=float, default=1.0)
    ap.add_argument("--sparse-from", type=float, default=0.3)
    ap.add_argument("--qat-from", type=float, default=0.85)
    ap.add_argument("--chat-frac", type=float, default=0.05)
    ap.add_argument("--eval-every", type=float, default=300, help="seconds")
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--ckpt-every", type=float, default=420, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--final-eval", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    os.makedirs(a.out, exist_ok=True)
    logf = open(os.path.join(a.out, "log.txt"), "a")

    def log(s):
        line = time.strftime("%H:%M:%S ") + s
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    enc = load_tokenizer(a.tokenizer)
    n_ranks = enc.n_vocab
    import k3ckpt
    cfg = text_config(a.preset, n_ranks, a.ctx)
    cfg["text_config"].update(json.loads(a.override))
    tc = cfg["text_config"]
    specials = {v: k for k, v in k3ckpt.special_tokens_k3(n_ranks).items()}

    t0 = time.time()
    split, tr, ho = encode_corpora(enc)
    dialogues = train_chat.make_dialogues({n: v[0] for n, v in split.items()}, enc, specials,
                                          n_tokens=int(0.06 * sum(len(v) for v in tr.values())))
    chat = np.array([i for d in dialogues for i in d], dtype=np.int32)
    chat_starts = np.cumsum([0] + [len(d) for d in dialogues[:-1]])
    chat_starts = chat_starts[chat_starts < len(chat) - a.ctx - 1]
    names = sorted(tr)
    sizes = np.array([len(tr[n]) for n in names], dtype=np.float64)
    probs = sizes / sizes.sum()
    log(f"data: train tokens {dict(zip(names, sizes.astype(int).tolist()))}, chat tokens "
        f"{len(chat)} ({len(dialogues)} dialogues), heldout "
        f"{ {n: len(v) for n, v in ho.items()} } ({time.time()-t0:.1f}s)")

    model = K3Model(tc)
    pc = model.param_counts()
    log("config " + json.dumps(tc))
    log("params " + json.dumps(pc))
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "conv1d" not in n and "res_proj" not in n
         else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    meta = {"config": cfg, "args": vars(a), "params": pc}

    def save(tag="ckpt.pt", extra=None):
        d = dict(meta, model=model.state_dict(), **(extra or {}))
        tmp = os.path.join(a.out, tag + ".tmp")
        torch.save(d, tmp)
        os.replace(tmp, os.path.join(a.out, tag))

    def batch():
        xs = []
        for _ in range(a.batch):
            if rng.random() < a.chat_frac:
                s = int(rng.choice(chat_starts))
                xs.append(chat[s:s + a.ctx + 1])
            else:
                n = names[rng.choice(len(names), p=probs)]
                s = int(rng.integers(0, len(tr[n]) - a.ctx - 1))
                xs.append(tr[n][s:s + a.ctx + 1])
        return torch.from_numpy(np.stack(xs)).long()

    budget = a.minutes * 60
    start = time.time()
    last_eval = last_ckpt = start
    step, seen = 0, 0
    ema = None
    sparse = qat = False
    best_th, st_time = 1, {1: None, 2: None}
    while True:
        el = time.time() - start
        frac = el / budget
        if frac >= 1.0 or (a.max_steps and step >= a.max_steps):
            break
        if not sparse and frac >= a.sparse_from:
            sparse = True
            log(f"step {step}: DSA sparse attention on (top-{tc['index_topk']})")
        if not qat and frac >= a.qat_from:
            qat = True
            for m in model.moe_layers():
                m.qat = True
            log(f"step {step}: MXFP4 fake-quant of routed experts on")
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (
            a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for gp in opt.param_groups:
            gp["lr"] = lr
        # The 2 cores are shared with other jobs; OpenMP with 2 threads is ~3x slower than 1
        # thread when another process holds a core. Probe the other thread count for 3 steps
        # every 60 and keep whichever has the lower recent step time.
        if a.threads > 1:
            probe = step % 60 < 3 and step >= 60
            th = (3 - best_th) if probe else best_th
            torch.set_num_threads(th)
        ts = time.time()
        x = batch()
        logits, il, ik = model(x[:, :-1], sparse=sparse)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss = lm + a.idx_weight * sum(il) if il else lm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing: bias += γ·sign(mean_load − load)
            for m in model.moe_layers():
                load = m.last_load.float()
                m.gate.e_score_correction_bias += a.bias_gamma * torch.sign(load.mean() - load)
        if a.threads > 1:
            dt = time.time() - ts
            st_time[th] = dt if st_time[th] is None else (0.5 * st_time[th] + 0.5 * dt if probe
                                                          else 0.8 * st_time[th] + 0.2 * dt)
            if probe and step % 60 == 2 and st_time[3 - best_th] < st_time[best_th]:
                best_th = 3 - best_th
                log(f"step {step}: switching to {best_th} threads ({st_time})")
        step += 1
        seen += x[:, 1:].numel()
        ema = lm.item() if ema is None else 0.98 * ema + 0.02 * lm.item()
        if step % 20 == 0:
            el = time.time() - start
            loads = [m.last_load.float() for m in model.moe_layers()]
            imb = max((l.max() / l.mean()).item() for l in loads)
            kl = sum(k.item() for k in ik) / max(1, len(ik))
            log(f"step {step} tok {seen} lr {lr:.2e} loss {lm.item():.4f} ema {ema:.4f} "
                f"idx_kl {kl:.3f} gnorm {gn:.2f} max_load/mean {imb:.2f} "
                f"{seen/el:.0f} tok/s elapsed {el/60:.1f}m threads {best_th}")
        now = time.time()
        if now - last_eval >= a.eval_every:
            r = evaluate(model, ho, a.ctx, a.eval_windows, sparse=sparse)
            log(f"eval step {step} heldout " + " ".join(f"{k} {v:.4f}" for k, v in r.items()))
            last_eval = time.time()
            start += last_eval - now  # evaluation time does not eat the training budget
        if now - last_ckpt >= a.ckpt_every:
            save(extra={"step": step, "tokens": seen})
            last_ckpt = time.time()
    train_s = time.time() - start
    save(extra={"step": step, "tokens": seen, "train_seconds": train_s})
    log(f"done: {step} steps, {seen} tokens, {train_s/60:.1f} min")
    if a.final_eval:
        r = evaluate(model, ho, a.ctx, None, sparse=True)
        log("final heldout (all windows, sparse DSA) " + " ".join(f"{k} {v:.4f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
