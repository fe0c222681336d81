"""serve_robust.py -- `k3 serve` loses no request: raw-socket and official-client checks.

Usage: python tests/serve_robust.py K3_BINARY
Starts `k3 serve` on tests/models/tiny (a free port per server) and checks: clients that
half-close after their request are answered in full on every generating route, streamed and
not; SIGTERM with 8 streams and 4 waiting whole answers ends every one properly (an error
event, [DONE] and the chunked body's end; a 503) and exits 0 within the shutdown timeout, while
new requests get 503 with Retry-After; a second signal cuts at once; an engine failure injected
by the test hook gives every request in flight the engine's message and the process exits 1;
a request that fails alone fails alone; streamed chat logprobs cover the reasoning tokens and
equal the whole answer's; the work caps and the seat share of one request; SSE over
keep-alive; CORS (a page's preflight and call allowed with --allowed-origins, refused without);
x-api-key; 415 for a compressed body; the drain, an engine failure, CORS, the key and
half-closed clients on /v1/responses and /v1/messages too, each ending and refusal in its
API's shape. Prints `ok   robust: NAME` / `FAIL robust: NAME` and ends with
`robust: N passed, N failed, N skipped`; a second argument runs only the checks whose name holds it. Every server it starts dies with it (PR_SET_PDEATHSIG).
"""
import http.client
import json
import os
import signal
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

K3 = h.K3
ONLY = sys.argv[2] if len(sys.argv) > 2 else None
TINY = h.TINY


class Server(h.Server):
    """The harness's server with this suite's order: options first, the model a keyword; 15 s to stop."""

    def __init__(self, *extra, model=TINY):
        super().__init__(model, *extra, stop_timeout=15)

    def running(self):
        return h.metric(self.metrics(), "vllm:num_requests_running") or 0

    def draining(self):
        """Whether it answers /health 503 (a signal began the drain)."""
        try:
            return get(self.port, "/health").status == 503
        except OSError:
            return True


suite = h.Suite("robust", ONLY)
check = suite.check


class Reply:
    """One HTTP answer read off a socket to its end: status, headers, the body (chunks
    decoded), and whether it ended properly (its length, or the terminating chunk)."""

    def __init__(self, raw):
        self.raw = raw
        head, sep, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode(errors="replace").split("\r\n")
        self.status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else -1
        self.headers = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            self.headers[k.strip().lower()] = v.strip()
        self.complete = False
        if not sep:
            self.body = b""
            return
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            body, pos = b"", 0
            while True:
                eol = rest.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(rest[pos:eol].split(b";")[0] or b"0", 16)
                if size == 0:
                    self.complete = rest[eol + 2:eol + 4] == b"\r\n"
                    break
                body += rest[eol + 2:eol + 2 + size]
                pos = eol + 2 + size + 2
            self.body = body
        else:
            n = int(self.headers.get("content-length", "-1"))
            self.body = rest if n < 0 else rest[:n]
            self.complete = n >= 0 and len(rest) >= n

    def events(self):
        """The SSE data payloads ('[DONE]' kept as a string)."""
        out = []
        for block in self.body.decode(errors="replace").split("\n\n"):
            for ln in block.split("\n"):
                if ln.startswith("data: "):
                    d = ln[6:]
                    out.append(d if d == "[DONE]" else json.loads(d))
        return out

    def json(self):
        return json.loads(self.body)


def request_bytes(method, path, body=None, headers=None, host="x"):
    hd = {"Host": host}
    hd.update(headers or {})
    data = b""
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hd.setdefault("Content-Type", "application/json")
        hd["Content-Length"] = str(len(data))
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hd.items()) + "\r\n").encode() + data


