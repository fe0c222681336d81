"""pd_serve.py -- prefill and decode apart, end to end with the official `openai` client.

Usage: python tests/pd_serve.py K3_BINARY [--mpi] [--kv-transport tcp|ucx]
Starts colocated `k3 serve` instances and prefill (--role prefill) / decode (--role decode)
instances behind `k3 serve --role proxy`, on tests/models/tiny, tiny-dsa and vision-tiny, and
checks that the proxy's greedy answers equal the colocated server's token for token (1P1D and
2P1D; short prompts, prompts past the DSA top-k and several KDA chunks, chat with tools,
streams, images, 16 streams at once), that a prefix shared by two requests is transferred
once, and that every fault fails only its request with an error the client sees and leaves
the block counts of /metrics at their baseline: a corrupted byte, a model mismatch, the
prefill instance dying mid-transfer, the decode instance dying while pulling, a backend the
proxy cannot reach, a client that leaves during the transfer. With --mpi also a decode
instance under `mpirun -np 2 ... --dcp 2` (and a prefill instance so) behind the proxy.
Prints `ok   pd: NAME` / `FAIL pd: NAME` per check and ends with `pd: N passed, N failed, N skipped`;
stops every process it started (each also dies with this process). With --kv-transport ucx every
prefill and decode instance runs it (the rows by one-sided UCX gets) and every transfer is checked to
have gone that way; skipped where the build has no UCX.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

import openai  # noqa: E402

K3 = h.K3
MPI = "--mpi" in sys.argv
TRANSPORT = sys.argv[sys.argv.index("--kv-transport") + 1] if "--kv-transport" in sys.argv else "tcp"
TINY, DSA, VISION = "tests/models/tiny", "tests/models/tiny-dsa", "tests/models/vision-tiny"
IMAGE = "tests/golden/vision/images/rgb_200x130.png"
NAME = "m"  # the served model name on every instance (the proxy passes the client's on)
procs = h.servers
suite = h.Suite("pd")
check = suite.check


class Proc(h.Process):
    """A k3 process (the harness's), its metrics keyed without the model_name label."""

    def __init__(self, args, wait_for=rb"listening on http://[^:]+:(\d+)"):
        super().__init__(args, wait_for=wait_for, stop_timeout=15)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=60, max_retries=0)

    def metrics(self):
        out = {}
        for name, value in super().metrics().items():
            out[re.sub(r"\{.*\}", "", name) if "model_name" in name and "dir=" not in name and "result=" not in name
                else name] = value
        return out


def serve(model, *extra):
    return Proc([K3, "serve", "-m", model, "--port", "0", "--threads", "1", "--served-model-name", NAME,
                 "--cache-tokens", "8192", "--max-num-seqs", "16", *extra])


def prefill(model, *extra):
    return serve(model, "--role", "prefill", "--kv-transfer-port", "0", "--kv-transport", TRANSPORT, *extra)


def decode(model, *extra):
    return serve(model, "--role", "decode", "--kv-transport", TRANSPORT, *extra)


def proxy(pre, dec):
    return Proc([K3, "serve", "--role", "proxy", "--port", "0", "--timeout", "30",
                 "--prefill", ",".join(p if isinstance(p, str) else p.url for p in pre),
                 "--decode", ",".join(d if isinstance(d, str) else d.url for d in dec)])



def ids(n, seed):
    r, out = seed * 2654435761 + 7, []
    for _ in range(n):
        r = (r * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(int((r >> 33) % 700) + 20)
    return out


def comp(srv, prompt, n=16, **kw):
    r = srv.client().completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True}, **kw)
    return r


def chat(srv, messages, n=16, **kw):
    return srv.client().chat.completions.create(model=NAME, messages=messages, max_tokens=n, temperature=0, **kw)


def chat_stream(srv, messages, n=16, **kw):
    s = srv.client().chat.completions.create(model=NAME, messages=messages, max_tokens=n, temperature=0, stream=True,
                                             **kw)
    text, reasoning, calls = "", "", []
    for ch in s:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        text += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            calls.append((tc.index, tc.function.name if tc.function else None,
                          tc.function.arguments if tc.function else None))
    return text, reasoning, calls


