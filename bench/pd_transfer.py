"""pd_transfer.py -- the prefill -> decode transfer's throughput against a plain loopback TCP copy.

Usage: python3 bench/pd_transfer.py [--model DIR] [--tokens N] [--runs R] [--kv-cache f32|c8] [--k3 build/k3]
Starts a prefill and a decode instance (k3 serve --role prefill / decode, --mmap, --threads 1) and
the proxy, prefills one N-token prompt (ids), then sends it R more times: the prefill instance
reuses its prefix cache (it computes only the last block), the decode instance has none
(--no-prefix-cache), so each request moves the whole prompt's cache and its KDA state. Prints each
transfer's bytes, seconds and GB/s from the answer's kv_transfer figures, the median, and the
cache bytes per token and KDA state bytes of `k3 info` they add up to. Compare with
`build/tcpcopy BYTES` (make tcpcopy) run at the same time of day. stdlib only.
"""
import argparse
import json
import os
import re
import secrets
import select
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="bench/bench")
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--runs", type=int, default=5)
ap.add_argument("--kv-cache", default="f32")
ap.add_argument("--k3", default="build/k3")
a = ap.parse_args()
procs = []
# the instances and the proxy share a transfer secret (an older build ignores it)
os.environ.setdefault("K3_KV_TRANSFER_SECRET", secrets.token_hex(32))


def start(args):
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    procs.append(p)
    buf, deadline = b"", time.time() + 300
    while time.time() < deadline:
        r, _, _ = select.select([p.stderr], [], [], 1.0)
        if r:
            chunk = os.read(p.stderr.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            m = re.search(rb"listening on http://[^:]+:(\d+)", buf)
            if m:
                return int(m.group(1))
        elif p.poll() is not None:
            break
    raise SystemExit("did not start: %s\n%s" % (" ".join(args), buf.decode(errors="replace")[-800:]))


def post(port, body, timeout=3600):
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


try:
    common = ["serve", "-m", a.model, "--port", "0", "--threads", "1", "--mmap", "--kv-cache", a.kv_cache,
              "--served-model-name", "m", "--max-model-len", str(a.tokens + 64), "--cache-tokens", str(2 * a.tokens + 256),
              "--max-num-seqs", "2", "--max-num-batched-tokens", "1024"]
    pp = start([a.k3] + common + ["--role", "prefill", "--kv-transfer-port", "0"])
    dp = start([a.k3] + common + ["--role", "decode", "--no-prefix-cache"])
    xp = start([a.k3, "serve", "--role", "proxy", "--port", "0", "--prefill", "http://127.0.0.1:%d" % pp,
                "--decode", "http://127.0.0.1:%d" % dp, "--timeout", "3600"])
    ids = [(i * 7919 + 11) % 30000 + 100 for i in range(a.tokens)]
    info = subprocess.run([a.k3, "info", "-m", a.model, "--no-check-tensors"], capture_output=True, text=True).stdout
    m = re.search(r"cache: (\d+) bytes per token \(fp32\), (\d+) \(c8\); KDA state (\d+) bytes", info)
    bpt = int(m.group(1) if a.kv_cache == "f32" else m.group(2))
    state = int(m.group(3))
    t0 = time.time()
    first = post(xp, {"model": "m", "prompt": ids, "max_tokens": 2, "temperature": 0})
    print("prefill of %d tokens (and its transfer): %.1f s" % (a.tokens, time.time() - t0), flush=True)
    rates = []
    for r in range(a.runs):
        ans = post(xp, {"model": "m", "prompt": ids, "max_tokens": 2, "temperature": 0})
        t = ans["kv_transfer"]
        rates.append(t["gbps"])
        print("transfer %d: %d bytes (%d tokens x %d + %d = %d) in %.4f s: %.2f GB/s" %
              (r, t["bytes"], a.tokens, bpt, state, a.tokens * bpt + state, t["seconds"], t["gbps"]), flush=True)
        assert t["bytes"] == a.tokens * bpt + state
    print("median %.2f GB/s over %d transfers of %.1f MB" % (statistics.median(rates), a.runs,
                                                               (a.tokens * bpt + state) / 1e6))
finally:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
