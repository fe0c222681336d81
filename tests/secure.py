"""secure.py -- nobody reaches what is not theirs: the attacks of a security review, each a check.

Usage: python3 tests/secure.py K3_BINARY   (stdlib only; loopback only)
On tests/models/tiny (vision-tiny for images), every instance with --api-key and the deployment's
transfer secret (K3_KV_TRANSFER_SECRET, made here when unset): raw clients without the secret
against a prefill instance's transfer port get nothing and destroy no hold; an authenticated pull
for another prompt is refused naming nothing and leaves the hold; a decode instance given another
request's hold and a loopback port of this test's own answers 400 and connects to nothing, unless
the proxy's credential or --prefill-peers vouch for it; the proxy refuses an empty key, takes
x-api-key and a lower-case bearer, refuses differing framing, cuts unauthenticated bodies at their
headers, serves a normal client past idle connections over its limit, and its /health follows its
backends; 10,000 response ids over the four APIs carry no repeated or ordered bits (nor once the
splitmix64 finalizer, which the old ids went through, is undone); a request of 15 PNGs of
8192 x 8192 is refused from their headers (400 naming the limit) with the server's peak RSS flat,
and image requests at once are served one after another. Prints `ok   secure: NAME` /
`FAIL secure: NAME` and ends with `secure: N passed, N failed, N skipped` (tests/harness.py). Every
process dies with it.
"""
import base64
import hashlib
import hmac
import http.client
import json
import os
import re
import resource
import secrets
import select
import socket
import struct
import sys
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

K3 = sys.argv[1] if len(sys.argv) > 1 else "build/k3"
TINY, VISION = "tests/models/tiny", "tests/models/vision-tiny"
KEY = "user-key"
SECRET = os.environ.setdefault("K3_KV_TRANSFER_SECRET", secrets.token_hex(32))
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
M64 = (1 << 64) - 1
suite = harness.Suite("secure")
check = suite.check


def serve(model, *extra):
    return harness.Process([K3, "serve", "-m", model, "--port", "0", "--threads", "1", "--api-key", KEY, *extra],
                     stop_timeout=15, start_timeout=60)


def call(port, method, path, body=None, headers=None, timeout=120, key=KEY):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Authorization": "Bearer " + key} if key else {}
    h.update(headers or {})
    data = json.dumps(body).encode() if body is not None else None
    if data is not None:
        h["Content-Type"] = "application/json"
    c.request(method, path, data, h)
    r = c.getresponse()
    out = r.status, r.read()
    c.close()
    return out


