"""serve_spec.py -- speculative decoding through `k3 serve` with the official `openai` client.

Usage: python tests/serve_spec.py K3_BINARY [--mpi]
A server drafting (--speculative suffix) against one that does not, on models/k3-mini: the same greedy
text (completions and chat, streamed and whole), the same seeded texts for n choices, stop strings,
a JSON-schema constraint, a request's own speculative_config, a pool small enough to preempt, and
with --mpi the drafting server under `mpirun -np 2 --dcp 2`; /metrics counts vLLM's spec_decode
counters. K3_SPEC_TEST_ISA=NAME runs every server with --isa NAME (the default table is the CPU's
best: on a Xeon with AMX a verify chunk's products of >= 4 MXFP4 rows round activations to BF16,
which `--isa avx512` does not). Prints `ok   spec: NAME` / `FAIL spec: NAME` and ends with
`spec: N passed, N failed, N skipped`.
"""
import json
import os
import re
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402  (the server process, /metrics, the check lines)

K3 = h.K3
MPI = "--mpi" in sys.argv
MINI = h.MINI
ISA = ["--isa", os.environ["K3_SPEC_TEST_ISA"]] if os.environ.get("K3_SPEC_TEST_ISA") else []
suite = h.Suite("spec")
check = suite.check

REPEAT = ("The old man walked down to the harbour every morning. He looked at the boats and the water, "
          "and then he walked back up the hill to his house. ") * 3 + "The old man walked"
NOVEL = "It is a truth universally acknowledged, that"
CODE = ("def area(width, height):\n    return width * height\n\n" * 2) + "def area(width, height):\n"


def spec_counts(sv):
    m = sv.metrics()
    return (h.metric(m, "vllm:spec_decode_num_drafts_total") or 0,
            h.metric(m, "vllm:spec_decode_num_draft_tokens_total") or 0,
            h.metric(m, "vllm:spec_decode_num_accepted_tokens_total") or 0)


def complete(sv, prompt, **kw):
    c = sv.client()
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0)
    return c.completions.create(model=sv.name, prompt=prompt, **kw)


def streamed(sv, prompt, **kw):
    c = sv.client()
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0)
    text, finish = "", None
    for ch in c.completions.create(model=sv.name, prompt=prompt, stream=True, **kw):
        for x in ch.choices:
            text += x.text
            finish = x.finish_reason or finish
    return text, finish


class MpiServer(h.Process):
    """k3 serve under mpirun (rank 0 serves): the same harness, another command."""

    def __init__(self, model, *extra):
        super().__init__(["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", K3, "serve", "-m", model,
                          "--port", "0", "--threads", "1", *extra], start_timeout=120)
        self.name = model


