"""serve_anthropic.py -- `k3 serve`'s Anthropic Messages API end to end with the official `anthropic` client.

Usage: python tests/serve_anthropic.py K3_BINARY
Starts `k3 serve` (--port 0, with an API key, sent as x-api-key and as Bearer) on tests/models/tiny,
models/k3-mini and tests/models/vision-tiny and checks /v1/messages against chat/completions (the same
conversation is the same prompt, token for token, and greedy gives the same text), the stream against the
whole answer (`messages.stream(...).get_final_message()`), thinking blocks, stop sequences, tools
(tool_use / tool_result, tool_choice), count_tokens, cache reads, images, and Anthropic's error JSON.
Prints `ok   anthropic: NAME` / `FAIL anthropic: NAME` per check and ends with
`anthropic: N passed, N failed`.
"""
import base64
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

import anthropic  # noqa: E402

TINY, MINI, VISION = h.TINY, h.MINI, h.VISION
KEY = "k3-test-key"


suite = h.Suite("anthropic")
check = suite.check


def client(s, key=KEY):
    # the key both ways: x-api-key (Anthropic's header) and Authorization: Bearer
    return anthropic.Anthropic(base_url=s.url, api_key=key, default_headers={"x-api-key": key}, timeout=60,
                               max_retries=0)


def expect_error(fn, status, etype):
    try:
        fn()
    except anthropic.APIStatusError as e:
        assert e.status_code == status, f"status {e.status_code}, wanted {status}: {e}"
        body = e.response.json()
        assert body["type"] == "error" and body["error"]["type"] == etype and body["error"]["message"], body
        return e
    raise AssertionError(f"no error, wanted HTTP {status}")


def masked(m):
    """A message as a dict without what differs between two runs of one request (ids, cache hits)."""
    d = m.model_dump(mode="json") if not isinstance(m, dict) else json.loads(json.dumps(m))
    d.pop("id", None)
    for b in d.get("content", []):
        if b.get("type") == "tool_use":
            b.pop("id", None)
    u = d.get("usage") or {}
    total = (u.get("input_tokens") or 0) + (u.get("cache_read_input_tokens") or 0)
    for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "cache_creation",
              "server_tool_use", "service_tier", "inference_geo", "output_tokens_details"):
        u.pop(k, None)
    u["prompt"] = total
    return d


