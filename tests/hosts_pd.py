"""hosts_pd.py -- prefill and decode apart on separate network hosts (tests/hosts.sh makes them).

Runs inside host 1's network namespace (the client's and the proxy's host) and starts the prefill
instance on host 2, decode instances on hosts 3 and 4 and a colocated reference on host 2, each bound
to its own host's address (ip netns exec; stdlib only). Checks, through the proxy:
  - a request's greedy text equals the colocated server's, its cache crossed the network (the
    prefill host's eth0 sent at least the transfer's bytes), and /metrics of both sides are back
    at their baseline afterwards;
  - a decode host killed mid-stream: the client's stream ends with an error event and [DONE], the
    prefill side frees its hold;
  - a decode host's link cut during the transfer: the client gets a proper ending (the other decode
    host takes the request, or a 502), both sides free everything once the link is back, and the
    host serves again without a restart;
  - the prefill host's link cut during the transfer: the decode side's pull times out, the client
    gets an error, the decode side frees; with the link back the same instances serve again;
  - a decode host whose link is down before the request: the proxy fails over to the other.
Prints `ok ...` / `FAIL ...` / `skip ...` lines and `hosts-pd: N passed, N failed`.

Usage (inside host 1): python3 tests/hosts_pd.py K3 PREFIX NET [--quick]
  PREFIX, NET: tests/hosts/lib.sh's HOSTS_PREFIX and HOSTS_NET (host H is namespace PREFIX+H at NET.H)
"""
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

K3, PREFIX, NET = sys.argv[1], sys.argv[2], sys.argv[3]
QUICK = "--quick" in sys.argv
MODEL = "tests/models/tiny"
NAME = "m"
passed = failed = 0
procs = []


def check(name, fn):
    global passed, failed
    try:
        r = fn()
        passed += 1
        print("ok   hosts-pd: %s%s" % (name, (": " + r) if isinstance(r, str) else ""), flush=True)
    except Exception as e:  # noqa: BLE001 -- every failure is reported by name
        failed += 1
        print("FAIL hosts-pd: %s: %s: %s" % (name, type(e).__name__, str(e)[:600]), flush=True)


def addr(h):
    return "%s.%d" % (NET, h)


def ns(h):
    return PREFIX + str(h)


# ---- the one place that knows the PD roles' flags ------------------------------------------------
# (a transport that needs more flags -- a key, a transport name -- changes them here only)
def role_args(role, host, extra=()):
    common = ["serve", "-m", MODEL, "--host", addr(host), "--port", "0", "--threads", "1",
              "--served-model-name", NAME, "--max-num-seqs", "4", "--cache-tokens", "8192"]
    if role == "prefill":
        return common + ["--role", "prefill", "--kv-transfer-host", addr(host), "--kv-transfer-port", "0",
                         "--kv-hold-timeout", "60", "--kv-transfer-timeout", "5"] + list(extra)
    if role == "decode":
        return common + ["--role", "decode", "--kv-transfer-timeout", "3"] + list(extra)
    if role == "colocated":
        return common + list(extra)
    raise ValueError(role)


def proxy_args(host, prefills, decodes):
    return ["serve", "--role", "proxy", "--host", addr(host), "--port", "0", "--timeout", "6",
            "--prefill", ",".join(prefills), "--decode", ",".join(decodes)]


