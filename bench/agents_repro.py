"""agents_repro.py -- what an agent framework meets on the chat surfaces, counted
over 40 seeds each against `k3 serve -m models/k3-mini`: tool calls whose
arguments the server cannot return, chat markup in any field, tool calls cut by
max_tokens told differently streamed and not, tools beside an output schema,
keys a schema did not declare.

Usage: .venv/bin/python bench/agents_repro.py build/k3 [SEEDS] [CONCURRENCY]
(CONCURRENCY 1 by default: each request alone, so a seed gives the same reply
whatever else runs; the AMX kernels make results depend on the batch)
Prints one line per case: `CASE: BAD of N (what BAD is) ...` and an example of
each kind of failure. Nothing is asserted: it is a measurement (the tests that
hold the fixed behaviour are in tests/serve_agents.py).
"""
import concurrent.futures as cf
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import harness as h  # noqa: E402


SEEDS = int(sys.argv[2]) if len(sys.argv) > 2 else 40
CONC = int(sys.argv[3]) if len(sys.argv) > 3 else 1
M = h.MINI
NOTHINK = {"chat_template_kwargs": {"thinking": False}}
MARKUP = re.compile(r"<\|(open|close|sep|end_of_msg)\|>|<\|[a-z_]*\|?$|\|>(response|think|message|tools)")

POP = {"type": "function", "function": {
    "name": "get_population", "description": "The population of a city in a year.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
                   "required": ["city", "year"]}}}
POP_NAMED = {"type": "function", "function": {"name": "get_population"}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
          "required": ["answer", "confidence"]}


def markup(*fields):
    return any(isinstance(f, str) and MARKUP.search(f) for f in fields)


def strings(o):
    """Every string inside a JSON-like value (keys too)."""
    if isinstance(o, str):
        yield o
    elif isinstance(o, dict):
        for k, v in o.items():
            yield k
            yield from strings(v)
    elif isinstance(o, list):
        for v in o:
            yield from strings(v)


def chat_raw(s, body, stream=False):
    """(status, parsed body or list of SSE events)."""
    body = dict(body, model=M, stream=stream)
    r = h.post(s.url + "/v1/chat/completions", json_body=body, timeout=300)
    if not stream:
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text
    events = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line[6:] != "[DONE]":
            events.append(json.loads(line[6:]))
    return r.status_code, events


