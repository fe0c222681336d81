"""hosts_pd.py -- the prefill -> decode transfer across network-namespace hosts (bench/hosts.sh makes them).

Runs inside host 1 (the proxy's and the client's host): a prefill instance on host 2, a decode instance
(--no-prefix-cache, so every request moves its whole prompt) on host 3, the proxy on host 1. For each
prompt length it prefills once (the prefill instance keeps its prefix cache, so later requests compute
one block), then for each link shape (tests/hosts/lib.sh's shape on every host's egress) sends --runs
requests and prints the transfer's bytes, seconds and GB/s from the answers' kv_transfer figures
(medians), against the link's rate. With --itl it also streams a long generation on the decode instance
and lands the largest prompt's transfer in the middle of it: the inter-token latency of that stream
before and while the transfer lands (p50, p99, max). With --lock, the prefills hold that lock shared
and each shape's measurements exclusively, with the load and the memory bandwidth state (build/xcore)
printed at the start and the end of each hold.

Usage (inside host 1): python3 bench/hosts_pd.py K3 PREFIX NET --model DIR --tokens 1024,8192,32768
                       [--shapes 'none;10gbit 1ms;1gbit 5ms'] [--runs 3] [--kv-cache c8] [--itl]
                       [--quant MODE] [--threads N] [--lock /tmp/k3-cpu.lock]
"""
import argparse
import fcntl
import json
import os
import re
import select
import signal
import statistics
import subprocess
import threading
import time
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("k3")
ap.add_argument("prefix")
ap.add_argument("net")
ap.add_argument("--model", default="bench/bench-dsa")
ap.add_argument("--tokens", default="1024,8192")
ap.add_argument("--shapes", default="none;10gbit 1ms;1gbit 5ms")
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--kv-cache", default="c8")
ap.add_argument("--itl", action="store_true")
ap.add_argument("--lock", default="")
ap.add_argument("--quant", default="none")
ap.add_argument("--threads", type=int, default=1)
a = ap.parse_args()
BUILD = os.path.dirname(a.k3) or "."
lock_fd = os.open(a.lock, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666) if a.lock else None


def state(what):
    bw = "(build/xcore not built)"
    xcore = os.path.join(BUILD, "xcore")
    if os.access(xcore, os.X_OK):
        last = subprocess.run([xcore, "1", "10"], capture_output=True, text=True).stdout.strip().splitlines()[-1].split()
        bw = "%s / %s GB/s" % (last[0], last[2])
    print("-- %s: load %s; memory bandwidth, 1 / 2 threads: %s" % (
        what, " ".join(open("/proc/loadavg").read().split()[:3]), bw), flush=True)


def hold(how):
    """the CPU lock: LOCK_SH, LOCK_EX or LOCK_UN (nothing without --lock)"""
    if lock_fd is not None:
        fcntl.flock(lock_fd, how)
procs = []


def addr(h):
    return "%s.%d" % (a.net, h)