class Proc:
    """A k3 process on host `host`: its URL once it says it listens."""

    def __init__(self, host, args):
        self.host = host
        self.p = subprocess.Popen(["ip", "netns", "exec", ns(host), K3] + args, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        procs.append(self)
        self.log = b""
        deadline = time.time() + 120
        while time.time() < deadline:
            r, _, _ = select.select([self.p.stderr], [], [], 0.5)
            if r:
                chunk = os.read(self.p.stderr.fileno(), 65536)
                if not chunk:
                    break
                self.log += chunk
                m = re.search(rb"listening on http://([0-9.]+):(\d+)", self.log)
                if m:
                    self.url = "http://%s:%s" % (m.group(1).decode(), m.group(2).decode())
                    threading.Thread(target=self._drain, daemon=True).start()
                    return
            elif self.p.poll() is not None:
                break
        raise RuntimeError("did not start on host %d: %s\n%s" % (host, " ".join(args), self.log.decode()[-800:]))

    def _drain(self):
        while True:
            try:
                d = os.read(self.p.stderr.fileno(), 65536)
            except OSError:
                return
            if not d:
                return
            self.log += d

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            out = {}
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, _, v = line.rpartition(" ")
                    try:
                        v = float(v)
                    except ValueError:
                        continue
                    # by the name with its other labels (model_name dropped), and summed by name
                    out[re.sub(r'model_name="[^"]*",?', "", k).replace("{}", "")] = v
                    base = k.split("{")[0]
                    out.setdefault(base + "+", 0.0)
                    out[base + "+"] += v
            return out

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def post(url, body, timeout=60):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream(url, body, on_first=None, timeout=60):
    """A streamed completion: (text, how it ended). Endings: 'finished', 'error CODE MESSAGE', 'cut'."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps(dict(body, stream=True)).encode(),
                                 {"Content-Type": "application/json"})
    text, ending = "", "cut"
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            first = True
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return text, ending
                ev = json.loads(data)
                if "error" in ev:
                    ending = "error %s %s" % (ev["error"].get("code"), ev["error"].get("message"))
                    continue
                ch = ev["choices"][0]
                text += ch.get("text", "")
                if ch.get("finish_reason"):
                    ending = "finished"
                if first and on_first:
                    first = False
                    on_first()
    except urllib.error.HTTPError as e:
        return text, "http %d %s" % (e.code, (e.read() or b"")[:200].decode(errors="replace"))
    except OSError as e:
        return text, "cut (%s)" % e
    return text, ending + " (no [DONE])"


def host_kill(h):
    """Every process on host h killed at once (SIGKILL): the host is gone."""
    pids = subprocess.run(["ip", "netns", "pids", ns(h)], capture_output=True, text=True).stdout.split()
    for p in pids:
        try:
            os.kill(int(p), signal.SIGKILL)
        except ProcessLookupError:
            pass


def link(h, state):
    """tests/hosts/lib.sh's link: up returns once the carrier is back and the cut's failed neighbour
    entries are flushed"""
    subprocess.run(["sh", "-c", '. tests/hosts/lib.sh && link "$0" "$1"', str(h), state], check=True,
                   env=dict(os.environ, HOSTS_PREFIX=PREFIX, HOSTS_NET=NET))


def eth0_tx(h):
    out = subprocess.run(["ip", "-n", ns(h), "-s", "-j", "link", "show", "eth0"], capture_output=True, text=True)
    return json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"]


def wait_for(what, fn, timeout=30):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = fn()
            if last is True:
                return
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise AssertionError("%s: not within %d s (last: %s)" % (what, timeout, last))


LEAK_KEYS = ("k3:kv_blocks_used+", "k3:kv_hold_blocks+", "k3:kv_holds+", "k3:kv_pulls+", "k3:kv_pull_blocks+",
             "vllm:num_requests_running+", "vllm:num_requests_waiting+")


def baseline(p):
    m = p.metrics()
    return {k: m.get(k, 0.0) for k in LEAK_KEYS}


def at_baseline(p, base):
    def f():
        m = p.metrics()
        missing = [k for k in LEAK_KEYS if k not in m]
        assert not missing, "no %s in /metrics" % missing
        diff = {k: m.get(k, 0.0) for k in LEAK_KEYS if m.get(k, 0.0) != base[k]}
        return True if not diff else diff
    return f


PROMPT = [(i * 37 + 11) % 900 + 20 for i in range(300)]


def body(n=8, prompt=None):
    return {"model": NAME, "prompt": prompt or PROMPT, "max_tokens": n, "temperature": 0}


def main():
    pre = Proc(2, role_args("prefill", 2))
    colo = Proc(2, role_args("colocated", 2))
    dec = [Proc(3, role_args("decode", 3)), Proc(4, role_args("decode", 4))]
    proxy = Proc(1, proxy_args(1, [pre.url], [d.url for d in dec]))
    base_p, base_d = baseline(pre), [baseline(d) for d in dec]
    ref = post(colo.url, body(16))[1]["choices"][0]["text"]

    def same_text():
        tx0 = eth0_tx(2)
        st, ans = post(proxy.url, body(16))
        assert st == 200, (st, ans)
        assert ans["choices"][0]["text"] == ref, (ans["choices"][0]["text"], ref)
        moved = ans["kv_transfer"]["bytes"]
        sent = eth0_tx(2) - tx0
        assert moved > 0 and sent >= moved, (moved, sent)
        wait_for("prefill back at baseline", at_baseline(pre, base_p))
        for d, b in zip(dec, base_d):
            wait_for("decode back at baseline", at_baseline(d, b))
        return "%d B of cache from host 2 (its eth0 sent %d B), text = colocated" % (moved, sent)

    check("proxy on host 1, prefill on host 2, decode on hosts 3/4: greedy text = colocated", same_text)

    def streamed():
        text, end = stream(proxy.url, body(16))
        assert end == "finished" and text == ref, (text, end)
    check("a stream through the proxy across hosts = colocated", streamed)

    # a decode host whose link is down before the request: the proxy's connect fails, it marks the
    # host down and the other decode host takes the request (two requests: whichever the proxy tries
    # first, one of them meets host 4 first)
    OK_RECV = 'k3:kv_transfers_total{dir="received",result="ok"}'

    def failover():
        link(4, "down")
        try:
            t0 = time.time()
            got = [post(proxy.url, body(16)) for _ in range(2)]
            dt = time.time() - t0
        finally:
            link(4, "up")
        for st, ans in got:
            assert st == 200 and ans["choices"][0]["text"] == ref, (st, ans)
        fails = proxy.metrics()["k3:proxy_backend_failures_total+"]
        assert fails >= 1, fails
        wait_for("prefill back at baseline", at_baseline(pre, base_p))
        return "2 requests answered by host 3 in %.1f s, %d backend failure(s) counted" % (dt, fails)
    check("decode host 4's link down: the proxy fails over to host 3", failover)

    # a proxy whose only decode host is cut: the client gets a 502 and the hold is released; the
    # link back, the same proxy uses the host again (no restart anywhere)
    def only_decode_cut():
        px = Proc(1, proxy_args(1, [pre.url], [dec[1].url]))
        link(4, "down")
        try:
            t0 = time.time()
            st, ans = post(px.url, body(16))
            dt = time.time() - t0
        finally:
            link(4, "up")
        assert st == 502, (st, ans)
        wait_for("prefill back at baseline (the hold released)", at_baseline(pre, base_p))
        assert px.metrics()["k3:proxy_holds_released_total+"] >= 1
        n4 = dec[1].metrics().get(OK_RECV, 0)
        wait_for("host 4 serves again", lambda: post(px.url, body(16))[0] == 200 or "not yet", 30)
        assert dec[1].metrics().get(OK_RECV, 0) > n4
        px.stop()
        return "502 after %.1f s (%s), the hold released; served again once the link was back" % (
            dt, ans.get("error", {}).get("message", "")[:120])
    check("the only decode host's link down: 502, hold released; back up: used again without a restart",
          only_decode_cut)

    # the prefill host's link cut while a transfer is under way (its unit 1 stalled 3 s by
    # --kv-fault so the cut lands inside the transfer): the decode side's pull goes silent and
    # times out (--kv-transfer-timeout 3), the client gets an error, the decode side frees; the
    # link back, both sides at baseline, and the next request is served by the same instances
    pre2 = Proc(2, role_args("prefill", 2, ["--kv-fault", "stall:1:3000"]))
    proxy2 = Proc(1, proxy_args(1, [pre2.url], [dec[0].url]))
    base_p2 = baseline(pre2)

    def prefill_cut():
        res = {}
        t = threading.Thread(target=lambda: res.update(r=post(proxy2.url, body(8), timeout=60)))
        t.start()
        wait_for("the pull under way", lambda: dec[0].metrics().get("k3:kv_pulls+", 0) >= 1 or "no pull", 30)
        link(2, "down")
        t0 = time.time()
        t.join(60)
        dt = time.time() - t0
        link(2, "up")
        st, ans = res["r"]
        assert st >= 500, (st, ans)
        msg = ans.get("error", {}).get("message", "")
        wait_for("decode back at baseline", at_baseline(dec[0], base_d[0]))
        wait_for("prefill back at baseline", at_baseline(pre2, base_p2), 60)
        return "client got %d after %.1f s: %s" % (st, dt, msg[:160])
    check("prefill host's link cut mid-transfer: the client gets an error, both sides free", prefill_cut)

    def prefill_back():
        wait_for("served again", lambda: post(proxy2.url, body(8), timeout=30)[0] == 200 or "not yet", 30)
    check("prefill host's link back: the same instances serve again", prefill_back)
    pre2.stop()
    proxy2.stop()

    # decode host 3's link cut during the transfer: the proxy's call to it goes silent (its
    # --timeout 6), the other decode host pulls the same hold, or the client gets a 502
    pre3 = Proc(2, role_args("prefill", 2, ["--kv-fault", "stall:1:3000"]))
    proxy3 = Proc(1, proxy_args(1, [pre3.url], [dec[0].url, dec[1].url]))
    base_p3 = baseline(pre3)

    def decode_cut():
        res = {}
        t = threading.Thread(target=lambda: res.update(r=post(proxy3.url, body(8), timeout=90)))
        t.start()
        who = []

        def pulling():
            who[:] = [i for i, d in enumerate(dec) if d.metrics().get("k3:kv_pulls+", 0) >= 1]
            return bool(who) or "no pull"
        wait_for("a pull under way", pulling, 30)
        h = who[0] + 3
        link(h, "down")
        t0 = time.time()
        try:
            t.join(90)
            dt = time.time() - t0
            assert not t.is_alive(), "no answer within 90 s"
            st, ans = res["r"]
            ending = "%d after %.1f s%s" % (st, dt, (": " + ans.get("error", {}).get("message", "")[:160])
                                            if st != 200 else "")
            assert st == 200 or st == 502, ending
            # the link still down: the prefill side's send gives up at its --kv-transfer-timeout
            wait_for("prefill back at baseline with the link still down", at_baseline(pre3, base_p3), 30)
        finally:
            link(h, "up")
        wait_for("host 3's decode back at baseline", at_baseline(dec[0], base_d[0]), 60)
        wait_for("host 4's decode back at baseline", at_baseline(dec[1], base_d[1]), 30)
        return "host %d cut; client got %s; the prefill side freed the hold before the link came back" % (h, ending)
    check("decode host's link cut mid-transfer: a proper ending, both sides free", decode_cut)
    pre3.stop()
    proxy3.stop()

    # a decode host killed mid-stream (every process on host 4): the stream ends with the proxy's
    # error event and [DONE]; the prefill side holds nothing
    def decode_killed():
        proxy4 = Proc(1, proxy_args(1, [pre.url], [dec[1].url]))
        text, end = stream(proxy4.url, dict(body(3000), ignore_eos=True), on_first=lambda: host_kill(4))
        assert end.startswith("error 502"), end
        wait_for("prefill back at baseline", at_baseline(pre, base_p))
        proxy4.stop()
        return end[:160]
    check("decode host killed mid-stream: the client's stream ends with an error event and [DONE]", decode_killed)


try:
    main()
except Exception as e:  # noqa: BLE001
    failed += 1
    print("FAIL hosts-pd: %s: %s" % (type(e).__name__, str(e)[:800]), flush=True)
finally:
    for p in procs:
        p.stop()
print("hosts-pd: %d passed, %d failed" % (passed, failed), flush=True)
sys.exit(1 if failed else 0)
