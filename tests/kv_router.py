"""kv_router.py -- `k3 serve --role router` in front of colocated instances (docs/kvstore.md).

Usage: python tests/kv_router.py K3_BINARY [--only TEXT]
On tests/models/tiny, two and three instances behind the router: new conversations spread over
the instances and every later turn of one goes where its first went, where it hits the prefix
cache (each decided by the instances' own /metrics: which one's request count moved, its
cached_tokens); an instance killed: the next turns of its conversations are answered by the
others, the router's /metrics mark it down; the same instance started again on its port: marked
up, and new conversations reach it; one instance busier than the other by more than
--balance-abs: the next turn of its conversation goes to the idle one (reason balance); the
proxy's vllm:num_requests_running is the sum over the instances. Lines `ok   kvrouter: NAME`,
closing `kvrouter: N passed, N failed, N skipped`.
"""
import http.client
import json
import sys
import urllib.parse

import harness as h

ONLY = None
for i, a in enumerate(sys.argv):
    if a == "--only" and i + 1 < len(sys.argv):
        ONLY = sys.argv[i + 1]
suite = h.Suite("kvrouter", only=ONLY)
MODEL = None


def instance(port=0):
    return h.Process([h.K3, "serve", "-m", h.TINY, "--port", str(port), "--threads", "1", "--block-size", "16",
                      "--max-num-seqs", "8"], start_timeout=60)


def router(backends, *extra):
    args = [h.K3, "serve", "--role", "router", "--port", "0"]
    for b in backends:
        args += ["--backend", b.url]
    r = h.Process(args + list(extra), start_timeout=30)
    h.wait_until(lambda: h.get(r.url + "/health").status_code == 200, 10, "the router's /health")
    return r


def words(c, n):
    """n words of conversation c's own text"""
    return " ".join(f"w{(c * 7919 + i * 104729) % 997}" for i in range(n))


def messages(c, t):
    """conversation c at turn t: a long first turn, a short exchange per later turn (what agents send:
    the history grows by a little each time)"""
    m = [{"role": "system", "content": "You are a careful assistant. " + words(c, 120)},
         {"role": "user", "content": "task: " + words(c + 1000, 40)}]
    for k in range(t):
        m += [{"role": "assistant", "content": words(c + 2000 + k, 12)},
              {"role": "user", "content": "and then " + words(c + 3000 + k, 10)}]
    return m


def chat(r, c, t, max_tokens=2):
    body = {"model": MODEL, "messages": messages(c, t), "max_tokens": max_tokens, "temperature": 0}
    resp = h.post(r.url + "/v1/chat/completions", json_body=body, timeout=60)
    assert resp.status_code == 200, (resp.status_code, resp.text[:300])
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def total(proc, name):
    """the sum of every series of name (any labels) on proc's /metrics"""
    return sum(v for k, v in proc.metrics().items() if k == name or k.startswith(name + "{"))


def served(insts):
    """requests each instance answered, by its own /metrics"""
    out = []
    for s in insts:
        try:
            out.append(total(s, "vllm:request_success_total"))
        except OSError:
            out.append(None)
    return out


def which(insts, before):
    after = served(insts)
    moved = [i for i, (a, b) in enumerate(zip(before, after)) if a is not None and b is not None and b > a]
    assert len(moved) == 1, f"requests answered moved on {moved}: {before} -> {after}"
    return moved[0]


def send(r, insts, c, t):
    """conversation c's turn t through the router: (the instance that answered, cached tokens)"""
    before = served(insts)
    cached = chat(r, c, t)
    # an answer is counted once its request ends: poll the instances' state
    return h.wait_until(lambda: which_or_none(insts, before), 10, "an instance to count the answer"), cached


def which_or_none(insts, before):
    try:
        return (which(insts, before),)
    except AssertionError:
        return None


def affinity(n):
    insts = [instance() for _ in range(n)]
    r = router(insts)
    home = {}
    for c in range(2 * n):
        (i,), _ = send(r, insts, c, 0)
        home[c] = i
    per = [list(home.values()).count(i) for i in range(n)]
    assert per == [2] * n, f"new conversations per instance: {per}"
    for t in range(1, 4):
        for c in range(2 * n):
            (i,), cached = send(r, insts, c, t)
            assert i == home[c], f"conversation {c} turn {t} went to instance {i}, its first to {home[c]}"
            assert cached > 0, f"conversation {c} turn {t}: no prefix cache hit on its instance"
    m = r.metrics()
    assert h.metric(m, "k3:router_requests_total", reason="affinity") == 2 * n * 3, m
    assert h.metric(m, "k3:router_affinity_hit_bytes_total") > 0
    h.stop_all()


