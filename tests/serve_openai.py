"""serve_openai.py -- `k3 serve` end to end with the official `openai` client.

Usage: python tests/serve_openai.py K3_BINARY
Starts `k3 serve` (a free port per run, --port 0) on tests/models/tiny,
tests/models/vision-tiny and models/k3-mini, runs the checks, and always stops every server it started
(tests/harness.py). Prints `ok   serve: NAME` / `FAIL serve: NAME` per check and
ends with `serve: N passed, N failed, N skipped`.
"""
import json
import os
import re
import socket
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import (IMAGES, K3, MINI, TINY, VISION, Server, data_url, expect_status, get,  # noqa: E402
                     image_msg, metric, png_url, post)

from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

suite = h.Suite("serve")
check = suite.check


def greedy(c, model, prompt, n=16, **kw):
    return c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                extra_body={"ignore_eos": True}, **kw)


def main():
    s = Server(TINY)
    c = s.client()
    M = s.name

    def t_models():
        ms = c.models.list().data
        assert len(ms) == 1 and ms[0].id == M, ms
        assert ms[0].model_extra["max_model_len"] > 0, ms[0]

    def t_completion():
        r = greedy(c, M, "Hello world", 8)
        assert r.object == "text_completion" and len(r.choices) == 1
        assert r.choices[0].finish_reason == "length", r.choices[0]
        assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 6, r.usage
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        r2 = greedy(c, M, "Hello world", 8)
        assert r2.choices[0].text == r.choices[0].text, "greedy is not deterministic"
        # a prompt of token ids is the same request
        r3 = greedy(c, M, [39, 596, 78, 286, 267, 582], 8)
        assert r3.choices[0].text == r.choices[0].text
        # several prompts in one request: one choice each, in order, each as if alone
        r4 = greedy(c, M, ["Once upon a time", "Hello world"], 8)
        assert [ch.index for ch in r4.choices] == [0, 1] and r4.choices[1].text == r.choices[0].text, r4
        assert r4.choices[0].text == greedy(c, M, "Once upon a time", 8).choices[0].text
        assert r4.usage.completion_tokens == 16

    def t_chat():
        r = c.chat.completions.create(model=M, messages=[{"role": "system", "content": "be brief"},
                                                         {"role": "user", "content": "hi"}],
                                      max_completion_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert r.usage.completion_tokens == 8, r.usage
        assert r.choices[0].finish_reason == "length"

    def t_stream_usage():
        whole = greedy(c, M, "Hello world", 12).choices[0].text
        chunks = list(c.completions.create(model=M, prompt="Hello world", max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == whole, (text, whole)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12, chunks[-1]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        # chat: the role first, then deltas, then the finish
        cs = list(c.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
        assert cs[0].choices[0].delta.role == "assistant", cs[0]
        assert cs[-1].usage.completion_tokens == 6
        assert cs[-2].choices[0].finish_reason == "length"

    def t_stop():
        stops0 = metric(s.metrics(), "vllm:request_success_total", finished_reason="stop") or 0
        full = greedy(c, M, "Once upon a time", 24).choices[0].text
        k = len(full) // 2
        stop = full[k:k + 3]
        assert len(stop) == 3, full
        want = full[:full.find(stop)]
        r = greedy(c, M, "Once upon a time", 24, stop=[stop, "@@never@@"])
        assert r.choices[0].text == want, (r.choices[0].text, want, stop)
        assert r.choices[0].finish_reason == "stop"
        chunks = list(c.completions.create(model=M, prompt="Once upon a time", max_tokens=24, temperature=0,
                                           stop=stop, stream=True, extra_body={"ignore_eos": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == want and stop not in text, (text, want)
        assert chunks[-1].choices[0].finish_reason == "stop"
        # the engine reports the cancelled requests at its next step; they count as "stop"
        h.wait_until(lambda: (metric(s.metrics(), "vllm:request_success_total", finished_reason="stop") or 0) >=
                     stops0 + 2, 10, "the two stopped requests counted as stop")
        stops = metric(s.metrics(), "vllm:request_success_total", finished_reason="stop") or 0
        assert stops == stops0 + 2, (stops0, stops)

    def t_n2_seed():
        r = c.completions.create(model=M, prompt="Hello", max_tokens=10, temperature=1.0, n=2, seed=7,
                                 extra_body={"ignore_eos": True})
        assert len(r.choices) == 2 and {ch.index for ch in r.choices} == {0, 1}
        assert r.usage.completion_tokens == 20
        r2 = c.completions.create(model=M, prompt="Hello", max_tokens=10, temperature=1.0, n=2, seed=7,
                                  extra_body={"ignore_eos": True})
        assert [ch.text for ch in r.choices] == [ch.text for ch in r2.choices], "same seed, other text"
        r3 = c.completions.create(model=M, prompt="Hello", max_tokens=10, temperature=1.0, seed=8,
                                  extra_body={"ignore_eos": True})
        assert r3.choices[0].text not in (r.choices[0].text, r.choices[1].text) or True
        texts = set()
        for sd in range(4):
            texts.add(c.completions.create(model=M, prompt="Hello", max_tokens=10, temperature=1.0, seed=100 + sd,
                                           extra_body={"ignore_eos": True}).choices[0].text)
        assert len(texts) > 1, "four seeds gave one text"

    def t_logprobs_echo():
        r = c.completions.create(model=M, prompt="Hello world", max_tokens=1, temperature=0, echo=True,
                                 logprobs=1, extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == 7 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
        assert all(x <= 0 for x in lp.token_logprobs[1:]), lp.token_logprobs
        assert r.choices[0].text.startswith("Hello world")
        # greedy: the generated token is the most likely one
        assert abs(max(lp.top_logprobs[-1].values()) - lp.token_logprobs[-1]) < 1e-4, lp
        # the prompt logprobs agree with the logprob each prefix gives the next token when generated
        r2 = c.completions.create(model=M, prompt="Hello", max_tokens=1, temperature=0, logprobs=5,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        top = r2.choices[0].logprobs.top_logprobs[0]
        assert len(top) == 5 and all(k.startswith("token_id:") for k in top), top
        assert r2.choices[0].logprobs.tokens[0] == max(top, key=top.get), r2.choices[0].logprobs
        ch = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2, reasoning_effort="none",
                                       extra_body={"ignore_eos": True})
        lc = ch.choices[0].logprobs.content
        # a tiny model's tokens may be bytes that are not UTF-8 alone: the content has U+FFFD for each
        got = b"".join(bytes(t.bytes) for t in lc).decode(errors="replace")
        assert got == ch.choices[0].message.content, (lc, ch.choices[0])
        assert len(lc) >= 1 and len(lc[0].top_logprobs) == 2, lc

    def t_tools():
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                   "parameters": {"type": "object", "properties": {
                                                       "city": {"type": "string"}}, "required": ["city"]}}}]
        msgs = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
        r = c.chat.completions.create(model=M, messages=msgs, tools=tools, tool_choice="auto", max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason in ("length", "tool_calls", "stop"), r.choices[0]
        # streamed, accumulated by the official client's own stream state (tool-call deltas by index,
        # arguments concatenated): the same message as the whole reply
        kw = dict(model=M, messages=msgs, tools=tools, tool_choice="auto", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": False}})
        whole = c.chat.completions.create(**kw).choices[0]
        state = ChatCompletionStreamState()
        for ch in c.chat.completions.create(stream=True, **kw):
            state.handle_chunk(ch)
        acc = state.current_completion_snapshot.choices[0]
        assert acc.finish_reason == whole.finish_reason, (acc, whole)
        assert (acc.message.content or "") == (whole.message.content or ""), (acc.message, whole.message)
        wt = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
        at = [(t.function.name, t.function.arguments) for t in acc.message.tool_calls or []]
        assert at == wt, (at, wt)
        # the tools and the call are in the prompt: it is longer than the same talk without them
        plain = post(s.url + "/tokenize", json_body={"messages": [msgs[0]]}).json()["count"]
        assert r.usage.prompt_tokens > plain + 20, (r.usage.prompt_tokens, plain)
        # a call naming an unknown tool result is the client's error
        bad = msgs[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}] + [{"role": "nobody"}]
        expect_status(lambda: c.chat.completions.create(model=M, messages=bad, max_tokens=2), 400)

    def t_thinking():
        on = post(s.url + "/tokenize", json_body={"messages": [{"role": "user", "content": "hi"}]}).json()
        off = post(s.url + "/tokenize", json_body={"messages": [{"role": "user", "content": "hi"}],
                                                    "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert on["tokens"] != off["tokens"], "thinking on and off encode the same prompt"
        kw = dict(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        r_off = c.chat.completions.create(**kw, extra_body={"ignore_eos": True,
                                                            "chat_template_kwargs": {"enable_thinking": False}})
        m = r_off.choices[0].message
        assert getattr(m, "reasoning_content", None) in (None, ""), m
        r_on = c.chat.completions.create(**kw, extra_body={"ignore_eos": True,
                                                           "chat_template_kwargs": {"enable_thinking": True}})
        m = r_on.choices[0].message
        assert m.model_extra.get("reasoning_content"), m
        # streamed thinking arrives as reasoning_content deltas
        cs = list(c.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
        rs = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in cs if ch.choices)
        assert rs == m.model_extra["reasoning_content"], (rs, m.model_extra["reasoning_content"])

    def t_errors():
        r = post(s.url + "/v1/completions", content=b'{"prompt": "x",', timeout=10)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
        r = post(s.url + "/v1/completions", content=b'{"prompt": "\xff"}', timeout=10)
        assert r.status_code == 400, r.text
        expect_status(lambda: c.completions.create(model=M, prompt="x", temperature="hot"), 400)
        expect_status(lambda: c.completions.create(model=M, prompt="x", max_tokens=-1), 400)
        expect_status(lambda: c.completions.create(model=M, prompt="x", n=99), 400)
        expect_status(lambda: c.completions.create(model=M, prompt=[99999999]), 400)
        expect_status(lambda: c.completions.create(model=M, prompt=""), 400)
        expect_status(lambda: c.completions.create(model=M, prompt="x", presence_penalty=2.5), 400)
        expect_status(lambda: c.completions.create(model=M, prompt="x", logit_bias={"99999999": 10}), 400)
        expect_status(lambda: c.completions.create(model=M, prompt="x", stream_options={"include_usage": True}), 400)
        mml = c.models.list().data[0].model_extra["max_model_len"]
        e = expect_status(lambda: c.completions.create(model=M, prompt=[5] * (mml + 1), max_tokens=1), 400)
        assert "length" in str(e) or "context" in str(e), e
        expect_status(lambda: c.completions.create(model=M, prompt=[5] * 10, max_tokens=mml), 400)
        expect_status(lambda: c.completions.create(model="no-such-model", prompt="x"), 404)
        assert get(s.url + "/v1/nothing", timeout=10).status_code == 404
        # announced over the limit: refused before the body is sent
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sk:
            sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5242880\r\n\r\n")
            head = sk.recv(200)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert get(s.url + "/health", timeout=10).status_code == 200

    def t_dropped_stream():
        before = s.metrics()
        ab0 = metric(before, "vllm:request_success_total", finished_reason="abort") or 0
        st = c.completions.create(model=M, prompt="Hello world", max_tokens=3000, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
        got = 0
        for ch in st:
            got += 1
            if got == 3:
                break
        st.close()
        def ended():
            m = s.metrics()
            return (metric(m, "vllm:num_requests_running") == 0 and metric(m, "k3:kv_blocks_used") == 0 and
                    (metric(m, "vllm:request_success_total", finished_reason="abort") or 0) > ab0)
        h.wait_until(ended, 10, "the dropped stream to end (running 0, no blocks held, one more abort)")

    def t_concurrent():
        prompts = [f"Request number {i} says" for i in range(32)]
        alone = [greedy(c, M, p, 12).choices[0].text for p in prompts]
        results = [None] * 32
        errors = []

        def run(i):
            try:
                cl = s.client()
                parts = [ch.choices[0].text for ch in cl.completions.create(
                    model=M, prompt=prompts[i], max_tokens=12, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}) if ch.choices]
                results[i] = "".join(parts)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        th = [threading.Thread(target=run, args=(i,)) for i in range(32)]
        for t in th:
            t.start()
        for t in th:
            t.join(120)
        assert not errors, errors[:3]
        diff = [i for i in range(32) if results[i] != alone[i]]
        assert not diff, f"{len(diff)} of 32 differ from the same request alone, e.g. {results[diff[0]]!r} vs {alone[diff[0]]!r}"

    def t_prefix_cache():
        before = s.metrics()
        h0 = metric(before, "vllm:prefix_cache_hits_total") or 0
        long_prompt = " ".join(f"word{i}" for i in range(120))
        r1 = greedy(c, M, long_prompt, 4)
        r2 = greedy(c, M, long_prompt, 4)
        assert r1.usage.prompt_tokens >= 192, r1.usage
        assert r2.usage.prompt_tokens_details.cached_tokens > 0, r2.usage
        assert r2.choices[0].text == r1.choices[0].text
        after = s.metrics()
        assert (metric(after, "vllm:prefix_cache_hits_total") or 0) > h0, "hits did not grow"
        assert metric(after, "vllm:time_to_first_token_seconds_count") > 0

    def t_busy_and_key():
        s2 = Server(TINY, "--max-num-seqs", "1", "--max-waiting", "1", key="k3-secret")
        try:
            expect_status(lambda: s2.client(key="wrong").models.list(), 401)
            assert get(s2.url + "/v1/models", timeout=10).status_code == 401
            assert get(s2.url + "/health", timeout=10).status_code == 200
            cl = s2.client()
            assert cl.models.list().data[0].id == TINY
            codes = []
            lock = threading.Lock()

            def one():
                r = post(s2.url + "/v1/completions", headers={"Authorization": "Bearer k3-secret"},
                               json_body={"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}, timeout=60)
                with lock:
                    codes.append((r.status_code, r.headers.get("retry-after")))

            th = [threading.Thread(target=one) for _ in range(6)]
            for t in th:
                t.start()
            for t in th:
                t.join(60)
            assert any(cd == 503 and ra for cd, ra in codes), codes
            assert any(cd == 200 for cd, _ in codes), codes
        finally:
            s2.stop()

    def t_kv_residency():
        # vLLM's sampled residency histograms: absent unless asked for; with every block followed and a
        # pool of 8 blocks, the lifetime count grows once requests evict blocks
        assert metric(s.metrics(), "vllm:kv_block_lifetime_seconds_count") is None
        s3 = Server(TINY, "--kv-cache-metrics", "--kv-cache-metrics-sample", "1", "--cache-tokens", "512",
                    "--max-num-seqs", "2")
        try:
            m0 = s3.metrics()
            names = ["vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
                     "vllm:kv_block_reuse_gap_seconds"]
            for n in names:
                assert metric(m0, n + "_count") == 0, (n, m0)
                assert metric(m0, n + "_bucket", le="1800") == 0 and metric(m0, n + "_bucket", le="+Inf") == 0
            cl = s3.client()
            counts = []
            for i in range(6):
                words = " ".join(f"w{(i * 37 + k) % 101}" for k in range(60))
                greedy(cl, TINY, words, 8)
                counts.append(metric(s3.metrics(), "vllm:kv_block_lifetime_seconds_count"))
            assert counts[-1] > counts[2] > 0, counts
            m1 = s3.metrics()
            assert metric(m1, "vllm:kv_block_idle_before_evict_seconds_count") == counts[-1], m1
            assert metric(m1, "vllm:kv_block_lifetime_seconds_bucket", le="+Inf") == counts[-1]
        finally:
            s3.stop()

    for name, fn in [("models", t_models), ("completion", t_completion), ("chat", t_chat),
                     ("streaming with usage", t_stream_usage), ("stop strings", t_stop),
                     ("n=2 and seed", t_n2_seed), ("logprobs with echo", t_logprobs_echo),
                     ("tool-call round trip", t_tools), ("thinking on and off", t_thinking),
                     ("errors", t_errors), ("dropped stream is cancelled", t_dropped_stream),
                     ("32 concurrent streams equal alone", t_concurrent), ("prefix cache hit", t_prefix_cache),
                     ("503 when busy, API key", t_busy_and_key),
                     ("KV block residency histograms", t_kv_residency)]:
        check(name, fn)

    def t_mini_soak():
        # 120 streams of random lengths, a fifth of the clients leaving early: none of the others
        # fails, and every block is back afterwards
        bs = subprocess.run([K3, "bench", "serve", "--base-url", s.url, "--tokenizer", TINY,
                             "--random-input-len", "48", "--random-output-len", "24", "--random-range-ratio", "0.9",
                             "--num-prompts", "120", "--max-concurrency", "24", "--disconnect-fraction", "0.2",
                             "--timeout", "60", "--json"], capture_output=True, timeout=300, text=True)
        rep = json.loads(bs.stdout.splitlines()[-1])
        assert rep["failed"] == 0 and rep["completed"] + rep["disconnected"] == 120 and rep["disconnected"] > 0, rep
        h.wait_until(lambda: metric(s.metrics(), "vllm:num_requests_running") == 0 and
                     metric(s.metrics(), "k3:kv_blocks_used") == 0, 10, "no request running and no block held after "
                     "the soak")

    check("a short soak with dropped clients", t_mini_soak)

    def t_vision():
        # images in chat: the same greedy bytes and prompt length as k3 run --image --chat
        sv = Server(VISION, "--max-image-pixels", "60000")
        try:
            cv = sv.client()
            # specials kept by name, unspaced, as k3 run prints them
            kw = dict(model=VISION, max_tokens=12, temperature=0, logprobs=True,
                      extra_body={"ignore_eos": True, "repetition_penalty": 1,
                                  "chat_template_kwargs": {"thinking": False}, "skip_special_tokens": False,
                                  "spaces_between_special_tokens": False})
            q = "What is in the picture?"
            for files in (["photo_67x45.jpg"], ["photo_67x45.jpg", "rgb_112x112.png"]):
                r = cv.chat.completions.create(messages=image_msg([data_url(IMAGES + f) for f in files], q), **kw)
                got = b"".join(bytes(t.bytes) for t in r.choices[0].logprobs.content)
                args = [K3, "run", "-m", VISION, "-n", "12", "--temp", "0", "--repeat-penalty", "1",
                        "--threads", "1", "--chat"]
                for f in files:
                    args += ["--image", IMAGES + f]
                out = subprocess.run(args + [q], capture_output=True, timeout=60)
                assert out.returncode == 0, out.stderr[-300:]
                assert got == out.stdout.rstrip(b"\n"), (files, got, out.stdout)
                n_ref = int(re.search(rb"prompt (\d+) tokens", out.stderr).group(1))
                assert r.usage.prompt_tokens == n_ref, (files, r.usage.prompt_tokens, n_ref)
                assert r.usage.completion_tokens == 12
            # the prefix cache keys images by content: two 224x224 PNGs of one colour each
            # give the same ids, so only the image's hash tells them apart
            red, blue = png_url(224, 224, (200, 30, 30)), png_url(224, 224, (30, 30, 200))
            kw["max_tokens"], kw["logprobs"] = 2, False
            cached = []
            for u in (red, red, blue):
                r = cv.chat.completions.create(messages=image_msg([u], q), **kw)
                assert r.usage.prompt_tokens > 64, r.usage
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
            assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0, cached
            # bad images are 400s with a message naming the part
            e = expect_status(lambda: cv.chat.completions.create(
                messages=image_msg(["http://example.com/cat.png"], q), **kw), 400)
            assert "messages[0].content[0]" in e.message and "data:" in e.message, e.message
            e = expect_status(lambda: cv.chat.completions.create(
                messages=image_msg(["data:image/png;base64,iVBORw0K!!!not base64"], q), **kw), 400)
            assert "messages[0].content[0]" in e.message, e.message
            e = expect_status(lambda: cv.chat.completions.create(
                messages=image_msg([red, png_url(300, 300, (9, 9, 9))], q), **kw), 400)
            assert "messages[0].content[1]" in e.message and "60000" in e.message, e.message
        finally:
            sv.stop()
        # and an image sent to a text-only model
        e = expect_status(lambda: c.chat.completions.create(
            model=M, messages=image_msg([data_url(IMAGES + "dot_5x3.png")], "hi"), max_tokens=2), 400)
        assert "vision tower" in e.message, e.message

    check("vision: images in chat equal k3 run --image, cached by content, bad images are 400s", t_vision)

    def t_shutdown():
        # a stream in flight when SIGTERM comes: the server still exits cleanly (status 0)
        st = c.completions.create(model=M, prompt="Hello", max_tokens=3000, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
        next(iter(st))
        s.stop()
        assert s.proc.returncode == 0, s.proc.returncode
        assert "shutting down" in "".join(s.log), s.log[-3:]

    check("SIGTERM shuts down cleanly", t_shutdown)

    def t_mini():
        sm = Server(MINI)
        try:
            prompt = "It is a truth universally acknowledged, that"
            r = sm.client().completions.create(model=MINI, prompt=prompt, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True})
            out = subprocess.run([K3, "run", "-m", MINI, "-n", "16", "--temp", "0", "--repeat-penalty", "1",
                                  "--threads", "1", prompt], capture_output=True, timeout=120, text=True)
            ref = out.stdout.rstrip("\n")[len(prompt):]
            assert r.choices[0].text == ref, (r.choices[0].text, ref)
            # accuracy through the API: the offline figures, to the last digit
            ev = [K3, "eval", "-m", MINI, "--text", "data/heldout/austen.txt", "--max-tokens", "600",
                  "--ctx", "256", "--threads", "1", "--compare-fp32"]
            off = subprocess.run(ev, capture_output=True, timeout=300, text=True)
            on = subprocess.run(ev + ["--base-url", sm.url], capture_output=True, timeout=300, text=True)
            assert off.returncode == 0 and on.returncode == 0, (off.stderr[-300:], on.stderr[-300:])
            lo, ln = off.stdout.splitlines()[-2:], on.stdout.splitlines()[-2:]
            assert lo[1] == ln[1] and lo[0].split(" quant ")[0] == ln[0].split(" via ")[0], (lo, ln)
            # k3 bench serve against it
            bs = subprocess.run([K3, "bench", "serve", "--base-url", sm.url, "--tokenizer", MINI,
                                 "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "8",
                                 "--max-concurrency", "4", "--ignore-eos", "--json"],
                                capture_output=True, timeout=300, text=True)
            rep = json.loads(bs.stdout.splitlines()[-1])
            assert bs.returncode == 0 and rep["completed"] == 8 and rep["failed"] == 0, bs.stdout + bs.stderr
            assert rep["total_output_tokens"] == 64 and rep["mean_ttft_ms"] > 0 and rep["mean_tpot_ms"] > 0, rep
        finally:
            sm.stop()

    check("k3-mini: greedy equals k3 run, eval --base-url equals offline eval, bench serve", t_mini)


if __name__ == "__main__":
    suite.main(main)
