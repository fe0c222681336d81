"""kv_bench.py -- the prefix cache's figures through k3 serve (docs/kvstore.md); bench/kvstore.sh runs it.

  python bench/kv_bench.py K3 ttft MODEL TOKENS RUNS DIR
      TTFT of a TOKENS-token prompt: cold (a fresh server, an empty --kv-cache-dir), a RAM hit (the
      same prompt again), a disk hit after a restart (the directory's pages dropped from the page
      cache first: fsync + POSIX_FADV_DONTNEED), and the directory's raw sequential read speed (a
      file of the cache's size, written, dropped, read with 1 MiB reads) beside the load's own rate
      (vllm:kv_offload_load_bytes_total / _time_total). Medians of RUNS.
  python bench/kv_bench.py K3 itl MODEL TOKENS RUNS DIR [CYCLES]
      decode ITL of two streaming requests in the windows where a (TOKENS+1)-token prompt loads from
      the disk tier (a restarted server) while another one's blocks and state are saved (CYCLES
      times, 6), against the same traffic on a server without the tier where the prompt is a RAM
      hit: p50 / p99 of the gaps that start in the windows, and of the gaps after them. Medians of
      RUNS pairs, alternated.
  python bench/kv_bench.py K3 replay MODEL CONVS TURNS POLICY SEED [SYS_WORDS TOOL_WORDS]
      an agent replay over two instances of MODEL behind `k3 serve --role router --policy POLICY`:
      CONVS conversations of TURNS turns (a system prompt of SYS_WORDS words (600), each turn adds a
      reply and a tool output of TOOL_WORDS words (120)), each round's turns in a shuffled order (SEED); prints the
      prefix cache hit rate summed over the instances and TTFT p50 / p99 (streamed first token).
"""
import json
import os
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import harness as h  # noqa: E402

K3 = sys.argv[1]
h.K3 = K3


def total(proc, name):
    return sum(v for k, v in proc.metrics().items() if k == name or k.startswith(name + "{"))


def drop_pages(d):
    n = 0
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return n


def raw_read(d, size):
    """GB/s of a sequential 1 MiB-read of a fresh size-byte file in d, its pages dropped"""
    p = os.path.join(d, "raw.bin")
    with open(p, "wb") as f:
        for _ in range(max(1, size >> 20)):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    n = 0
    with open(p, "rb", buffering=0) as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            n += len(b)
    dt = time.perf_counter() - t0
    os.unlink(p)
    return n / dt / 1e9


def serve(model, d, threads=2, buffered=None):
    """buffered: True (the page cache), "writes" (saves through it, loads O_DIRECT), False (O_DIRECT
    where the directory does it); None: KV_IO=buffered|writes|direct (default direct)"""
    if buffered is None:
        buffered = {"buffered": True, "writes": "writes"}.get(os.environ.get("KV_IO", ""), False)
    io = ["--kv-cache-buffered-writes"] if buffered == "writes" else ["--kv-cache-buffered"] if buffered else []
    disk = (["--kv-cache-dir", d] + io) if d else []
    return h.Process([K3, "serve", "-m", model, "--port", "0", "--threads", str(threads)] + disk, start_timeout=300, stop_timeout=120)


def cpu_ticks():
    """the machine's CPU ticks so far: user, system, iowait, steal (/proc/stat)"""
    f = open("/proc/stat").readline().split()[1:]
    return [int(f[0]) + int(f[1]), int(f[2]) + int(f[5]) + int(f[6]), int(f[4]), int(f[7])]


def io_threads_cpu(pid):
    """user and system CPU seconds of the disk tier's reader and writer threads (named k3-kvs-read,
    k3-kvs-write) so far, from /proc/PID/task/*/stat"""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            st = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        if name.startswith("k3-kvs-"):
            f = st[st.rindex(")") + 2:].split()
            out.append(f"{name} user {int(f[11]) / tick:.2f} s system {int(f[12]) / tick:.2f} s")
    return ", ".join(out) or "no k3-kvs- threads"