def assemble(events):
    """A chat stream's events as one message: content, reasoning, tool calls, finish, error."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "error": None}
    for e in events:
        if "error" in e:
            out["error"] = e["error"].get("message")
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
    return out


class Case:
    def __init__(self, name, what):
        self.name, self.what, self.bad, self.n, self.ex, self.kinds = name, what, 0, 0, {}, {}

    def add(self, bad, kind=None, example=None):
        self.n += 1
        if bad:
            self.bad += 1
            kind = kind or "bad"
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            self.ex.setdefault(kind, example)

    def line(self):
        s = f"{self.name}: {self.bad} of {self.n} {self.what}"
        if self.kinds:
            s += " (" + ", ".join(f"{k} {v}" for k, v in self.kinds.items()) + ")"
        for k, v in self.ex.items():
            s += f"\n    e.g. {k}: {str(v)[:200]!r}"
        return s


def run_seeds(fn):
    with cf.ThreadPoolExecutor(CONC) as ex:
        return list(ex.map(fn, range(SEEDS)))


def valid_pop_args(a):
    try:
        v = json.loads(a)
    except ValueError:
        return False
    return isinstance(v, dict) and set(v) == {"city", "year"} and isinstance(v["city"], str) and \
        isinstance(v["year"], int) and not isinstance(v["year"], bool)


def main():
    s = h.Server(M, threads=2)
    cases = []

    # 1. a forced tool call with an integer argument
    msgs = [{"role": "user", "content": "What was the population of Lyon in 1990?"}]
    c1 = Case("forced get_population, whole", "not a 200 with valid arguments")
    c1s = Case("forced get_population, streamed", "with an error event or arguments that do not parse")
    for st, b in run_seeds(lambda i: chat_raw(s, dict(messages=msgs, tools=[POP], tool_choice=POP_NAMED,
                                                      seed=i, max_tokens=200, **NOTHINK))):
        ch = b["choices"][0] if st == 200 else {}
        calls = ch.get("message", {}).get("tool_calls")
        ok = st == 200 and calls and all(valid_pop_args(c["function"]["arguments"]) for c in calls)
        kind = f"HTTP {st}" if st != 200 else "cut at max_tokens" if ch.get("finish_reason") == "length" else "bad"
        c1.add(not ok, kind, b if st != 200 else ch)
    for st, ev in run_seeds(lambda i: chat_raw(s, dict(messages=msgs, tools=[POP], tool_choice=POP_NAMED,
                                                       seed=i, max_tokens=200, **NOTHINK), True)):
        a = assemble(ev) if st == 200 else {"error": st, "calls": {}}
        ok = not a["error"] and a["calls"] and all(valid_pop_args(c["arguments"]) for c in a["calls"].values())
        kind = "error event" if a["error"] else "cut at max_tokens" if a["finish"] == "length" else "arguments"
        c1s.add(not ok, kind, a)
    cases += [c1, c1s]

    # 2. markup in any field, max_tokens cutting the closing markup
    plain = [{"role": "user", "content": "Tell me about the weather and the budget."}]
    c2 = Case("chat, max_tokens 40", "with chat markup in a field")
    c2s = Case("chat streamed, max_tokens 40", "with chat markup in a field")
    c2r = Case("responses, max_output_tokens 40", "with chat markup in a field")
    c2m = Case("messages, max_tokens 40", "with chat markup in a field")
    for st, b in run_seeds(lambda i: chat_raw(s, dict(messages=plain, seed=i, max_tokens=40, **NOTHINK))):
        m = b["choices"][0]["message"] if st == 200 else {}
        c2.add(st != 200 or markup(m.get("content"), m.get("reasoning_content")), "markup", m or b)
    for st, ev in run_seeds(lambda i: chat_raw(s, dict(messages=plain, seed=i, max_tokens=40, **NOTHINK), True)):
        a = assemble(ev)
        c2s.add(st != 200 or markup(a["content"], a["reasoning"]), "markup", a)

    def resp(i):
        r = h.post(s.url + "/v1/responses", json_body=dict(model=M, input=plain[0]["content"], seed=i,
                                                           max_output_tokens=40, reasoning={"effort": "none"}),
                   timeout=300)
        return r.status_code, r.json()
    for st, b in run_seeds(resp):
        c2r.add(st != 200 or markup(*strings(b.get("output"))), "markup", b.get("output"))

    def msg(i):
        r = h.post(s.url + "/v1/messages", json_body=dict(model=M, messages=plain, max_tokens=40,
                                                          seed=i, temperature=1.0,
                                                          thinking={"type": "disabled"}), timeout=300)
        return r.status_code, r.json()
    for st, b in run_seeds(msg):
        c2m.add(st != 200 or markup(*strings(b.get("content"))), "markup", b.get("content"))

    c2j = Case("json_schema reply, max_tokens 12", "with chat markup in a field")
    for st, b in run_seeds(lambda i: chat_raw(s, dict(messages=plain, seed=i, max_tokens=12, **NOTHINK,
                                                      response_format={"type": "json_schema", "json_schema": {
                                                          "name": "n", "schema": {"type": "integer"}}}))):
        m = b["choices"][0]["message"] if st == 200 else {}
        c2j.add(st != 200 or markup(m.get("content")), "markup", m or b)

    c2t = Case("thinking on, max_tokens 40", "with chat markup in a field")
    c2ts = Case("thinking on streamed, max_tokens 40", "with chat markup in a field")
    for st, b in run_seeds(lambda i: chat_raw(s, dict(messages=plain, seed=i, max_tokens=40))):
        m = b["choices"][0]["message"] if st == 200 else {}
        c2t.add(st != 200 or markup(m.get("content"), m.get("reasoning_content")), "markup", m or b)
    for st, ev in run_seeds(lambda i: chat_raw(s, dict(messages=plain, seed=i, max_tokens=40), True)):
        a = assemble(ev)
        c2ts.add(st != 200 or markup(a["content"], a["reasoning"]), "markup", a)
    cases += [c2, c2s, c2r, c2m, c2j, c2t, c2ts]

    # 2b. a tool call cut by max_tokens: the stream and the whole answer say the same
    c2c = Case("forced tool call cut at max_tokens 60", "where stream and whole answer differ (calls, finish)")
    def cut(i):
        body = dict(messages=msgs, tools=[POP], tool_choice=POP_NAMED, seed=i, max_tokens=60, **NOTHINK)
        return chat_raw(s, body), chat_raw(s, body, True)
    for (st, b), (sst, ev) in run_seeds(cut):
        a = assemble(ev)
        m = b["choices"][0] if st == 200 else {}
        whole = [(c["function"]["name"], c["function"]["arguments"])
                 for c in (m.get("message", {}).get("tool_calls") or [])]
        streamed = [(c["name"], c["arguments"]) for _, c in sorted(a["calls"].items())]
        same = st == 200 and whole == streamed and m.get("finish_reason") == a["finish"]
        c2c.add(not same, "differ", {"whole": whole, "finish": m.get("finish_reason") or b,
                                     "streamed": streamed, "sfinish": a["finish"] or a["error"]})
    cases.append(c2c)

    # 3. tools and an output schema together
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    for tc in ("required", POP_NAMED, "auto"):
        name = tc if isinstance(tc, str) else "named"
        c3 = Case(f"tools + response_format, tool_choice {name}", "refused or not in the union's shape")

        def both(i, tc=tc):
            return chat_raw(s, dict(messages=msgs, tools=[POP], tool_choice=tc, response_format=rf, seed=i,
                                    max_tokens=200, **NOTHINK))
        for st, b in run_seeds(both):
            if st != 200:
                c3.add(True, str(st), b)
                continue
            m = b["choices"][0]["message"]
            calls = m.get("tool_calls") or []
            if b["choices"][0]["finish_reason"] == "length":
                c3.add(True, "cut at max_tokens", m)  # the toy model's unbounded city name: not the server's
                continue
            if calls:
                ok = all(valid_pop_args(c["function"]["arguments"]) for c in calls)
            else:
                try:
                    v = json.loads(m.get("content") or "")
                    ok = tc == "auto" and isinstance(v, dict) and set(v) == {"answer", "confidence"}
                except ValueError:
                    ok = False
            c3.add(not ok, "shape", m)
        cases.append(c3)
    c3r = Case("responses: tools + text.format, tool_choice required", "refused")
    def rboth(i):
        r = h.post(s.url + "/v1/responses", json_body=dict(
            model=M, input=msgs[0]["content"], seed=i, max_output_tokens=200, reasoning={"effort": "none"},
            tools=[{"type": "function", **POP["function"]}], tool_choice="required",
            text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}),
            timeout=300)
        return r.status_code, r.json()
    for st, b in run_seeds(rboth):
        c3r.add(st != 200, str(st), b)
    cases.append(c3r)

    # 4. a schema without additionalProperties: keys it did not declare
    open_schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                    "age": {"type": "integer"}}}
    c4 = Case("json_schema without additionalProperties", "with keys the schema does not declare")
    for st, b in run_seeds(lambda i: chat_raw(s, dict(messages=plain, seed=i, max_tokens=120, **NOTHINK,
                                                      response_format={"type": "json_schema", "json_schema": {
                                                          "name": "p", "schema": open_schema}}))):
        m = b["choices"][0]["message"] if st == 200 else {}
        try:
            v = json.loads(m.get("content") or "")
            extra = sorted(set(v) - {"name", "age"}) if isinstance(v, dict) else ["not an object"]
        except ValueError:
            extra = ["not JSON"] if m.get("content") else []
            if b["choices"][0]["finish_reason"] == "length":
                extra = ["cut at max_tokens"]
        c4.add(st != 200 or bool(extra), "extra keys", extra or b)
    cases.append(c4)

    for c in cases:
        print(c.line(), flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        h.stop_all()
