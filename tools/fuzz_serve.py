"""fuzz_serve.py -- throws mutated, truncated, random and dropped requests at a running
`k3 serve` (tests/models/tiny) for a while and counts the statuses. Run the server from an
AddressSanitizer build (`make BUILD=build-asan CFLAGS="-O1 -g -fsanitize=address
-fno-omit-frame-pointer" build-asan/k3`) to catch memory errors; afterwards /metrics must show
nothing running and no blocks used. Usage: python3 tools/fuzz_serve.py PORT SECONDS
"""
import json, random, socket, sys, time
port = int(sys.argv[1]); dur = float(sys.argv[2])
random.seed(7)
base = [
  ("/v1/completions", {"model": "tests/models/tiny", "prompt": "Hello world", "max_tokens": 8, "temperature": 0.7, "stop": ["a", "b"], "logprobs": 2, "echo": True, "n": 2, "seed": 3}),
  ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True, "logprobs": True, "top_logprobs": 2}),
  ("/v1/chat/completions", {"messages": [{"role": "system", "content": [{"type": "text", "text": "x"}]}, {"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}], "max_tokens": 3}),
  ("/tokenize", {"prompt": "abc"}), ("/detokenize", {"tokens": [1, 2]}),
]
vals = [None, True, False, 0, -1, 1, 2**40, -2**63, 1.5, float("nan") if False else 1e308, "", "x" * 300, "\u00e9\ud7ff", [], [1], [[1, 2]], {}, {"a": 1}, [None], ["a"] * 20, 17]
keys = ["prompt", "messages", "max_tokens", "n", "stop", "logprobs", "echo", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "tools", "tool_choice", "chat_template_kwargs", "min_tokens", "stop_token_ids", "model", "max_completion_tokens", "top_logprobs", "ignore_eos", "tokens", "response_format"]
def send(raw, read=True):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=20)
        s.sendall(raw)
        if random.random() < 0.1:
            s.close(); return b"dropped"
        data = b""
        while read:
            c = s.recv(65536)
            if not c: break
            data += c
        s.close(); return data
    except Exception as e:
        return repr(e).encode()
n = 0; codes = {}
t0 = time.time()
while time.time() - t0 < dur:
    path, body = random.choice(base)
    body = json.loads(json.dumps(body))
    for _ in range(random.randint(0, 3)):
        body[random.choice(keys)] = random.choice(vals)
    txt = json.dumps(body).encode()
    r = random.random()
    if r < 0.1: txt = txt[: random.randint(0, len(txt))]
    elif r < 0.15: txt = bytes(random.getrandbits(8) for _ in range(random.randint(0, 200)))
    elif r < 0.2: i = random.randrange(len(txt)); txt = txt[:i] + bytes([random.getrandbits(8)]) + txt[i + 1:]
    raw = b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: " + str(len(txt)).encode() + b"\r\n\r\n" + txt
    out = send(raw)
    code = out[9:12].decode(errors="replace") if out.startswith(b"HTTP/1.1") else out[:20].decode(errors="replace")
    codes[code] = codes.get(code, 0) + 1
    n += 1
print(n, "requests", codes)