def exchange(port, raw, half_close=False, timeout=60, on_first=None):
    """Sends raw, optionally shuts down the sending side, reads until the server closes
    (or an answer of known length is in); on_first(sock) once the body's first event (or,
    for a plain body, its first bytes) came."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            try:
                d = s.recv(65536)
            except OSError:
                break
            if not d:
                break
            data += d
            if on_first:
                head, sep, body = data.partition(b"\r\n\r\n")
                if sep and (b"\n\n" in body or (body and b"text/event-stream" not in head)):
                    on_first(s)
                    on_first = None
            r = Reply(data)
            if r.complete:
                break
        return Reply(data)
    finally:
        s.close()


def post(port, path, body, headers=None, **kw):
    return exchange(port, request_bytes("POST", path, body, dict(headers or {}, Connection="close")), **kw)


def get(port, path, headers=None):
    return exchange(port, request_bytes("GET", path, None, dict(headers or {}, Connection="close")), timeout=10)


def stream_ended_by_server(r, why):
    """A stream the server ended: an error event naming why (code 503), then [DONE], then the
    chunked body's end."""
    ev = r.events()
    assert r.status == 200 and r.complete, (r.status, r.complete, r.raw[-200:])
    assert len(ev) >= 2 and ev[-1] == "[DONE]" and isinstance(ev[-2], dict) and "error" in ev[-2], ev[-3:]
    err = ev[-2]["error"]
    assert err["code"] == 503 and why in err["message"], err
    return len(ev) - 2


def stream_finished(r, max_tokens):
    ev = r.events()
    assert r.status == 200 and r.complete, (r.status, r.complete, r.raw[-300:])
    assert ev and ev[-1] == "[DONE]", ev[-3:]
    fins = [c["choices"][0].get("finish_reason") for c in ev[:-1] if isinstance(c, dict) and c.get("choices")]
    assert fins and fins[-1] == "length", fins[-3:]
    assert not any(isinstance(c, dict) and "error" in c for c in ev), ev


def named_events(r):
    """The SSE events as (event name or None, data payload), for the named events of the
    Responses and Messages APIs."""
    out = []
    for block in r.body.decode(errors="replace").split("\n\n"):
        name, data = None, None
        for ln in block.split("\n"):
            if ln.startswith("event: "):
                name = ln[7:]
            elif ln.startswith("data: "):
                data = ln[6:]
        if data is not None:
            out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


# one long request per generating surface, in its own shape (tests/models/tiny's chat markup)
LONG = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 3000}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000}),
}


def surface_stream_ended(api, r, why):
    """A stream the server ended, in its API's own shape: chat's error event and [DONE]; the
    Responses API's response.failed naming why; Anthropic's `event: error` with its error
    JSON. Always the chunked body's end."""
    assert r.status == 200 and r.complete, (api, r.status, r.complete, r.raw[-200:])
    if api == "chat":
        return stream_ended_by_server(r, why)
    ev = named_events(r)
    assert ev and all(d != "[DONE]" for _, d in ev), (api, ev[-3:])
    name, last = ev[-1]
    if api == "responses":
        assert ev[0][0] == "response.created", ev[:2]
        assert name == "response.failed" and last["type"] == name, (name, last)
        assert last["response"]["status"] == "failed" and why in last["response"]["error"]["message"], last
    else:
        assert ev[0][0] == "message_start", ev[:2]
        assert name == "error" and last["type"] == "error", (name, last)
        assert last["error"]["type"] == "overloaded_error" and why in last["error"]["message"], last
    return len(ev)


def surface_whole_refused(api, r, status, why):
    """A whole answer refused with status, in its API's error JSON."""
    assert r.status == status and r.complete, (api, r.status, r.body[:200])
    j = r.json()
    if api == "messages":
        assert j["type"] == "error" and why in j["error"]["message"], j
        assert j["error"]["type"] == {401: "authentication_error", 403: "permission_error",
                                      503: "overloaded_error"}[status], j
    else:
        assert why in j["error"]["message"], j


