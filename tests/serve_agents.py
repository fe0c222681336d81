"""serve_agents.py -- what agent frameworks send, held on `k3 serve -m models/k3-mini`,
each pattern over 40 seeds: every reply parses, validates and carries no chat markup.

  - a forced tool call with an integer argument (whole and streamed): a 200 whose
    arguments parse, the integer within the bound the grammar keeps (16 digits);
  - replies cut by max_tokens on chat (whole, streamed, thinking on), Responses and
    Messages, and a json_schema reply cut the same way: no special in any field;
  - a tool call cut by max_tokens: the stream and the whole answer tell the same
    call, with finish_reason "length";
  - tools beside an output schema: tool_choice required / named make the turn a call,
    auto a call or JSON that validates (chat, Responses, Messages);
  - a schema without additionalProperties: only the declared keys; the opt-out;
  - thinking on under a schema: the think block runs free, the content validates;
  - openai-agents (tools + output_type) on its Chat Completions and its Responses model
    classes; instructor (JSON_SCHEMA and TOOLS modes).

Usage: python tests/serve_agents.py K3_BINARY [NAME_SUBSTRING]
Ends with `agents: N passed, N failed, N skipped`. A framework that is not installed
(scripts/venv.sh installs them from PyPI) is a skip with its reason.
"""
import asyncio
import concurrent.futures as cf
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

import jsonschema  # noqa: E402
import pydantic  # noqa: E402

SEEDS = 40
CONC = 8
M = h.MINI
NOTHINK = {"chat_template_kwargs": {"thinking": False}}
MARKUP = re.compile(r"<\|(open|close|sep|end_of_msg)\|>|<\|[a-z_]*\|?$|\|>(response|think|message|tools)")
suite = h.Suite("agents", sys.argv[2] if len(sys.argv) > 2 else None)

POP_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "year": {"type": "integer"}}, "required": ["city", "year"]}
POP = {"type": "function", "function": {"name": "get_population", "description": "The population of a city in a year.",
                                        "parameters": POP_PARAMS}}
POP_LONG = {"type": "function", "function": {"name": "get_population", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["city", "year"]}}}
POP_NAMED = {"type": "function", "function": {"name": "get_population"}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                           "confidence": {"type": "number"}}, "required": ["answer", "confidence"]}
ASK = [{"role": "user", "content": "What was the population of Lyon in 1990?"}]
PLAIN = [{"role": "user", "content": "Tell me about the weather and the budget."}]


def seeds(fn):
    """fn(seed) over the seeds, CONC at once (the engine batches them); the results in order."""
    with cf.ThreadPoolExecutor(CONC) as ex:
        return list(ex.map(fn, range(SEEDS)))


def strings(o):
    if isinstance(o, str):
        yield o
    elif isinstance(o, dict):
        for k, v in o.items():
            yield k
            yield from strings(v)
    elif isinstance(o, list):
        for v in o:
            yield from strings(v)


def no_markup(what, *objs):
    for o in objs:
        for s in strings(o):
            assert not MARKUP.search(s), f"{what}: chat markup in a field: {s[-120:]!r}"


def chat(s, body, stream=False, timeout=300):
    r = h.post(s.url + "/v1/chat/completions", json_body=dict(body, model=M, stream=stream), timeout=timeout)
    if not stream:
        assert r.status_code == 200, (r.status_code, r.text[:300])
        return r.json()
    assert r.status_code == 200, (r.status_code, r.text[:300])
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "error": None}
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line[6:] == "[DONE]":
            continue
        e = json.loads(line[6:])
        no_markup("a chat chunk", e)
        if "error" in e:
            out["error"] = e["error"]
            continue
        for ch in e.get("choices", []):
            d = ch.get("delta", {})
            out["content"] += d.get("content") or ""
            out["reasoning"] += d.get("reasoning_content") or ""
            for t in d.get("tool_calls") or []:
                c = out["calls"].setdefault(t["index"], {"name": "", "arguments": ""})
                f = t.get("function") or {}
                c["name"] += f.get("name") or ""
                c["arguments"] += f.get("arguments") or ""
            out["finish"] = ch.get("finish_reason") or out["finish"]
    assert not out["error"], out["error"]
    return out