def start(host, args):
    p = subprocess.Popen(["ip", "netns", "exec", a.prefix + str(host), a.k3] + args, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    procs.append(p)
    buf, deadline = b"", time.time() + 600
    while time.time() < deadline:
        r, _, _ = select.select([p.stderr], [], [], 1.0)
        if r:
            chunk = os.read(p.stderr.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            m = re.search(rb"listening on http://([0-9.]+):(\d+)", buf)
            if m:
                threading.Thread(target=lambda: [None for _ in iter(lambda: os.read(p.stderr.fileno(), 65536), b"")],
                                 daemon=True).start()
                return "http://%s:%s" % (m.group(1).decode(), m.group(2).decode())
        elif p.poll() is not None:
            break
    raise SystemExit("did not start: %s\n%s" % (" ".join(args), buf.decode(errors="replace")[-800:]))


def shape(spec):
    """every host's link: tests/hosts/lib.sh's shape (a tbf, and netem or k3-netdelay for the delay)"""
    for h in (1, 2, 3):
        args = ["off"] if spec == "none" else spec.split()
        subprocess.run(["sh", "-c", '. tests/hosts/lib.sh && shape "$@"', "sh", str(h)] + args, check=True,
                       env=dict(os.environ, HOSTS_PREFIX=a.prefix, HOSTS_NET=a.net,
                                HOSTS_NETDELAY=os.path.join(BUILD, "k3-netdelay")))


def post(url, body, timeout=3600):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


try:
    lens = [int(x) for x in a.tokens.split(",")]
    longest = max(lens)
    common = ["serve", "-m", a.model, "--port", "0", "--threads", str(a.threads), "--mmap", "--kv-cache", a.kv_cache,
              "--quant", a.quant, "--served-model-name", "m", "--max-model-len", str(longest + 4096),
              "--cache-tokens", str(2 * longest + 8192), "--max-num-seqs", "4", "--max-num-batched-tokens", "2048"]
    hold(fcntl.LOCK_SH)
    pre = start(2, common + ["--host", addr(2), "--role", "prefill", "--kv-transfer-host", addr(2),
                             "--kv-transfer-port", "0", "--kv-transfer-timeout", "600"])
    dec = start(3, common + ["--host", addr(3), "--role", "decode", "--no-prefix-cache",
                             "--kv-transfer-timeout", "600"])
    px = start(1, ["serve", "--role", "proxy", "--host", addr(1), "--port", "0", "--prefill", pre, "--decode", dec,
                   "--timeout", "3600"])
    prompts = {n: [(i * 7919 + 11 + n) % 30000 + 100 for i in range(n)] for n in lens}
    for n in lens:
        t0 = time.time()
        post(px, {"model": "m", "prompt": prompts[n], "max_tokens": 1, "temperature": 0})
        print("prefill of %d tokens (and a first transfer): %.1f s" % (n, time.time() - t0), flush=True)
    hold(fcntl.LOCK_UN)
    print("model %s, cache %s, quant %s, %d thread(s) an instance; prefill on host 2, decode on host 3; medians of %d"
          % (a.model, a.kv_cache, a.quant, a.threads, a.runs), flush=True)
    head = "%-12s %7s %12s %9s %8s %8s %12s %s" % ("link", "tokens", "bytes", "s", "GB/s", "Gb/s", "of the link",
                                                   "the link's rate alone")
    for spec in a.shapes.split(";"):
        shape(spec)
        rate = None if spec == "none" else float(spec.split()[0][:-4]) * (1 if spec.split()[0].endswith("gbit") else 1e-3)
        hold(fcntl.LOCK_EX)
        state("exclusive")
        print(head, flush=True)
        for n in lens:
            got = []
            for _ in range(a.runs):
                t = post(px, {"model": "m", "prompt": prompts[n], "max_tokens": 1, "temperature": 0})["kv_transfer"]
                got.append(t)
            sec = statistics.median(x["seconds"] for x in got)
            b = got[0]["bytes"]
            g = b / sec / 1e9
            print("%-12s %7d %12d %9.3f %8.3f %8.2f %12s %s" % (
                spec, n, b, sec, g, g * 8, "%.0f%%" % (100 * g * 8 / rate) if rate else "-",
                "%.3f s" % (b * 8 / (rate * 1e9)) if rate else "-"), flush=True)
        if a.itl:
            # a long stream on the decode instance, and the longest prompt's transfer landing mid-way
            times = []
            mark = {}

            def streamer():
                req = urllib.request.Request(px + "/v1/completions", json.dumps(
                    {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                     "stream": True}).encode(), {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=3600) as r:
                    for raw in r:
                        if raw.startswith(b"data: {"):
                            times.append(time.time())
            th = threading.Thread(target=streamer)
            th.start()
            while len(times) < 60 and th.is_alive():
                time.sleep(0.01)
            mark["t0"] = time.time()
            big = post(px, {"model": "m", "prompt": prompts[longest], "max_tokens": 1, "temperature": 0})["kv_transfer"]
            mark["t1"] = time.time()
            th.join()
            gaps = [(times[i], times[i] - times[i - 1]) for i in range(1, len(times))]
            before = [g for t, g in gaps if t < mark["t0"]]
            during = [g for t, g in gaps if mark["t0"] <= t <= mark["t1"] + 0.5]
            print("ITL on %s while %d tokens' transfer (%.3f s, the request %.3f s) lands: before p50 %.1f ms p99 %.1f"
                  " ms; during p50 %.1f ms p99 %.1f ms max %.1f ms (%d tokens)" % (
                      spec, longest, big["seconds"], mark["t1"] - mark["t0"], 1e3 * pct(before, 0.5),
                      1e3 * pct(before, 0.99), 1e3 * pct(during, 0.5) if during else 0,
                      1e3 * pct(during, 0.99) if during else 0, 1e3 * max(during) if during else 0, len(during)),
                  flush=True)
        state("end")
        hold(fcntl.LOCK_UN)
    shape("none")
finally:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