def round_robin():
    """the control: the same conversations under --policy round_robin leave their instance"""
    insts = [instance(), instance()]
    r = router(insts, "--policy", "round_robin")
    moved = 0
    home = {}
    for t in range(3):
        for c in range(3):
            (i,), _ = send(r, insts, c, t)
            moved += home.setdefault(c, i) != i
    assert moved > 0, "round-robin kept every conversation on its instance"
    assert r.metric("k3:router_requests_total", reason="round_robin") == 9
    h.stop_all()


def failover(n):
    insts = [instance() for _ in range(n)]
    r = router(insts)
    home = {}
    for c in range(2 * n):
        (i,), _ = send(r, insts, c, 0)
        home[c] = i
    dead = insts[0]
    port = dead.port
    dead.kill()
    alive = insts[1:]
    # the dead instance's conversations: answered by the others at once (the failed call is retried)
    for c in [c for c in home if home[c] == 0]:
        (i,), _ = send(r, alive, c, 1)
    r.wait_metric("k3:router_backend_healthy", lambda v: v == 0, 10, url=dead.url)
    for c in range(2 * n):
        (i,), _ = send(r, alive, c, 2)
    # the same instance again on its port: marked up, and new conversations reach it
    back = instance(port)
    assert back.url == dead.url
    r.wait_metric("k3:router_backend_healthy", lambda v: v == 1, 10, url=back.url)
    insts = [back] + alive
    got = set()
    for c in range(100, 100 + n):
        (i,), _ = send(r, insts, c, 0)
        got.add(i)
    assert 0 in got, f"new conversations after the restart went to {sorted(got)}, not the restarted instance"
    h.stop_all()


def open_stream(url, body):
    """a streaming request left open: its status read, its body not"""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.status
    return conn


def balance():
    insts = [instance(), instance()]
    r = router(insts, "--balance-abs", "2")
    (home,), _ = send(r, insts, 0, 0)
    (i,), _ = send(r, insts, 0, 1)
    assert i == home
    # three long turns of the conversation in flight on its instance (3 > 0 + 2 and 3 > 1.5 x 0)
    body = {"model": MODEL, "messages": messages(0, 1), "max_tokens": 3000, "ignore_eos": True, "stream": True,
            "temperature": 0}
    conns = [open_stream(r.url, body) for _ in range(3)]
    try:
        r.wait_metric("k3:router_backend_load", lambda v: v == 3, 10, url=insts[home].url)
        running = h.wait_until(lambda: r.metric("vllm:num_requests_running") == 3 or None, 20,
                               "the proxy's vllm:num_requests_running to sum the instances' 3")
        assert running
        (i,), _ = send(r, insts, 0, 2)
        assert i != home, "the busy instance got the turn"
        assert r.metric("k3:router_requests_total", reason="balance") == 1
    finally:
        for c in conns:
            c.close()
    # the streams the client left end on the instance, and the router's load with them
    r.wait_metric("k3:router_backend_load", lambda v: v == 0, 30, url=insts[home].url)
    h.wait_until(lambda: total(insts[home], "vllm:num_requests_running") == 0, 30, "the streams to end")
    h.stop_all()


def bad_options():
    for args, want in [(["--backend", "ftp://x"], "is not http://HOST:PORT"),
                       (["--backend", "http://127.0.0.1:9", "--policy", "random"], "--policy must be"),
                       ([], "--backend is required"),
                       (["--backend", "http://127.0.0.1:9", "--prefill", "http://127.0.0.1:9"], "a router takes")]:
        import subprocess
        p = subprocess.run([h.K3, "serve", "--role", "router", "--port", "0", *args], capture_output=True,
                           timeout=10, text=True)
        assert p.returncode != 0 and want in p.stderr, (args, p.returncode, p.stderr[-300:])


def run():
    global MODEL
    s = instance()
    MODEL = h.get(s.url + "/v1/models").json()["data"][0]["id"]
    h.stop_all()
    suite.check("two instances: conversations spread, every turn where its first went, a cache hit there",
                lambda: affinity(2))
    suite.check("three instances: conversations spread, every turn where its first went, a cache hit there",
                lambda: affinity(3))
    suite.check("round-robin (the control): turns leave their conversation's instance", round_robin)
    suite.check("two instances: one killed, the other answers; started again, used again", lambda: failover(2))
    suite.check("three instances: one killed, the others answer; started again, used again", lambda: failover(3))
    suite.check("one instance busier by more than --balance-abs: the turn goes to the idle one", balance)
    suite.check("bad router options: one message each", bad_options)


suite.main(run)
