"""serve_replay.py -- serving the agent replay with and without speculative decoding (docs/spec.md).

Usage: python3 bench/serve_replay.py K3 --model DIR --prompts P.jsonl [--conc 1,4,16] [--num-prompts 40]
         [--output-len 48] [--threads 2] [--configs off,suffix] [--out FILE.jsonl] [-- SERVER ARGS...]

For each concurrency, and for each config in turn (off, then suffix: alternated), starts `K3 serve -m DIR
--threads T [--speculative suffix]` on a free loopback port, waits for /health, runs `K3 bench serve
--dataset-name custom --dataset-path P.jsonl --num-prompts N --max-concurrency C --random-output-len O
--ignore-eos --json` against it, reads the engine's phase counters from /metrics before and after, and
stops it. Prints one line a run (output tok/s, acceptance length, median TTFT and ITL, and where a step's
time went: ms a step by phase) and, for each concurrency, the ratio suffix / off. Appends every run as a
JSON line to --out when given (for medians over rounds: --summary FILE.jsonl prints them).
Run one round under `flock -x /tmp/k3-cpu.lock` (it is the timing): a round of three concurrencies on
k3-mini takes about two minutes.
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

PHASES = ["begin", "propose", "schedule", "setup", "pass", "sample", "verify", "finish", "outside"]


def arg(name, default):
    a = sys.argv
    return a[a.index(name) + 1] if name in a else default


def metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, val = line.rpartition(" ")
        if name.startswith("k3:engine_phase_seconds_total"):
            ph = name.split('phase="')[1].split('"')[0]
            out["phase_" + ph] = float(val)
        elif name.startswith("k3:engine_steps_total") or name.startswith("k3:engine_spec_steps_total") or \
                name.startswith("k3:spec_decode_propose_seconds_total") or \
                name.startswith("k3:spec_decode_accept_seconds_total"):
            out[name.split("{")[0]] = float(val)
    return out


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def serve(k3, model, threads, extra, spec):
    port = free_port()
    cmd = [k3, "serve", "-m", model, "--threads", str(threads), "--port", str(port), *extra]
    if spec != "off":
        cmd += ["--speculative", spec]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while True:
        if p.poll() is not None:
            raise SystemExit("serve_replay: the server exited (%s)" % " ".join(cmd))
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=2) as r:
                if r.status == 200:
                    return p, port
        except OSError:
            pass
        if time.time() - t0 > 120:
            p.kill()
            raise SystemExit("serve_replay: no /health after 120 s")
        time.sleep(0.1)


def run(k3, model, prompts, conc, num, olen, threads, extra, spec):
    p, port = serve(k3, model, threads, extra, spec)
    try:
        m0 = metrics(port)
        out = subprocess.run([k3, "bench", "serve", "--base-url", "http://127.0.0.1:%d" % port, "--dataset-name",
                              "custom", "--dataset-path", prompts, "--num-prompts", str(num), "--max-concurrency",
                              str(conc), "--random-output-len", str(olen), "--ignore-eos", "--json"],
                             capture_output=True, text=True, check=True).stdout
        m1 = metrics(port)
    finally:
        p.terminate()
        p.wait()
    j = json.loads(out.strip().splitlines()[-1])
    steps = m1.get("k3:engine_steps_total", 0) - m0.get("k3:engine_steps_total", 0)
    j["steps"] = steps
    j["spec_steps"] = m1.get("k3:engine_spec_steps_total", 0) - m0.get("k3:engine_spec_steps_total", 0)
    for ph in PHASES:
        k = "phase_" + ph
        j[k + "_ms_per_step"] = 1e3 * (m1.get(k, 0) - m0.get(k, 0)) / steps if steps else 0
    j.update({"config": spec, "conc": conc, "model": model})
    return j


def line(j):
    ph = " ".join("%s %.3f" % (x, j["phase_%s_ms_per_step" % x]) for x in PHASES)
    return ("%-7s c%-3d %8.1f tok/s  acc %4.2f  ttft %7.1f ms  itl %6.2f ms  steps %6d (spec %6d)  ms/step: %s" %
            (j["config"], j["conc"], j["output_throughput"], j.get("spec_decode_acceptance_length", 1.0),
             j["median_ttft_ms"], j["median_itl_ms"], j["steps"], j["spec_steps"], ph))


def summary(path):
    runs = [json.loads(x) for x in open(path) if x.strip()]
    for model in sorted({r["model"] for r in runs}):
        for conc in sorted({r["conc"] for r in runs if r["model"] == model}):
            by = {}
            for r in runs:
                if r["model"] == model and r["conc"] == conc:
                    by.setdefault(r["config"], []).append(r)
            med = {c: {k: statistics.median(x[k] for x in v)
                       for k in ["output_throughput", "median_ttft_ms", "median_itl_ms"]} for c, v in by.items()}
            acc = {c: statistics.median(x.get("spec_decode_acceptance_length", 1.0) for x in v) for c, v in by.items()}
            s = "%s c%d:" % (model, conc)
            for c in by:
                s += "  %s %.1f tok/s (n %d, acc %.2f, ttft %.1f, itl %.2f)" % (
                    c, med[c]["output_throughput"], len(by[c]), acc[c], med[c]["median_ttft_ms"],
                    med[c]["median_itl_ms"])
            if "off" in med and len(med) > 1:
                for c in med:
                    if c != "off":
                        s += "  %s/off %.3fx" % (c, med[c]["output_throughput"] / med["off"]["output_throughput"])
                        pairs = [b["output_throughput"] / a["output_throughput"] for a, b in zip(by["off"], by[c])]
                        s += " (rounds %s)" % " ".join("%.2f" % x for x in pairs)
            print(s)


def main():
    if "--summary" in sys.argv:
        summary(arg("--summary", None))
        return
    k3 = sys.argv[1]
    extra = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    model = arg("--model", "models/k3-mini")
    prompts = arg("--prompts", None)
    if not prompts or not os.path.exists(prompts):
        raise SystemExit("serve_replay: --prompts FILE (bench/make_replay.py --prompts FILE makes it)")
    concs = [int(x) for x in arg("--conc", "1,4,16").split(",")]
    configs = arg("--configs", "off,suffix").split(",")
    num, olen, threads = int(arg("--num-prompts", "40")), int(arg("--output-len", "48")), int(arg("--threads", "2"))
    out = arg("--out", None)
    for conc in concs:
        res = {}
        for spec in configs:
            j = run(k3, model, prompts, conc, num, olen, threads, extra, spec)
            res[spec] = j
            print(line(j), flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(j) + "\n")
        if "off" in res:
            for c, j in res.items():
                if c != "off":
                    print("c%d %s/off %.3fx" % (conc, c, j["output_throughput"] / res["off"]["output_throughput"]),
                          flush=True)


if __name__ == "__main__":
    main()