def same_comp(a, b, what, transport=None):
    """a through the proxy (it was pulled, by the transport asked for: its kv_transfer figures), b colocated."""
    kt = (a.model_extra or {}).get("kv_transfer")
    assert kt, "%s: no kv_transfer in the answer: not disaggregated" % what
    assert kt["transport"] == (transport or TRANSPORT), "%s: moved by %s" % (what, kt["transport"])
    ta, tb = a.choices[0].text, b.choices[0].text
    assert ta == tb, "%s: %r != %r" % (what, ta, tb)
    assert a.choices[0].finish_reason == b.choices[0].finish_reason, what
    assert a.usage.completion_tokens == b.usage.completion_tokens, what


def blocks_back(*servers, wait=8.0):
    """Every hold and pull gone, no block used (the cache's blocks may stay cached, unreferenced)."""
    def bad():
        out = []
        for s in servers:
            m = s.metrics()
            for k in ("k3:kv_blocks_used", "k3:kv_hold_blocks", "k3:kv_holds", "k3:kv_pulls", "k3:kv_pull_blocks"):
                if m.get(k, 0) != 0:
                    out.append("%s %s=%g" % (s.url, k, m[k]))
        return out
    try:
        h.wait_until(lambda: not bad(), wait, "every hold and pull gone, no block used")
    except AssertionError:
        raise AssertionError("not back to baseline: " + ", ".join(bad())) from None


def expect_error(fn, *words):
    try:
        fn()
    except openai.APIStatusError as e:
        msg = str(e)
        assert e.status_code >= 400, e
        for w in words:
            assert w in msg, "%r not in %s" % (w, msg)
        return e
    raise AssertionError("no error")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
LONG_TEXT = " ".join("the quick brown fox number %d jumps over the lazy dog" % i for i in range(30))


