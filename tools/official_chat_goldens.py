#!/usr/bin/env python3
"""Goldens for k3_chat_encode_json and k3_chat_parse_reply, made by Moonshot's
own code: the official TikTokenTokenizer (tokenization_kimi.py) over
models/k3-mini's tiktoken.model and specials, apply_chat_template(...,
tokenize=True), which renders with encoding_k3.build_chat_segments and
encodes segment by segment. tests/test_chat_json.c checks k3 gives the same
ids, byte for byte.

    .venv/bin/python tools/official_chat_goldens.py   # writes tests/golden/chat/

Each case holds the request as JSON text (what a server hands the encoder),
the options, and either the ids or "error": true where the official code
raises. Reply cases hold the official rendering of an assistant turn after
the generation prompt (text) and what parsing it must give back. floats.txt
holds doubles (as C hex floats) and Python's repr of each.
"""
import json
import os
import random
import struct
import sys

sys.path.insert(0, os.path.dirname(__file__))
from official_common import ROOT, kimi_k3, official_tokenizer  # noqa: E402

OUT = os.path.join(ROOT, "tests/golden/chat")
MODEL = os.path.join(ROOT, "models/k3-mini")

J = json.dumps

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city, today or on a date.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name, e.g. 北京"},
        "unit": {"enum": ["c", "f"], "type": "string", "default": "c"},
        "days": {"type": "integer", "minimum": 1, "maximum": 16.5}}}}}
SEARCH = {"type": "function", "function": {
    "name": "web.search", "description": "Search the web.\nReturns \"snippets\"\t& links.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"},
                                                    "top_k": {"type": "number", "default": 1e-7}}}}}

CALLS = [
    {"id": "call_a", "type": "function",
     "function": {"name": "get_weather", "arguments": J({"city": "北京", "days": 3})}},
    {"id": "call_b", "type": "function",
     "function": {"name": "web.search", "arguments": {"q": "K3 \"release\" & notes", "top_k": 2.5,
                                                      "filters": {"lang": ["en", "zh"], "safe": True},
                                                      "cursor": None, "exact": False}}},
]

