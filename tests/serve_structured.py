"""serve_structured.py -- structured outputs through `k3 serve` with the official `openai` client.

Usage: python tests/serve_structured.py K3_BINARY
Starts `k3 serve` on models/k3-mini (a toy model that never writes JSON by itself) and checks, as a
client calls it:
  - 50 JSON schemas (nested objects, arrays, enums, anyOf, $ref/$defs, formats, patterns, bounds):
    every reply parses and validates with `jsonschema`, streamed and not;
  - chat.completions.parse() with a pydantic model returns the object;
  - tool_choice "required" and a named function return tool_calls whose arguments validate against
    the function's parameters, streamed deltas included; auto with a strict tool;
  - vLLM's structured_outputs (regex, choice, grammar, json) and guided_* on chat and completions;
  - /v1/responses' text.format and /v1/messages' tool_choice any / tool, through the same constraint;
  - n > 1 with a seed (the same seed, the same replies), logprobs, stop strings, thinking on;
  - a request preempted on a tiny cache pool still valid;
  - the 400s: an unsupported keyword named with its path, a named function not in tools, two
    constraints at once, a bad regex or grammar.
Schemas are bounded (maxLength, maximum, maxItems, enums) so that a model that never closes a string
still ends within max_tokens. Prints `ok   structured: NAME` / `FAIL structured: NAME` and ends with
`structured: N passed, N failed`.
"""
import concurrent.futures as cf
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402
import pydantic  # noqa: E402

MAXTOK = 400
NOTHINK = {"reasoning_effort": "none"}


suite = h.Suite("structured")
check = suite.check


# ---- 50 schemas ------------------------------------------------------------------------------

def S(n=12):
    return {"type": "string", "maxLength": n}


def I(lo=0, hi=999):
    return {"type": "integer", "minimum": lo, "maximum": hi}


def obj(props, required=None, **kw):
    o = {"type": "object", "properties": props, "required": list(props) if required is None else required,
         "additionalProperties": False}
    o.update(kw)
    return o