def pop_args(a, params=POP_PARAMS):
    """The arguments of a get_population call: valid JSON that validates, the integer as
    the grammar bounds it."""
    v = json.loads(a)
    jsonschema.validate(v, params)
    year = re.search(r'"year": (-?[0-9]+)', a)
    assert year and len(year.group(1).lstrip("-")) <= 16, a
    return v


def run(s):
    # ---- 1. a valid tool call is never a 500 --------------------------------
    def forced(stream):
        def go():
            def one(i):
                body = dict(messages=ASK, tools=[POP], tool_choice=POP_NAMED, seed=i, max_tokens=200, **NOTHINK)
                if stream:
                    a = chat(s, body, True)
                    assert a["finish"] == "tool_calls" and len(a["calls"]) == 1, a
                    pop_args(a["calls"][0]["arguments"])
                    return
                r = chat(s, body)
                no_markup("forced call", r)
                ch = r["choices"][0]
                assert ch["finish_reason"] == "tool_calls", ch
                for c in ch["message"]["tool_calls"]:
                    pop_args(c["function"]["arguments"])
            seeds(one)
        return go
    suite.check("forced get_population(city, year: integer), 40 seeds: 200s, arguments valid", forced(False))
    suite.check("forced get_population streamed, 40 seeds: no error event, arguments valid", forced(True))

    # ---- 2. no chat markup in any field, wherever max_tokens cuts ------------
    def cut_replies():
        def one(i):
            for body, thinking in ((dict(messages=PLAIN, seed=i, max_tokens=40, **NOTHINK), False),
                                   (dict(messages=PLAIN, seed=i, max_tokens=40), True)):
                r = chat(s, body)
                no_markup("chat", r)
                a = chat(s, body, True)
                no_markup("chat stream", a)
            r = chat(s, dict(messages=PLAIN, seed=i, max_tokens=12, **NOTHINK, response_format={
                "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}))
            no_markup("json_schema", r)
            resp = h.post(s.url + "/v1/responses", json_body=dict(
                model=M, input=PLAIN[0]["content"], seed=i, max_output_tokens=40, reasoning={"effort": "none"}),
                timeout=300)
            assert resp.status_code == 200, resp.text[:300]
            no_markup("responses", resp.json()["output"])
            msg = h.post(s.url + "/v1/messages", json_body=dict(model=M, messages=PLAIN, max_tokens=40, seed=i,
                                                                temperature=1.0), timeout=300)
            assert msg.status_code == 200, msg.text[:300]
            no_markup("messages", msg.json()["content"])
        seeds(one)
    suite.check("cut by max_tokens on chat (thinking on and off, streamed), json_schema, Responses, Messages, "
                "40 seeds: no markup", cut_replies)

    def cut_call():
        def one(i):
            body = dict(messages=ASK, tools=[POP_LONG], tool_choice=POP_NAMED, seed=i, max_tokens=60, **NOTHINK)
            r, a = chat(s, body), chat(s, body, True)
            ch = r["choices"][0]
            whole = [(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"].get("tool_calls") or []]
            streamed = [(c["name"], c["arguments"]) for _, c in sorted(a["calls"].items())]
            assert whole == streamed, (whole, streamed)
            assert ch["finish_reason"] == a["finish"], (ch["finish_reason"], a["finish"])
            if ch["finish_reason"] == "length":
                return 1
            return 0
        cuts = sum(seeds(one))
        assert cuts >= SEEDS // 2, f"only {cuts} of {SEEDS} calls were cut: the case does not test the cut"
    suite.check("a tool call cut by max_tokens, 40 seeds: stream and whole answer tell the same call, "
                "finish_reason length", cut_call)

    # ---- 3. tools beside an output schema ------------------------------------
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}

    def union(tc):
        def go():
            def one(i):
                r = chat(s, dict(messages=ASK, tools=[POP], tool_choice=tc, response_format=rf, seed=i,
                                 max_tokens=200, **NOTHINK))
                no_markup("tools + response_format", r)
                m = r["choices"][0]["message"]
                if m.get("tool_calls"):
                    for c in m["tool_calls"]:
                        pop_args(c["function"]["arguments"])
                    assert r["choices"][0]["finish_reason"] == "tool_calls"
                    return "call"
                assert tc == "auto", ("a forced tool choice answered without a call", m)
                jsonschema.validate(json.loads(m["content"]), ANSWER)
                return "json"
            return seeds(one)
        return go
    suite.check("tools + response_format, tool_choice required, 40 seeds: a valid call each", union("required"))
    suite.check("tools + response_format, tool_choice named, 40 seeds: a valid call each", union(POP_NAMED))
    suite.check("tools + response_format, tool_choice auto, 40 seeds: a valid call or valid JSON", union("auto"))

    def union_other_apis():
        tools_r = [{"type": "function", **POP["function"]}]
        tools_m = [{"name": "get_population", "description": "x", "input_schema": POP_PARAMS}]

        def one(i):
            for tc in ("required", "auto"):
                r = h.post(s.url + "/v1/responses", json_body=dict(
                    model=M, input=ASK[0]["content"], seed=i, max_output_tokens=200, reasoning={"effort": "none"},
                    tools=tools_r, tool_choice=tc,
                    text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}),
                    timeout=300)
                assert r.status_code == 200, r.text[:300]
                out = r.json()["output"]
                no_markup("responses", out)
                calls = [o for o in out if o["type"] == "function_call"]
                for c in calls:
                    pop_args(c["arguments"])
                if not calls:
                    assert tc == "auto", out
                    text = "".join(p["text"] for o in out if o["type"] == "message" for p in o["content"])
                    jsonschema.validate(json.loads(text), ANSWER)
            for tc in ({"type": "any"}, {"type": "auto"}):
                r = h.post(s.url + "/v1/messages", json_body=dict(
                    model=M, messages=ASK, max_tokens=200, seed=i, tools=tools_m, tool_choice=tc,
                    output_config={"format": {"type": "json_schema", "schema": ANSWER}}), timeout=300)
                assert r.status_code == 200, r.text[:300]
                content = r.json()["content"]
                no_markup("messages", content)
                uses = [b for b in content if b["type"] == "tool_use"]
                for u in uses:
                    jsonschema.validate(u["input"], POP_PARAMS)
                if not uses:
                    assert tc["type"] == "auto", content
                    text = "".join(b["text"] for b in content if b["type"] == "text")
                    jsonschema.validate(json.loads(text), ANSWER)
        seeds(one)
    suite.check("Responses (text.format) and Messages (output_config.format) beside tools, required/any and auto, "
                "40 seeds", union_other_apis)

    # ---- 4. objects closed unless the schema opens them ----------------------
    open_schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                    "age": {"type": "integer"}}}

    def closed():
        def one(i):
            r = chat(s, dict(messages=PLAIN, seed=i, max_tokens=120, **NOTHINK, response_format={
                "type": "json_schema", "json_schema": {"name": "p", "schema": open_schema}}))
            ch = r["choices"][0]
            assert ch["finish_reason"] == "stop", ch
            v = json.loads(ch["message"]["content"])
            jsonschema.validate(v, open_schema)
            assert set(v) <= {"name", "age"}, v
        seeds(one)
        # the opt-out: JSON Schema's meaning, other keys allowed (the reply still validates)
        r = chat(s, dict(messages=PLAIN, seed=3, max_tokens=400, **NOTHINK, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": open_schema}},
            structured_outputs={"disable_additional_properties": False}))
        assert r["choices"][0]["message"]["content"].startswith("{"), r
        bad = h.post(s.url + "/v1/chat/completions", json_body=dict(
            model=M, messages=PLAIN, max_tokens=4, structured_outputs={"disable_additional_properties": "no"}))
        assert bad.status_code == 400 and "disable_additional_properties" in bad.text, bad.text
    suite.check("a schema without additionalProperties, 40 seeds: only the declared keys; the opt-out", closed)

    # ---- 5. thinking on: the constraint starts after the think block ---------
    def thinking():
        def one(i):
            r = chat(s, dict(messages=ASK, seed=i, max_tokens=400, response_format={
                "type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}))
            ch = r["choices"][0]
            no_markup("thinking", r)
            if ch["finish_reason"] == "length":
                return 0
            jsonschema.validate(json.loads(ch["message"]["content"]), ANSWER)
            return 1 if ch["message"].get("reasoning_content") else 0
        thought = sum(seeds(one))
        assert thought >= SEEDS // 4, f"only {thought} replies thought before their JSON"
    suite.check("thinking on under a schema, 40 seeds: free reasoning, then content that validates", thinking)

    # ---- frameworks -----------------------------------------------------------
    def oa_agents(kind):
        def go():
            try:
                import httpx2 as httpx
                import openai
                from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                                    function_tool, set_tracing_disabled)
                from agents.exceptions import MaxTurnsExceeded
                from openai.types.shared import Reasoning
            except ImportError as e:
                raise h.Skip(f"openai-agents is not installed ({e}); scripts/venv.sh openai-agents")
            from typing import Annotated
            set_tracing_disabled(True)
            replies = []

            async def keep(resp):
                await resp.aread()
                replies.append(resp.text)
            client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300,
                                        http_client=httpx.AsyncClient(event_hooks={"response": [keep]}, timeout=300))
            ran = []

            @function_tool
            def get_population(city: Annotated[str, pydantic.Field(max_length=24)], year: int) -> int:
                """The population of a city in a year."""
                assert isinstance(year, int)
                ran.append((city, year))
                return 472317

            class Answer(pydantic.BaseModel):
                answer: str = pydantic.Field(max_length=40)
                confidence: float

            async def one(i):
                model = (OpenAIChatCompletionsModel(model=M, openai_client=client) if kind == "chat"
                         else OpenAIResponsesModel(model=M, openai_client=client))
                extra = {"seed": i}
                if kind == "chat":
                    extra.update(NOTHINK)
                out = []
                # the first turn must call (then auto: a call or the output type's JSON, one
                # grammar); and with tool_choice none the output type alone
                for tc in ("required", "none"):
                    agent = Agent(name="population", instructions="Answer with the population.",
                                  tools=[get_population], output_type=Answer, model=model,
                                  model_settings=ModelSettings(max_tokens=200, temperature=1.0, tool_choice=tc,
                                                               reasoning=Reasoning(effort="none"), extra_body=extra))
                    try:
                        r = await Runner.run(agent, ASK[0]["content"], max_turns=3)
                        assert isinstance(r.final_output, Answer), r.final_output
                        out.append("answer")
                    except MaxTurnsExceeded:
                        assert tc == "required"
                        out.append("max turns")  # the toy model kept calling the tool: every call was valid
                return out

            async def all_seeds():
                sem = asyncio.Semaphore(CONC)

                async def lim(i):
                    async with sem:
                        return await one(i)
                return await asyncio.gather(*[lim(i) for i in range(SEEDS)])
            outcomes = [o for pair in asyncio.run(all_seeds()) for o in pair]
            for t in replies:
                for line in t.splitlines() if "data:" in t else [t]:
                    line = line[6:] if line.startswith("data: ") else line
                    if line.startswith("{"):
                        no_markup("openai-agents reply", json.loads(line))
            assert len(ran) >= SEEDS, f"{len(ran)} tool calls ran in {SEEDS} runs"
            assert outcomes.count("answer") >= SEEDS, outcomes
            print(f"    {kind}: {outcomes.count('answer')} answers, {outcomes.count('max turns')} runs kept calling "
                  f"the tool; {len(ran)} calls ran, {len(replies)} replies read", flush=True)
        return go
    suite.check("openai-agents, OpenAIChatCompletionsModel, tools + output_type, 40 seeds", oa_agents("chat"))
    suite.check("openai-agents, OpenAIResponsesModel, tools + output_type, 40 seeds", oa_agents("responses"))

    def instructor_modes():
        try:
            import instructor
            import openai
        except ImportError as e:
            raise h.Skip(f"instructor is not installed ({e}); scripts/venv.sh instructor")

        class City(pydantic.BaseModel):
            name: str = pydantic.Field(max_length=24)
            population: int
            founded: int

        for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
            client = instructor.from_openai(openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0,
                                                          timeout=300), mode=mode)

            def one(i):
                c = client.chat.completions.create(model=M, response_model=City, max_retries=0, messages=ASK,
                                                   max_tokens=200, seed=i, extra_body=NOTHINK)
                assert isinstance(c, City) and set(c.model_dump()) == {"name", "population", "founded"}, c
            seeds(one)
    suite.check("instructor Mode.JSON_SCHEMA and Mode.TOOLS, 40 seeds each: a validated model", instructor_modes)


def main():
    s = h.Server(M)
    run(s)


if __name__ == "__main__":
    suite.main(main)
