"""robust_findings.py -- the probes of a robustness review of `k3 serve`, one per finding, against
a given k3 binary (so the same command runs on an older build and a newer one).

  halfclose  50 clients per generating route, streamed and not, that shut down their sending side
             after the request: how many are answered in full
  sigterm    SIGTERM with 16 streams running and 4 whole answers waiting: how each ends
  slowloris  1100 connections sending a header byte every 5 s (reconnecting when closed) against
             the default 1024-connection limit; a normal client in 5 rounds
  framing    two Content-Lengths that differ; Transfer-Encoding: gzip with a length; a garbage
             request line
  auth       200 unauthenticated connections each sending 4 MiB - 1 of a 4 MiB body: the server's
             RSS; --api-key ""; the Bearer scheme in lower case
  health     (mpirun) /health while a rank is stopped for 12 s
  bounded    streamed chat logprobs of a reply that stays in reasoning_content; a request of 16
             choices with echo, 20 top logprobs and a 3,900-token prompt (and of 6, within the
             caps), and a small request behind it; a small request behind one of 16 choices x 600
             tokens
  memory     models/k3-mini under 3.5 minutes of load: RSS and the KDA snapshot bytes
Usage: python3 bench/robust_findings.py K3_BINARY FINDING... [--after]
(--after adds the options the fixes introduced: --step-timeout for health).
"""
import json
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time

K3 = sys.argv[1]
WHICH = [a for a in sys.argv[2:] if not a.startswith("--")]
AFTER = "--after" in sys.argv
TINY = "tests/models/tiny"
resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))


class Server:
    def __init__(self, *extra, model=TINY, mpi=0):
        args = [K3, "serve", "-m", model, "--port", "0", "--threads", "1", *extra]
        if mpi:
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            args = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", str(mpi)] + args
        else:
            env = None
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        self.log = b""
        deadline = time.time() + 60
        self.port = None
        while time.time() < deadline and self.port is None:
            r, _, _ = select.select([self.proc.stderr], [], [], 1.0)
            if not r:
                if self.proc.poll() is not None:
                    break
                continue
            chunk = os.read(self.proc.stderr.fileno(), 4096)
            if not chunk:
                break
            self.log += chunk
            m = re.search(rb"listening on http://[^:]+:(\d+)", self.log)
            if m:
                self.port = int(m.group(1))
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

    def pid(self):
        return self.proc.pid

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def rss_mb(pid):
    try:
        for ln in open(f"/proc/{pid}/status"):
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) / 1024
    except OSError:
        pass
    return -1


def req(method, path, body=None, headers=None):
    h = {"Host": "x", "Connection": "close"}
    h.update(headers or {})
    data = b""
    if body is not None:
        data = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
        h["Content-Length"] = str(len(data))
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode() + data


def talk(port, raw, half_close=False, timeout=120, on_first=None):
    """(bytes, seconds) read until the server closes."""
    t0 = time.time()
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    data = b""
    try:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        while True:
            d = s.recv(65536)
            if not d:
                break
            if not data and on_first:
                on_first()
            data += d
    except OSError:
        pass
    s.close()
    return data, time.time() - t0


def status(data):
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None


def body_of(data):
    head, _, rest = data.partition(b"\r\n\r\n")
    if b"chunked" not in head.lower():
        return rest, True
    out, pos = b"", 0
    while True:
        eol = rest.find(b"\r\n", pos)
        if eol < 0:
            return out, False
        n = int(rest[pos:eol] or b"0", 16)
        if n == 0:
            return out, rest[eol + 2:eol + 4] == b"\r\n"
        out += rest[eol + 2:eol + 2 + n]
        pos = eol + 2 + n + 2


def ending(data):
    """how a stream ended: finished / error-event CODE / cut"""
    b, complete = body_of(data)
    ev = [ln[6:] for ln in b.decode(errors="replace").split("\n") if ln.startswith("data: ")]
    if complete and ev and ev[-1] == "[DONE]":
        if len(ev) >= 2 and ev[-2].startswith('{"error"'):
            return "error event %d + [DONE]" % json.loads(ev[-2])["error"]["code"]
        return "finished"
    return "cut (no [DONE] / no end of body)"


