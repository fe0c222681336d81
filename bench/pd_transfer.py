"""pd_transfer.py -- the prefill -> decode transfer on one host, by transport: GB/s and a PD request's TTFT.

Usage: python3 bench/pd_transfer.py [--model DIR] [--tokens N[,N...]] [--runs R] [--kv-cache f32|c8]
                                    [--transports tcp,ucx] [--ucx-tls LIST] [--quant MODE] [--k3 build/k3]
                                    [--lock /tmp/k3-cpu.lock]
Starts one prefill instance (k3 serve --role prefill, --kv-transport ucx when any transport asked is
ucx: it serves the stream too), one decode instance per transport (--no-prefix-cache, so each
request moves its whole prompt's cache and KDA state) and a proxy in front of each pair; all --mmap,
--threads 1. Prefills each prompt once (the prefill instance keeps its prefix cache: later requests
compute only the last block), then sends R rounds of each prompt to every transport, alternating the
transport's order each round (paired). Prints each transfer's bytes, seconds, GB/s and transport (each
checked to have gone by the transport asked for; over UCX the share of the time the decode side spent
checking the MACs of what landed), the request's TTFT (a max_tokens 1 request's wall time from the
client: queue + the last block's prefill + the transfer + the first decode step), and per token count
the medians and the paired ratio of the transfer times. --ucx-tls: UCX's transports (default: UCX_TLS,
else sm,self). With --lock the prefills hold that lock shared and the measured rounds exclusively, with
the load and the memory bandwidth state (build/xcore, make xcore) printed at the start and the end of
each hold. Compare with `build/tcpcopy BYTES` (make tcpcopy). stdlib only.
"""
import argparse
import fcntl
import json
import os
import re
import secrets
import select
import signal
import statistics
import subprocess
import time
import urllib.error
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="bench/bench")
ap.add_argument("--tokens", default="4096")
ap.add_argument("--runs", type=int, default=5)
ap.add_argument("--kv-cache", default="f32")
ap.add_argument("--k3", default="build/k3")
ap.add_argument("--transports", "--kv-transport", default="tcp,ucx")
ap.add_argument("--ucx-tls", default=None)
ap.add_argument("--quant", default=None)
ap.add_argument("--lock", default="")
a = ap.parse_args()
procs = []
# the instances and the proxy share a transfer secret
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
                return int(m.group(1)), buf.decode(errors="replace")
        elif p.poll() is not None:
            break
    raise SystemExit("did not start: %s\n%s" % (" ".join(args), buf.decode(errors="replace")[-800:]))


lock_fd = os.open(a.lock, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666) if a.lock else None


def hold(how):
    if lock_fd is not None:
        fcntl.flock(lock_fd, how)


def bw_state(what):
    bw = "(build/xcore not built)"
    xcore = os.path.join(os.path.dirname(a.k3) or ".", "xcore")
    if os.access(xcore, os.X_OK):
        last = subprocess.run([xcore, "1", "10"], capture_output=True, text=True).stdout.strip().splitlines()[-1].split()
        bw = "%s / %s GB/s" % (last[0], last[2])
    print("-- %s: load %s; memory bandwidth, 1 / 2 threads: %s" % (
        what, " ".join(open("/proc/loadavg").read().split()[:3]), bw), flush=True)


def post(port, body, timeout=3600):
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise SystemExit("HTTP %d: %s" % (e.code, e.read()[:400].decode(errors="replace"))) from None