def message(b):
    try:
        j = json.loads(b)
        return j["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return b.decode(errors="replace")


def metrics(port):
    _, t = call(port, "GET", "/metrics")
    out = {}
    for ln in t.decode().splitlines():
        if ln.startswith("#") or not ln.strip():
            continue
        name, _, v = ln.rpartition(" ")
        out[re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")] = float(v)
    return out


def make_hold(pre, prompt):
    st, b = call(pre.port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                        "kv_transfer_params": {"do_remote_decode": True}})
    assert st == 200, (st, b[:300])
    return json.loads(b)["kv_transfer_params"]


def credential(kv, **over):
    """The proxy's credential over kv's fields (src/pd/auth.c: k3_pd_credential)."""
    f = dict(kv, **over)
    proxy_key = hmac.new(SECRET.encode(), b"k3 proxy credential v2", hashlib.sha256).digest()
    text = "k3 kv_transfer_params\n%d:%s\n%d\n%d:%s\n%d:%s\n%d" % (
        len(f["remote_host"]), f["remote_host"], int(f["remote_port"]), len(f["remote_request_id"]),
        f["remote_request_id"], len(f["prompt_hash"]), f["prompt_hash"], int(f["num_tokens"]))
    return hmac.new(proxy_key, text.encode(), hashlib.sha256).hexdigest()


def tokens_of(srv, text):
    st, b = call(srv.port, "POST", "/tokenize", {"prompt": text})
    assert st == 200, b
    return json.loads(b)["tokens"]


def raw_exchange(port, data, read_first=False):
    """Sends data (after reading the server's first bytes, if any come), reads to the end."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    got = b""
    try:
        s.sendall(data)
        while True:
            d = s.recv(65536)
            if not d:
                break
            got += d
    except OSError:
        pass
    s.close()
    return got


def v1_request(op, hold, model=0):
    """A request of the former protocol (96 bytes, no secret): PULL (1) or RELEASE (2) of hold."""
    body = b"K3PD" + struct.pack("<HHQ", 1, op, hold) + struct.pack("<Q24sIi", model, b"", 0, 0) + \
        struct.pack("<qqqQ", 0, 64, 1 << 20, 0)
    return body + b"\0" * 8


def main():
    pre = serve(TINY, "--role", "prefill", "--kv-transfer-port", "0", "--max-num-seqs", "4")
    dec = serve(TINY, "--role", "decode")
    col = serve(TINY)

    def transfer_port():
        kv = make_hold(pre, "The victim's private prompt about a merger")
        kv2 = make_hold(pre, "The victim's private prompt about a merger")
        m0 = metrics(pre.port)
        holds = m0["k3:kv_holds"]
        leaked = kv["model_id"].encode()
        back = b""
        for h in range(1, 9):  # the former protocol's PULL with a zeroed identity, and RELEASE
            back += raw_exchange(pre.kv_port, v1_request(1, h))
            back += raw_exchange(pre.kv_port, v1_request(2, h))
        # the handshake without the secret: the server's hello (a nonce and its proof), then nothing
        hello = b"K3PH" + struct.pack("<HH", 2, 1) + os.urandom(32) + b"\0" * 32
        got = raw_exchange(pre.kv_port, hello + b"K3PH" + struct.pack("<HH", 2, 3) + b"\0" * 32 + os.urandom(32) +
                           b"K3PD" + b"\0" * 132)
        assert not back, "the former protocol got %d bytes back: %r" % (len(back), back[:200])
        assert len(got) <= 72 and leaked not in got and kv["remote_request_id"].encode() not in got, got
        m1 = metrics(pre.port)
        assert m1["k3:kv_holds"] == holds, (holds, m1["k3:kv_holds"])
        refused = m1['k3:kv_transfer_refused_total{reason="auth"}'] - m0['k3:kv_transfer_refused_total{reason="auth"}']
        assert refused == 17, refused
        # holds are named by 128 random bits, and bound to the prompt's hash
        assert re.fullmatch(r"[0-9a-f]{32}", kv["remote_request_id"]) and \
            re.fullmatch(r"[0-9a-f]{64}", kv["prompt_hash"]) and kv2["remote_request_id"] != kv["remote_request_id"], kv
    check("a raw client without the secret gets nothing from the transfer port and destroys no hold", transfer_port)

    def bound_to_prompt():
        victim, attacker = "Tell me the access code for the east wing vault", "Hello there, how are you?"
        kv = make_hold(pre, victim)
        mine = tokens_of(col, attacker)
        hash_mine = hashlib.sha256(struct.pack("<%di" % len(mine), *mine)).hexdigest()
        forged = dict(kv, prompt_hash=hash_mine, num_tokens=len(mine))
        m0 = metrics(pre.port)
        st, b = call(dec.port, "POST", "/v1/completions",
                     {"prompt": attacker, "max_tokens": 4, "kv_transfer_params": forged},
                     headers={"X-K3-Transfer-Credential": credential(forged)})
        msg = message(b)
        assert st >= 400 and "refused" in msg and kv["model_id"] not in msg, (st, msg)
        m1 = metrics(pre.port)
        assert m1["k3:kv_holds"] == m0["k3:kv_holds"], "the hold went"
        assert m1['k3:kv_transfer_refused_total{reason="hold"}'] == \
            m0['k3:kv_transfer_refused_total{reason="hold"}'] + 1, m1
        # the request it was made for still reads it: the victim's own continuation
        st, b = call(dec.port, "POST", "/v1/completions",
                     {"prompt": victim, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                      "kv_transfer_params": kv}, headers={"X-K3-Transfer-Credential": credential(kv)})
        _, w = call(col.port, "POST", "/v1/completions", {"prompt": victim, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True})
        assert st == 200 and json.loads(b).get("kv_transfer"), (st, b[:300])
        assert json.loads(b)["choices"][0]["text"] == json.loads(w)["choices"][0]["text"]
    check("a hold is read only by the prompt it was made for: another prompt's pull is refused, naming nothing",
          bound_to_prompt)

    def untrusted_params():
        kv = make_hold(pre, "Another user's request, held for its decode instance")
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(8)
        mine = tokens_of(col, "Hello")
        attacker = [mine[0]] * kv["num_tokens"]
        m0 = metrics(dec.port)
        tries = [{k: v for k, v in kv.items() if k != "prompt_hash"}, dict(kv),
                 dict(kv, remote_host="127.0.0.1", remote_port=lst.getsockname()[1])]
        for p in tries:
            for hdr in ({}, {"X-K3-Transfer-Credential": "0" * 64}):
                st, b = call(dec.port, "POST", "/v1/completions",
                             {"prompt": attacker, "max_tokens": 4, "kv_transfer_params": p}, headers=hdr)
                assert st == 400 and "credential" in message(b), (st, message(b))
        r, _, _ = select.select([lst], [], [], 0)
        lst.close()
        assert not r, "the decode instance connected to the port the request named"
        m1 = metrics(dec.port)
        assert m1['k3:kv_transfer_refused_total{reason="params"}'] - \
            m0['k3:kv_transfer_refused_total{reason="params"}'] == 6, m1
        assert metrics(pre.port)["k3:kv_holds"] >= 1  # nobody released it
    check("kv_transfer_params without the proxy's credential: 400, no connection (another's hold, a port of ours)",
          untrusted_params)

    def peers_list():
        dp = serve(TINY, "--role", "decode", "--prefill-peers", "127.0.0.1:%d" % pre.kv_port)
        try:
            kv = make_hold(pre, "Pulled by a decode instance that lists its peer")
            p = tokens_of(col, "Pulled by a decode instance that lists its peer")
            st, b = call(dp.port, "POST", "/v1/completions",
                         {"prompt": p, "max_tokens": 4, "temperature": 0, "kv_transfer_params": kv})
            assert st == 200 and json.loads(b).get("kv_transfer"), (st, b[:300])
            other = socket.socket()
            other.bind(("127.0.0.1", 0))
            other.listen(4)
            kv2 = make_hold(pre, "Pulled by a decode instance that lists its peer")
            st, b = call(dp.port, "POST", "/v1/completions",
                         {"prompt": p, "max_tokens": 4, "kv_transfer_params":
                          dict(kv2, remote_port=other.getsockname()[1])})
            r, _, _ = select.select([other], [], [], 0)
            other.close()
            assert st == 400 and not r, (st, message(b))
        finally:
            dp.stop()
    check("--prefill-peers: a listed peer is pulled from without the credential, no other", peers_list)

    pre.stop()
    dec.stop()

    # ---- the proxy ----
    def proxy_key():
        px = harness.Process([K3, "serve", "--role", "proxy", "--api-key", "", "--prefill", "http://127.0.0.1:1",
                        "--decode", "http://127.0.0.1:2", "--port", "0"], expect_start=False)
        px.proc.wait(10)
        assert px.proc.returncode == 2 and "the API key is empty" in px.text(), (px.proc.returncode, px.text()[-300:])
    check("the proxy refuses an empty --api-key", proxy_key)

    p2 = serve(TINY, "--role", "prefill", "--kv-transfer-port", "0")
    d2 = serve(TINY, "--role", "decode")
    x = harness.Process([K3, "serve", "--role", "proxy", "--api-key", KEY, "--port", "0", "--max-connections", "64",
              "--prefill", "http://127.0.0.1:%d" % p2.port, "--decode", "http://127.0.0.1:%d" % d2.port])

    def proxy_auth_framing():
        body = {"prompt": "Hello", "max_tokens": 2}
        assert call(x.port, "POST", "/v1/completions", body, key=None, headers={"x-api-key": KEY})[0] == 200
        assert call(x.port, "POST", "/v1/completions", body, key=None,
                    headers={"Authorization": "bearer " + KEY})[0] == 200
        assert call(x.port, "POST", "/v1/completions", body, key="wrong")[0] == 401
        tb = json.dumps(body).encode()
        for extra in (b"Content-Length: %d\r\nContent-Length: 5\r\n" % len(tb),
                      b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(tb)):
            got = raw_exchange(x.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                               KEY.encode() + b"\r\nConnection: close\r\n" + extra + b"\r\n" + tb)
            assert got.startswith(b"HTTP/1.1 400"), got[:100]
    check("the proxy: x-api-key and a lower-case bearer, a wrong key 401, differing framing 400", proxy_auth_framing)

    def proxy_bodies():
        def rss():
            for ln in open("/proc/%d/status" % x.proc.pid):
                if ln.startswith("VmRSS:"):
                    return int(ln.split()[1]) / 1024
        r0 = rss()
        socks, big = [], 4 << 20
        for _ in range(40):
            k = socket.create_connection(("127.0.0.1", x.port), timeout=10)
            k.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % big)
            sent = 0
            try:
                while sent < big - 1:
                    sent += k.send(b"a" * min(65536, big - 1 - sent))
            except OSError:
                pass
            socks.append(k)
        grown = rss() - r0
        for k in socks:
            k.close()
        assert grown < 40, "the proxy grew %.0f MB with 40 unauthenticated 4 MiB bodies" % grown
    check("the proxy cuts unauthenticated bodies at their headers: its RSS stays flat", proxy_bodies)

    def proxy_idle():
        socks = []
        for _ in range(80):  # over its limit of 64, each with half a request line
            k = socket.create_connection(("127.0.0.1", x.port), timeout=10)
            k.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks.append(k)
        st, _ = call(x.port, "GET", "/v1/models", timeout=10)
        for k in socks:
            k.close()
        assert st == 200, st
    check("the proxy: a normal client is served past 80 idle connections over a limit of 64", proxy_idle)

    def proxy_health():
        assert call(x.port, "GET", "/health", key=None)[0] == 200
        d2.proc.kill()
        d2.proc.wait(5)
        deadline, st, b = time.time() + 15, 200, b""
        while time.time() < deadline and st == 200:
            st, b = call(x.port, "GET", "/health", key=None)
            if st == 200:
                time.sleep(0.2)
        assert st == 503 and "no decode instance is healthy" in message(b), (st, b)
        m = metrics(x.port)
        assert m['k3:proxy_backend_up{role="decode",url="http://127.0.0.1:%d"}' % d2.port] == 0, m
    check("the proxy's /health follows its backends (503 once its decode instance is dead)", proxy_health)
    for p in (x, p2):
        p.stop()

    # ---- ids ----
    def ids():
        routes = [("/v1/completions", {"prompt": "hi", "max_tokens": 1}, "cmpl-"),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                   "chatcmpl-"),
                  ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "store": False}, "resp_"),
                  ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, "msg_")]
        N = 10000
        got = [None] * N

        def worker(k):
            c = http.client.HTTPConnection("127.0.0.1", col.port, timeout=60)
            for i in range(k, N, 8):
                path, body, _ = routes[i % 4]
                c.request("POST", path, json.dumps(body), {"Authorization": "Bearer " + KEY,
                                                           "Content-Type": "application/json"})
                r = c.getresponse()
                got[i] = json.loads(r.read())["id"]
            c.close()

        th = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in th:
            t.start()
        for t in th:
            t.join(600)
        assert all(got), "%d of %d requests answered" % (sum(1 for g in got if g), N)
        assert len(set(got)) == N, "repeated ids"
        abc = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        for r, (_, _, prefix) in enumerate(routes):
            ids_r = [got[i] for i in range(r, N, 4)]
            assert all(g.startswith(prefix) for g in ids_r), ids_r[:3]
            body = [g[len(prefix):] for g in ids_r]
            n = len(body)
            # the letters as numbers; two 64-bit words as the old ids were made of
            words = []
            for t in body:
                if re.fullmatch(r"[0-9a-f]{16}", t):
                    words.append((int(t, 16), int(t, 16)))
                    continue
                ws = []
                for half in (t[:12], t[12:24]):
                    v = 0
                    for ch in reversed(half):
                        v = v * 62 + abc.index(ch)
                    ws.append(v & M64)
                words.append(tuple(ws))
            seqs = {"word 0": [w[0] for w in words], "word 1": [w[1] for w in words],
                    "unmix(word 0)": [unmix(w[0]) for w in words],
                    "unmix(word 1) ^ word 0": [unmix(w[1]) ^ w[0] for w in words]}
            for name, seq in seqs.items():
                # repeated: a value (a pointer) in more than one id
                assert len(set(seq)) > n - 3, "%s of %s ids repeats: %d distinct of %d" % (name, prefix, len(set(seq)),
                                                                                           n)
                # ordered: the low 20 bits (a counter) or the high 32 (a clock) rising with the order
                for lo, hi in ((0, 20), (32, 64)):
                    part = [(v >> lo) & ((1 << (hi - lo)) - 1) for v in seq]
                    ups = sum(1 for a, b in zip(part, part[1:]) if b > a) / (n - 1)
                    assert 0.45 < ups < 0.55, "%s of %s ids: bits %d..%d rise in %.0f%% of steps" % (
                        name, prefix, lo, hi, 100 * ups)
            # every bit of the raw letters' words as often 0 as 1 (within 6 sd)
            for b in range(64):
                ones = sum((w[0] >> b) & 1 for w in words)
                assert abs(ones - n / 2) < 6 * (n ** 0.5) / 2 or (1 << b) > 62 ** 12, (prefix, b, ones)
    check("10,000 ids over the four APIs: no repeated or ordered bits, nor behind the splitmix64 finalizer", ids)
    col.stop()

    # ---- images ----
    def images():
        s = serve(VISION, "--max-body-bytes", str(16 << 20))
        try:
            def hwm():
                for ln in open("/proc/%d/status" % s.proc.pid):
                    if ln.startswith("VmHWM:"):
                        return int(ln.split()[1]) / 1024
            img = "data:image/png;base64," + base64.b64encode(png(8192, 8192)).decode()
            parts = [{"type": "image_url", "image_url": {"url": img}} for _ in range(15)]
            r0 = hwm()
            st, b = call(s.port, "POST", "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": parts + [{"type": "text", "text": "What?"}]}],
                          "max_tokens": 1}, timeout=300)
            grown = hwm() - r0
            assert st == 400 and "--max-request-image-pixels" in message(b) and "268435456" in message(b), \
                (st, message(b))
            assert grown < 100, "peak RSS grew %.0f MB" % grown
            # four requests at once, each one image: all answered, one after another on the tower's pool
            small = "data:image/png;base64," + base64.b64encode(png(640, 480)).decode()
            res = [None] * 4

            def one(i):
                res[i] = call(s.port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": small}}, {"type": "text", "text": "What?"}]}],
                    "max_tokens": 2}, timeout=300)[0]
            th = [threading.Thread(target=one, args=(i,)) for i in range(4)]
            for t in th:
                t.start()
            for t in th:
                t.join(300)
            assert res == [200] * 4, res
            m = metrics(s.port)
            assert m["k3:image_requests_waiting"] == 0 and m["k3:image_pixels_in_flight"] == 0, m
        finally:
            s.stop()
    check("15 PNGs of 8192 x 8192: 400 from their headers naming the limit, peak RSS flat; image requests queue",
          images)


def unmix(z):
    """The inverse of splitmix64's finalizer."""
    def unxorshift(x, s):
        r = x
        for _ in range(64 // s + 1):
            r = x ^ (r >> s)
        return r & M64
    z = unxorshift(z, 31)
    z = (z * pow(0x94d049bb133111eb, -1, 1 << 64)) & M64
    z = unxorshift(z, 27)
    z = (z * pow(0xbf58476d1ce4e5b9, -1, 1 << 64)) & M64
    z = unxorshift(z, 30)
    return (z - 0x9e3779b97f4a7c15) & M64


def png(w, h):
    raw = zlib.compress((b"\0" + b"\x80" * (3 * w)) * h, 9)

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", raw) + chunk(b"IEND", b"")


suite.main(main)
