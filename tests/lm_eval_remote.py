"""lm_eval_remote.py -- lm-eval's local-completions with tokenizer_backend=remote against `k3 serve`.

Usage: python tests/lm_eval_remote.py K3_BINARY      (make test-lm-eval: lm-eval[api] 0.4.13 in .venv, no torch)
Starts `k3 serve` on models/k3-mini and runs lm-eval (its Python API, as `lm_eval --model local-completions
--model_args base_url=...,tokenizer_backend=remote` does) on two local tasks in tests/lm_eval/: k3_mc
(multiple choice: a loglikelihood per choice) and k3_rolling (loglikelihood_rolling: the first token predicted
from lm-eval's prefix token, the BOS id its remote tokenizer finds through /tokenizer_info and /tokenize). Every
loglikelihood lm-eval got (and its is_greedy) is held to the one computed here from `k3 run --dump-logits` on the
same ids, to 1e-5. `import torch` is made to fail: lm-eval must not need it for this.
Prints `ok   lm-eval: NAME` / `FAIL lm-eval: NAME` and ends with `lm-eval: N passed, N failed`.
"""
import builtins
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_import = builtins.__import__


def _no_torch(name, *args, **kwargs):
    if name == "torch" or name.startswith("torch."):
        raise ImportError("torch is kept out of this test")
    return _import(name, *args, **kwargs)


builtins.__import__ = _no_torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

K3 = sys.argv[1] if len(sys.argv) > 1 else "build/k3"
TOL = 1e-5
worst = [0.0]  # the largest |lm-eval - k3 run| seen


suite = h.Suite("lm-eval")
check = suite.check


def main():
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import RemoteTokenizer

    s = h.Server(h.MINI)
    cfg = json.load(open(os.path.join(h.MINI, "config.json")))
    V = cfg.get("text_config", cfg)["vocab_size"]
    tmp = tempfile.mkdtemp(prefix="k3-lm-eval-")

    def encode(text):  # what lm-eval's remote tokenizer sends
        return h.post(s.url + "/tokenize", json_body={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    cache = {}

    def logprobs_of(ids):
        """log_softmax of every position's logits, from k3 run --dump-logits (float64)."""
        key = tuple(ids)
        if key not in cache:
            out = os.path.join(tmp, "logits.f32")
            r = subprocess.run([K3, "run", "-m", h.MINI, "--threads", "1", "--ids", ",".join(map(str, ids)), "-n", "0",
                                "--dump-logits", out], capture_output=True, timeout=120)
            assert r.returncode == 0, r.stderr[-400:]
            lg = np.fromfile(out, dtype=np.float32).reshape(len(ids), V).astype(np.float64)
            mx = lg.max(axis=1, keepdims=True)
            cache[key] = lg - mx - np.log(np.exp(lg - mx).sum(axis=1, keepdims=True))
        return cache[key]

    def reference(ctx_ids, cont_ids):
        ids = ctx_ids + cont_ids
        lp = logprobs_of(ids)
        ll, greedy = 0.0, True
        for j, t in enumerate(cont_ids):
            row = lp[len(ctx_ids) - 1 + j]
            ll += row[t]
            greedy &= int(np.argmax(row)) == t
        return ll, greedy

    def t_remote_tokenizer():
        rt = RemoteTokenizer(s.url + "/v1/completions")
        cfg = json.load(open(os.path.join(h.MINI, "tokenizer_config.json")))
        ids = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
        assert rt.eos_token == "[EOS]" and rt.eos_token_id == ids["[EOS]"], (rt.eos_token, rt.eos_token_id)
        assert rt.bos_token_id == ids["[BOS]"] and rt.pad_token == cfg["pad_token"]
        text = "It is a truth universally acknowledged."
        assert rt.decode(rt.encode(text)) == text
        r = subprocess.run([K3, "tokenize", "-m", h.MINI], input=text.encode(), capture_output=True, timeout=60)
        assert rt.encode(text) == [int(x) for x in r.stdout.split()], (rt.encode(text), r.stdout)

    results = {}

    def t_evaluate():
        tm = TaskManager(include_path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval"))
        args = (f"base_url={s.url}/v1/completions,model={s.name},tokenizer_backend=remote,num_concurrent=1,"
                "max_retries=1,batch_size=4,timeout=120")
        res = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["k3_mc", "k3_rolling"],
                                      task_manager=tm, log_samples=True)
        results.update(res)
        assert res["results"]["k3_mc"]["acc,none"] >= 0.5, res["results"]
        assert "torch" not in sys.modules

    def t_multiple_choice():
        samples = results["samples"]["k3_mc"]
        n = 0
        for smp in samples:
            for (ctx, cont), resp in zip(smp["arguments"], smp["resps"]):
                ll, greedy = resp[0]
                # lm-eval's _encode_pair: trailing spaces of the context go to the continuation
                k = len(ctx) - len(ctx.rstrip())
                if k:
                    ctx, cont = ctx[:-k], ctx[-k:] + cont
                whole, c_ids = encode(ctx + cont), encode(ctx)
                want, want_greedy = reference(c_ids, whole[len(c_ids):])
                worst[0] = max(worst[0], abs(ll - want))
                assert abs(ll - want) <= TOL, (ctx[-30:], cont, ll, want)
                assert greedy == want_greedy, (cont, greedy, want_greedy)
                n += 1
        assert n == 24, n

    def t_rolling():
        bos = RemoteTokenizer(s.url + "/v1/completions").bos_token_id
        samples = results["samples"]["k3_rolling"]
        assert len(samples) == 3
        for smp in samples:
            (text,) = smp["arguments"][0]
            ll = smp["resps"][0][0]
            want, _ = reference([bos], encode(text))
            worst[0] = max(worst[0], abs(ll - want))
            assert abs(ll - want) <= TOL, (text[:30], ll, want)
        print(f"    the largest |lm-eval - k3 run --dump-logits| over 27 loglikelihoods: {worst[0]:.2e}", flush=True)

    for name, fn in [("the remote tokenizer: /tokenizer_info, BOS and EOS ids, /tokenize = k3 tokenize", t_remote_tokenizer),
                     ("simple_evaluate local-completions, tokenizer_backend=remote, without torch", t_evaluate),
                     ("multiple choice: 24 loglikelihoods = k3 run --dump-logits to 1e-5, is_greedy too",
                      t_multiple_choice),
                     ("loglikelihood_rolling from the BOS prefix = k3 run --dump-logits to 1e-5", t_rolling)]:
        if name.startswith(("multiple", "loglikelihood_rolling")) and "samples" not in results:
            check(name, lambda: (_ for _ in ()).throw(AssertionError("no lm-eval results")))
            continue
        check(name, fn)
    s.stop()


if __name__ == "__main__":
    suite.main(main)