def schemas():
    out = []
    add = out.append
    # flat objects
    add(obj({"name": S(), "age": I(0, 120)}))
    add(obj({"city": S(16), "unit": {"enum": ["celsius", "fahrenheit"]}}))
    add(obj({"ok": {"type": "boolean"}, "count": I(0, 50)}))
    add(obj({"id": I(1, 10**6), "label": S(8), "active": {"type": "boolean"}}))
    add(obj({"a": {"const": "fixed"}, "b": I(-5, 5)}))
    add(obj({"x": {"type": "null"}, "y": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}))
    add(obj({"level": {"enum": [1, 2, 3]}, "mode": {"enum": ["fast", "slow", None]}}))
    add(obj({"path": S(20), "line": I(1, 9999)}, required=["path"]))
    add(obj({"q": S(10), "limit": I(1, 100), "offset": I(0, 1000)}, required=["q"]))
    add(obj({"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}))
    # nested objects
    add(obj({"user": obj({"name": S(), "email": {"type": "string", "format": "email", "maxLength": 24}})}))
    add(obj({"a": obj({"b": obj({"c": I(0, 9)})})}))
    add(obj({"meta": obj({"v": I(1, 3), "tag": S(6)}), "body": S(20)}))
    add(obj({"from": obj({"lat": I(-90, 90), "lon": I(-180, 180)}),
             "to": obj({"lat": I(-90, 90), "lon": I(-180, 180)})}))
    add(obj({"cfg": obj({"debug": {"type": "boolean"}, "retries": I(0, 5)}, required=["debug"])}))
    # arrays
    add(obj({"tags": {"type": "array", "items": S(6), "maxItems": 3}}))
    add(obj({"nums": {"type": "array", "items": I(0, 99), "minItems": 1, "maxItems": 4}}))
    add(obj({"pairs": {"type": "array", "items": obj({"k": S(4), "v": I(0, 9)}), "maxItems": 2}}))
    add(obj({"grid": {"type": "array", "items": {"type": "array", "items": I(0, 9), "maxItems": 2},
                      "maxItems": 2}}))
    add(obj({"point": {"type": "array", "prefixItems": [I(0, 9), I(0, 9)], "items": False}}))
    add({"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3})
    add(obj({"steps": {"type": "array", "items": obj({"op": {"enum": ["add", "del"]}, "n": I(0, 9)}),
                       "minItems": 1, "maxItems": 3}}))
    # enums
    add({"enum": ["yes", "no", "maybe"]})
    add(obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}}))
    add(obj({"status": {"enum": ["open", "closed"]}, "prio": {"enum": [1, 2, 3, 4]}}))
    add({"type": "string", "enum": ["alpha", "beta", "gamma", "delta"]})
    # anyOf / oneOf
    add(obj({"v": {"anyOf": [I(0, 9), S(5)]}}))
    add(obj({"v": {"anyOf": [{"type": "null"}, obj({"x": I(0, 9)})]}}))
    add({"anyOf": [obj({"kind": {"const": "a"}, "a": I(0, 9)}), obj({"kind": {"const": "b"}, "b": S(5)})]})
    add(obj({"shape": {"oneOf": [obj({"type": {"const": "circle"}, "r": I(1, 9)}),
                                 obj({"type": {"const": "square"}, "side": I(1, 9)})]}}))
    add(obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                              {"type": "string", "pattern": "^[a-f0-9]{4}$"}]}}))
    # $ref / $defs
    add({"$defs": {"pt": obj({"x": I(0, 9), "y": I(0, 9)})}, "type": "object",
         "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"],
         "additionalProperties": False})
    add({"definitions": {"name": S(8)}, "type": "object", "properties": {"first": {"$ref": "#/definitions/name"},
         "last": {"$ref": "#/definitions/name"}}, "required": ["first", "last"], "additionalProperties": False})
    add({"$defs": {"item": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": I(1, 9)})},
         "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                    "minItems": 1, "maxItems": 2}},
         "required": ["items"], "additionalProperties": False})
    add({"$defs": {"e": {"enum": ["low", "high"]}}, "type": "object",
         "properties": {"p": {"$ref": "#/$defs/e"}, "q": {"$ref": "#/$defs/e"}},
         "required": ["p", "q"], "additionalProperties": False})
    add({"$defs": {"node": {"type": "object", "properties": {"v": I(0, 9), "next": {"anyOf": [{"type": "null"},
         {"$ref": "#/$defs/node"}]}}, "required": ["v", "next"], "additionalProperties": False}},
         "$ref": "#/$defs/node", "maxProperties": 2})
    # formats
    add(obj({"day": {"type": "string", "format": "date"}}))
    add(obj({"at": {"type": "string", "format": "time"}}))
    add(obj({"when": {"type": "string", "format": "date-time"}}))
    add(obj({"id": {"type": "string", "format": "uuid"}}))
    add(obj({"ip": {"type": "string", "format": "ipv4"}}))
    add(obj({"ip6": {"type": "string", "format": "ipv6"}}))
    # patterns
    add(obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}))
    add(obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}))
    add(obj({"ver": {"type": "string", "pattern": "^v[0-9]\\.[0-9]{1,2}\\.[0-9]$"}}))
    add({"type": "string", "pattern": "^(foo|bar|baz)[0-9]$"})
    # bounds and mixes
    add(obj({"n": {"type": "integer", "minimum": 10, "exclusiveMaximum": 20, "multipleOf": 3}}))
    add(obj({"word": {"type": "string", "minLength": 3, "maxLength": 5}}))
    add(obj({"user": obj({"id": {"type": "string", "format": "uuid"}, "role": {"enum": ["admin", "dev"]}}),
             "perms": {"type": "array", "items": {"enum": ["r", "w", "x"]}, "maxItems": 3},
             "since": {"type": "string", "format": "date"}}))
    add(obj({"event": obj({"title": S(10), "when": {"type": "string", "format": "date-time"},
                           "attendees": {"type": "array", "items": S(6), "maxItems": 2}}),
             "remind": {"anyOf": [{"type": "null"}, I(0, 60)]}}))
    assert len(out) == 50, len(out)
    return out


def chat_json(c, schema, i, stream):
    body = dict(model=h.MINI, messages=[{"role": "user", "content": "Give me the JSON, case %d." % i}],
                max_tokens=MAXTOK, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "s%d" % i, "schema": schema,
                                                                        "strict": i % 2 == 0}},
                extra_body=NOTHINK)
    if not stream:
        r = c.chat.completions.create(**body)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, fin = "", None
    for ch in c.chat.completions.create(stream=True, **body):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            fin = ch.choices[0].finish_reason or fin
    return text, fin


def validate(text, schema, what):
    try:
        v = json.loads(text)
    except Exception as e:
        raise AssertionError(f"{what}: not JSON ({e}): {text[:300]!r}")
    try:
        jsonschema.validate(v, schema)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{what}: does not validate ({e.message}): {text[:300]!r}")
    return v


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": S(16), "unit": {"enum": ["c", "f"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Adds numbers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": I(0, 99), "b": I(0, 99),
                                          "tags": {"type": "array", "items": S(4), "maxItems": 2}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_calls(calls, only=None):
    assert calls, "no tool_calls"
    for tc in calls:
        name = tc["function"]["name"] if isinstance(tc, dict) else tc.function.name
        args = tc["function"]["arguments"] if isinstance(tc, dict) else tc.function.arguments
        assert name in PARAMS, name
        if only:
            assert name == only, (name, only)
        validate(args, PARAMS[name], "arguments of " + name)


