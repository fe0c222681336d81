"""pd_bench_serve.py -- k3 bench serve against 1P1D (behind the proxy) or one colocated k3 serve,
with a mixed workload: short prompts decoding while long ones arrive.

Usage: python3 bench/pd_bench_serve.py pd|colo '[[CONCURRENCY, PROMPTS, LONG_LEN], ...]'
       [--model DIR] [--k3 build/k3]
pd: a prefill instance pinned to CPU 0 and a decode instance pinned to CPU 1 (--threads 1 each,
taskset), and the proxy; colo: one k3 serve with --threads 2. Both --mmap, 16 sequences, chunks of
256 tokens. For each setting: PROMPTS requests of 32 prompt tokens and 32 output tokens
(--ignore-eos), a quarter of them LONG_LEN tokens instead (--long-input-len, --long-fraction
0.25), at most CONCURRENCY at once, a seed of their own (no prefix-cache hits across settings).
Prints one JSON line per setting: TTFT, TPOT, ITL and the short requests' ITL (mean, p99). stdlib
only. Run under flock -x /tmp/k3-cpu.lock on the shared machine.
"""
import argparse
import json
import os
import re
import select
import signal
import subprocess
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["pd", "colo"])
ap.add_argument("settings")
ap.add_argument("--model", default="bench/bench")
ap.add_argument("--k3", default="build/k3")
a = ap.parse_args()
K3, MODEL = a.k3, a.model
procs = []


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
                threading.Thread(target=lambda: [os.read(p.stderr.fileno(), 65536) for _ in iter(int, 1)],
                                 daemon=True).start()
                return int(m.group(1))
        elif p.poll() is not None:
            break
    raise SystemExit("did not start: %s\n%s" % (" ".join(args), buf.decode(errors="replace")[-800:]))


common = ["serve", "-m", MODEL, "--port", "0", "--mmap", "--served-model-name", "m", "--max-model-len", "4096",
          "--cache-tokens", "40000", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"]
try:
    if a.mode == "colo":
        port = start([K3] + common + ["--threads", "2"])
    else:
        pp = start(["taskset", "-c", "0", K3] + common + ["--threads", "1", "--role", "prefill", "--kv-transfer-port", "0"])
        dp = start(["taskset", "-c", "1", K3] + common + ["--threads", "1", "--role", "decode"])
        port = start([K3, "serve", "--role", "proxy", "--port", "0", "--prefill", "http://127.0.0.1:%d" % pp,
                      "--decode", "http://127.0.0.1:%d" % dp, "--timeout", "600"])
    for conc, n, L in json.loads(a.settings):
        args = [K3, "bench", "serve", "--base-url", "http://127.0.0.1:%d" % port, "--model", "m", "--tokenizer", MODEL,
                "--random-input-len", "32", "--random-output-len", "32", "--ignore-eos", "--num-prompts", str(n),
                "--max-concurrency", str(conc), "--seed", str(conc * 10007 + L + 1), "--json"]
        if L:
            args += ["--long-input-len", str(L), "--long-fraction", "0.25"]
        t0 = time.time()
        r = subprocess.run(args, capture_output=True, text=True)
        try:
            j = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            print("FAILED", " ".join(args), r.stdout[-500:], r.stderr[-500:], flush=True)
            continue
        keys = ["completed", "failed", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                "p99_itl_ms", "p99_itl_short_ms", "median_itl_short_ms", "long_requests"]
        print(json.dumps({"mode": a.mode, "conc": conc, "n": n, "long": L, "wall_s": round(time.time() - t0, 1),
                          **{k: (round(j[k], 2) if isinstance(j.get(k), float) else j.get(k)) for k in keys}}),
              flush=True)
finally:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
