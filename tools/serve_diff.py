#!/usr/bin/env python3
"""The same requests against two `k3` binaries' servers, the answers compared.

  python3 tools/serve_diff.py OLD_K3 NEW_K3 MODEL_DIR [extra k3 serve options]

For a change to the server that must not change its answers. About 150
requests: every route and method, every request field's refusal, completions
and chat (streamed and not, logprobs, echo, n, seeds, stop strings and ids,
tools, thinking on and off), and the API key. Statuses, the headers that
matter and the bodies are compared with response ids, `created` and tool-call
ids masked; a stream is compared by its content per choice (its text, deltas,
logprobs, finish reasons, usage, event shapes), since where a stream is cut
into chunks depends on thread timing and differs between two runs of one
binary. Only the standard library; prints each difference and a count.
"""
import http.client, json, os, re, select, signal, subprocess, sys, time

OLD, NEW, MODEL = sys.argv[1], sys.argv[2], sys.argv[3]
EXTRA = sys.argv[4:]

def start(binary, *extra):
    p = subprocess.Popen([binary, "serve", "-m", MODEL, "--port", "0", "--threads", "1", *EXTRA, *extra],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    buf = b""
    deadline = time.time() + 60
    while time.time() < deadline:
        r, _, _ = select.select([p.stderr], [], [], 1.0)
        if r:
            chunk = os.read(p.stderr.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            m = re.search(rb"listening on http://[^:]+:(\d+)", buf)
            if m:
                return p, int(m.group(1))
    raise SystemExit("no start: " + buf.decode(errors="replace"))

def ask(port, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    h = dict(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
        h.setdefault("Content-Type", "application/json")
    elif isinstance(body, str):
        body = body.encode()
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    hdr = {k.lower(): v for k, v in r.getheaders() if k.lower() in ("content-type", "retry-after", "www-authenticate", "cache-control", "connection")}
    c.close()
    return r.status, hdr, data

def canon_stream(t):
    """A stream's content independent of how it was cut into chunks."""
    acc, shapes, tail = {}, set(), []
    for ev in t.split("\n\n"):
        if not ev:
            continue
        assert ev.startswith("data: "), ev
        d = ev[6:]
        if d == "[DONE]":
            tail.append("DONE")
            continue
        o = json.loads(d)
        if "error" in o:
            tail.append(("error", json.dumps(o, sort_keys=True)))
            continue
        shapes.add(tuple(o.keys()))
        if not o["choices"]:
            tail.append(("usage", json.dumps(o.get("usage"), sort_keys=True)))
        for ch in o["choices"]:
            a = acc.setdefault(ch["index"], {"text": "", "role": [], "reasoning": "", "content": "", "tools": {}, "lp": [], "finish": [], "keys": set()})
            a["keys"].add(tuple(ch.keys()))
            if "text" in ch:
                a["text"] += ch["text"]
            dl = ch.get("delta") or {}
            a["keys"].add(("delta",) + tuple(dl.keys()))
            if "role" in dl:
                a["role"].append(dl["role"])
            a["reasoning"] += dl.get("reasoning_content") or ""
            a["content"] += dl.get("content") or ""
            for tc in dl.get("tool_calls") or []:
                t2 = a["tools"].setdefault(tc["index"], {"args": "", "head": None})
                if "id" in tc:
                    t2["head"] = json.dumps({k: v for k, v in tc.items() if k != "id"}, sort_keys=True)
                t2["args"] += tc["function"].get("arguments", "")
            lp = ch.get("logprobs")
            if lp:
                if "content" in lp:
                    a["lp"] += lp["content"]
                else:
                    a["lp"].append(("tokens",) + tuple(lp["tokens"]))
                    a["lp"] += [("tl", x) for x in lp["token_logprobs"]]
                    a["lp"] += [("top", json.dumps(x, sort_keys=True)) for x in lp["top_logprobs"]]
                    a["lp"] += [("off", x) for x in lp["text_offset"]]
            if ch.get("finish_reason"):
                a["finish"].append(ch["finish_reason"])
    for a in acc.values():
        a["keys"] = sorted(a["keys"])
        if any(k[0] == "tokens" for k in a["lp"] if isinstance(k, tuple)):
            toks = sum((list(k[1:]) for k in a["lp"] if isinstance(k, tuple) and k[0] == "tokens"), [])
            a["lp"] = [toks] + sorted((x for x in a["lp"] if not (isinstance(x, tuple) and x[0] == "tokens")), key=lambda x: (x[0],))
    return json.dumps({"choices": {str(k): v for k, v in sorted(acc.items())}, "shapes": sorted(shapes), "tail": tail}, sort_keys=True, default=str)

def norm(path, data):
    t = data.decode("utf-8", errors="replace")
    if t.startswith("data: "):
        t = re.sub(r'"id":"(chatcmpl|cmpl)-[0-9a-f]{16}"', r'"id":"\1-X"', t)
        t = re.sub(r'"created":\d+', '"created":0', t)
        t = re.sub(r'call_[0-9A-Za-z]{24}', 'call_X', t)
        return "STREAM " + canon_stream(t)
    t = re.sub(r'"id":"(chatcmpl|cmpl)-[0-9a-f]{16}"', r'"id":"\1-X"', t)
    t = re.sub(r'"created":\d+', '"created":0', t)
    t = re.sub(r'call_[0-9A-Za-z]{24}', 'call_X', t)
    if path == "/metrics":
        t = "\n".join(l.rpartition(" ")[0] if not l.startswith("#") else l for l in t.splitlines())
    return t

C = "/v1/completions"
H = "/v1/chat/completions"
msgs = [{"role": "user", "content": "hi there"}]
tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
cases = [
    ("GET", "/health", None), ("HEAD", "/health", None), ("POST", "/health", None),
    ("GET", "/version", None), ("HEAD", "/version", None), ("GET", "/v1/models", None), ("POST", "/v1/models", None),
    ("GET", "/nothing", None), ("PUT", C, None), ("GET", C, None), ("DELETE", "/tokenize", None),
    ("POST", "/tokenize", {"prompt": "Hello world"}), ("POST", "/tokenize", {"messages": msgs}),
    ("POST", "/tokenize", {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}),
    ("POST", "/tokenize", {}), ("POST", "/tokenize", "{bad"), ("POST", "/tokenize", "[1,2]"), ("POST", "/tokenize", ""),
    ("POST", "/tokenize", "[" * 70 + "]" * 70), ("POST", "/tokenize", {"prompt": "x", "model": "nope"}),
    ("POST", "/tokenize", {"prompt": "x", "model": None}), ("POST", "/tokenize", {"prompt": "x", "model": 5}),
    ("POST", "/detokenize", {"tokens": [39, 596, 78]}), ("POST", "/detokenize", {"tokens": [-1]}), ("POST", "/detokenize", {}),
    # completions
    ("POST", C, {"prompt": "Hello world", "max_tokens": 8, "temperature": 0}),
    ("POST", C, {"prompt": "Hello world", "temperature": 0}),
    ("POST", C, {"prompt": "Hello world", "max_tokens": 0, "temperature": 0}),
    ("POST", C, {"prompt": [39, 596, 78, 286], "max_tokens": 6, "temperature": 0}),
    ("POST", C, {"prompt": ["Once upon a time", "Hello world"], "max_tokens": 6, "temperature": 0}),
    ("POST", C, {"prompt": [[39, 596], [78, 286]], "max_tokens": 6, "temperature": 0}),
    ("POST", C, {"prompt": "Hello", "max_tokens": 10, "temperature": 1.0, "n": 2, "seed": 7, "ignore_eos": True}),
    ("POST", C, {"prompt": "Hello", "max_tokens": 10, "temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.05,
                 "repetition_penalty": 1.2, "seed": 3, "ignore_eos": True}),
    ("POST", C, {"prompt": "Hello", "max_tokens": 10, "temperature": 1.0, "seed": -5, "ignore_eos": True}),
    ("POST", C, {"prompt": "Hello world", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2, "ignore_eos": True}),
    ("POST", C, {"prompt": "Hello world", "max_tokens": 3, "temperature": 0, "echo": True, "ignore_eos": True}),
    ("POST", C, {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 5, "return_tokens_as_token_ids": True}),
    ("POST", C, {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 0}),
    ("POST", C, {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stop": ["e", "@@"], "ignore_eos": True}),
    ("POST", C, {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stop": "th", "ignore_eos": True}),
    ("POST", C, {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stop": "", "ignore_eos": True}),
    ("POST", C, {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stop_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}),
    ("POST", C, {"prompt": "Once", "max_tokens": 8, "min_tokens": 4, "temperature": 0}),
    ("POST", C, {"prompt": "Once", "max_tokens": 8, "temperature": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
                 "logit_bias": {}, "best_of": 1, "suffix": None}),
    ("POST", C, {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}),
    ("POST", C, {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}, "ignore_eos": True}),
    ("POST", C, {"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "stream": True, "logprobs": 2, "ignore_eos": True}),
    ("POST", C, {"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "stream": True, "echo": True, "ignore_eos": True}),
    ("POST", C, {"prompt": ["A", "B"], "max_tokens": 6, "temperature": 1, "seed": 1, "n": 2, "stream": True, "ignore_eos": True}),
    ("POST", C, {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stop": ["e"], "stream": True, "ignore_eos": True}),
    ("POST", C, {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stop": ["e"], "stream": True, "logprobs": 1, "ignore_eos": True}),
    # completion errors
    ("POST", C, {"prompt": "x", "temperature": "hot"}), ("POST", C, {"prompt": "x", "temperature": 5}),
    ("POST", C, {"prompt": "x", "top_p": 0}), ("POST", C, {"prompt": "x", "min_p": 2}),
    ("POST", C, {"prompt": "x", "repetition_penalty": 0}), ("POST", C, {"prompt": "x", "top_k": -2}),
    ("POST", C, {"prompt": "x", "top_k": 1.5}), ("POST", C, {"prompt": "x", "n": 99}), ("POST", C, {"prompt": "x", "n": 0}),
    ("POST", C, {"prompt": "x", "seed": "a"}), ("POST", C, {"prompt": "x", "max_tokens": -1}),
    ("POST", C, {"prompt": "x", "min_tokens": -1}), ("POST", C, {"prompt": "x", "stream": 1}),
    ("POST", C, {"prompt": "x", "ignore_eos": "yes"}), ("POST", C, {"prompt": "x", "stop": 5}),
    ("POST", C, {"prompt": "x", "stop": [1]}), ("POST", C, {"prompt": "x", "stop": ["a"] * 17}),
    ("POST", C, {"prompt": "x", "stop": ["a" * 257]}), ("POST", C, {"prompt": "x", "return_tokens_as_token_ids": 1}),
    ("POST", C, {"prompt": "x", "max_completion_tokens": "a", "temperature": 0}),
    ("POST", C, {"prompt": "x", "presence_penalty": 0.5}), ("POST", C, {"prompt": "x", "frequency_penalty": "a"}),
    ("POST", C, {"prompt": "x", "logit_bias": {"5": 10}}), ("POST", C, {"prompt": "x", "best_of": 3}),
    ("POST", C, {"prompt": "x", "best_of": 2, "n": 2, "max_tokens": 2, "temperature": 0}),
    ("POST", C, {"prompt": "x", "suffix": "y"}), ("POST", C, {"prompt": "x", "echo": 1}),
    ("POST", C, {"prompt": "x", "logprobs": True}), ("POST", C, {"prompt": "x", "logprobs": 21}),
    ("POST", C, {"prompt": "x", "top_logprobs": 2, "max_tokens": 1, "temperature": 0}),
    ("POST", C, {"prompt": "x", "stream_options": {"include_usage": True}}),
    ("POST", C, {"prompt": "x", "stream": True, "stream_options": 3}),
    ("POST", C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 3}}),
    ("POST", C, {"prompt": "x", "stream": True, "echo": True, "logprobs": 1}),
    ("POST", C, {}), ("POST", C, {"prompt": []}), ("POST", C, {"prompt": ""}), ("POST", C, {"prompt": 5}),
    ("POST", C, {"prompt": [99999999]}), ("POST", C, {"prompt": [[]]}), ("POST", C, {"prompt": ["a", 5]}),
    ("POST", C, {"prompt": ["a"] * 17}), ("POST", C, {"prompt": ["a"] * 9, "n": 2}),
    ("POST", C, {"prompt": "x", "stop_token_ids": 5}), ("POST", C, {"prompt": "x", "stop_token_ids": [1] * 17}),
    ("POST", C, {"prompt": "x", "stop_token_ids": [-1]}), ("POST", C, {"prompt": [5] * 5000, "max_tokens": 1}),
    ("POST", C, {"prompt": [5] * 10, "max_tokens": 1 << 30}),
    ("POST", C, {"prompt": "x", "model": "no-such"}), ("POST", C, {"prompt": "\udcff"}),
    ("POST", C, {"prompt": "x", "temperature": "hot", "top_p": 5, "prompt": 7}),
    ("POST", C, {"prompt": 7, "stop_token_ids": "a"}),
    # chat
    ("POST", H, {"messages": msgs, "max_tokens": 8, "temperature": 0}),
    ("POST", H, {"messages": msgs, "max_completion_tokens": 8, "temperature": 0, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "max_tokens": 100, "max_completion_tokens": 5, "temperature": 0, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "max_tokens": 8, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "max_tokens": 8, "temperature": 0, "chat_template_kwargs": {"thinking": False}, "ignore_eos": True}),
    ("POST", H, {"messages": [{"role": "system", "content": "be brief"}] + msgs, "max_tokens": 30, "temperature": 0}),
    ("POST", H, {"messages": msgs, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "max_tokens": 5, "temperature": 0, "logprobs": True, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "max_tokens": 5, "temperature": 0, "logprobs": False, "top_logprobs": 2}),
    ("POST", H, {"messages": msgs, "max_tokens": 5, "temperature": 0, "top_logprobs": None, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "max_tokens": 8, "temperature": 1, "n": 3, "seed": 11, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "tools": tools, "tool_choice": "auto", "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 12, "temperature": 0}),
    ("POST", H, {"messages": msgs, "response_format": {"type": "json_object"}, "max_tokens": 6, "temperature": 0}),
    ("POST", H, {"messages": msgs, "reasoning_effort": "high", "max_tokens": 6, "temperature": 0}),
    ("POST", H, {"messages": msgs, "max_tokens": 24, "temperature": 0, "stop": ["e"], "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True,
                 "chat_template_kwargs": {"thinking": False}, "stream_options": {"include_usage": True}}),
    ("POST", H, {"messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 1,
                 "ignore_eos": True, "chat_template_kwargs": {"thinking": False}}),
    ("POST", H, {"messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True, "logprobs": True, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "max_tokens": 8, "temperature": 1, "n": 2, "seed": 4, "stream": True, "ignore_eos": True}),
    ("POST", H, {"messages": msgs, "tools": tools, "max_tokens": 16, "temperature": 0, "stream": True, "ignore_eos": True,
                 "chat_template_kwargs": {"thinking": False}}),
    ("POST", H, {"messages": msgs, "max_tokens": 24, "temperature": 0, "stop": ["e"], "stream": True, "ignore_eos": True}),
    # chat errors
    ("POST", H, {"messages": []}), ("POST", H, {}), ("POST", H, {"messages": "hi"}),
    ("POST", H, {"messages": msgs, "tools": 5}), ("POST", H, {"messages": msgs, "tool_choice": 5}),
    ("POST", H, {"messages": msgs, "chat_template_kwargs": 5}), ("POST", H, {"messages": msgs, "chat_template_kwargs": {"thinking": 1}}),
    ("POST", H, {"messages": msgs, "chat_template_kwargs": {"enable_thinking": "no"}}),
    ("POST", H, {"messages": [{"role": "nobody", "content": "x"}]}), ("POST", H, {"messages": msgs, "logprobs": 3}),
    ("POST", H, {"messages": msgs, "logprobs": True, "top_logprobs": 21}), ("POST", H, {"messages": msgs, "echo": True, "max_tokens": 1, "temperature": 0}),
    ("POST", H, {"messages": msgs, "prompt": "x", "max_tokens": 1, "temperature": 0}),
    ("POST", H, {"messages": msgs, "n": 17}), ("POST", H, {"messages": msgs, "max_completion_tokens": -3}),
    ("POST", H, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
    ("POST", H, {"messages": msgs, "temperature": 9, "chat_template_kwargs": 5}),
    ("POST", H, {"messages": 5, "stop_token_ids": [-4]}),
    ("GET", "/metrics", None),
]

def run(binary, extra_cases):
    p, port = start(binary)
    out = []
    try:
        for m, path, body in cases + extra_cases:
            st, hdr, data = ask(port, m, path, body)
            out.append((m, path, body, st, hdr, norm(path, data)))
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(20)
    return out

def run_key(binary):
    p, port = start(binary, "--api-key", "sekret")
    out = []
    try:
        for m, path, hdrs in [("GET", "/v1/models", {}), ("GET", "/v1/models", {"Authorization": "Bearer sekret"}),
                              ("GET", "/v1/models", {"Authorization": "Bearer wrong"}), ("GET", "/nothing", {}),
                              ("GET", "/nothing", {"Authorization": "Bearer sekret"}), ("GET", "/health", {}),
                              ("POST", "/health", {}), ("POST", "/version", {}), ("POST", "/version", {"Authorization": "Bearer sekret"}),
                              ("POST", C, {}), ("GET", C, {"Authorization": "Bearer sekret"})]:
            st, hdr, data = ask(port, m, path, None, hdrs)
            out.append((m, path, hdrs, st, hdr, norm(path, data)))
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(20)
    return out

a = run(OLD, []) + run_key(OLD)
b = run(NEW, []) + run_key(NEW)
diff = 0
for x, y in zip(a, b):
    if x != y:
        diff += 1
        print("DIFF", x[0], x[1], json.dumps(x[2])[:200])
        print("  old:", x[3], x[4], x[5][:600])
        print("  new:", y[3], y[4], y[5][:600])
print(f"{len(a)} requests, {diff} differ")
statuses = {}
for x in a:
    statuses[x[3]] = statuses.get(x[3], 0) + 1
print("statuses:", statuses)
