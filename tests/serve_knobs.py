"""serve_knobs.py -- the sampling knobs, roles and thinking of `k3 serve` with the official `openai` client.

Usage: python tests/serve_knobs.py K3_BINARY
Starts `k3 serve` on tests/models/tiny (and models/k3-mini for the thinking checks) and checks, through
`openai.OpenAI` as a user calls it:
  - frequency_penalty / presence_penalty against their definition: greedy with the penalties equals
    greedy one token at a time with logit_bias = -(count * frequency + (count > 0) * presence) over the
    tokens generated so far (OpenAI's definition, which logit_bias expresses exactly);
  - logit_bias against the raw logprobs (a bias that closes the gap to the best token flips the greedy
    choice, one that does not leaves it), clamping to [-100, 100], a key that is not a token id;
  - allowed_token_ids, bad_words (vLLM's tokenization), include_stop_str_in_output, skip_special_tokens,
    spaces_between_special_tokens, repetition_penalty kept;
  - the developer role, every reasoning_effort (the prompt it renders and the answer), thinking that uses
    up max_tokens (content "", finish_reason length, reasoning_tokens), logprobs.content = message.content,
    an unsupported content part named;
  - /metrics right after each reply: the success counter and the histograms agree, prompt tokens counted
    as vLLM counts them (cached ones in), /tokenizer_info.
Prints `ok   knobs: NAME` / `FAIL knobs: NAME` and ends with `knobs: N passed, N failed`.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402


suite = h.Suite("knobs")
check = suite.check


def main():
    s = h.Server(h.TINY)
    c = s.client()
    M = s.name
    def tok(text, specials=False):
        body = {"prompt": text} if specials else {"prompt": text, "split_special_tokens": True}
        return h.post(s.url + "/tokenize", json_body=body).json()["tokens"]

    def detok(ids):
        return h.post(s.url + "/detokenize", json_body={"tokens": ids}).json()["prompt"]

    def gtext(prompt, n, **extra):
        r = c.completions.create(model=M, prompt=prompt, max_tokens=n, temperature=0,
                                 extra_body={"ignore_eos": True, **extra})
        return r.choices[0].text, r

    PROMPT = "Once upon a time"
    P = tok(PROMPT)
    specials = {int(k) for k in h.get(s.url + "/tokenizer_info").json()["added_tokens_decoder"]}

    def greedy_ids(prompt, n, **kw):
        """greedy token ids (return_tokens_as_token_ids) and the response."""
        r = c.completions.create(model=M, prompt=prompt, max_tokens=n, temperature=0, logprobs=0,
                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                             **kw.pop("extra", {})}, **kw)
        return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens], r

    def t_penalties():
        for freq, pres in ((1.5, 0.0), (0.0, 1.8), (0.6, 0.9), (-0.7, -0.4)):
            got, _ = greedy_ids(P, 12, frequency_penalty=freq, presence_penalty=pres)
            plain, _ = greedy_ids(P, 12)
            # the reference: one token at a time, the penalties of the tokens so far as logit_bias
            ref = []
            for _ in range(12):
                bias = {}
                for t in set(ref):
                    bias[str(t)] = -(ref.count(t) * freq + pres)
                ids, _ = greedy_ids(P + ref, 1, logit_bias=bias)
                ref += ids
            assert got == ref, (freq, pres, got, ref)
            if freq > 0 or pres > 0:
                assert got != plain or len(set(plain)) == len(plain), ("the penalties changed nothing", plain)
            # chat takes them too
            r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, frequency_penalty=freq, presence_penalty=pres,
                                          reasoning_effort="none")
            assert r.choices[0].finish_reason in ("length", "stop"), r
        h.expect_status(lambda: c.completions.create(model=M, prompt="x", frequency_penalty=2.01), 400)
        h.expect_status(lambda: c.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}],
                                                            presence_penalty=-2.5), 400)

    def t_logit_bias():
        r = c.completions.create(model=M, prompt=P, max_tokens=1, temperature=0, logprobs=5,
                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        top = r.choices[0].logprobs.top_logprobs[0]
        (best, lb), (second, ls) = sorted(top.items(), key=lambda kv: -kv[1])[:2]
        best, second = int(best.split(":")[1]), int(second.split(":")[1])
        gap = lb - ls
        # raw logprobs differ from logits by one constant: the bias closes the gap or it does not
        assert greedy_ids(P, 1, logit_bias={str(second): gap + 0.05})[0] == [second]
        assert greedy_ids(P, 1, logit_bias={str(second): max(gap - 0.05, 0)})[0] == [best]
        assert greedy_ids(P, 1, logit_bias={str(best): -100})[0] != [best]
        # clamped to [-100, 100]: +1e9 is +100, which still wins; -1e9 is -100
        ids, _ = greedy_ids(P, 6, logit_bias={"77": 1e9})
        assert ids == [77] * 6, ids
        assert greedy_ids(P, 1, logit_bias={str(best): -1e9})[0] != [best]
        # the reported logprobs stay the model's own (vLLM's raw logprobs): 77's logprob after P, as the
        # echoed prompt P + [77] gives it
        _, rb = greedy_ids(P, 1, logit_bias={"77": 100})
        echo = c.completions.create(model=M, prompt=P + [77], max_tokens=0, echo=True, logprobs=1, temperature=0)
        raw77 = echo.choices[0].logprobs.token_logprobs[-1]
        assert abs(rb.choices[0].logprobs.token_logprobs[0] - raw77) < 1e-5, (rb.choices[0].logprobs, raw77)
        e = h.expect_status(lambda: c.completions.create(model=M, prompt="x", logit_bias={"99999999": 1}), 400)
        assert "99999999" in e.message, e.message
        e = h.expect_status(lambda: c.completions.create(model=M, prompt="x", logit_bias={"hello": 1}), 400)
        assert "hello" in e.message, e.message
        # chat
        rc = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logit_bias={"77": 100}, reasoning_effort="none",
                                       logprobs=True, extra_body={"ignore_eos": True})
        assert [t.token for t in rc.choices[0].logprobs.content] == [detok([77])] * 3, rc.choices[0]
        assert rc.choices[0].message.content == detok([77]) * 3, rc.choices[0]

    def t_allowed_and_bad_words():
        r = c.completions.create(model=M, prompt=P, max_tokens=1, temperature=0, logprobs=20,
                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        top = sorted(r.choices[0].logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])
        allowed = [int(k.split(":")[1]) for k, _ in top[3:8]]
        ids, _ = greedy_ids(P, 10, extra={"allowed_token_ids": allowed})
        assert ids[0] == allowed[0] and all(t in allowed for t in ids), (ids, allowed)
        rs = c.completions.create(model=M, prompt=P, max_tokens=30, temperature=1.5, seed=3,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": allowed,
                                              "return_tokens_as_token_ids": True}, logprobs=0)
        assert all(int(t.split(":")[1]) in allowed for t in rs.choices[0].logprobs.tokens), rs.choices[0]
        h.expect_status(lambda: c.completions.create(model=M, prompt="x", extra_body={"allowed_token_ids": []}), 400)
        h.expect_status(lambda: c.completions.create(model=M, prompt="x",
                                                      extra_body={"allowed_token_ids": [10 ** 8]}), 400)
        # bad words: a word of the greedy text is never generated again, as either spelling
        plain_ids, plain = greedy_ids(P, 24)
        words = [detok([t]).strip() for t in plain_ids if t not in specials]
        words = [w for w in words if w.isascii() and w.isalnum()]
        assert words, plain.choices[0].text
        word = words[0]
        spellings = [tok(word), tok(" " + word)]
        got, rb = greedy_ids(P, 24, extra={"bad_words": [word]})
        for sp in spellings:
            for i in range(len(got) - len(sp) + 1):
                assert got[i:i + len(sp)] != sp, (word, sp, got)
        assert got != plain_ids, "bad_words changed nothing"
        h.expect_status(lambda: c.completions.create(model=M, prompt="x", extra_body={"bad_words": ["  "]}), 400)
        h.expect_status(lambda: c.completions.create(model=M, prompt="x", extra_body={"bad_words": "x"}), 400)

    def t_stop_str_and_specials():
        full, _ = gtext(PROMPT, 24)
        stop = full[len(full) // 2:len(full) // 2 + 3]
        cut = full[:full.find(stop)]
        r = c.completions.create(model=M, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
        assert r.choices[0].text == cut + stop and r.choices[0].finish_reason == "stop", (r, cut, stop)
        chunks = list(c.completions.create(model=M, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                           stream=True, extra_body={"ignore_eos": True,
                                                                    "include_stop_str_in_output": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == cut + stop
        # a stop token's text stays with include_stop_str_in_output (an ordinary id as the stop)
        ids, _ = greedy_ids(P, 8)
        sid = [t for t in ids[1:] if t not in specials][0]
        without, _ = gtext(P, 8, stop_token_ids=[sid])
        with_, _ = gtext(P, 8, stop_token_ids=[sid], include_stop_str_in_output=True)
        assert with_ == without + detok([sid]), (with_, without, detok([sid]))
        # specials: left out by default; by name with skip_special_tokens false, spaced by default
        bos = tok("[BOS]", specials=True)
        assert len(bos) == 1, bos
        base = {"logit_bias": {str(bos[0]): 100}}
        t0, _ = gtext(P, 3, **base)
        t1, _ = gtext(P, 3, **base, skip_special_tokens=False)
        t2, _ = gtext(P, 3, **base, skip_special_tokens=False, spaces_between_special_tokens=False)
        assert (t0, t1, t2) == ("", "[BOS] [BOS] [BOS]", "[BOS][BOS][BOS]"), (t0, t1, t2)
        # chat: the same, the reply's markup parsed away either way
        kw = dict(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
                  reasoning_effort="none")
        m0 = c.chat.completions.create(**kw, extra_body={"ignore_eos": True, **base}).choices[0].message.content
        m1 = c.chat.completions.create(**kw, extra_body={"ignore_eos": True, **base,
                                                         "skip_special_tokens": False}).choices[0].message.content
        assert (m0, m1) == ("", "[BOS] [BOS]"), (m0, m1)
        # repetition_penalty is still taken (1 changes nothing)
        assert greedy_ids(P, 12, extra={"repetition_penalty": 1.0})[0] == greedy_ids(P, 12)[0]
        greedy_ids(P, 12, extra={"repetition_penalty": 1.5})

    def t_developer_role():
        msgs = lambda role: [{"role": role, "content": "Answer in one word."}, {"role": "user", "content": "hi"}]  # noqa
        ids = [h.post(s.url + "/tokenize", json_body={"messages": msgs(r)}).json()["tokens"] for r in ("system", "developer")]
        assert ids[0] == ids[1], ids
        a, b = [c.chat.completions.create(model=M, messages=msgs(r), max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}) for r in ("system", "developer")]
        assert a.choices[0].message == b.choices[0].message, (a, b)
        assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)
        e = h.expect_status(lambda: c.chat.completions.create(model=M, messages=[{"role": "moderator", "content": "x"}]), 400)
        assert "moderator" in e.message
        e = h.expect_status(lambda: c.chat.completions.create(model=M, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]), 400)
        assert "input_audio" in e.message, e.message

    def t_reasoning_effort():
        def prompt(**body):
            return h.post(s.url + "/tokenize", json_body={"messages": [{"role": "user", "content": "hi"}], **body}).json()["tokens"]
        kw = lambda e: {"chat_template_kwargs": {"thinking": e is not None, "thinking_effort": e}}  # noqa
        want = {None: kw("max"), "none": kw(None), "minimal": kw("low"), "low": kw("low"), "medium": kw("high"),
                "high": kw("high"), "xhigh": kw("max"), "max": kw("max")}
        assert prompt() == prompt(**kw("max")) != prompt(**{"chat_template_kwargs": {"thinking": True,
                                                                                     "thinking_effort": None}})
        for effort, k in want.items():
            body = {} if effort is None else {"reasoning_effort": effort}
            assert prompt(**body) == prompt(**k), effort
            args = dict(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
                        extra_body={"ignore_eos": True})
            r = c.chat.completions.create(**args, **({} if effort is None else {"reasoning_effort": effort}))
            r2 = c.chat.completions.create(**{**args, "extra_body": {"ignore_eos": True, **k}})
            assert r.usage.prompt_tokens == len(prompt(**k)) and r.choices[0].message == r2.choices[0].message, effort
            m = r.choices[0].message
            if effort == "none":
                assert not (m.model_extra or {}).get("reasoning_content") and isinstance(m.content, str), m
                assert r.usage.completion_tokens_details.reasoning_tokens == 0
        # chat_template_kwargs win over reasoning_effort
        assert prompt(reasoning_effort="high", chat_template_kwargs={"thinking": False}) == prompt(**kw(None))
        e = h.expect_status(lambda: c.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}],
                                                                reasoning_effort="extreme"), 400)
        assert "extreme" in e.message and "xhigh" in e.message, e.message

    for name, fn in [("frequency and presence penalties = their logit_bias", t_penalties),
                     ("logit_bias against the raw logprobs, clamped, bad keys", t_logit_bias),
                     ("allowed_token_ids and bad_words", t_allowed_and_bad_words),
                     ("include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens",
                      t_stop_str_and_specials),
                     ("developer role = system, unsupported parts named", t_developer_role),
                     ("each reasoning_effort renders its K3 thinking", t_reasoning_effort)]:
        check(name, fn)
    s.stop()

    # thinking on the trained model, and /metrics right after each reply (a fresh server: exact counts)
    sm = h.Server(h.MINI)
    cm = sm.client()
    MM = sm.name

    def t_thinking_budget():
        q = [{"role": "user", "content": "Who wrote Pride and Prejudice?"}]
        r = cm.chat.completions.create(model=MM, messages=q, max_tokens=3, temperature=0)
        ch = r.choices[0]
        assert ch.message.content == "" and ch.finish_reason == "length", ch
        assert ch.message.model_extra.get("reasoning_content"), ch.message
        assert r.usage.completion_tokens_details.reasoning_tokens == 3 == r.usage.completion_tokens, r.usage
        state = ChatCompletionStreamState()
        for chunk in cm.chat.completions.create(model=MM, messages=q, max_tokens=3, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
            state.handle_chunk(chunk)
        acc = state.current_completion_snapshot
        assert acc.choices[0].message.content == "" and acc.choices[0].finish_reason == "length", acc
        assert acc.usage.completion_tokens_details.reasoning_tokens == 3, acc.usage
        # a whole reply: reasoning tokens + the rest = completion tokens; logprobs.content = content
        r = cm.chat.completions.create(model=MM, messages=q, max_tokens=80, temperature=0, logprobs=True,
                                       top_logprobs=2)
        ch = r.choices[0]
        assert ch.finish_reason == "stop" and ch.message.content and ch.message.model_extra["reasoning_content"], ch
        lp = b"".join(bytes(t.bytes) for t in ch.logprobs.content).decode()
        assert lp == ch.message.content, (lp, ch.message.content)
        rt = r.usage.completion_tokens_details.reasoning_tokens
        assert 0 < rt < r.usage.completion_tokens - len(ch.logprobs.content), (rt, r.usage)
        state = ChatCompletionStreamState()
        for chunk in cm.chat.completions.create(model=MM, messages=q, max_tokens=80, temperature=0, logprobs=True,
                                                top_logprobs=2, stream=True):
            state.handle_chunk(chunk)
        acc = state.current_completion_snapshot.choices[0]
        assert acc.message.content == ch.message.content, (acc.message, ch.message)
        assert [t.token for t in acc.logprobs.content] == [t.token for t in ch.logprobs.content], acc.logprobs

    def t_metrics_together():
        def m():
            return sm.metrics()
        seen_prompt = seen_cached = 0
        m0 = m()
        base = {k: h.metric(m0, k) or 0 for k in ("vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total")}
        n0 = sum(h.metric(m0, "vllm:request_success_total", finished_reason=r) or 0 for r in ("stop", "length", "abort", "error"))
        for i in range(6):
            if i % 2:
                r = cm.chat.completions.create(model=MM, messages=[{"role": "user", "content": f"Question {i // 2}?"}],
                                               max_tokens=4, temperature=0)
            else:
                r = cm.completions.create(model=MM, prompt="It is a truth universally acknowledged, that " * 8,
                                          max_tokens=3, temperature=0)
            seen_prompt += r.usage.prompt_tokens
            seen_cached += r.usage.prompt_tokens_details.cached_tokens
            mm = m()  # right after the reply: no wait
            n = sum(h.metric(mm, "vllm:request_success_total", finished_reason=x) or 0 for x in ("stop", "length", "abort", "error"))
            for hist in ("vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                         "vllm:request_generation_tokens", "vllm:request_queue_time_seconds",
                         "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"):
                assert h.metric(mm, hist + "_count") == n, (i, hist, h.metric(mm, hist + "_count"), n)
            assert n == n0 + i + 1, (i, n, n0)
            assert h.metric(mm, "vllm:prompt_tokens_total") - base["vllm:prompt_tokens_total"] == seen_prompt, (i, mm)
            assert h.metric(mm, "vllm:prompt_tokens_cached_total") - base["vllm:prompt_tokens_cached_total"] == seen_cached
            assert h.metric(mm, "vllm:request_prompt_tokens_sum") - (h.metric(m0, "vllm:request_prompt_tokens_sum") or 0) == seen_prompt
        assert seen_cached > 0, "the repeated prompts were never cached"
        # what the forward pass computed is the rest
        assert h.metric(m(), "k3:prompt_tokens_computed_total") <= h.metric(m(), "vllm:prompt_tokens_total")

    def t_tokenizer_info():
        info = h.get(sm.url + "/tokenizer_info").json()
        cfg = json.load(open(os.path.join(h.MINI, "tokenizer_config.json")))
        assert info["tokenizer_class"] == cfg["tokenizer_class"] and info["eos_token"] == cfg["eos_token"], info
        assert info["bos_token"] == cfg["bos_token"] and info["pad_token"] == cfg["pad_token"]
        assert info["added_tokens_decoder"] == {k: v["content"] for k, v in cfg["added_tokens_decoder"].items()}
        assert "vocab_file" not in info and info["model_max_length"] == cfg["model_max_length"]
        # lm-eval's remote tokenizer finds the EOS id by tokenizing its name
        eos = h.post(sm.url + "/tokenize", json_body={"prompt": info["eos_token"], "add_special_tokens": False}).json()
        want = [int(k) for k, v in cfg["added_tokens_decoder"].items() if v["content"] == cfg["eos_token"]]
        assert eos["tokens"] == want, (eos, want)
        # and decodes ids back
        d = h.post(sm.url + "/detokenize", json_body={"tokens": eos["tokens"]}).json()
        assert d == {"prompt": cfg["eos_token"]}, d

    for name, fn in [("thinking that uses up max_tokens; reasoning tokens; logprobs = content", t_thinking_budget),
                     ("/metrics right after each reply: counters and histograms together", t_metrics_together),
                     ("/tokenizer_info as vLLM answers it", t_tokenizer_info)]:
        check(name, fn)
    sm.stop()


if __name__ == "__main__":
    suite.main(main)