def tokenize(s, msgs, **kw):
    r = h.post(s.url + "/tokenize", json_body={"messages": msgs, **kw},
                headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def openai_chat(s, msgs, n, **extra):
    return s.client().chat.completions.create(model=s.name, messages=msgs, max_tokens=n, temperature=0,
                                              extra_body={"ignore_eos": True, **extra})


def prompt_tokens(m):
    return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def main():
    s = h.Server(TINY, key=KEY)
    a = client(s)
    M = s.name
    X = {"ignore_eos": True, "temperature": 0}  # this SDK has no temperature argument: the body has

    def t_create_equals_chat():
        m = a.messages.create(model=M, max_tokens=8, messages=[{"role": "user", "content": "hi"}], extra_body=X)
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m
        assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 8, m
        # thinking off by default, as in Anthropic's API: chat with thinking off gives the same text
        ch = openai_chat(s, [{"role": "user", "content": "hi"}], 8, chat_template_kwargs={"thinking": False})
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == ch.choices[0].message.content
        assert prompt_tokens(m) == ch.usage.prompt_tokens, (m.usage, ch.usage)
        # a system string and the same as text blocks are one prompt
        m1 = a.messages.create(model=M, max_tokens=1, system="Be brief.", messages=[{"role": "user", "content": "hi"}])
        m2 = a.messages.create(model=M, max_tokens=1, system=[{"type": "text", "text": "Be brief."}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
        n = len(tokenize(s, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                         chat_template_kwargs={"thinking": False}))
        assert prompt_tokens(m1) == prompt_tokens(m2) == n, (m1.usage, m2.usage, n)

    def t_stream_equals_create():
        long_q = " ".join(f"word{i}" for i in range(120))  # over two cache blocks
        kw = dict(model=M, max_tokens=12, messages=[{"role": "user", "content": long_q}], extra_body=X)
        a.messages.create(**kw)  # the prompt in the cache for both below
        whole = a.messages.create(**kw)
        with a.messages.stream(**kw) as st:
            events = [e.type for e in st]
            final = st.get_final_message()
        assert masked(final) == masked(whole), (masked(final), masked(whole))
        assert events[0] == "message_start" and events[-1] == "message_stop", events
        assert "content_block_start" in events and "message_delta" in events, events
        assert final.usage.cache_read_input_tokens > 0, final.usage

    def t_thinking():
        kw = dict(model=M, max_tokens=1100, messages=[{"role": "user", "content": "hi"}],
                  thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=X)
        whole = a.messages.create(**kw)
        assert whole.content and whole.content[0].type == "thinking" and whole.content[0].signature, whole.content
        ch = openai_chat(s, [{"role": "user", "content": "hi"}], 1100, chat_template_kwargs={"thinking": True})
        assert whole.content[0].thinking == ch.choices[0].message.model_extra["reasoning_content"]
        with a.messages.stream(**kw) as st:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in st]
            final = st.get_final_message()
        assert masked(final) == masked(whole), (masked(final)["content"][:1], masked(whole)["content"][:1])
        assert ("content_block_delta", "thinking_delta") in kinds and ("content_block_delta", "signature_delta") in kinds
        # thinking blocks sent back are the assistant's reasoning
        msgs = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                                  {"type": "text", "text": "Hello."}]},
                {"role": "user", "content": "again"}]
        n = len(tokenize(s, [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "Hello.", "reasoning_content": "hmm"},
                             {"role": "user", "content": "again"}], chat_template_kwargs={"thinking": True}))
        got = a.messages.count_tokens(model=M, messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024})
        assert got.input_tokens == n, (got, n)
        # Anthropic's checks of the budget
        expect_error(lambda: a.messages.create(model=M, max_tokens=1000, messages=[{"role": "user", "content": "x"}],
                                               thinking={"type": "enabled", "budget_tokens": 1024}), 400,
                     "invalid_request_error")
        expect_error(lambda: a.messages.create(model=M, max_tokens=2000, messages=[{"role": "user", "content": "x"}],
                                               thinking={"type": "enabled", "budget_tokens": 10}), 400,
                     "invalid_request_error")

    def t_tools():
        tools = [{"name": "get_weather", "description": "weather of a city",
                  "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}}]
        chat_tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                        "parameters": tools[0]["input_schema"]}}]
        msgs = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": "sunny, 21 C"}]}]
        m = a.messages.create(model=M, max_tokens=6, tools=tools, messages=msgs, extra_body=X)
        chat_msgs = [{"role": "user", "content": "weather in Paris?"},
                     {"role": "assistant", "content": "Let me look.", "tool_calls": [
                         {"id": "toolu_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"}]
        ch = openai_chat(s, chat_msgs, 6, tools=chat_tools, chat_template_kwargs={"thinking": False})
        assert prompt_tokens(m) == ch.usage.prompt_tokens, (m.usage, ch.usage)
        assert m.content[0].text == ch.choices[0].message.content
        # the same via count_tokens; is_error and tool_result blocks change the prompt as chat's would
        assert a.messages.count_tokens(model=M, tools=tools, messages=msgs).input_tokens == prompt_tokens(m)
        err = json.loads(json.dumps(msgs))
        err[2]["content"][0]["is_error"] = True
        err[2]["content"][0]["content"] = [{"type": "text", "text": "no such city"}]
        chat_err = chat_msgs[:2] + [{"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such city"}]
        n = len(tokenize(s, chat_err, tools=chat_tools, chat_template_kwargs={"thinking": False}))
        assert a.messages.count_tokens(model=M, tools=tools, messages=err).input_tokens == n
        # tool_choice: any and a named tool are chat's required, none is none
        for tc, want in (({"type": "any"}, "required"), ({"type": "tool", "name": "get_weather"}, "required"),
                         ({"type": "none"}, "none"), ({"type": "auto"}, "auto")):
            got = a.messages.count_tokens(model=M, tools=tools, tool_choice=tc, messages=msgs[:1]).input_tokens
            n = len(tokenize(s, msgs[:1], tools=chat_tools, tool_choice=want,
                             chat_template_kwargs={"thinking": False}))
            assert got == n, (tc, got, n)
        expect_error(lambda: a.messages.create(model=M, max_tokens=1, tools=tools, messages=msgs[:1],
                                               tool_choice={"type": "tool", "name": "nope"}), 400,
                     "invalid_request_error")
        expect_error(lambda: a.messages.create(model=M, max_tokens=1, messages=msgs[:1],
                                               tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
                     "invalid_request_error")

    def t_errors():
        expect_error(lambda: a.messages.create(model=M, max_tokens=0, messages=[{"role": "user", "content": "x"}]),
                     400, "invalid_request_error")
        e = expect_error(lambda: a.post("/v1/messages", cast_to=object,
                                        body={"model": M, "messages": [{"role": "user", "content": "x"}]}), 400,
                         "invalid_request_error")
        assert "max_tokens" in e.message, e.message
        expect_error(lambda: a.messages.create(model="claude-nope", max_tokens=1,
                                               messages=[{"role": "user", "content": "x"}]), 404, "not_found_error")
        expect_error(lambda: client(s, "wrong").messages.create(model=M, max_tokens=1,
                                                                messages=[{"role": "user", "content": "x"}]), 401,
                     "authentication_error")
        expect_error(lambda: a.messages.create(model=M, max_tokens=1, messages=[{"role": "robot", "content": "x"}]),
                     400, "invalid_request_error")
        expect_error(lambda: a.messages.create(model=M, max_tokens=1, extra_body={"temperature": 5},
                                               messages=[{"role": "user", "content": "x"}]), 400,
                     "invalid_request_error")
        expect_error(lambda: a.messages.create(model=M, max_tokens=1, messages=[{"role": "user", "content": "x"}],
                                               thinking={"type": "between_tools"}), 400, "invalid_request_error")
        r = h.post(s.url + "/v1/messages", content=b'{"max_tokens": 1,', headers={"x-api-key": KEY,
                                                                                  "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        # an image for a text-only model: the vision path's 400, in Anthropic's shape
        png = h.data_url(h.IMAGES + "dot_5x3.png").split(",", 1)[1]
        expect_error(lambda: a.messages.create(model=M, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}]), 400,
            "invalid_request_error")

    def t_dropped_stream():
        m0 = s.metrics()
        ab0 = h.metric(m0, "vllm:request_success_total", finished_reason="abort") or 0
        with a.messages.stream(model=M, max_tokens=3000, messages=[{"role": "user", "content": "x"}],
                               extra_body=X) as st:
            for i, _ in enumerate(st):
                if i == 6:
                    break
        h.wait_until(lambda: h.metric(s.metrics(), "vllm:num_requests_running") == 0 and
                     (h.metric(s.metrics(), "vllm:request_success_total", finished_reason="abort") or 0) > ab0,
                     10, "the dropped stream to end (running 0, one more abort)")

    for name, fn in [("create equals chat (text, prompt, usage); system blocks", t_create_equals_chat),
                     ("messages.stream().get_final_message() equals create()", t_stream_equals_create),
                     ("thinking blocks, signature, budget checks", t_thinking),
                     ("tools: tool_use / tool_result round trip, is_error, tool_choice", t_tools),
                     ("errors in Anthropic's shape", t_errors), ("a dropped stream is cancelled", t_dropped_stream)]:
        check(name, fn)
    s.stop()

    def t_mini():
        sm = h.Server(MINI, key=KEY)
        try:
            am = client(sm)
            q = [{"role": "user", "content": "Who wrote Pride and Prejudice?"}]
            m = am.messages.create(model=MINI, max_tokens=64, messages=q, extra_body={"temperature": 0})
            assert m.stop_reason == "end_turn" and m.content[0].text, m
            text = m.content[0].text
            ch = sm.client().chat.completions.create(model=MINI, messages=q, max_tokens=64, temperature=0,
                                                     extra_body={"chat_template_kwargs": {"thinking": False}})
            assert text == ch.choices[0].message.content, (text, ch.choices[0].message)
            # a stop sequence cuts the text before it and is named
            stop = text[len(text) // 2:len(text) // 2 + 4]
            kw = dict(model=MINI, max_tokens=64, messages=q, stop_sequences=["@@never@@", stop],
                      extra_body={"temperature": 0})
            ms = am.messages.create(**kw)
            assert ms.stop_reason == "stop_sequence" and ms.stop_sequence == stop, ms
            assert ms.content[0].text == text[:text.find(stop)], (ms.content, text, stop)
            with am.messages.stream(**kw) as st:
                final = st.get_final_message()
            assert masked(final) == masked(ms), (masked(final), masked(ms))
        finally:
            sm.stop()

    check("k3-mini: end_turn, equal to chat; stop_sequences, streamed too", t_mini)

    def t_vision():
        sv = h.Server(VISION, "--max-image-pixels", "60000", key=KEY)
        try:
            av = client(sv)
            with open(h.IMAGES + "photo_67x45.jpg", "rb") as f:
                data = base64.b64encode(f.read()).decode()
            q = "What is in the picture?"
            m = av.messages.create(model=VISION, max_tokens=8, extra_body=X, messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                          "media_type": "image/jpeg", "data": data}},
                                             {"type": "text", "text": q}]}])
            url = "data:image/jpeg;base64," + data
            ch = openai_chat(sv, h.image_msg([url], q), 8, chat_template_kwargs={"thinking": False})
            assert prompt_tokens(m) == ch.usage.prompt_tokens, (m.usage, ch.usage)
            assert m.content[0].text == ch.choices[0].message.content, (m.content, ch.choices[0].message)
            n = av.messages.count_tokens(model=VISION, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": data}},
                {"type": "text", "text": q}]}]).input_tokens
            assert n == ch.usage.prompt_tokens, (n, ch.usage)
            expect_error(lambda: av.messages.create(model=VISION, max_tokens=1, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}]), 400,
                "invalid_request_error")
        finally:
            sv.stop()

    check("vision: image blocks equal chat's image_url, count_tokens", t_vision)


if __name__ == "__main__":
    suite.main(main)