def timed(s, model, ids):
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = h.post(s.url + "/v1/completions", json_body=body, timeout=1800)
    dt = time.perf_counter() - t0
    assert r.status_code == 200, r.text[:300]
    return dt, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def ttft(model, tokens, runs, d):
    import shutil
    cold, ram, disk, rate, raw, fr = [], [], [], [], [], []
    name = None
    for run in range(runs):
        cd = os.path.join(d, f"cache{run}")
        shutil.rmtree(cd, ignore_errors=True)
        rnd = random.Random(1000 + run)
        vocab = json.load(open(os.path.join(model, "config.json")))
        vocab = vocab.get("text_config", vocab)["vocab_size"]
        ids = [rnd.randrange(16, vocab - 256) for _ in range(tokens)]
        s = serve(model, cd)
        name = name or h.get(s.url + "/v1/models").json()["data"][0]["id"]
        t, c = timed(s, name, ids)
        cold.append(t)
        t, cr = timed(s, name, ids)
        ram.append(t)
        assert cr > 0, "no RAM hit"
        # the saves land behind the engine; a stop finishes those queued
        s.stop()
        size = drop_pages(cd)
        s = serve(model, cd)
        t, c = timed(s, name, ids)
        disk.append(t)
        assert c > 0, "no disk hit"
        lb, lt = total(s, "vllm:kv_offload_load_bytes_total"), total(s, "vllm:kv_offload_load_time_total")
        rate.append(lb / lt / 1e9 if lt else 0)
        s.stop()
        raw.append(raw_read(d, size))
        fr.append(rate[-1] / raw[-1])
        print(f"run {run}: cold {cold[-1]:.3f} s, RAM hit {ram[-1]:.3f} s, disk hit {disk[-1]:.3f} s "
              f"(cached {cr} in RAM, {c} from disk, {size / 1e6:.1f} MB on disk, loaded {lb / 1e6:.1f} MB at {rate[-1]:.2f} GB/s; "
              f"raw read {raw[-1]:.2f} GB/s)", flush=True)
        shutil.rmtree(cd, ignore_errors=True)
    med = statistics.median
    print(f"ttft {model} {tokens} tokens, medians of {runs}: cold {med(cold):.3f} s, RAM hit {med(ram):.3f} s "
          f"({med(cold) / med(ram):.1f}x), disk hit after a restart {med(disk):.3f} s ({med(cold) / med(disk):.1f}x "
          f"faster than cold); the load read at {med(rate):.2f} GB/s against the directory's raw sequential read "
          f"{med(raw):.2f} GB/s ({100 * med(fr):.0f}%)")


def load(model, tokens, runs, d):
    """a TOKENS-token prompt computed once (its blocks and state saved), then RUNS times each: a
    restarted server loads it from disk with O_DIRECT and through the page cache (alternated, the
    directory's pages dropped before each), the load's rate against the directory's raw sequential
    read measured right after it"""
    import shutil
    cd = os.path.join(d, "load")
    shutil.rmtree(cd, ignore_errors=True)
    rnd = random.Random(2000)
    vocab = json.load(open(os.path.join(model, "config.json")))
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    ids = [rnd.randrange(16, vocab - 256) for _ in range(tokens)]
    s = serve(model, cd)
    name = h.get(s.url + "/v1/models").json()["data"][0]["id"]
    timed(s, name, ids)
    s.stop()
    res = {"direct": [], "buffered": []}
    for run in range(runs):
        for mode in res:
            size = drop_pages(cd)
            s = serve(model, cd, buffered=mode == "buffered")
            t, c = timed(s, name, ids)
            lb, lt = total(s, "vllm:kv_offload_load_bytes_total"), total(s, "vllm:kv_offload_load_time_total")
            direct = total(s, "k3:kv_disk_direct_io")
            cpu = io_threads_cpu(s.proc.pid)
            s.stop()
            raw = raw_read(d, size)
            rate = lb / lt / 1e9 if lt else 0
            res[mode].append((t, rate, raw, rate / raw))
            print(f"run {run} {mode} ({'direct' if direct else 'buffered'} I/O): TTFT {t:.3f} s, {c} tokens from disk, "
                  f"loaded {lb / 1e6:.1f} MB at {rate:.2f} GB/s, raw read {raw:.2f} GB/s ({100 * rate / raw:.0f}%); {cpu}",
                  flush=True)
    shutil.rmtree(cd, ignore_errors=True)
    med = statistics.median
    for mode, v in res.items():
        print(f"load {model} {tokens} tokens, {mode}, medians of {runs}: TTFT {med(x[0] for x in v):.3f} s, the load "
              f"{med(x[1] for x in v):.2f} GB/s, raw read {med(x[2] for x in v):.2f} GB/s, "
              f"{100 * med(x[3] for x in v):.0f}% of it")


