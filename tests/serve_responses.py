"""serve_responses.py -- `k3 serve`'s /v1/responses end to end with the official `openai` client.

Usage: python tests/serve_responses.py K3_BINARY
Starts `k3 serve` (--port 0) on tests/models/tiny, models/k3-mini and tests/models/vision-tiny and checks
the Responses API against chat/completions (the same conversation is the same prompt, token for token,
and greedy gives the same text), the stream against the whole answer (the SDK's own stream state and
`responses.stream(...).get_final_response()`), function tools and their items, the store
(previous_response_id, GET and DELETE), reasoning.effort, text.format, images, and the refusals.
Prints `ok   responses: NAME` / `FAIL responses: NAME` per check and ends with
`responses: N passed, N failed`.
"""
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

import openai  # noqa: E402
from openai.lib.streaming.responses import ResponseStreamState  # noqa: E402

TINY, MINI, VISION = h.TINY, h.MINI, h.VISION
KEY = "k3-test-key"


suite = h.Suite("responses")
check = suite.check


def expect_status(fn, status):
    try:
        fn()
    except openai.APIStatusError as e:
        assert e.status_code == status, f"status {e.status_code}, wanted {status}: {e}"
        body = e.response.json()
        assert "error" in body and body["error"]["message"], body
        return e
    raise AssertionError(f"no error, wanted HTTP {status}")


def masked(r):
    """A response as a dict without what differs between two runs of one request (ids, times, cache hits)."""
    d = copy.deepcopy(r if isinstance(r, dict) else r.model_dump(mode="json", exclude_none=False))
    for k in ("id", "created_at"):
        d.pop(k, None)
    for it in d.get("output", []):
        it.pop("id", None)
        it.pop("call_id", None)
        for part in it.get("content") or []:
            part.pop("parsed", None)  # the SDK's parsed view of a final response
    if d.get("usage"):
        d["usage"]["input_tokens_details"].pop("cached_tokens", None)
    return d


