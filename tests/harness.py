"""harness.py -- what every Python test of `k3 serve` shares: the server process,
raw HTTP, /metrics, waiting on a state, and the check/summary lines.

    import harness as h
    suite = h.Suite("serve")                 # lines `ok   serve: NAME (1.2 s)`, `FAIL serve: NAME: ...`
    s = h.Server(h.TINY, "--max-num-seqs", "2")
    suite.check("name", fn)                  # fn raises on failure; suite.skip("name", "why")
    h.wait_until(lambda: ..., 10, "what")    # polls a state (/metrics, /health, a file), never a fixed sleep
    suite.main(run)                          # runs run(), stops every server, prints
                                             # `serve: N passed, N failed, N skipped`, exits 1 on a failure

A server binds 127.0.0.1 on a free port (--port 0, read from its log), dies with
this process (PR_SET_PDEATHSIG), and its stderr is drained into Server.log so it
never blocks on a full pipe.
"""
import base64
import ctypes
import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import struct
import urllib.parse
import zlib

K3 = sys.argv[1] if len(sys.argv) > 1 else "build/k3"
TINY = "tests/models/tiny"
MINI = "models/k3-mini"
VISION = "tests/models/vision-tiny"
IMAGES = "tests/golden/vision/images/"
servers = []


class Resp:
    def __init__(self, status, headers, body):
        self.status_code = status
        self.headers = {k.lower(): v for k, v in headers}
        self.content = body
        self.text = body.decode(errors="replace")

    def json(self):
        return json.loads(self.content)