def replay(model, convs, turns, policy, seed, sys_words=600, tool_words=120):
    insts = [h.Process([K3, "serve", "-m", model, "--port", "0", "--threads", "1"], start_timeout=300)
             for _ in range(2)]
    r = h.Process([K3, "serve", "--role", "router", "--port", "0", "--policy", policy] +
                  [a for s in insts for a in ("--backend", s.url)], start_timeout=30)
    h.wait_until(lambda: h.get(r.url + "/health").status_code == 200, 30, "the router")
    name = h.get(insts[0].url + "/v1/models").json()["data"][0]["id"]
    rnd = random.Random(seed)

    def words(k, n):
        w = random.Random(k)
        return " ".join(w.choice(["alpha", "build", "check", "delta", "error", "fix", "graph", "heap", "index",
                                  "join", "kernel", "list", "merge", "node", "open", "patch", "query", "run"]) +
                        str(w.randrange(100)) for _ in range(n))
    hist = {c: [{"role": "system", "content": "You are a coding agent. Tools: shell, edit. " + words(c, sys_words)},
                {"role": "user", "content": "Task: " + words(10_000 + c, 60)}] for c in range(convs)}
    ttfts = []
    q0 = sum(total(s, "vllm:prefix_cache_queries_total") for s in insts)
    h0 = sum(total(s, "vllm:prefix_cache_hits_total") for s in insts)
    for t in range(turns):
        order = list(range(convs))
        rnd.shuffle(order)
        for c in order:
            body = {"model": name, "messages": hist[c], "max_tokens": 8, "temperature": 0, "stream": True}
            import http.client
            conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=600)
            t0 = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, (resp.status, resp.read()[:300])
            first = None
            text = ""
            for line in resp:
                if line.startswith(b"data: ") and b"[DONE]" not in line:
                    d = json.loads(line[6:])
                    ch = d.get("choices") or []
                    if ch and (ch[0].get("delta", {}).get("content") or ch[0].get("delta", {}).get("reasoning_content")):
                        if first is None:
                            first = time.perf_counter() - t0
                        text += ch[0]["delta"].get("content") or ""
            conn.close()
            ttfts.append(first if first is not None else time.perf_counter() - t0)
            hist[c] += [{"role": "assistant", "content": text or words(20_000 + c * 100 + t, 8)},
                        {"role": "user", "content": "Tool output: " + words(30_000 + c * 100 + t, tool_words)}]
    q = sum(total(s, "vllm:prefix_cache_queries_total") for s in insts) - q0
    hh = sum(total(s, "vllm:prefix_cache_hits_total") for s in insts) - h0
    ttfts.sort()
    p = lambda f: ttfts[min(len(ttfts) - 1, int(f * len(ttfts)))]  # noqa: E731
    m = r.metrics()
    print(f"replay {model} {convs} conversations x {turns} turns, policy {policy}: prefix cache hit rate "
          f"{100 * hh / q:.1f}% ({hh:.0f} of {q:.0f} prompt tokens), TTFT p50 {p(0.5):.3f} s p99 {p(0.99):.3f} s, "
          f"routed {[int(h.metric(m, 'k3:router_backend_routed_total', url=s.url)) for s in insts]}", flush=True)
    h.stop_all()