def tokenize(s, msgs, **kw):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = h.post(s.url + "/tokenize", json_body={"messages": msgs, **kw}, headers=auth)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def main():
    s = h.Server(TINY, key=KEY)
    c = s.client()
    M = s.name
    G = dict(temperature=0, extra_body={"ignore_eos": True})

    def t_create_equals_chat():
        r = c.responses.create(model=M, input="hi", max_output_tokens=8, **G)
        assert r.object == "response" and r.id.startswith("resp_"), r
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
        u = r.usage
        assert u.output_tokens == 8 and u.total_tokens == u.input_tokens + 8, u
        ch = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=8, **G)
        assert u.input_tokens == ch.usage.prompt_tokens, (u, ch.usage)
        # thinking is on by default, as in chat: the reply is the reasoning item
        want = ch.choices[0].message.model_extra.get("reasoning_content") or ""
        got = "".join(p.text for it in r.output if it.type == "reasoning" for p in it.content)
        assert got == want, (got, want)
        assert u.output_tokens_details.reasoning_tokens == 8, u
        assert r.max_output_tokens == 8 and r.model == M and r.store is True and r.tools == []

    def t_stream_events():
        kw = dict(model=M, input="Tell me a story", max_output_tokens=12, **G)
        whole = c.responses.create(**kw)
        events = list(c.responses.create(stream=True, **kw))
        types = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events))), types
        assert types[:2] == ["response.created", "response.in_progress"], types
        assert types[-1] == "response.incomplete", types
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        # every item is added, then its deltas, then done: the SDK's own state machine takes them all
        # (it asserts each delta's item and part), and the items done are the whole answer's
        st = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
        for e in events:
            st.handle_event(e)
        done_items = [e.item for e in events if e.type == "response.output_item.done"]
        # and each part's text is its deltas in order
        acc = {}
        for e in events:
            if e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
                acc[e.output_index, e.content_index] = acc.get((e.output_index, e.content_index), "") + e.delta
        for (oi, ci), text in acc.items():
            assert done_items[oi].content[ci].text == text, (oi, ci, text, done_items[oi])
        assert acc, types
        assert masked({"output": [it.model_dump(mode="json") for it in done_items]}) == \
            masked({"output": [it.model_dump(mode="json") for it in whole.output]}), (done_items, whole.output)
        final = events[-1].response
        assert masked(final) == masked(whole), (masked(final), masked(whole))
        for e in events:
            if e.type == "response.output_item.added":
                assert e.item.status == "in_progress"
        done = [e for e in events if e.type == "response.output_item.done"]
        assert [d.item.id for d in done] == [it.id for it in final.output]

    def t_items_and_instructions():
        # instructions, a developer message, parts, an earlier assistant turn: the prompt chat would build
        items = [{"role": "developer", "content": "Answer briefly."},
                 {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
                 {"role": "user", "content": "Another?"}]
        r = c.responses.create(model=M, input=items, instructions="You are terse.", max_output_tokens=2, **G)
        msgs = [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
                {"role": "user", "content": "Another?"}]
        assert r.usage.input_tokens == len(tokenize(s, msgs)), (r.usage, len(tokenize(s, msgs)))
        assert r.instructions == "You are terse."

    def t_function_tools():
        tools = [{"type": "function", "name": "get_weather", "description": "weather of a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}]
        chat_tools = [{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}]
        items = [{"role": "user", "content": "weather in Paris?"},
                 {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                  "arguments": json.dumps({"city": "Paris"})},
                 {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
        r = c.responses.create(model=M, input=items, tools=tools, tool_choice="auto", max_output_tokens=4, **G)
        msgs = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
        n = len(tokenize(s, msgs, tools=chat_tools, tool_choice="auto"))
        assert r.usage.input_tokens == n, (r.usage.input_tokens, n)
        assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
        # the same through chat: the same greedy reply
        ch = c.chat.completions.create(model=M, messages=msgs, tools=chat_tools, max_tokens=4, **G)
        want = ch.choices[0].message.model_extra.get("reasoning_content") or ""
        got = "".join(p.text for it in r.output if it.type == "reasoning" for p in it.content)
        assert got == want, (got, want)
        # a named function: required; one not in tools, a hosted tool, a call without its id are 400s
        r2 = c.responses.create(model=M, input="x", tools=tools, max_output_tokens=1,
                                tool_choice={"type": "function", "name": "get_weather"}, **G)
        assert r2.tool_choice.name == "get_weather"
        n2 = len(tokenize(s, [{"role": "user", "content": "x"}], tools=chat_tools, tool_choice="required"))
        assert r2.usage.input_tokens == n2, (r2.usage.input_tokens, n2)
        expect_status(lambda: c.responses.create(model=M, input="x", tools=tools, max_output_tokens=1,
                                                 tool_choice={"type": "function", "name": "nope"}), 400)
        e = expect_status(lambda: c.responses.create(model=M, input="x", tools=[{"type": "web_search"}],
                                                     max_output_tokens=1), 400)
        assert "web_search" in e.message, e.message
        expect_status(lambda: c.responses.create(model=M, input=[{"type": "function_call_output", "output": "x"}],
                                                 max_output_tokens=1), 400)

    def t_store_and_previous():
        r1 = c.responses.create(model=M, input="hi", instructions="Be kind.", max_output_tokens=6, **G)
        got = c.responses.retrieve(r1.id)
        assert got.model_dump() == r1.model_dump(), (got, r1)
        # the next turn: the first turn's input and output, then the new input; the old instructions drop out
        r2 = c.responses.create(model=M, input="more", previous_response_id=r1.id, max_output_tokens=3, **G)
        reasoning = "".join(p.text for it in r1.output if it.type == "reasoning" for p in it.content)
        msgs = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "reasoning_content": reasoning},
                {"role": "user", "content": "more"}]
        n = len(tokenize(s, msgs))
        assert r2.usage.input_tokens == n, (r2.usage.input_tokens, n)
        assert r2.previous_response_id == r1.id
        # the history grew by the stored turn: its prefix is in the cache
        assert r2.usage.input_tokens_details.cached_tokens >= 0
        # store=false: not kept; an unknown id is a 404 (vLLM's message)
        r3 = c.responses.create(model=M, input="hi", store=False, max_output_tokens=1, **G)
        assert r3.store is False
        e = expect_status(lambda: c.responses.retrieve(r3.id), 404)
        assert "not found" in e.message, e.message
        expect_status(lambda: c.responses.create(model=M, input="x", previous_response_id="resp_nope",
                                                 max_output_tokens=1), 404)
        # a streamed response is kept too, and DELETE forgets it
        with c.responses.stream(model=M, input="hey", max_output_tokens=3, **G) as st:
            rid = [e for e in st if e.type == "response.created"][0].response.id
        assert c.responses.retrieve(rid).id == rid
        c.responses.delete(rid)
        expect_status(lambda: c.responses.retrieve(rid), 404)

    def t_reasoning_effort():
        base = c.responses.create(model=M, input="hi", max_output_tokens=4, **G)
        off = c.responses.create(model=M, input="hi", reasoning={"effort": "none"}, max_output_tokens=4, **G)
        assert [it.type for it in off.output] == ["message"], off.output
        assert off.usage.output_tokens_details.reasoning_tokens == 0
        ch = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True,
                                                                  "chat_template_kwargs": {"thinking": False}})
        assert off.output[0].content[0].text == ch.choices[0].message.content, (off.output, ch.choices[0])
        assert off.output_text == ch.choices[0].message.content
        # chat's reasoning_effort table (k3_chat_reasoning_effort): none given is chat's default
        # prompt; medium and high are K3's "high"; the echo keeps OpenAI's name
        assert base.usage.input_tokens == len(tokenize(s, [{"role": "user", "content": "hi"}])), base.usage
        n = len(tokenize(s, [{"role": "user", "content": "hi"}], reasoning_effort="high"))
        for effort in ("medium", "high"):
            r = c.responses.create(model=M, input="hi", reasoning={"effort": effort}, max_output_tokens=1, **G)
            assert r.usage.input_tokens == n and r.reasoning.effort == effort, (effort, r.usage.input_tokens, n)
        expect_status(lambda: c.responses.create(model=M, input="hi", reasoning={"effort": "extreme"},
                                                 max_output_tokens=1), 400)

    def t_text_format():
        schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                  "additionalProperties": False}
        r = c.responses.create(model=M, input="give x", max_output_tokens=2,
                               text={"format": {"type": "json_schema", "name": "thing", "schema": schema,
                                                "strict": True}}, **G)
        rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
        n = len(tokenize(s, [{"role": "user", "content": "give x"}], response_format=rf))
        assert r.usage.input_tokens == n, (r.usage.input_tokens, n)
        assert r.text.format.type == "json_schema" and r.text.format.name == "thing"
        expect_status(lambda: c.responses.create(model=M, input="x", max_output_tokens=1,
                                                 text={"format": {"type": "yaml"}}), 400)

    def t_errors():
        expect_status(lambda: c.responses.create(model=M, input=[], max_output_tokens=1), 400)
        expect_status(lambda: c.responses.create(model=M, input=[{"type": "web_search_call"}]), 400)
        expect_status(lambda: c.responses.create(model=M, input="x", max_output_tokens=0), 400)
        expect_status(lambda: c.responses.create(model=M, input="x", background=True), 400)
        expect_status(lambda: c.responses.create(model=M, input="x", temperature=9), 400)
        expect_status(lambda: c.responses.create(model=M, input="x", include=["message.output_text.logprobs"]),
                      400)
        expect_status(lambda: c.responses.create(model="nope", input="x"), 404)
        r = h.post(s.url + "/v1/responses", content=b'{"input": "x",', headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
        assert h.get(s.url + "/v1/responses/resp_x").status_code == 401
        assert h.get(s.url + "/v1/responses/", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404

    def t_dropped_stream():
        m0 = s.metrics()
        ab0 = h.metric(m0, "vllm:request_success_total", finished_reason="abort") or 0
        st = c.responses.create(model=M, input="x", max_output_tokens=3000, stream=True, **G)
        for i, _ in enumerate(st):
            if i == 5:
                break
        st.close()
        h.wait_until(lambda: h.metric(s.metrics(), "vllm:num_requests_running") == 0 and
                     (h.metric(s.metrics(), "vllm:request_success_total", finished_reason="abort") or 0) > ab0,
                     10, "the dropped stream to end (running 0, one more abort)")

    def t_page():
        # the chat page at / (no key needed for the page itself), off with --no-ui
        r = h.get(s.url + "/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), (r.status_code, r.headers)
        assert b"/v1/chat/completions" in r.content and b"<script" in r.content
        assert b"http://" not in r.content and b"https://" not in r.content, "the page fetches nothing"
        m = c.models.list().data[0]
        assert m.model_extra["capabilities"] == {"vision": False}, m
        s2 = h.Server(TINY, "--no-ui")
        try:
            assert h.get(s2.url + "/").status_code == 404
        finally:
            s2.stop()

    for name, fn in [("create equals chat (prompt, reasoning, usage)", t_create_equals_chat),
                     ("stream: events in order, the SDK takes them, deltas make the items done, which are the whole answer", t_stream_events),
                     ("input items and instructions are chat's prompt", t_items_and_instructions),
                     ("function tools, function_call and function_call_output items", t_function_tools),
                     ("store: retrieve, previous_response_id, store=false, delete", t_store_and_previous),
                     ("reasoning.effort onto the thinking switch", t_reasoning_effort),
                     ("text.format json_schema is chat's response_format", t_text_format),
                     ("errors", t_errors), ("a dropped stream is cancelled", t_dropped_stream),
                     ("the chat page at /, --no-ui, the models' capabilities", t_page)]:
        check(name, fn)
    s.stop()

    def t_mini_completed():
        sm = h.Server(MINI, key=KEY)
        try:
            cm = sm.client()
            kw = dict(model=MINI, input="Who wrote Pride and Prejudice?", reasoning={"effort": "none"},
                      max_output_tokens=64, temperature=0)
            cm.responses.create(**kw)  # the prompt in the cache, so both below see the same hit
            whole = cm.responses.create(**kw)
            assert whole.status == "completed" and whole.incomplete_details is None, whole
            with cm.responses.stream(**kw) as st:
                deltas = "".join(e.delta for e in st if e.type == "response.output_text.delta")
                final = st.get_final_response()
            assert masked(final) == masked(whole), (masked(final), masked(whole))
            assert deltas == whole.output_text and whole.output_text, (deltas, whole.output_text)
            ch = cm.chat.completions.create(model=MINI, messages=[{"role": "user", "content": kw["input"]}],
                                            max_tokens=64, temperature=0,
                                            extra_body={"chat_template_kwargs": {"thinking": False}})
            assert whole.output_text == ch.choices[0].message.content, (whole.output_text, ch.choices[0])
            assert whole.usage.output_tokens == ch.usage.completion_tokens
        finally:
            sm.stop()

    check("k3-mini: a reply that ends: stream().get_final_response() equals create(), and chat", t_mini_completed)

    def t_vision():
        sv = h.Server(VISION, "--max-image-pixels", "60000", key=KEY)
        try:
            cv = sv.client()
            url = h.data_url(h.IMAGES + "photo_67x45.jpg")
            q = "What is in the picture?"
            r = cv.responses.create(model=VISION, reasoning={"effort": "none"}, max_output_tokens=8, temperature=0,
                                    input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                                        {"type": "input_text", "text": q}]}],
                                    extra_body={"ignore_eos": True})
            ch = cv.chat.completions.create(model=VISION, messages=h.image_msg([url], q), max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True,
                                                                       "chat_template_kwargs": {"thinking": False}})
            assert r.usage.input_tokens == ch.usage.prompt_tokens, (r.usage, ch.usage)
            assert r.output_text == ch.choices[0].message.content, (r.output_text, ch.choices[0].message)
            e = expect_status(lambda: cv.responses.create(
                model=VISION, max_output_tokens=1, input=[{"role": "user", "content": [
                    {"type": "input_image", "image_url": "http://example.com/a.png"}]}]), 400)
            assert "data:" in e.message, e.message
        finally:
            sv.stop()

    check("vision: input_image parts equal chat's image_url", t_vision)


if __name__ == "__main__":
    suite.main(main)