def halfclose():
    s = Server()
    for path, b in (("/v1/completions", {"prompt": "Hello world"}),
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in (False, True):
            out = [None] * 50
            raw = req("POST", path, dict(b, max_tokens=8, ignore_eos=True, stream=stream), {"Connection": "keep-alive"})
            th = [threading.Thread(target=lambda i=i: out.__setitem__(i, talk(s.port, raw, half_close=True)[0]))
                  for i in range(50)]
            [t.start() for t in th]
            [t.join() for t in th]
            full = 0
            for d in out:
                if status(d) != 200:
                    continue
                if stream:
                    full += ending(d) == "finished"
                else:
                    bd, _ = body_of(d)
                    try:
                        full += json.loads(bd)["usage"]["completion_tokens"] == 8
                    except ValueError:
                        pass
            print(f"halfclose: {path} stream={stream}: {full} of 50 answered in full", flush=True)
    s.stop()


def sigterm():
    s = Server()
    res = [None] * 20
    started = threading.Semaphore(0)
    body = {"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True}

    def one(i):
        raw = req("POST", "/v1/completions", dict(body, stream=i < 16))
        res[i] = talk(s.port, raw, on_first=started.release if i < 16 else None)[0]

    th = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    [t.start() for t in th]
    for _ in range(16):
        started.acquire(timeout=60)
    time.sleep(0.5)
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    [t.join(60) for t in th]
    s.proc.wait(30)
    kinds = {}
    for d in res[:16]:
        k = ending(d)
        kinds[k] = kinds.get(k, 0) + 1
    print(f"sigterm: 16 streams: {kinds}", flush=True)
    print("sigterm: 4 waiting whole answers: " +
          ", ".join(f"status {status(d)} ({len(d)} bytes)" for d in res[16:]), flush=True)
    print(f"sigterm: the server exited {s.proc.returncode} {time.time() - t0:.1f} s after SIGTERM", flush=True)


def slowloris():
    s = Server()
    N = 1100
    socks = [None] * N
    dropped = [0]
    stop = threading.Event()

    def open_one(i):
        try:
            k = socket.create_connection(("127.0.0.1", s.port), timeout=5)
            k.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            k.setblocking(False)
            socks[i] = k
        except OSError:
            socks[i] = None

    def trickle():
        while not stop.is_set():
            for i in range(N):
                k = socks[i]
                if k is not None:
                    try:
                        k.recv(4096)  # an answer (408, 503) or the end: the server dropped it
                        gone = True
                    except BlockingIOError:
                        try:
                            k.send(b"a")
                            gone = False
                        except OSError:
                            gone = True
                    except OSError:
                        gone = True
                    if gone:
                        dropped[0] += 1
                        k.close()
                        socks[i] = None
                if socks[i] is None and not stop.is_set():
                    open_one(i)
            stop.wait(5)

    for i in range(N):
        open_one(i)
    t = threading.Thread(target=trickle)
    t.start()
    time.sleep(2)
    codes = []
    for r in range(5):
        d, _ = talk(s.port, req("GET", "/v1/models"), timeout=10)
        codes.append(status(d))
        time.sleep(5)
    stop.set()
    t.join()
    for k in socks:
        if k:
            k.close()
    print(f"slowloris: {N} trickling connections: the normal client got {codes}; "
          f"{dropped[0]} trickling connections closed by the server in {5 * 5 + 2} s", flush=True)
    s.stop()


def framing():
    s = Server()
    tb = json.dumps({"prompt": "Hello world"}).encode()
    raw = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(tb) + tb
    d, t = talk(s.port, raw, timeout=60)
    print(f"framing: two Content-Lengths ({len(tb)}, 5): status {status(d)} in {t:.1f} s", flush=True)
    raw = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(tb) + tb
    d, t = talk(s.port, raw, timeout=60)
    print(f"framing: Transfer-Encoding: gzip with a length: status {status(d)} after {t:.1f} s", flush=True)
    d, t = talk(s.port, b"GARBAGE\r\n\r\n", timeout=60)
    print(f"framing: the request line 'GARBAGE': status {status(d)} ({len(d)} bytes) after {t:.1f} s", flush=True)
    s.stop()


def auth():
    s = Server("--api-key", "k")
    r0 = rss_mb(s.pid())
    big = 4 << 20

    def one():
        try:
            k = socket.create_connection(("127.0.0.1", s.port), timeout=30)
            k.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % big)
            chunk = b"a" * 65536
            left = big - 1
            while left > 0:
                n = k.send(chunk[:min(left, len(chunk))])
                left -= n
            conns.append(k)
        except OSError:
            refused.append(1)

    conns, refused = [], []
    th = [threading.Thread(target=one) for _ in range(200)]
    [t.start() for t in th]
    [t.join(120) for t in th]
    time.sleep(1)
    r1 = rss_mb(s.pid())
    print(f"auth: 200 unauthenticated 4 MiB bodies: server RSS {r0:.0f} MB -> {r1:.0f} MB "
          f"({len(conns)} bodies sent to the last byte but one, {len(refused)} cut off by the server)", flush=True)
    for k in conns:
        k.close()
    d, _ = talk(s.port, req("GET", "/v1/models", None, {"Authorization": "bearer k"}), timeout=10)
    print(f"auth: 'Authorization: bearer k' (scheme in lower case): status {status(d)}", flush=True)
    s.stop()
    e = Server("--api-key", "")
    if e.port:
        d, _ = talk(e.port, req("GET", "/v1/models"), timeout=10)
        print(f"auth: --api-key \"\": the server started; GET /v1/models without a key: status {status(d)}", flush=True)
        e.stop()
    else:
        e.proc.wait(10)
        print(f"auth: --api-key \"\": refused to start (exit {e.proc.returncode}): "
              f"{e.log.decode(errors='replace').strip().splitlines()[-1]}", flush=True)


def health():
    extra = ["--ep", "2", "--dist-timeout", "20"] + (["--step-timeout", "5"] if AFTER else [])
    s = Server(*extra, model="tests/models/tiny-dsa", mpi=2)
    started = threading.Event()
    th = threading.Thread(target=lambda: talk(s.port, req("POST", "/v1/completions", {
        "prompt": "Hello", "max_tokens": 100000 // 40, "ignore_eos": True, "stream": True}), on_first=started.set))
    th.start()
    started.wait(60)
    r1 = None
    for p in subprocess.run(["pgrep", "-P", str(s.pid())], capture_output=True, text=True).stdout.split():
        try:
            if "OMPI_COMM_WORLD_RANK=1" in open(f"/proc/{p}/environ").read().split("\0"):
                r1 = int(p)
        except OSError:
            pass
    os.kill(r1, signal.SIGSTOP)
    t0 = time.time()
    seen = []
    while time.time() - t0 < 12:
        d, _ = talk(s.port, req("GET", "/health"), timeout=5)
        seen.append((round(time.time() - t0, 1), status(d)))
        time.sleep(0.5)
    os.kill(r1, signal.SIGCONT)
    first503 = next((t for t, c in seen if c == 503), None)
    print(f"health: rank 1 stopped for 12 s: /health {sum(c == 200 for _, c in seen)} x 200, "
          f"{sum(c == 503 for _, c in seen)} x 503" + (f" (503 from {first503} s)" if first503 else ""), flush=True)
    s.proc.send_signal(signal.SIGTERM)
    try:
        s.proc.wait(30)
    except subprocess.TimeoutExpired:
        s.proc.kill()
    th.join(30)


def bounded():
    s = Server()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    d, _ = talk(s.port, req("POST", "/v1/chat/completions", body))
    whole = json.loads(body_of(d)[0])["choices"][0]
    d, _ = talk(s.port, req("POST", "/v1/chat/completions", dict(body, stream=True)))
    n = 0
    for ln in body_of(d)[0].decode().split("\n"):
        if ln.startswith("data: {"):
            c = json.loads(ln[6:])["choices"]
            if c and c[0].get("logprobs"):
                n += len(c[0]["logprobs"].get("content") or []) + len(c[0]["logprobs"].get("reasoning_content") or [])
    n_whole = len(whole["logprobs"].get("content") or []) + len(whole["logprobs"].get("reasoning_content") or [])
    print(f"bounded: streamed chat logprobs of a reply in reasoning_content: {n} of "
          f"{n_whole} (reasoning {len(whole['message'].get('reasoning_content') or '')} "
          f"chars, content {len(whole['message'].get('content') or '')} chars)", flush=True)
    prompt = " ".join(f"w{i}" for i in range(900))
    big = {"prompt": prompt, "n": 16, "echo": True, "logprobs": 20, "max_tokens": 16}
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("big", talk(s.port, req("POST", "/v1/completions", big),
                                                                    timeout=300)))
    th.start()
    time.sleep(0.5)
    d, t = talk(s.port, req("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 8}))
    th.join()
    bd, bt = res["big"]
    print(f"bounded: {len(json.dumps(big))}-byte request (n 16, echo, logprobs 20): status {status(bd)}, "
          f"{len(bd)} bytes in {bt:.1f} s; a small request behind it: {t:.1f} s", flush=True)
    res = {}
    big = dict(big, n=6)
    th = threading.Thread(target=lambda: res.setdefault("big", talk(s.port, req("POST", "/v1/completions", big),
                                                                    timeout=300)))
    th.start()
    time.sleep(0.5)
    d, t = talk(s.port, req("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 8}))
    th.join()
    bd, bt = res["big"]
    print(f"bounded: the same with n 6 (within the caps): status {status(bd)}, {len(bd)} bytes in {bt:.1f} s; "
          f"a small request behind it: {t:.1f} s", flush=True)
    res = {}
    big = {"prompt": "Once upon a time", "n": 16, "max_tokens": 600, "ignore_eos": True, "temperature": 1}
    th = threading.Thread(target=lambda: res.setdefault("big", talk(s.port, req("POST", "/v1/completions", big),
                                                                    timeout=300)))
    th.start()
    time.sleep(0.5)
    d, t = talk(s.port, req("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 8}))
    th.join()
    print(f"bounded: a small request behind one of 16 choices x 600 tokens ({res['big'][1]:.1f} s): {t:.1f} s",
          flush=True)
    s.stop()


def memory():
    s = Server(model="models/k3-mini")
    pid = s.pid()
    r0 = rss_mb(pid)
    load = subprocess.Popen(["timeout", "210", K3, "bench", "serve", "--base-url", f"http://127.0.0.1:{s.port}",
                             "--tokenizer", "models/k3-mini", "--random-input-len", "256", "--random-output-len", "32",
                             "--random-range-ratio", "0.9", "--num-prompts", "100000", "--max-concurrency", "16",
                             "--seed", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = []
    t0 = time.time()
    while load.poll() is None:
        time.sleep(30)
        samples.append((round(time.time() - t0), round(rss_mb(pid))))
    m = talk(s.port, req("GET", "/metrics"))[0].decode(errors="replace")
    snap = re.search(r"k3:kda_snapshot_bytes\{[^}]*\} (\S+)", m)
    print(f"memory: k3-mini, 3.5 min of load (16 at once, prompts 26-486 tokens): RSS {r0:.0f} MB at start, "
          f"then {samples} (s, MB); KDA snapshots {float(snap.group(1)) / 2**20 if snap else -1:.0f} MB", flush=True)
    s.stop()


for w in WHICH:
    globals()[w]()