CASES = [
    ("system_user_think", [{"role": "system", "content": "You are a terse assistant."},
                           {"role": "user", "content": "What is the weather in Beijing?"}], None, {}),
    ("effort_max", [{"role": "user", "content": "Prove that 2+2=4."}], None,
     {"thinking_effort": "max"}),
    ("effort_low_no_think_ignored", [{"role": "user", "content": "hi"}], None,
     {"thinking": False, "thinking_effort": "low"}),
    ("multi_turn_no_think", [
        {"role": "system", "content": "You are Kimi."},
        {"role": "user", "content": "Say hi in Chinese."},
        {"role": "assistant", "content": "你好！", "reasoning_content": "The user wants 你好."},
        {"role": "user", "content": "And in Japanese?\n"}], None, {"thinking": False}),
    ("multi_turn_think", [
        {"role": "user", "content": "Say hi in Chinese."},
        {"role": "assistant", "content": "你好！", "reasoning_content": "The user wants 你好."},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "你好", "reasoning_content": "  \n ", "reasoning": "unused"},
        {"role": "user", "content": "Once more."},
        {"role": "assistant", "content": "您好", "reasoning_content": "", "reasoning": "fallback key"},
        {"role": "user", "content": "Thanks"}], None, {"thinking_effort": "high"}),
    ("tools_calls_results", [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in 北京 and search K3 notes."},
        {"role": "assistant", "content": "", "reasoning_content": "Two tools.", "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_a", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "call_b", "content": "K3 ships XTML."},
        {"role": "assistant", "content": "It is 21°C; K3 ships XTML."},
        {"role": "user", "content": "ok"}], [WEATHER, SEARCH], {}),
    ("tool_results_out_of_order", [
        {"role": "user", "content": "Both please."},
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_b", "name": "stale_name", "content": "second"},
        {"role": "tool", "tool_call_id": "call_a", "content": [{"type": "text", "text": "first"},
                                                               {"type": "text", "text": " part two"}]}],
     [WEATHER, SEARCH], {"thinking": False}),
    ("tool_results_unresolved_by_order", [
        {"role": "user", "content": "Both please."},
        {"role": "assistant", "content": "", "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_b", "content": "second"},
        {"role": "tool", "tool_call_id": "nope", "content": "first"},
        {"role": "user", "content": "and?"},
        {"role": "tool", "name": "explicit", "content": "late"}],
     [WEATHER, SEARCH], {}),
    ("arguments_forms", [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": 7, "function": {"name": "get_weather", "arguments": "{not json"}},
            {"id": "x2", "function": {"name": "get_weather", "arguments": "   "}},
            {"id": "x3", "function": {"name": "get_weather", "arguments": None}},
            {"id": "x4", "function": {"name": "get_weather"}},
            {"id": "x5", "name": "flat_call", "arguments": "{\"a\": [1, 2.0, \"三\"], \"b\": {}}"},
            {"id": "x6", "function": {"name": "get_weather", "arguments": "\n{\"n\": 1e2, \"m\": -0.0}\t"}},
        ]},
        {"role": "tool", "tool_call_id": 7, "content": "r1"},
        {"role": "tool", "tool_call_id": "x2", "content": "r2"},
        {"role": "tool", "tool_call_id": "x3", "content": "r3"},
        {"role": "tool", "tool_call_id": "x4", "content": "r4"},
        {"role": "tool", "tool_call_id": "x5", "content": "r5"},
        {"role": "tool", "tool_call_id": "x6", "content": "r6"}], [WEATHER], {}),
    ("non_ascii", [
        {"role": "system", "content": "Réponds en français. 日本語も可。"},
        {"role": "user", "name": "Zoë", "content": "Ça va? 👍🏽 Ω≈ç√ — e\u0301 한국어 مرحبا"},
        {"role": "assistant", "name": "キミ", "content": "très bien 😀", "reasoning_content": "思考中…"},
        {"role": "user", "content": "\u00a0\u3000spaces\u2028"}],
     [{"type": "function", "function": {"name": "翻訳", "description": "Übersetzt → 中文",
                                        "parameters": {"type": "object", "properties": {"文": {"type": "string"}}}}}],
     {}),
    ("attr_escaping", [
        {"role": "user", "name": "Tom & \"Jerry\"", "content": "say <|open|>hi<|close|> & \"bye\""},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "q1", "function": {"name": "say\"&it", "arguments": {"k&\"ey": "v\"&<|sep|>", "x": 1}}}]},
        {"role": "tool", "tool_call_id": "q1", "content": "&amp; already"}], None, {}),
    ("tool_choice_required", [{"role": "user", "content": "weather?"}], [WEATHER],
     {"tool_choice": "required"}),
    ("tool_choice_none_auto", [{"role": "user", "content": "weather?"}], [WEATHER],
     {"tool_choice": "none", "thinking": False}),
    ("tool_choice_auto", [{"role": "user", "content": "weather?"}], [WEATHER],
     {"tool_choice": "auto"}),
    ("response_format_json_object", [{"role": "user", "content": "JSON please"}], None,
     {"response_format": {"type": "json_object"}}),
    ("response_format_json_schema", [{"role": "user", "content": "JSON please"}], None,
     {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "strict": True, "schema": {
         "type": "object", "required": ["z", "a"], "properties": {"z": {"type": "number", "maximum": 1e16},
                                                                 "a": {"type": "array", "items": {"type": "string"}}}}}},
      "tool_choice": "required"}),
    ("response_format_schema_fallbacks", [{"role": "user", "content": "x"}], None,
     {"response_format": {"type": "json_schema", "json_schema": {"type": "object", "b": 1, "a": 0.1}}}),
    ("response_format_text", [{"role": "user", "content": "x"}], None,
     {"response_format": {"type": "text"}}),
    ("system_dynamic_tools", [
        {"role": "system", "content": "ignored", "tools": [SEARCH]},
        {"role": "user", "content": "search"}], [WEATHER], {}),
    ("no_generation_prompt", [
        {"role": "user", "content": "hello\r\n\r\n  world\t\t\n"},
        {"role": "assistant", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": ""},
                                          {"type": "text", "text": " two"}]}], None,
     {"add_generation_prompt": False}),
    ("empty_and_null_content", [
        {"role": "system", "content": ""}, {"role": "user", "content": None}, {"role": "user"},
        {"role": "assistant"}], None, {"thinking": False}),
    ("controls_and_floats", [
        {"role": "user", "content": "ctl \u0001\u001f\u007f end"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "f", "function": {"name": "nums", "arguments": {
            "a": 0.1, "b": 1e-7, "c": 1e16, "d": 1e15, "e": 123456789012345680000.0, "f": -2.5e-300,
            "g": 100.0, "h": -0, "i": 9007199254740993, "j": [1.0, [], {}], "k": "tab\there\nnl",
            "l": {"z": 1, "a": 2}}}}]}],
     [{"type": "function", "function": {"name": "nums", "description": "ctl \u0001 \u001f \\ / \" end",
                                        "parameters": {"type": "object", "properties": {}}}}],
     {"add_generation_prompt": False}),
]