def main():
    s = h.Server(h.MINI)
    c = s.client()
    c.timeout = 120
    M = h.MINI
    schs = schemas()

    def fifty(stream):
        def go():
            with cf.ThreadPoolExecutor(16) as ex:
                res = list(ex.map(lambda a: chat_json(c, a[1], a[0], stream), enumerate(schs)))
            bad = []
            for i, ((text, fin), sch) in enumerate(zip(res, schs)):
                try:
                    validate(text, sch, "schema %d" % i)
                    assert fin == "stop", f"schema {i}: finish_reason {fin}"
                except AssertionError as e:
                    bad.append(str(e))
            assert not bad, f"{len(bad)} of 50 failed: " + " | ".join(bad[:3])
        return go

    check("50 schemas, every reply valid", fifty(False))
    check("50 schemas streamed, every reply valid", fifty(True))

    def parse_pydantic():
        class Step(pydantic.BaseModel):
            model_config = pydantic.ConfigDict(extra="forbid")
            op: str = pydantic.Field(max_length=8)
            n: int = pydantic.Field(ge=0, le=9)

        class Plan(pydantic.BaseModel):
            model_config = pydantic.ConfigDict(extra="forbid")
            title: str = pydantic.Field(max_length=12)
            steps: list[Step] = pydantic.Field(max_length=2)
            done: bool

        r = c.beta.chat.completions.parse(model=M, messages=[{"role": "user", "content": "Plan it."}],
                                          response_format=Plan, max_tokens=MAXTOK, temperature=0,
                                          extra_body=NOTHINK) if hasattr(c, "beta") and hasattr(
            c.beta, "chat") else c.chat.completions.parse(model=M, messages=[{"role": "user", "content": "Plan it."}],
                                                          response_format=Plan, max_tokens=MAXTOK, temperature=0,
                                                          extra_body=NOTHINK)
        p = r.choices[0].message.parsed
        assert isinstance(p, Plan), r.choices[0].message
    check("chat.completions.parse() with a pydantic model", parse_pydantic)

    def tools_call(tc, stream, only=None):
        def go():
            body = dict(model=M, messages=[{"role": "user", "content": "Call a tool."}], tools=TOOLS,
                        tool_choice=tc, max_tokens=MAXTOK, temperature=0.7, seed=7, extra_body=NOTHINK)
            if not stream:
                r = c.chat.completions.create(**body)
                m = r.choices[0].message
                assert r.choices[0].finish_reason == "tool_calls", r.choices[0].finish_reason
                check_calls(m.tool_calls, only)
                return
            calls = {}
            fin = None
            for ch in c.chat.completions.create(stream=True, **body):
                if not ch.choices:
                    continue
                d = ch.choices[0].delta
                fin = ch.choices[0].finish_reason or fin
                for t in d.tool_calls or []:
                    e = calls.setdefault(t.index, {"function": {"name": "", "arguments": ""}})
                    if t.function and t.function.name:
                        e["function"]["name"] = t.function.name
                    if t.function and t.function.arguments:
                        e["function"]["arguments"] += t.function.arguments
            assert fin == "tool_calls", fin
            check_calls([calls[k] for k in sorted(calls)], only)
        return go

    named = {"type": "function", "function": {"name": "add"}}
    check("tool_choice required: valid tool_calls", tools_call("required", False))
    check("tool_choice required, streamed deltas: valid tool_calls", tools_call("required", True))
    check("tool_choice named: a valid call of that function", tools_call(named, False, "add"))
    check("tool_choice named, streamed deltas", tools_call(named, True, "add"))

    def auto_strict():
        tools = [dict(t, function=dict(t["function"], strict=True)) for t in TOOLS]
        for seed in range(3):
            r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=tools, tool_choice="auto", max_tokens=MAXTOK, temperature=1.0,
                                          seed=seed, extra_body=NOTHINK)
            m = r.choices[0].message
            if m.tool_calls:
                check_calls(m.tool_calls)
            else:
                assert r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason
    check("tool_choice auto with strict tools: calls that validate, or text", auto_strict)

    def regex_choice():
        r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "A code."}], max_tokens=60,
                                      temperature=0, extra_body=dict(NOTHINK, structured_outputs={
                                          "regex": "[A-Z]{3}-[0-9]{2,4}"}))
        t = r.choices[0].message.content
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", t), t
        r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Pick."}], max_tokens=20,
                                      temperature=0, extra_body=dict(NOTHINK, guided_choice=["left", "right"]))
        assert r.choices[0].message.content in ("left", "right"), r.choices[0].message.content
        r = c.completions.create(model=M, prompt="The answer is", max_tokens=20, temperature=0,
                                 extra_body={"guided_regex": "(yes|no), [0-9]"})
        assert re.fullmatch(r"(yes|no), [0-9]", r.choices[0].text), r.choices[0].text
        r = c.completions.create(model=M, prompt="Colour:", max_tokens=20, temperature=0,
                                 extra_body={"structured_outputs": {"choice": ["red", "green"]}})
        assert r.choices[0].text in ("red", "green"), r.choices[0].text
        g = 'root ::= "x=" [0-9] [0-9]? ";"'
        r = c.completions.create(model=M, prompt="Set", max_tokens=20, temperature=0,
                                 extra_body={"structured_outputs": {"grammar": g}})
        assert re.fullmatch(r"x=[0-9][0-9]?;", r.choices[0].text), r.choices[0].text
        sch = obj({"k": I(0, 9)})
        r = c.completions.create(model=M, prompt="JSON:", max_tokens=60, temperature=0,
                                 extra_body={"guided_json": sch})
        validate(r.choices[0].text, sch, "completions guided_json")
        # streamed regex
        text = ""
        for ch in c.completions.create(model=M, prompt="Code", max_tokens=40, temperature=0, stream=True,
                                       extra_body={"guided_regex": "[a-z]{2}[0-9]{3}"}):
            text += ch.choices[0].text if ch.choices else ""
        assert re.fullmatch(r"[a-z]{2}[0-9]{3}", text), text
    check("regex, choice and grammar outputs match (chat, completions, streamed)", regex_choice)

    sch = schs[49]

    def n_seed():
        def once():
            r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Event?"}], n=3, seed=11,
                                          temperature=1.0, max_tokens=MAXTOK, extra_body=NOTHINK,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "e", "schema": sch}})
            out = [ch.message.content for ch in r.choices]
            for t in out:
                validate(t, sch, "n=3")
            return out
        a, b = once(), once()
        assert a == b, (a, b)
    check("n=3 with a seed: valid, and the same seed gives the same replies", n_seed)

    def logprobs():
        r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}], max_tokens=MAXTOK,
                                      temperature=0, logprobs=True, top_logprobs=3, extra_body=NOTHINK,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "e", "schema": schs[1]}})
        validate(r.choices[0].message.content, schs[1], "logprobs")
        lp = r.choices[0].logprobs.content
        assert lp, "no logprobs"
        assert "".join(t.token for t in lp) == r.choices[0].message.content
        for t in lp:
            assert t.logprob <= 0 and t.logprob > -1e9, t
            # the mask is applied first: the chosen token is the most likely of the allowed ones
            assert t.top_logprobs and t.top_logprobs[0].logprob >= t.logprob - 1e-4, t
    check("logprobs under a grammar: the masked distribution", logprobs)

    def stops():
        sch2 = obj({"a": S(6), "b": {"type": "array", "items": I(0, 9), "maxItems": 3}})
        r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}], max_tokens=MAXTOK,
                                      temperature=0, stop=[",", "\"", "]"], extra_body=NOTHINK,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "e", "schema": sch2}})
        validate(r.choices[0].message.content, sch2, "stop strings")
        r = c.completions.create(model=M, prompt="JSON:", max_tokens=80, temperature=0, stop=[":", "\""],
                                 extra_body={"guided_json": sch2})
        validate(r.choices[0].text, sch2, "stop strings, completions")
    check("stop strings do not cut a structured output", stops)

    def thinking():
        sch2 = schs[0]
        r = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Who are you?"}],
                                      max_tokens=MAXTOK, temperature=0,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "e", "schema": sch2}})
        m = r.choices[0].message
        validate(m.content, sch2, "thinking on")
        assert getattr(m, "reasoning_content", None) is not None or (m.model_extra or {}).get("reasoning_content")
    check("thinking on: the think block runs free, the content validates", thinking)

    def bad(status, needle, **kw):
        def go():
            body = dict(model=M, messages=[{"role": "user", "content": "x"}], max_tokens=10)
            body.update(kw)
            try:
                c.chat.completions.create(**body)
            except openai.APIStatusError as e:
                assert e.status_code == status, (e.status_code, e.message)
                assert needle in e.message, e.message
                return
            raise AssertionError("accepted")
        return go

    def rf(schema):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    check("400: an unsupported keyword, named with its path",
          bad(400, "response_format.json_schema.schema.properties.a: keyword 'contains' is not supported",
              response_format=rf({"type": "object", "properties": {"a": {"type": "array", "contains": {}}}})))
    check("400: if/then/else named",
          bad(400, "keyword 'if'", response_format=rf({"if": {"type": "string"}, "then": {"maxLength": 3}})))
    check("400: a named tool_choice absent from tools",
          bad(400, "\"tool_choice\" names the function \"nope\", which is not in \"tools\"", tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "nope"}}))
    check("400: tool_choice required without tools", bad(400, "tools", tool_choice="required"))
    check("400: a tool's unsupported keyword names the tool",
          bad(400, "tools[1].function.parameters", tool_choice={"type": "function", "function": {"name": "t2"}},
              tools=[TOOLS[0], {"type": "function", "function": {"name": "t2", "parameters": {
                  "type": "object", "properties": {"a": {"type": "string"}}, "dependentRequired": {"a": ["b"]}}}}]))
    check("400: two constraints at once", bad(400, "both constrain", response_format={"type": "json_object"},
                                               extra_body={"guided_regex": "a+"}))
    check("400: a bad regex", bad(400, "regex", extra_body={"structured_outputs": {"regex": "(a"}}))
    check("400: a bad grammar", bad(400, "grammar", extra_body={"structured_outputs": {"grammar": "root ::= ("}}))
    check("400: a bad response_format type", bad(400, "response_format",
                                                  response_format={"type": "xml"}))

    def responses_format():
        sch2 = schs[23]
        r = c.responses.create(model=M, input="Pick.", max_output_tokens=MAXTOK, temperature=0,
                               reasoning={"effort": "none"},
                               text={"format": {"type": "json_schema", "name": "p", "schema": sch2, "strict": True}})
        validate(r.output_text, sch2, "responses text.format")
        r = h.post(s.url + "/v1/responses", json_body={
            "model": M, "input": "x", "max_output_tokens": 10,
            "text": {"format": {"type": "json_schema", "name": "p", "schema": {"contains": {}}}}})
        assert r.status_code == 400 and "text.format.schema: keyword 'contains'" in r.text, r.text
    check("/v1/responses: text.format's schema constrains the output; its 400 names text.format.schema",
          responses_format)

    def messages_tools():
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in TOOLS]
        for tc, only in (({"type": "any"}, None), ({"type": "tool", "name": "get_weather"}, "get_weather")):
            r = h.post(s.url + "/v1/messages", json_body={
                "model": M, "max_tokens": MAXTOK, "temperature": 0, "tools": tools, "tool_choice": tc,
                "messages": [{"role": "user", "content": "Call a tool."}]}, timeout=120)
            assert r.status_code == 200, r.text
            body = r.json()
            uses = [b for b in body["content"] if b["type"] == "tool_use"]
            assert uses and body["stop_reason"] == "tool_use", body
            for u in uses:
                assert u["name"] in PARAMS and (not only or u["name"] == only), u
                jsonschema.validate(u["input"], PARAMS[u["name"]])
    check("/v1/messages: tool_choice any and tool give tool_use blocks whose input validates", messages_tools)
    s.stop()

    # preemption: four constrained requests at once on a pool too small for them
    def preempt():
        p = h.Server(h.MINI, "--cache-tokens", "640", "--max-num-seqs", "4")
        try:
            cp = p.client()
            cp.timeout = 120
            sch2 = obj({"items": {"type": "array", "items": obj({"name": S(12), "n": I(0, 999)}),
                                  "minItems": 4, "maxItems": 4}})
            def one(i):
                r = cp.chat.completions.create(model=M, messages=[{"role": "user", "content": "List %d." % i}],
                                               max_tokens=300, temperature=0, extra_body=NOTHINK,
                                               response_format={"type": "json_schema",
                                                                "json_schema": {"name": "e", "schema": sch2}})
                return r.choices[0].message.content
            with cf.ThreadPoolExecutor(4) as ex:
                outs = list(ex.map(one, range(4)))
            for t in outs:
                validate(t, sch2, "preempted")
            m = p.metrics()
            pre = sum(v for k, v in m.items() if k.startswith("vllm:num_preemptions_total"))
            assert pre > 0, "no preemption happened"
        finally:
            p.stop()
    check("preempted requests (a 640-token pool) still valid", preempt)


if __name__ == "__main__":
    suite.main(main)