def main():
    # ---- tiny: 1P1D and 2P1D against colocated ----
    c = serve(TINY)
    p1, p2, d = prefill(TINY), prefill(TINY), decode(TINY)
    if TRANSPORT == "ucx" and "kv transport ucx" not in p1.text():
        suite.skip("every check over UCX", re.search(r"kv transport ([^\n]*)", p1.text()).group(1))
        return
    x1, x2 = proxy([p1], [d]), proxy([p1, p2], [d])

    def short_and_long(x):
        for prompt in ["Hello there", LONG_TEXT, ids(300, 1)]:
            same_comp(comp(x, prompt), comp(c, prompt), "prompt of %d" % len(prompt))
    check("1P1D completions equal colocated (2, 300+ tokens, text and ids)", lambda: short_and_long(x1))
    check("2P1D completions equal colocated", lambda: [short_and_long(x2) for _ in range(2)])

    def tools():
        msgs = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Paris?"}]
        a, b = chat(x1, msgs, 24, tools=TOOLS), chat(c, msgs, 24, tools=TOOLS)
        assert a.model_extra["kv_transfer"]["tokens"] == b.usage.prompt_tokens
        assert a.choices[0].message.content == b.choices[0].message.content
        assert (a.choices[0].message.tool_calls or []) == (b.choices[0].message.tool_calls or [])
        assert a.choices[0].finish_reason == b.choices[0].finish_reason
        assert chat_stream(x1, msgs, 24, tools=TOOLS) == chat_stream(c, msgs, 24, tools=TOOLS)
        msgs2 = [{"role": "user", "content": "Say something."}]
        assert chat_stream(x2, msgs2, 20) == chat_stream(c, msgs2, 20)
    check("chat with tools, whole and streamed, equal colocated", tools)

    def surfaces():
        def post(srv, path, body):
            r = urllib.request.Request(srv.url + path, json.dumps(body).encode(),
                                       {"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
            with urllib.request.urlopen(r, timeout=60) as f:
                return json.load(f)
        rb = {"model": NAME, "input": "Tell me about the weather.", "max_output_tokens": 16, "temperature": 0,
              "store": False}
        a, b = post(x1, "/v1/responses", rb), post(c, "/v1/responses", rb)
        # the decode instance's own prefix cache may hold the start of the prompt
        assert a["kv_transfer"]["tokens"] >= 1 and a["usage"]["input_tokens"] == b["usage"]["input_tokens"], a
        strip = lambda r: [[p.get("text") for p in o.get("content", [])] for o in r["output"]]
        assert strip(a) == strip(b) and a["usage"]["output_tokens"] == b["usage"]["output_tokens"], (a, b)
        mb = {"model": NAME, "messages": [{"role": "user", "content": "Tell me about the weather."}], "max_tokens": 16,
              "temperature": 0}
        a, b = post(x2, "/v1/messages", mb), post(c, "/v1/messages", mb)
        assert a["kv_transfer"]["tokens"] >= 1 and a["usage"]["input_tokens"] == b["usage"]["input_tokens"], a
        assert a["content"] == b["content"] and a["stop_reason"] == b["stop_reason"], (a, b)
    check("the Responses and Messages APIs equal colocated", surfaces)

    def structured():
        schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
                  "required": ["city", "n"]}
        rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        a = chat(x1, msgs, 40, response_format=rf)
        b = chat(c, msgs, 40, response_format=rf)
        assert a.model_extra["kv_transfer"]["tokens"] >= 1
        assert a.choices[0].message.content == b.choices[0].message.content, (a, b)
        assert a.choices[0].finish_reason == b.choices[0].finish_reason
    check("structured outputs (a JSON schema) equal colocated", structured)

    def many():
        prompts = [ids(20 + 7 * i, 100 + i) for i in range(16)]
        want = [comp(c, p, 12).choices[0].text for p in prompts]
        got = [None] * 16

        def one(i):
            s = x2.client().completions.create(model=NAME, prompt=prompts[i], max_tokens=12, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            got[i] = "".join(ch.choices[0].text for ch in s if ch.choices)
        th = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        [t.start() for t in th]
        [t.join(120) for t in th]
        bad = [i for i in range(16) if got[i] != want[i]]
        assert not bad, "streams %s differ" % bad
    check("16 concurrent streams through 2P1D all equal colocated", many)

    def prefix_once():
        a = ids(200, 7)
        b = a[:192] + ids(40, 8)  # three 64-token blocks shared
        ra, rb = comp(x1, a, 6), comp(x1, b, 6)
        same_comp(ra, comp(c, a, 6), "first")
        same_comp(rb, comp(c, b, 6), "second")
        ta, tb = ra.model_extra["kv_transfer"], rb.model_extra["kv_transfer"]
        assert ta["tokens"] == 200 and tb["tokens"] == 40, (ta, tb)
        assert rb.usage.prompt_tokens_details.cached_tokens == 192, rb.usage
    check("a prefix shared by two requests is transferred once (the second pulls 40 of 232 tokens)", prefix_once)

    def bytes_exact():
        info = subprocess.run([K3, "info", "-m", TINY, "--no-check-tensors"], capture_output=True, text=True).stdout
        bpt = int(re.search(r"cache: \d+ bytes per token \(fp32\), (\d+) \(c8\)", info).group(1))
        st = int(re.search(r"KDA state (\d+) bytes per sequence", info).group(1))
        m0 = d.metrics()
        moved = 0
        for n in (37, 300):
            r = comp(x1, ids(n, 50 + n), 2)
            t = r.model_extra["kv_transfer"]
            assert t["bytes"] == n * bpt + st and t["states"] == 1, (n, t, bpt, st)
            moved += t["bytes"]
            tt = t["ttft"]  # the time to first token, split
            for k in ("prefill_queue_s", "prefill_s", "decode_queue_s", "transfer_s", "first_decode_step_s"):
                assert tt[k] >= 0, (k, tt)
            assert tt["prefill_s"] > 0 and tt["transfer_s"] > 0 and tt["first_decode_step_s"] > 0, tt
        m1 = d.metrics()
        rx = 'k3:kv_transfer_bytes_total{model_name="m",dir="received"}'
        assert m1[rx] - m0[rx] == moved, (m1[rx] - m0[rx], moved)
        ok = 'k3:kv_transfers_total{model_name="m",dir="received",result="ok"}'
        assert m1[ok] - m0[ok] == 2
        for k in ("k3:kv_transfer_states_total", "k3:kv_transfer_gbps_count", "k3:pd_ttft_transfer_seconds_count",
                  "k3:pd_first_decode_step_seconds_count"):
            assert m1[k] - m0.get(k, 0) == 2, (k, m0.get(k), m1.get(k))
        assert m1["k3:kv_transfer_blocks_total"] - m0["k3:kv_transfer_blocks_total"] == 1 + 5, (m0, m1)
        # the transport the rows took, as /metrics counts it
        ux = 'k3:kv_transfers_ucx_total{model_name="m",dir="received"}'
        assert m1.get(ux, 0) - m0.get(ux, 0) == (2 if TRANSPORT == "ucx" else 0), (TRANSPORT, m0.get(ux), m1.get(ux))
    check("transfer bytes = prompt tokens x cache bytes per token + one KDA state (k3 info); "
          "the TTFT split and /metrics agree", bytes_exact)
    check("tiny: every hold and pull gone, no block used", lambda: blocks_back(p1, p2, d))

    # ---- tiny-dsa: past the DSA top-k ----
    cd, pd_, dd = serve(DSA), prefill(DSA), decode(DSA)
    xd = proxy([pd_], [dd])

    def dsa():
        for prompt in [ids(5, 3), ids(150, 4), ids(400, 5), LONG_TEXT]:
            same_comp(comp(xd, prompt, 20), comp(cd, prompt, 20), "dsa prompt")
        m = [{"role": "user", "content": LONG_TEXT}]
        assert chat_stream(xd, m, 16) == chat_stream(cd, m, 16)
    check("tiny-dsa (top-k 8): 5..400-token prompts and a streamed chat equal colocated", dsa)

    # ---- vision-tiny: images ----
    cv, pv, dv = serve(VISION), prefill(VISION), decode(VISION)
    xv = proxy([pv], [dv])

    def images():
        import base64
        with open(IMAGE, "rb") as f:
            url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in the picture?"}]}]
        a, b = chat(xv, msgs, 16), chat(cv, msgs, 16)
        assert a.model_extra["kv_transfer"]["tokens"] == b.usage.prompt_tokens
        assert a.choices[0].message.content == b.choices[0].message.content, (a, b)
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
        assert chat_stream(xv, msgs, 12) == chat_stream(cv, msgs, 12)
    check("vision-tiny: chat with an image equals colocated", images)
    check("tiny-dsa and vision: every hold and pull gone", lambda: blocks_back(pd_, dd, pv, dv))
    for s in (cd, cv, pv, dv, xv):
        s.stop()

    # ---- faults: each fails its request only, with an error; nothing leaks ----
    pe = prefill(TINY, "--kv-hold-timeout", "0.5")

    def expired():
        # vLLM's first leg, asked directly; nobody comes to pull
        r = pe.client().completions.create(model=NAME, prompt=ids(90, 12), max_tokens=8, temperature=0,
                                           extra_body={"kv_transfer_params": {"do_remote_decode": True}})
        kt = r.model_extra["kv_transfer_params"]
        assert kt["do_remote_prefill"] and kt["remote_block_ids"] and r.usage.completion_tokens == 1, kt
        m = pe.metrics()
        assert m["k3:kv_holds"] == 1 and m["k3:kv_hold_blocks"] == 2, m
        blocks_back(pe)
        assert pe.metrics()["k3:kv_holds_expired_total"] == 1
    check("a hold nobody pulls is freed at --kv-hold-timeout, counted in /metrics", expired)
    pe.stop()
    pf = prefill(TINY, "--kv-fault", "flip:1")
    xf = proxy([pf], [d])

    def flipped():
        expect_error(lambda: comp(xf, ids(100, 9), 4), "damaged", "MAC")
        blocks_back(pf, d)
        same_comp(comp(x1, ids(100, 9), 4), comp(c, ids(100, 9), 4), "after")  # the next request is fine
    check("a flipped byte: the request fails (its MAC), nothing held", flipped)

    def offer_fault(kind, words):
        po = prefill(TINY, "--kv-fault", "offer:" + kind)
        xo = proxy([po], [d])
        ux = 'k3:kv_transfers_ucx_total{model_name="m",dir="%s"}'
        if kind == "replay":  # the first pull's offer is good: it is sent again for the next
            same_comp(comp(xo, ids(90, 14), 4), comp(c, ids(90, 14), 4), "the first offer")
        m0, n0 = d.metrics(), po.metrics()
        expect_error(lambda: comp(xo, ids(120, 15 if kind == "replay" else 16), 4), *words)
        blocks_back(po, d)
        m1, n1 = d.metrics(), po.metrics()
        assert m1[ux % "received"] == m0[ux % "received"] and n1[ux % "sent"] == n0[ux % "sent"], (m1, n1)
        same_comp(comp(x1, ids(120, 17), 4), comp(c, ids(120, 17), 4), "after")  # the next request is fine
        xo.stop()
        po.stop()
    for kind, words, what in (("forge", ("damaged", "MAC"), "a byte of its remote keys flipped after its MAC"),
                              ("replay", ("forged",), "the previous pull's offer sent again, as it went")):
        name = "a forged UCX offer (%s) is refused: the request fails, no get, nothing held" % what
        if TRANSPORT == "ucx":
            check(name, lambda kind=kind, words=words: offer_fault(kind, words))
        else:
            suite.skip(name, "the stream makes no offer (--kv-transport ucx)")

    xm = proxy([pd_], [d])  # tiny-dsa's prefill in front of tiny's decode

    def mismatch():
        e = expect_error(lambda: comp(xm, ids(30, 10), 4), "refused", "another model")
        assert "%016x" % 0 not in str(e) and "model 0" not in str(e), e
        blocks_back(pd_, d)
    check("a model mismatch is refused, naming neither model; nothing held", mismatch)

    def prefill_dies():
        ps = prefill(TINY, "--kv-fault", "stall:1:4000")
        xs = proxy([ps], [d])
        err = []

        def req():
            try:
                comp(xs, ids(200, 11), 4)
            except openai.APIStatusError as e:
                err.append(e)
        t = threading.Thread(target=req)
        t.start()
        h.wait_until(lambda: d.metrics().get("k3:kv_pulls", 0) >= 1, 30, "the decode side to pull (the transfer stalls)")
        ps.kill()
        t.join(30)
        assert err and ("closed" in str(err[0]) or "broke off" in str(err[0])), err
        blocks_back(d)
        xs.stop()
    check("the prefill instance dies mid-transfer: the client gets an error, the decode side frees all", prefill_dies)

    def decode_dies():
        ds = decode(TINY, "--kv-fault", "stall:0:4000")
        xs = proxy([p1], [ds])
        err = []

        def req():
            try:
                comp(xs, ids(400, 12), 4)
            except openai.APIStatusError as e:
                err.append(e)
        t = threading.Thread(target=req)
        t.start()
        h.wait_until(lambda: ds.metrics().get("k3:kv_pulls", 0) >= 1, 30, "the decode side to pull (it stalls)")
        ds.kill()
        t.join(30)
        assert err and err[0].status_code == 502, err
        blocks_back(p1)
        xs.stop()
    check("the decode instance dies while pulling: the client gets a 502, the prefill side frees its hold",
          decode_dies)

    def lost_backend():
        dead = "http://127.0.0.1:%d" % free_port()
        xa = proxy([dead, p1], [d])
        for _ in range(2):
            same_comp(comp(xa, "Hello there", 8), comp(c, "Hello there", 8), "a dead prefill instance skipped")
        xb = proxy([p1], [dead])
        e = expect_error(lambda: comp(xb, "Hello there", 8), "no decode instance answered")
        assert e.status_code == 502
        xc = proxy([dead], [d])
        e = expect_error(lambda: comp(xc, "Hello there", 8), "no prefill instance answered")
        assert e.status_code == 502
        blocks_back(p1, d)
        for x in (xa, xb, xc):
            x.stop()
    check("the proxy loses a backend: the next one is tried, or the client gets a 502; the hold is released",
          lost_backend)

    def client_leaves():
        ps = prefill(TINY, "--kv-fault", "stall:1:2500")
        xs = proxy([ps], [d])
        s = socket.create_connection(("127.0.0.1", xs.port))
        body = json.dumps({"model": NAME, "prompt": ids(150, 13), "max_tokens": 8, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d"
                  b"\r\n\r\n%s" % (len(body), body))
        # the prefill has answered; the pull stalls
        h.wait_until(lambda: d.metrics().get("k3:kv_pulls", 0) >= 1, 30, "the decode side to pull (it stalls)")
        s.close()
        blocks_back(ps, d, wait=30)  # once the stall (2.5 s) ends, the pull sees the client gone
        m = d.metrics()
        assert m.get('k3:kv_transfers_total{model_name="%s",dir="received",result="failed"}' % NAME, 0) >= 1 or \
            m.get("vllm:request_success_total", 0) >= 0
        xs.stop()
        ps.stop()
    check("a client that leaves during the transfer: both sides free everything", client_leaves)
    check("after the faults, requests still equal colocated",
          lambda: same_comp(comp(x2, LONG_TEXT, 10), comp(c, LONG_TEXT, 10), "after"))

    # ---- mpirun: decode under --dcp 2 (and a prefill so) ----
    if MPI:
        mpi = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2"]

        def under_mpi(role_args):
            return Proc(mpi + [K3, "serve", "-m", DSA, "--port", "0", "--threads", "1", "--served-model-name", NAME,
                               "--cache-tokens", "8192", "--max-num-seqs", "8", "--dcp", "2", *role_args])

        def dcp_decode():
            dm = under_mpi(["--role", "decode", "--kv-transport", TRANSPORT])
            xm2 = proxy([pd_], [dm])
            for prompt in [ids(5, 21), ids(150, 22), ids(330, 23)]:
                same_comp(comp(xm2, prompt, 16), comp(serve_once(), prompt, 16), "dcp decode")
            blocks_back(pd_, dm)
            stop_mpi(dm)
            xm2.stop()

        def dcp_prefill():
            pm = under_mpi(["--role", "prefill", "--kv-transfer-port", "0", "--kv-transport", TRANSPORT])
            xm3 = proxy([pm], [dd])
            for prompt in [ids(7, 31), ids(260, 32)]:
                # a prefill instance under DCP offers no hold in place: the stream, whatever was asked
                same_comp(comp(xm3, prompt, 16), comp(serve_once(), prompt, 16), "dcp prefill", "tcp")
            blocks_back(pm, dd)
            stop_mpi(pm)
            xm3.stop()
        check("decode under mpirun -np 2 --dcp 2 (from a prefill without DCP) equals colocated", dcp_decode)
        check("prefill under mpirun -np 2 --dcp 2 (to a decode without DCP) equals colocated", dcp_prefill)
    else:
        for name in ("decode under mpirun -np 2 --dcp 2 equals colocated",
                     "prefill under mpirun -np 2 --dcp 2 equals colocated"):
            suite.skip(name, "no --mpi (tests/pd.sh gives it when mpirun is on the PATH; "
                             "scripts/install-deps.sh installs openmpi-bin)")


_once = {}


def serve_once():
    if "dsa" not in _once:
        _once["dsa"] = serve(DSA)
    return _once["dsa"]


def rank0(pid):
    todo = [pid]
    while todo:
        nxt = []
        for q in todo:
            try:
                with open("/proc/%d/environ" % q, "rb") as f:
                    if b"OMPI_COMM_WORLD_RANK=0" in f.read().split(b"\0"):
                        return q
            except OSError:
                pass
            try:
                with open("/proc/%d/task/%d/children" % (q, q)) as f:
                    nxt += [int(x) for x in f.read().split()]
            except OSError:
                pass
        todo = nxt
    return None


def stop_mpi(p):
    r0 = rank0(p.proc.pid)
    if r0:
        os.kill(r0, signal.SIGTERM)
    try:
        p.proc.wait(20)
    except subprocess.TimeoutExpired:
        p.proc.kill()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port



def stop_all():
    for p in reversed(procs):
        try:
            if p.args[0] == "mpirun":
                stop_mpi(p)
            else:
                p.stop()
        except Exception:  # noqa: BLE001
            pass


if __name__ == "__main__":
    suite.main(main, cleanup=stop_all)