def itl(model, tokens, runs, d, cycles=6):
    """decode ITL of two streams in the windows where a prompt loads from the disk tier and another
    one's blocks and state are saved, against the same traffic without the tier (the prompt a RAM
    hit). Each cycle: a new prompt Q computed (outside the window: its prefill stalls every stream
    in both modes alike), then at once a prompt P sent (a disk load / a RAM hit at its end, one
    token computed) while Q's save runs; the window ends when P is answered and no save is in
    flight."""
    import http.client
    import threading
    vocab = json.load(open(os.path.join(model, "config.json")))
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    rnd = random.Random(77)
    ids = lambda n: [rnd.randrange(16, vocab - 256) for _ in range(n)]  # noqa: E731
    Ps = [ids(tokens + 1) for _ in range(cycles)]  # a block boundary right before the last token
    cd = os.path.join(d, f"itl{os.getpid()}")  # a new directory: only the Ps are on disk
    s = serve(model, cd)
    name = h.get(s.url + "/v1/models").json()["data"][0]["id"]
    for P in Ps:
        timed(s, name, P)
    s.stop()  # its saves finish: every P is on disk

    def stream(port, prompt, stamps, stop):
        body = {"model": name, "prompt": prompt, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                stamps.append(time.perf_counter())
            if stop.is_set():
                break
        conn.close()  # the server cancels it

    modes = os.environ.get("ITL_MODES", "disk ram").split()  # disk (O_DIRECT where it can), buffered, writes, ram
    res = {m: [] for m in modes}
    med = statistics.median
    q = lambda v, f: v[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
    for run in range(runs):
        # rotated by the run (ROTATE=N: by N more): the first server after the setup meets the
        # directory just written (its first windows ran slower in every mode put first)
        k = (run + int(os.environ.get("ROTATE", "0"))) % len(modes)
        for mode in modes[k:] + modes[:k]:
            if mode != "ram":  # disk (O_DIRECT), buffered, writes (buffered saves, O_DIRECT loads)
                drop_pages(cd)
                s = serve(model, cd, buffered={"buffered": True, "writes": "writes"}.get(mode, False))
            else:
                s = serve(model, None)
                for P in Ps:
                    timed(s, name, P)  # in the RAM prefix cache
            stamps, stop = [[], []], threading.Event()
            th = [threading.Thread(target=stream, args=(s.port, ids(64), stamps[k], stop)) for k in range(2)]
            for t in th:
                t.start()
            h.wait_until(lambda: min(len(x) for x in stamps) >= 10, 600, "the decoders")
            win, hits, ticks = [], [], [0, 0, 0, 0]
            for P in Ps:
                timed(s, name, ids(tokens + 1))  # Q: computed; with the tier its save starts as it ends
                t0 = time.perf_counter()
                c0 = cpu_ticks()
                _, c = timed(s, name, P)
                hits.append(c)
                if mode != "ram":
                    h.wait_until(lambda: total(s, "k3:kv_disk_saves_in_flight") == 0, 600, "the saves", every=0.002)
                w1 = time.perf_counter()
                ticks = [a + b - c for a, b, c in zip(ticks, cpu_ticks(), c0)]
                win.append((t0, w1))
                # the gaps that start in the window end before the next prompt's prefill
                h.wait_until(lambda: all(x[-1] > w1 for x in stamps), 60, "a token after the window", every=0.002)
            t_last = time.perf_counter()
            h.wait_until(lambda: all(x[-1] > t_last for x in stamps), 600, "a token after the last window")
            stop.set()
            for t in th:
                t.join()
            loaded = total(s, "vllm:kv_offload_load_bytes_total")
            assert (loaded > 0) == (mode != "ram"), (mode, loaded)
            cpu = io_threads_cpu(s.proc.pid) if mode != "ram" else ""
            direct = total(s, "k3:kv_disk_direct_io") if mode != "ram" else 0
            tier = f" ({'direct' if direct else 'buffered'} I/O; {cpu})" if mode != "ram" else ""
            assert all(c == tokens for c in hits), (mode, hits)
            gaps = sorted(b - a for x in stamps for a, b in zip(x, x[1:]) if any(w0 <= a <= w1 for w0, w1 in win))
            quiet = sorted(b - a for x in stamps for a, b in zip(x, x[1:]) if b > t_last)
            res[mode].append((q(gaps, 0.5), q(gaps, 0.99), len(gaps), q(quiet, 0.5), q(quiet, 0.99)))
            print(f"run {run} {mode}: ITL of the gaps that start in the {cycles} windows: p50 {1e3 * q(gaps, 0.5):.1f} ms "
                  f"p99 {1e3 * q(gaps, 0.99):.1f} ms ({len(gaps)} gaps, windows {1e3 * med(w1 - w0 for w0, w1 in win):.0f} ms "
                  f"median); after the last: p50 {1e3 * q(quiet, 0.5):.1f} ms p99 {1e3 * q(quiet, 0.99):.1f} ms"
                  f"{f'; loaded {loaded / 1e6:.1f} MB' if loaded else ''}"
                  f"{tier}; the machine in the windows: user {ticks[0]}, system {ticks[1]}, iowait {ticks[2]}, "
                  f"steal {ticks[3]} ticks of {os.sysconf('SC_CLK_TCK')} a second", flush=True)
            s.stop()
            if mode != "ram":  # the disk connector's calls in the step over 1 ms (the server's log)
                took = {}
                for line in "".join(s.log).splitlines():
                    m = re.search(r"the step's (.*) took ([0-9.]+) ms", line)
                    if m:
                        took.setdefault(m.group(1), []).append(float(m.group(2)))
                for k, v in sorted(took.items()):
                    print(f"  the step's {k}: {len(v)} over 1 ms, max {max(v):.1f} ms, sum {sum(v):.1f} ms", flush=True)
    if "ram" not in res:
        return
    rp = med(x[1] for x in res["ram"])
    for mode in modes:
        if mode == "ram":
            continue
        dp = med(x[1] for x in res[mode])
        print(f"itl {model}: a {tokens + 1}-token prompt loaded and another saved beside two decoding streams, x {cycles}, "
              f"medians of {runs}: the gaps' p99 {1e3 * dp:.1f} ms with the disk tier ({mode}), {1e3 * rp:.1f} ms "
              f"without it (RAM hits): {dp / rp:.2f}x; p50 {1e3 * med(x[0] for x in res[mode]):.1f} against "
              f"{1e3 * med(x[0] for x in res['ram']):.1f} ms")


if __name__ == "__main__":
    what = sys.argv[2]
    if what == "ttft":
        ttft(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif what == "load":
        load(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif what == "itl":
        itl(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], *map(int, sys.argv[7:8]))
    else:
        replay(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], int(sys.argv[7]), *map(int, sys.argv[8:10]))