def main():
    common = ["--max-num-seqs", "8", "--num-speculative-tokens", "6", *ISA]
    on = h.Server(MINI, "--speculative", "suffix", "--spec-no-cost-model", *common)
    # off speculates only for a request that asks (its own speculative_config),
    # and then without the cost model's veto, so that check does not hang on
    # how loaded the machine is (the cost model has its own tests, test_spec.c)
    off = h.Server(MINI, "--spec-no-cost-model", *common)
    prompts = [REPEAT, CODE, NOVEL]

    def greedy_same():
        for p in prompts:
            a, b = complete(on, p), complete(off, p)
            assert a.choices[0].text == b.choices[0].text, (p[:30], a.choices[0].text, b.choices[0].text)
            assert a.usage.completion_tokens == b.usage.completion_tokens
            sa, fa = streamed(on, p)
            assert sa == b.choices[0].text and fa == b.choices[0].finish_reason, (sa, b.choices[0].text)
        d, t, acc = spec_counts(on)
        assert d > 0 and acc > 0, f"drafts {d}, draft tokens {t}, accepted {acc}: nothing was drafted"
        assert spec_counts(off)[0] == 0
    check("greedy completions the same text with and without drafts, streamed and whole; drafts accepted",
          greedy_same)

    def chat_same():
        msgs = [{"role": "user", "content": "Repeat after me: " + REPEAT}]
        kw = dict(model=MINI, messages=msgs, max_tokens=40, temperature=0,
                  extra_body={"chat_template_kwargs": {"thinking": False}})
        a = on.client().chat.completions.create(**kw)
        b = off.client().chat.completions.create(**kw)
        assert a.choices[0].message.content == b.choices[0].message.content
    check("greedy chat the same", chat_same)

    def seeded_n():
        kw = dict(n=3, temperature=0.8, top_p=0.95, seed=1234, max_tokens=40, frequency_penalty=0.3,
                  logit_bias={"11": 3.0})
        a, b = complete(on, REPEAT, **kw), complete(off, REPEAT, **kw)
        ta = sorted((c.index, c.text) for c in a.choices)
        tb = sorted((c.index, c.text) for c in b.choices)
        assert ta == tb, (ta, tb)
        assert len({t for _, t in ta}) > 1, "the choices are all the same: the seeds do nothing"
    check("n = 3, a seed, penalties, logit_bias: the same texts", seeded_n)

    def stops():
        for stop in [[" harbour"], ["\n\n", "the"], ["walked"]]:
            a, b = complete(on, REPEAT, stop=stop, max_tokens=60), complete(off, REPEAT, stop=stop, max_tokens=60)
            assert a.choices[0].text == b.choices[0].text and a.choices[0].finish_reason == b.choices[0].finish_reason
            assert a.usage.completion_tokens == b.usage.completion_tokens, (a.usage, b.usage)
            sa, fa = streamed(on, REPEAT, stop=stop, max_tokens=60)
            assert sa == b.choices[0].text and fa == b.choices[0].finish_reason
    check("stop strings: the same text, finish and usage (streamed too)", stops)

    def schema():
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                             "items": {"type": "array", "items": {"type": "string",
                                                                                  "maxLength": 12},
                                                       "maxItems": 4}},
            "required": ["name", "items"], "additionalProperties": False}}}
        msgs = [{"role": "user", "content": "List the boats: " + REPEAT}]
        kw = dict(model=MINI, messages=msgs, max_tokens=80, temperature=0, response_format=fmt,
                  extra_body={"chat_template_kwargs": {"thinking": False}})
        a = on.client().chat.completions.create(**kw)
        b = off.client().chat.completions.create(**kw)
        assert a.choices[0].message.content == b.choices[0].message.content
        if a.choices[0].finish_reason == "stop":
            json.loads(a.choices[0].message.content)
    check("a JSON-schema constraint: the same output", schema)

    def per_request():
        before = spec_counts(off)[0]
        r = h.post(off.url + "/v1/completions", json_body={
            "model": MINI, "prompt": REPEAT, "max_tokens": 40, "temperature": 0,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == complete(off, REPEAT, max_tokens=40).choices[0].text
        assert spec_counts(off)[0] > before, "the request's own speculative_config drafted nothing"
        for bad in [{"method": "eagle"}, {"num_speculative_tokens": 0}, {"draft_tensor_parallel_size": 1}, "x"]:
            r = h.post(off.url + "/v1/completions", json_body={"model": MINI, "prompt": "a", "max_tokens": 2,
                                                                "speculative_config": bad})
            assert r.status_code == 400 and "speculative_config" in r.text, (bad, r.status_code, r.text)
        r = h.post(off.url + "/v1/completions", json_body={"model": MINI, "prompt": "a", "max_tokens": 2,
                                                            "speculative_config": {"method": "draft_model"}})
        assert r.status_code == 400 and "draft model" in r.text, r.text
    check("a request's own speculative_config (vLLM's names); bad ones are 400s", per_request)

    def metrics_shape():
        text = h.get(on.url + "/metrics").text
        for name in ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                     "vllm:spec_decode_num_accepted_tokens_total"]:
            assert f"# TYPE {name} counter" in text and f'{name}{{model_name="{MINI}"}}' in text, name
        pos = re.findall(r'vllm:spec_decode_num_accepted_tokens_per_pos_total\{model_name="[^"]*",position="(\d+)"\}',
                         text)
        assert [int(p) for p in pos] == list(range(6)), pos
        d, t, acc = spec_counts(on)
        per = sum(h.metric(on.metrics(), "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                  for p in range(6))
        assert per == acc and acc <= t, (per, acc, t)
    check("/metrics: vLLM's spec_decode counters, per position up to k", metrics_shape)
    on.stop()
    off.stop()

    def preempt():
        small = ["--cache-tokens", "512", "--block-size", "16", "--max-num-seqs", "6", *ISA]
        a = h.Server(MINI, "--speculative", "suffix", "--spec-no-cost-model", *small)
        b = h.Server(MINI, *small)
        try:
            out = {}
            for sv, key in [(a, "on"), (b, "off")]:
                res = [None] * 6

                def run(i, sv=sv, res=res):
                    res[i] = complete(sv, REPEAT if i % 2 else CODE * 2 + str(i), max_tokens=120,
                                      extra_body={"ignore_eos": True}).choices[0].text
                th = [threading.Thread(target=run, args=(i,)) for i in range(6)]
                for t in th:
                    t.start()
                for t in th:
                    t.join()
                out[key] = res
                pre = h.metric(sv.metrics(), "vllm:num_preemptions_total")
                assert pre and pre > 0, f"{key}: no preemption on a 512-token pool"
            assert out["on"] == out["off"], (out["on"], out["off"])
        finally:
            a.stop()
            b.stop()
    check("a pool that preempts (512 tokens, 6 requests of ~220 at once): the same texts", preempt)

    if MPI:
        def under_mpi(flag):
            def fn():
                one = h.Server(MINI, "--max-num-seqs", "4", *ISA)
                two = MpiServer(MINI, flag, "2", "--speculative", "suffix", "--spec-no-cost-model", "--max-num-seqs", "4",
                                *ISA)
                try:
                    for p in prompts:
                        a, b = complete(two, p), complete(one, p)
                        assert a.choices[0].text == b.choices[0].text, (p[:20], a.choices[0].text,
                                                                        b.choices[0].text)
                    assert spec_counts(two)[2] > 0, "nothing accepted under mpirun"
                finally:
                    two.stop()
                    one.stop()
            return fn
        check("mpirun -np 2 --dcp 2 drafting: the same greedy text as one process without", under_mpi("--dcp"))
        check("mpirun -np 2 --ep 2 drafting: the same greedy text as one process without", under_mpi("--ep"))



if __name__ == "__main__":
    suite.main(main)