# Segments the official tokenizer encodes in pieces: runs of whitespace or
# non-whitespace over 25,000 code points are cut (tokenization_kimi.py).
# (Multi-byte characters lead the first run: the count is in code points.)
CASES.append(("long_runs", [{"role": "user", "content": "x" + "…" * 10 + "é" * 5 + "." * 24995 + " " * 25002 +
                                                        "b" + "." * 25010}],
              None, {"add_generation_prompt": False}))

# Requests the official code refuses (k3 must refuse them too).
ERRORS = [
    ("error_tool_name_unresolvable", [{"role": "user", "content": "x"},
                                      {"role": "tool", "content": "orphan"}], None, {}),
    ("error_effort_medium", [{"role": "user", "content": "x"}], None, {"thinking_effort": "medium"}),
    ("error_arguments_not_object", [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "[1, 2]"}}]}], None, {}),
]

# Raw JSON text for literal forms json.dumps would not write.
RAW = [
    ("raw_number_literals", '[{"role":"user","content":"n"},{"role":"assistant","content":"",'
     '"tool_calls":[{"id":"r","function":{"name":"f","arguments":{"a":1E2,"b":-0.0,"c":1.50,'
     '"d":0.000012,"e":12345678901234567890e-5,"f":5e-324,"g":1.7976931348623157e308}}}]}]',
     '[{"type":"function","function":{"name":"f","parameters":{"type":"object","default":2.50E+1}}}]', {}),
    ("raw_duplicate_keys", '[{"role":"user","content":"first","content":"second"},{"role":"assistant",'
     '"content":"","tool_calls":[{"id":"d","function":{"name":"f","arguments":"{\\"k\\":1,\\"j\\":2,\\"k\\":3}"}}]}]',
     None, {}),
]


def options(o):
    return {"add_generation_prompt": o.get("add_generation_prompt", True),
            "thinking": o.get("thinking", True),
            "thinking_effort": o.get("thinking_effort"),
            "tool_choice": o.get("tool_choice"),
            "response_format": o.get("response_format")}


def encode(tok, messages_json, tools_json, o):
    kw = {}
    if o["tool_choice"] is not None:
        kw["tool_choice"] = o["tool_choice"]
    if o["response_format"] is not None:
        kw["response_format"] = o["response_format"]
    return tok.apply_chat_template(
        json.loads(messages_json), tools=json.loads(tools_json) if tools_json else None,
        tokenize=True, add_generation_prompt=o["add_generation_prompt"], thinking=o["thinking"],
        thinking_effort=o["thinking_effort"], **kw)