def raw(method, url, content=None, json_body=None, headers=None, timeout=30):
    """One HTTP request with the standard library (no extra package)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    hd = dict(headers or {})
    if json_body is not None:
        content = json.dumps(json_body).encode()
        hd["Content-Type"] = "application/json"
    try:
        conn.request(method, u.path, body=content, headers=hd)
        r = conn.getresponse()
        return Resp(r.status, r.getheaders(), r.read())
    finally:
        conn.close()


def get(url, **kw):
    return raw("GET", url, **kw)


def post(url, **kw):
    return raw("POST", url, **kw)


def die_with_parent():
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_until(pred, timeout, what, every=0.02):
    """Polls pred() until it is true (returns its value) or timeout seconds pass
    (AssertionError naming what was awaited)."""
    deadline = time.time() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.time() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def metric(m, name, **labels):
    """The value of a labelled series of name in m (parse_metrics), or None."""
    for k, v in m.items():
        if k.startswith(name + "{") and all(f'{a}="{b}"' in k for a, b in labels.items()):
            return v
    return m.get(name) if not labels else None


class Process:
    """A process that says where it listens on its stderr (`listening on http://HOST:PORT`, or
    wait_for's group 1): started, its port read, its stderr drained into log; it dies with this
    process and is stopped by stop_all."""

    def __init__(self, args, wait_for=rb"listening on http://[^:]+:(\d+)", stop_timeout=10, start_timeout=90,
                 expect_start=True):
        self.args = args
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        servers.append(self)
        self.log = []
        self.stop_timeout = stop_timeout
        deadline = time.time() + start_timeout
        port = None
        buf = b""
        while time.time() < deadline and port is None:
            r, _, _ = select.select([self.proc.stderr], [], [], 1.0)
            if not r:
                if self.proc.poll() is not None:
                    break
                continue
            chunk = os.read(self.proc.stderr.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            m = re.search(wait_for, buf)
            if m:
                port = int(m.group(1))
        self.log.append(buf.decode(errors="replace"))
        m = re.search(rb"kv transfer listening on [^ ]*?:(\d+)", buf)  # a prefill instance's transfer port
        self.kv_port = int(m.group(1)) if m else None
        self.port, self.key = port, None
        self.url = f"http://127.0.0.1:{port}" if port else None
        if port is None:
            self.stop()
            if expect_start:  # expect_start=False: a process that must refuse to start, its log kept
                raise RuntimeError(f"did not start: {' '.join(args)}: " + buf.decode(errors="replace")[-600:])
            return
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        while True:
            try:
                chunk = os.read(self.proc.stderr.fileno(), 4096)
            except OSError:
                return
            if not chunk:
                return
            self.log.append(chunk.decode(errors="replace"))

    def text(self):
        return "".join(self.log)

    def client(self, key=None, timeout=60):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or self.key or "none", timeout=timeout,
                             max_retries=0)

    def auth(self):
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def metrics(self):
        return parse_metrics(get(self.url + "/metrics", headers=self.auth(), timeout=10).text)

    def metric(self, name, **labels):
        return metric(self.metrics(), name, **labels)

    def wait_metric(self, name, pred, timeout=30, **labels):
        """Polls /metrics until pred(value) (value 0 when the series is absent)."""
        return wait_until(lambda: pred(self.metric(name, **labels) or 0) and True, timeout,
                          f"{name}{labels or ''} to satisfy the condition")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.kill()


class Server(Process):
    """`k3 serve -m MODEL --port 0 --threads THREADS EXTRA...` on 127.0.0.1."""

    def __init__(self, model, *extra, key=None, threads=1, stop_timeout=10):
        args = [K3, "serve", "-m", model, "--port", "0", "--threads", str(threads), *extra]
        if key:
            args += ["--api-key", key]
        super().__init__(args, stop_timeout=stop_timeout, start_timeout=60)
        self.name = model
        self.key = key


def data_url(path):
    kind = "jpeg" if path.endswith(".jpg") else "png"
    with open(path, "rb") as f:
        return f"data:image/{kind};base64," + base64.b64encode(f.read()).decode()


def png_url(w, h, rgb):
    """A data: URL of a w x h PNG of one colour, made here (no image package)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\0" + bytes(rgb) * w for _ in range(h))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
           chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_msg(urls, text):
    """One user turn of images then text: what `k3 run --image ... --chat` encodes."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls] +
             [{"type": "text", "text": text}]}]


def expect_status(fn, status):
    """fn raises the openai client's APIStatusError with status and an OpenAI-shaped body."""
    import openai
    try:
        fn()
    except openai.APIStatusError as e:
        assert e.status_code == status, f"status {e.status_code}, wanted {status}: {e}"
        body = e.response.json()
        assert "error" in body and "message" in body["error"], body
        return e
    raise AssertionError(f"no error, wanted HTTP {status}")


def stop_all():
    for sv in list(servers):
        try:
            sv.stop()
        except Exception:  # noqa: BLE001
            pass


class Skip(Exception):
    """Raised by a check that cannot run here: counted as skipped with its reason."""


class Suite:
    def __init__(self, prefix, only=None):
        self.prefix = prefix
        self.only = only
        self.passed = self.failed = self.skipped = 0

    def check(self, name, fn):
        if self.only and self.only not in name:
            return
        t0 = time.time()
        try:
            fn()
            self.passed += 1
            print(f"ok   {self.prefix}: {name} ({time.time() - t0:.1f} s)", flush=True)
        except Skip as e:
            self.skip(name, str(e))
        except Exception as e:  # noqa: BLE001 -- every failure is reported, none stops the run
            self.failed += 1
            print(f"FAIL {self.prefix}: {name}: {type(e).__name__}: {e}", flush=True)
            for line in traceback.format_exc().splitlines()[-6:]:
                print("    " + line, flush=True)

    def skip(self, name, why):
        self.skipped += 1
        print(f"skip {self.prefix}: {name}: {why}", flush=True)

    def fail(self, name, why):
        self.failed += 1
        print(f"FAIL {self.prefix}: {name}: {why}", flush=True)

    def summary(self):
        return f"{self.prefix}: {self.passed} passed, {self.failed} failed, {self.skipped} skipped"

    def main(self, run, cleanup=None):
        """Runs run(), always stops every server (cleanup, default stop_all), prints the
        summary line, exits."""
        cleanup = cleanup or stop_all

        def on_term(*_):
            cleanup()
            sys.exit(1)
        signal.signal(signal.SIGTERM, on_term)
        try:
            run()
        except Exception as e:  # noqa: BLE001
            self.failed += 1
            print(f"FAIL {self.prefix}: the run: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        finally:
            cleanup()
        print(self.summary(), flush=True)
        sys.exit(1 if self.failed else 0)