def main():
    s = Server()
    M = TINY

    def t_half_close():
        # 50 clients per route and mode at once, each shutting down its sending side after the request
        for path, body in (("/v1/completions", {"prompt": "Hello world"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for stream in (False, True):
                res = [None] * 50

                def one(i):
                    b = dict(body, max_tokens=8, temperature=0, ignore_eos=True, stream=stream)
                    res[i] = exchange(s.port, request_bytes("POST", path, b), half_close=True)

                th = [threading.Thread(target=one, args=(i,)) for i in range(50)]
                for t in th:
                    t.start()
                for t in th:
                    t.join(120)
                full = 0
                for r in res:
                    if r is None or r.status != 200 or not r.complete:
                        continue
                    if stream:
                        try:
                            stream_finished(r, 8)
                            full += 1
                        except AssertionError:
                            pass
                    else:
                        j = r.json()
                        full += j["usage"]["completion_tokens"] == 8 and j["choices"][0]["finish_reason"] == "length"
                assert full == 50, f"{path} stream={stream}: {full} of 50 half-closed clients answered in full"

    def t_logprobs_reasoning():
        # a reply that stays in reasoning_content streams the logprobs of every token
        # (logprobs.reasoning_content beside logprobs.content), equal to the whole answer's
        c = s.client()
        kw = dict(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0,
                  logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        whole = c.chat.completions.create(**kw).choices[0]
        assert whole.message.model_extra.get("reasoning_content"), whole.message

        def entries(lp, key):
            xs = (lp.model_extra or {}).get(key) if key != "content" else [t.model_dump() for t in lp.content or []]
            return [(t["token"], round(t["logprob"], 5), [(a["token"], round(a["logprob"], 5))
                                                          for a in t["top_logprobs"]]) for t in xs or []]

        want = entries(whole.logprobs, "reasoning_content") + entries(whole.logprobs, "content")
        got_r, got_c = [], []
        for ch in c.chat.completions.create(stream=True, **kw):
            if ch.choices and ch.choices[0].logprobs:
                got_r += entries(ch.choices[0].logprobs, "reasoning_content")
                got_c += entries(ch.choices[0].logprobs, "content")
        # every token that puts text in the reply (a special left out of the text has none)
        assert len(want) >= 8 and got_r + got_c == want, (len(got_r), len(got_c), len(want), got_r[:2], want[:2])

    def t_work_caps():
        prompt = " ".join(f"w{i}" for i in range(900))
        r = post(s.port, "/v1/completions", {"prompt": prompt, "n": 16, "echo": True, "logprobs": 20,
                                             "max_tokens": 16})
        assert r.status == 400 and "logprob entries" in r.json()["error"]["message"], (r.status, r.body[:300])
        r = post(s.port, "/v1/completions", {"prompt": "Hi", "n": 16, "max_tokens": 200000})
        assert r.status == 400 and "tokens" in r.json()["error"]["message"], (r.status, r.body[:300])
        # a default max_tokens with logprobs is cut to fit, not refused (the stream's start is enough)
        got = []
        r = post(s.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 16,
                                                  "logprobs": True, "top_logprobs": 20, "stream": True},
                 on_first=lambda sk: (got.append(1), sk.close()))
        assert got and r.status == 200, (r.status, r.raw[:300])

    def t_fair_share():
        # one request of 16 choices (the engine's 16 seats) takes half of them at a time: a small
        # request sent after it is answered before it ends
        done = {}

        def big():
            post(s.port, "/v1/completions", {"prompt": "Once upon a time", "n": 16, "max_tokens": 150,
                                             "temperature": 1, "ignore_eos": True}, timeout=300)
            done["big"] = time.time()

        th = threading.Thread(target=big)
        th.start()
        h.wait_until(lambda: s.running() >= 8, 60, "the big request's choices to run")
        r = post(s.port, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        done["small"] = time.time()
        th.join(300)
        assert r.status == 200 and "big" in done and done["small"] < done["big"], (r.status, done)

    def t_keepalive():
        # SSE over keep-alive: two streams, then a whole answer, on one connection
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        for i in range(2):
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True}),
                headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200 and (r.getheader("Connection") or "").lower() != "close", r.getheaders()
            body = r.read().decode()
            assert body.rstrip().endswith("data: [DONE]"), body[-100:]
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == M
        conn.close()

    def t_compressed():
        r = post(s.port, "/v1/chat/completions", b"\x1f\x8b\x08\x00", headers={"Content-Encoding": "gzip"})
        assert r.status == 415 and r.headers.get("accept-encoding") == "identity", (r.status, r.headers)

    def t_cors_off():
        # a page on another origin: its preflight and its call are refused by default
        pre = exchange(s.port, request_bytes("OPTIONS", "/v1/chat/completions", None, {
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type", "Connection": "close"}), timeout=10)
        assert pre.status == 403 and "access-control-allow-origin" not in pre.headers, (pre.status, pre.headers)
        r = post(s.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                 headers={"Origin": "http://app.example"})
        assert r.status == 403 and "access-control-allow-origin" not in r.headers, (r.status, r.headers)

    for name, fn in [("50 half-closing clients per generating route, streamed and not, answered in full",
                      t_half_close),
                     ("streamed chat logprobs cover the reasoning and equal the whole answer's", t_logprobs_reasoning),
                     ("work caps: 400s naming the limit, a default max_tokens cut to fit", t_work_caps),
                     ("a request of 16 choices leaves seats: a small one after it ends first", t_fair_share),
                     ("SSE over keep-alive", t_keepalive), ("a compressed body is a 415", t_compressed),
                     ("CORS off by default: a page on another origin is refused", t_cors_off)]:
        check(name, fn)
    s.stop()

    def t_cors_on():
        sc = Server("--allowed-origins", "http://app.example", "--api-key", "sekret")
        try:
            # what a browser does: the preflight, then the call; the answer (a stream) carries the header
            pre = exchange(sc.port, request_bytes("OPTIONS", "/v1/chat/completions", None, {
                "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type", "Connection": "close"}), timeout=10)
            assert pre.status == 204 and pre.headers.get("access-control-allow-origin") == "http://app.example", \
                (pre.status, pre.headers)
            assert "POST" in pre.headers.get("access-control-allow-methods", "") and \
                "authorization" in pre.headers.get("access-control-allow-headers", ""), pre.headers
            r = post(sc.port, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
                     headers={"Origin": "http://app.example", "Authorization": "Bearer sekret"})
            assert r.status == 200 and r.headers.get("access-control-allow-origin") == "http://app.example", \
                (r.status, r.headers)
            assert r.events()[-1] == "[DONE]"
            # x-api-key (the Anthropic API's header) on a generating route, without an Origin
            r = post(sc.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2}, headers={"x-api-key": "sekret"})
            assert r.status == 200 and "access-control-allow-origin" not in r.headers, (r.status, r.headers)
            r = post(sc.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2}, headers={"x-api-key": "wrong"})
            assert r.status == 401
            assert "auth on" in sc.text(), sc.text()[-300:]
        finally:
            sc.stop()

    check("CORS with --allowed-origins: preflight and stream carry the header; x-api-key", t_cors_on)

    def t_sigterm_drain():
        sd = Server("--shutdown-timeout", "1")
        streams, wholes, short = [None] * 8, [None] * 4, [None]
        firsts = threading.Semaphore(0)
        body = {"prompt": "Hello", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}

        def st(i):
            streams[i] = post(sd.port, "/v1/completions", dict(body, stream=True), on_first=lambda _: firsts.release())

        def wh(i):
            wholes[i] = post(sd.port, "/v1/completions", body)

        def sh():
            short[0] = post(sd.port, "/v1/completions", dict(body, max_tokens=10, stream=True),
                            on_first=lambda _: firsts.release())

        th = [threading.Thread(target=st, args=(i,)) for i in range(8)] + [threading.Thread(target=sh)]
        for t in th:
            t.start()
        for _ in range(9):
            assert firsts.acquire(timeout=60), "the streams did not start"
        # the whole answers join once the streams run, so none can finish its 3000 tokens first
        # on a loaded machine
        tw = [threading.Thread(target=wh, args=(i,)) for i in range(4)]
        for t in tw:
            t.start()
        th += tw
        h.wait_until(lambda: sd.running() >= 12, 60, "the 8 streams and the 4 whole answers to run")
        t0 = time.time()
        sd.proc.send_signal(signal.SIGTERM)
        h.wait_until(sd.draining, 10, "/health to turn 503 after SIGTERM")
        # draining: a new request is refused with Retry-After, /health is 503
        nr = post(sd.port, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert nr.status == 503 and nr.headers.get("retry-after") and "shutting down" in nr.body.decode(), \
            (nr.status, nr.body[:200])
        assert get(sd.port, "/health").status == 503
        for t in th:
            t.join(30)
        sd.proc.wait(15)
        took = time.time() - t0
        assert sd.proc.returncode == 0, (sd.proc.returncode, sd.text()[-500:])
        assert took < 1 + 4, f"exited {took:.1f} s after SIGTERM (--shutdown-timeout 1)"
        for r in streams:
            stream_ended_by_server(r, "shutting down")
        for r in wholes:
            assert r.status == 503 and r.complete and "shutting down" in r.json()["error"]["message"], \
                (r.status, r.body[:200])
        stream_finished(short[0], 10)  # finished within the grace
        assert "requests were ended" in sd.text(), sd.text()[-300:]

    check("SIGTERM with 8 streams and 4 waiting whole answers: each a proper ending, exit 0", t_sigterm_drain)

    def t_second_signal():
        sd = Server("--shutdown-timeout", "30")
        res = [None]
        started = threading.Event()

        def st():
            res[0] = post(sd.port, "/v1/completions", {"prompt": "Hello", "max_tokens": 3000, "stream": True,
                                                       "ignore_eos": True}, on_first=lambda _: started.set())

        t = threading.Thread(target=st)
        t.start()
        assert started.wait(60)
        t0 = time.time()
        sd.proc.send_signal(signal.SIGTERM)
        h.wait_until(sd.draining, 10, "/health to turn 503 after the first SIGTERM")
        sd.proc.send_signal(signal.SIGTERM)
        sd.proc.wait(10)
        t.join(10)
        assert time.time() - t0 < 3, f"{time.time() - t0:.1f} s after the second signal"
        assert sd.proc.returncode == 0, sd.proc.returncode

    check("a second signal cuts the drain at once", t_second_signal)

    def t_engine_failure():
        sf = Server("--test-fail-step", "60", "--max-num-seqs", "4")
        body = {"prompt": "Hello", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
        res = [None] * 4

        def one(i):
            res[i] = post(sf.port, "/v1/completions", dict(body, stream=i < 3))

        th = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in th:
            t.start()
        for t in th:
            t.join(60)
        sf.proc.wait(15)
        for r in res[:3]:
            stream_ended_by_server(r, "the engine failed: test hook: engine step 60 failed")
        w = res[3]
        assert w.status == 503 and "the engine failed: test hook" in w.json()["error"]["message"], \
            (w.status, w.body[:300])
        assert sf.proc.returncode == 1 and "the engine failed: test hook" in sf.text(), \
            (sf.proc.returncode, sf.text()[-300:])

    check("an engine failure (test hook): every request gets the engine's message, exit 1", t_engine_failure)

    def t_fails_alone():
        sa = Server("--test-fail-request", "2")
        try:
            body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r1 = post(sa.port, "/v1/completions", body)
            r2 = post(sa.port, "/v1/completions", dict(body, stream=True))
            r3 = post(sa.port, "/v1/completions", body)
            assert r1.status == 200 and r3.status == 200, (r1.status, r3.status)
            ev = r2.events()
            assert r2.complete and ev[-1] == "[DONE]" and "failed alone" in ev[-2]["error"]["message"] and \
                ev[-2]["error"]["code"] == 500, ev[-2:]
            assert get(sa.port, "/health").status == 200
        finally:
            sa.stop()
        assert sa.proc.returncode == 0

    check("a request that fails alone fails alone; the server goes on", t_fails_alone)

    def t_surfaces_drain():
        # SIGTERM with a stream and a whole answer on each generating surface: each ends in its
        # own API's shape; a new /v1/messages request is refused in Anthropic's (no grace, so
        # none of them can finish first)
        sd = Server("--shutdown-timeout", "0")
        res = {}
        firsts = threading.Semaphore(0)

        def one(api, stream):
            path, body = LONG[api]
            b = dict(body, temperature=0, ignore_eos=True, stream=stream)
            res[api, stream] = post(sd.port, path, b, on_first=(lambda _: firsts.release()) if stream else None)

        th = [threading.Thread(target=one, args=(api, True)) for api in LONG]
        for t in th:
            t.start()
        for _ in LONG:
            assert firsts.acquire(timeout=60), "the streams did not start"
        # the whole answers join once the streams run, so none can finish its 3000 tokens first
        # on a loaded machine
        tw = [threading.Thread(target=one, args=(api, False)) for api in LONG]
        for t in tw:
            t.start()
        th += tw
        h.wait_until(lambda: sd.running() >= 2 * len(LONG), 60, "every surface's stream and whole answer to run")
        sd.proc.send_signal(signal.SIGTERM)
        for t in th:
            t.join(30)
        sd.proc.wait(15)
        assert sd.proc.returncode == 0, (sd.proc.returncode, sd.text()[-500:])
        for api in LONG:
            surface_stream_ended(api, res[api, True], "shutting down")
            surface_whole_refused(api, res[api, False], 503, "shutting down")
        # while a stream drains, a new request is refused in its API's shape, with Retry-After
        sg = Server("--shutdown-timeout", "30")
        started = threading.Event()
        th = threading.Thread(target=lambda: post(sg.port, LONG["chat"][0],
                                                  dict(LONG["chat"][1], ignore_eos=True, stream=True),
                                                  on_first=lambda _: started.set()))
        th.start()
        assert started.wait(60)
        sg.proc.send_signal(signal.SIGTERM)
        h.wait_until(sg.draining, 10, "/health to turn 503 after SIGTERM")
        for api in ("messages", "responses"):
            nr = post(sg.port, LONG[api][0], LONG[api][1])
            assert nr.headers.get("retry-after"), nr.headers
            surface_whole_refused(api, nr, 503, "shutting down")
        th.join(60)
        sg.proc.wait(15)
        assert sg.proc.returncode == 0, sg.proc.returncode

    check("SIGTERM: chat, Responses and Messages streams and whole answers each end in their API's shape",
          t_surfaces_drain)

    def t_surfaces_engine_failure():
        sf = Server("--test-fail-step", "60", "--max-num-seqs", "6")
        res = {}

        def one(api, stream):
            path, body = LONG[api]
            res[api, stream] = post(sf.port, path, dict(body, temperature=0, ignore_eos=True, stream=stream))

        th = [threading.Thread(target=one, args=(api, st)) for api in LONG for st in (True, False)]
        for t in th:
            t.start()
        for t in th:
            t.join(60)
        sf.proc.wait(15)
        for api in LONG:
            surface_stream_ended(api, res[api, True], "the engine failed: test hook")
            surface_whole_refused(api, res[api, False], 503, "the engine failed: test hook")
        assert sf.proc.returncode == 1, sf.proc.returncode

    check("an engine failure: chat, Responses and Messages requests get the engine's message in their shape",
          t_surfaces_engine_failure)

    def t_surfaces_fail_alone():
        # a stream whose engine request fails alone ends in its API's error shape; the next is fine
        for api in ("responses", "messages"):
            sa = Server("--test-fail-request", "1")
            try:
                path, body = LONG[api]
                b = dict(body, temperature=0, ignore_eos=True, stream=True)
                b["max_output_tokens" if api == "responses" else "max_tokens"] = 6
                ev = named_events(post(sa.port, path, b))
                name, last = ev[-1]
                if api == "responses":
                    assert name == "response.failed" and "failed alone" in last["response"]["error"]["message"], ev
                else:
                    assert name == "error" and last["error"]["type"] == "api_error" and \
                        "failed alone" in last["error"]["message"], ev
                ok = named_events(post(sa.port, path, b))[-1][0]
                assert ok in ("response.incomplete", "message_stop"), ok
            finally:
                sa.stop()

    check("a Responses or Messages stream that fails alone ends in its API's error event", t_surfaces_fail_alone)

    def t_surfaces_cors_auth():
        sc = Server("--allowed-origins", "http://app.example", "--api-key", "sekret")
        try:
            # the Anthropic SDK's headers from a page: the preflight, then a stream with x-api-key
            pre = exchange(sc.port, request_bytes("OPTIONS", "/v1/messages", None, {
                "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "anthropic-version, content-type, x-api-key",
                "Connection": "close"}), timeout=10)
            assert pre.status == 204 and pre.headers.get("access-control-allow-origin") == "http://app.example" \
                and "x-api-key" in pre.headers.get("access-control-allow-headers", ""), (pre.status, pre.headers)
            hdr = {"Origin": "http://app.example", "x-api-key": "sekret", "anthropic-version": "2023-06-01"}
            r = post(sc.port, "/v1/messages", dict(LONG["messages"][1], max_tokens=4, stream=True), headers=hdr)
            assert r.status == 200 and r.headers.get("access-control-allow-origin") == "http://app.example", \
                (r.status, r.headers)
            assert named_events(r)[-1][0] == "message_stop", named_events(r)[-2:]
            r = post(sc.port, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]},
                     headers=hdr)
            assert r.status == 200 and r.json()["input_tokens"] > 0 and \
                r.headers.get("access-control-allow-origin") == "http://app.example", (r.status, r.body[:200])
            r = post(sc.port, "/v1/responses", dict(LONG["responses"][1], max_output_tokens=4, stream=True),
                     headers={"Origin": "http://app.example", "Authorization": "Bearer sekret"})
            assert r.status == 200 and r.headers.get("access-control-allow-origin") == "http://app.example", \
                (r.status, r.headers)
            assert named_events(r)[-1][0] in ("response.completed", "response.incomplete"), named_events(r)[-1]
            # refusals in the route's shape: a wrong key, an origin not allowed
            r = post(sc.port, "/v1/messages", dict(LONG["messages"][1], max_tokens=2), headers={"x-api-key": "no"})
            surface_whole_refused("messages", r, 401, "API key")
            r = post(sc.port, "/v1/messages", dict(LONG["messages"][1], max_tokens=2),
                     headers={"Origin": "http://evil.example", "x-api-key": "sekret"})
            assert "access-control-allow-origin" not in r.headers, r.headers
            surface_whole_refused("messages", r, 403, "not allowed")
            r = post(sc.port, "/v1/responses", dict(LONG["responses"][1], max_output_tokens=2),
                     headers={"Authorization": "Bearer no"})
            surface_whole_refused("responses", r, 401, "API key")
        finally:
            sc.stop()

    check("CORS and the key on /v1/messages and /v1/responses; refusals in each API's shape",
          t_surfaces_cors_auth)

    def t_surfaces_half_close():
        sh = Server()
        try:
            for api in ("responses", "messages"):
                path, body = LONG[api]
                for stream in (False, True):
                    res = [None] * 10

                    def one(i):
                        b = dict(body, temperature=0, ignore_eos=True, stream=stream)
                        b["max_output_tokens" if api == "responses" else "max_tokens"] = 8
                        res[i] = exchange(sh.port, request_bytes("POST", path, b), half_close=True)

                    th = [threading.Thread(target=one, args=(i,)) for i in range(10)]
                    for t in th:
                        t.start()
                    for t in th:
                        t.join(120)
                    for r in res:
                        assert r is not None and r.status == 200 and r.complete, (api, stream, r and r.status)
                        if stream:
                            last = named_events(r)[-1][0]
                            assert last in ("response.incomplete", "message_stop"), (api, last)
                        else:
                            assert r.json()["usage"]["output_tokens"] == 8, r.json()["usage"]
        finally:
            sh.stop()

    check("10 half-closing clients on /v1/responses and /v1/messages, streamed and not, answered in full",
          t_surfaces_half_close)



if __name__ == "__main__":
    suite.main(main)
