#!/usr/bin/env python3
"""pd_as_serve.py -- a prefill instance, a decode instance and the proxy in front of them, started
as if they were one `k3 serve`, so a suite written for the server runs against the proxy unchanged.

Usage: tests/pd_as_serve.py serve -m MODEL [k3 serve options]   (in place of `build/k3`)
The k3 binary is $K3_BIN (default build/k3). HTTP options (--port, --host, --api-key, CORS, the
deadlines and caps, --max-body-bytes, --metrics-require-key) go to the proxy;
the engine's (--threads, --max-num-seqs, ...) to both instances, the test hooks (--test-fail-*) to
the decode instance, which generates; --api-key and --shutdown-timeout to all three. Only the proxy's log lines are
printed as they are (so its "listening on" line is the one a harness reads); the instances' lines
after their start come with a "[prefill] " / "[decode] " prefix. A signal goes to the proxy; when
it exits, the instances are stopped and this exits with its status. An instance that exits on its
own with an error stops the proxy, and this exits with the instance's status. Every process dies
with this one. The instances share a transfer secret (K3_KV_TRANSFER_SECRET, made here when unset).
stdlib only.
"""
import ctypes
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import threading
import time

K3 = os.environ.get("K3_BIN", "build/k3")
PROXY_OPTS = {"--port", "--host", "--api-key", "--allowed-origins", "--allowed-methods", "--allowed-headers",
              "--header-timeout", "--body-timeout", "--timeout", "--max-connections", "--max-connections-per-ip",
              "--max-body-bytes"}
PROXY_FLAGS = {"--metrics-require-key"}
DECODE_ONLY = {"--test-fail-step", "--test-fail-request"}


def die_with_parent():
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.setpgid(0, 0)  # a signal to this process's group is not the proxy's


def start(args, wait=60):
    """A process and its port, read from its "listening on" line (not echoed)."""
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         preexec_fn=die_with_parent)
    buf, deadline = b"", time.time() + wait
    while time.time() < deadline:
        r, _, _ = select.select([p.stderr], [], [], 1.0)
        if r:
            chunk = os.read(p.stderr.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            m = re.search(rb"listening on http://[^:]+:(\d+)", buf)
            if m:
                return p, int(m.group(1)), buf
        elif p.poll() is not None:
            break
    sys.stderr.write(buf.decode(errors="replace"))
    p.kill()
    return None, None, buf


def relay(p, prefix):
    while True:
        try:
            chunk = os.read(p.stderr.fileno(), 4096)
        except OSError:
            return
        if not chunk:
            return
        text = chunk.decode(errors="replace")
        if prefix:
            text = "".join(prefix + ln for ln in text.splitlines(True))
        sys.stderr.write(text)
        sys.stderr.flush()


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    model, proxy, both, dec_only = "models/k3-mini", [], [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        v = argv[i + 1] if i + 1 < len(argv) else None
        if a == "-m":
            model = v
            i += 2
        elif a in ("--api-key", "--shutdown-timeout"):  # the instances drain within the same grace
            proxy += [a, v]
            both += [a, v]
            i += 2
        elif a in PROXY_OPTS:
            proxy += [a, v]
            i += 2
        elif a in PROXY_FLAGS:
            proxy.append(a)
            i += 1
        elif a in DECODE_ONLY:
            dec_only += [a, v]
            i += 2
        elif a.startswith("--") and v is not None and not v.startswith("--"):
            both += [a, v]
            i += 2
        else:
            both.append(a)
            i += 1
    os.environ.setdefault("K3_KV_TRANSFER_SECRET", secrets.token_hex(32))
    common = [K3, "serve", "-m", model, "--port", "0"] + both
    pre, pport, _ = start(common + ["--role", "prefill", "--kv-transfer-port", "0"])
    if not pre:
        return 1
    dec, dport, _ = start(common + ["--role", "decode"] + dec_only)
    if not dec:
        pre.kill()
        return 1
    px = subprocess.Popen([K3, "serve", "--role", "proxy", "--prefill", "http://127.0.0.1:%d" % pport, "--decode",
                           "http://127.0.0.1:%d" % dport] + proxy, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    signal.signal(signal.SIGTERM, lambda *_: px.poll() is None and px.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: px.poll() is None and px.send_signal(signal.SIGINT))
    for p, prefix in ((px, ""), (pre, "[prefill] "), (dec, "[decode] ")):
        threading.Thread(target=relay, args=(p, prefix), daemon=True).start()
    rc = None
    while rc is None:
        time.sleep(0.05)
        if px.poll() is not None:
            rc = px.returncode
        for b in (pre, dec):
            if rc is None and b.poll() is not None and b.returncode != 0:
                rc = b.returncode
                if px.poll() is None:
                    px.send_signal(signal.SIGTERM)
                    try:
                        px.wait(15)
                    except subprocess.TimeoutExpired:
                        px.kill()
    for b in (pre, dec):
        if b.poll() is None:
            b.send_signal(signal.SIGTERM)
    for b in (pre, dec):
        try:
            b.wait(15)
        except subprocess.TimeoutExpired:
            b.kill()
    time.sleep(0.1)  # the relays' last lines
    return rc


if __name__ == "__main__":
    sys.exit(main())