try:
    lens = [int(x) for x in a.tokens.split(",")]
    trs = a.transports.split(",")
    longest = max(lens)
    common = ["serve", "-m", a.model, "--port", "0", "--threads", "1", "--mmap", "--kv-cache", a.kv_cache,
              *(["--quant", a.quant] if a.quant else []), "--served-model-name", "m", "--max-model-len", str(longest + 64),
              "--cache-tokens", str(sum(lens) + longest + 512), "--max-num-seqs", "2", "--max-num-batched-tokens", "1024"]
    ux = ["--kv-transport", "ucx"] + (["--kv-ucx-tls", a.ucx_tls] if a.ucx_tls else [])
    pp, log = start([a.k3] + common + ["--role", "prefill", "--kv-transfer-port", "0"] + (ux if "ucx" in trs else []))
    print("prefill instance: %s" % re.search(r"kv transport [^\n]*", log).group(0), flush=True)
    proxies = {}
    for tr in trs:
        dp, _ = start([a.k3] + common[:-6] + ["--cache-tokens", str(longest + 512), "--max-num-seqs", "2",
                                              "--max-num-batched-tokens", "1024", "--role", "decode",
                                              "--no-prefix-cache"] + (ux if tr == "ucx" else []))
        proxies[tr], _ = start([a.k3, "serve", "--role", "proxy", "--port", "0", "--prefill",
                                "http://127.0.0.1:%d" % pp, "--decode", "http://127.0.0.1:%d" % dp, "--timeout", "3600"])
    info = subprocess.run([a.k3, "info", "-m", a.model, "--no-check-tensors"], capture_output=True, text=True).stdout
    m = re.search(r"cache: (\d+) bytes per token \(fp32\), (\d+) \(c8\); KDA state (\d+) bytes", info)
    bpt = int(m.group(1) if a.kv_cache == "f32" else m.group(2))
    state = int(m.group(3))
    hold(fcntl.LOCK_SH)
    prompts = {n: [(i * 7919 + 11 + n) % 30000 + 100 for i in range(n)] for n in lens}
    for n in lens:
        t0 = time.time()
        post(proxies[trs[0]], {"model": "m", "prompt": prompts[n], "max_tokens": 1, "temperature": 0})
        print("cold prefill of %d tokens (and its transfer): %.1f s" % (n, time.time() - t0), flush=True)
    print("model %s, cache %s; %d rounds, transports alternated" % (a.model, a.kv_cache, a.runs), flush=True)
    summary = []
    for n in lens:
        hold(fcntl.LOCK_EX)
        bw_state("exclusive")
        res = {tr: [] for tr in trs}
        for r in range(a.runs):
            for tr in (trs if r % 2 == 0 else trs[::-1]):
                t0 = time.time()
                ans = post(proxies[tr], {"model": "m", "prompt": prompts[n], "max_tokens": 1, "temperature": 0})
                ttft = time.time() - t0
                t = ans["kv_transfer"]
                assert t["bytes"] == n * bpt + state, (t["bytes"], n * bpt + state)
                assert t["transport"] == tr, "asked %s, moved by %s" % (tr, t["transport"])
                share = t.get("verify_s", 0) / t["seconds"] if t["seconds"] > 0 else 0
                res[tr].append((t["seconds"], t["gbps"], ttft, share))
                print("%6d tokens %s: %d bytes in %.4f s: %.2f GB/s%s; TTFT %.3f s" % (
                    n, tr, t["bytes"], t["seconds"], t["gbps"],
                    " (%.0f%% checking MACs)" % (100 * share) if tr == "ucx" else "", ttft), flush=True)
        line = "%6d tokens, %.1f MB:" % (n, (n * bpt + state) / 1e6)
        for tr in trs:
            xs = res[tr]
            line += " %s %.4f s %.2f GB/s TTFT %.3f s%s;" % (
                tr, statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs),
                statistics.median(x[2] for x in xs),
                " (MACs %.0f%%)" % (100 * statistics.median(x[3] for x in xs)) if tr == "ucx" else "")
        if len(trs) == 2:
            line += " paired %s/%s transfer time %.2fx" % (trs[0], trs[1], statistics.median(
                x[0] / y[0] for x, y in zip(res[trs[0]], res[trs[1]])))
        summary.append(line)
        bw_state("end")
        hold(fcntl.LOCK_SH)
    hold(fcntl.LOCK_UN)
    print("medians:")
    print("\n".join(summary))
finally:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