def reply_cases(enc):
    """Assistant turns as the official renderer writes them, cut after the
    generation prompt, and the fields they parse back to."""
    turns = [
        ("reply_think_text", True, {"role": "assistant", "reasoning_content": "Let me think: 2+2.",
                                    "content": "It is 4."}),
        ("reply_no_think", False, {"role": "assistant", "content": "Bonjour 👋 & \"salut\""}),
        ("reply_tools", True, {"role": "assistant", "reasoning_content": "Need two tools.", "content": "",
                               "tool_calls": CALLS}),
        ("reply_tools_no_think", False, {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "z", "function": {"name": "say\"&it", "arguments": {"k&\"ey": "v\"&", "n": [1.5, None, {"a": "b"}],
                                                                      "t": True, "none": None, "o": {}}}}]}),
        ("reply_json_block", False, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "z", "function": {"name": "f", "arguments": "{\"not\": closed"}}]}),
    ]
    out = []
    for name, thinking, msg in turns:
        segs = enc._render_assistant_segments(enc.normalize_message(msg), enc._ImagePromptState(None),
                                              thinking)
        segs += enc._close_tag("message") + enc._end_of_msg()
        text = "".join(s.text for s in segs)
        prefix = "<|open|>think<|sep|>" if thinking else "<|open|>response<|sep|>"
        assert text.startswith(prefix)
        text = text[len(prefix):]
        calls = []
        for tc in msg.get("tool_calls") or []:
            fn = tc.get("function", tc)
            args, block = enc.normalize_tool_arguments(fn.get("arguments"))
            calls.append({"name": fn["name"],
                          "arguments": None if block is not None else json.dumps(args, ensure_ascii=False)})
        rc = msg.get("reasoning_content")
        content = msg.get("content") or None if calls else msg.get("content")
        out.append({"name": name, "thinking": thinking, "message": json.dumps(msg, ensure_ascii=False),
                    "text": text,
                    "reasoning": rc if thinking and rc and rc.strip() else None,
                    "content": content, "tool_calls": calls})
    return out


def floats():
    rnd = random.Random(15)
    vals = [0.1, 0.2, 1 / 3, 1e-4, 1e-5, 9.999e-5, 1e15, 1e16, 9999999999999998.0, 1e22, 1e23,
            5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 123.456, 100.0, 1.5e300, 0.5,
            -1.25, 4.35, 2.0 ** 53, 2.0 ** 53 + 2, 1234567.0, 0.3, 2.675, 1e-7, 12345678901234567.0]
    for _ in range(300):
        bits = rnd.getrandbits(64)
        v = struct.unpack("<d", struct.pack("<Q", bits))[0]
        if v == v and abs(v) != float("inf"):
            vals.append(v)
    for _ in range(200):
        vals.append(rnd.uniform(-1e6, 1e6) * 10 ** rnd.randint(-12, 12))
    return "".join(f"{v.hex()} {json.dumps(v)}\n" for v in vals)


def main():
    enc = kimi_k3("encoding_k3")
    tok = official_tokenizer(MODEL)
    os.makedirs(OUT, exist_ok=True)
    cases = []
    for name, msgs, tools, o in CASES + ERRORS:
        cases.append((name, json.dumps(msgs, ensure_ascii=False),
                      json.dumps(tools, ensure_ascii=False) if tools is not None else None, o))
    cases += RAW
    out = []
    for name, mj, tj, o in cases:
        o = options(o)
        rf = o["response_format"]
        case = {"name": name, "messages": mj, "tools": tj,
                "add_generation_prompt": o["add_generation_prompt"], "thinking": o["thinking"],
                "thinking_effort": o["thinking_effort"], "tool_choice": o["tool_choice"],
                "response_format": json.dumps(rf, ensure_ascii=False) if rf is not None else None}
        try:
            case["ids"] = encode(tok, mj, tj, o)
        except (ValueError, TypeError, KeyError, AssertionError) as e:
            assert name.startswith("error_"), (name, e)
            case["error"] = True
            print(f"{name}: official code raises {type(e).__name__}: {e}")
        else:
            assert not name.startswith("error_"), name
            print(f"{name}: {len(case['ids'])} ids")
        out.append(case)
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=0)
        f.write("\n")
    with open(os.path.join(OUT, "replies.json"), "w", encoding="utf-8") as f:
        json.dump(reply_cases(enc), f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(OUT, "floats.txt"), "w") as f:
        f.write(floats())


if __name__ == "__main__":
    main()
