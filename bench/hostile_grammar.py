"""hostile_grammar.py -- what one client's grammar costs everyone else: two hostile
GBNF grammars sent as structured_outputs.grammar to `k3 serve -m models/k3-mini`
(default options, no key) while another client streams, and what happens when
the hostile client hangs up.

  ambiguous   root ::= "a" root root | "a" root | ""        (exponentially many parses)
  chain       40,000 rules r0 ::= "a" r1 ... (0.86 MB)        (a compile that grows)
  regular     root ::= [a-z]* "x" [a-z]{16}                  (2^17 DFA states: a long compile)

For each: the hostile request's answer (status, seconds, message; /v1/completions, min_tokens 48 so that the
model cannot end at once), the other
stream's inter-token latency before and while it runs (p50 / p99 / max, ms), the
longest gap between its tokens, and after the hostile client leaves (a 20 s
client timeout): how long a small request then takes, and whether the server
keeps working on the abandoned grammar (k3:grammar_seconds_total still growing).

Usage: .venv/bin/python bench/hostile_grammar.py build/k3 [CLIENT_TIMEOUT]
Prints one block per grammar. A measurement, nothing asserted (the tests that hold
the bounds are in tests/test_grammar_budget.c and tests/serve_agents.py).
"""
import json
import os
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import harness as h  # noqa: E402

TIMEOUT = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
M = h.MINI


def chain(n=40000):
    return "\n".join(["root ::= r0"] + [f'r{i} ::= "a" r{i + 1}' for i in range(n - 1)] + [f'r{n - 1} ::= "a"']) + "\n"


# (name, grammar, the hostile client's timeout: None for TIMEOUT)
GRAMMARS = [("ambiguous", 'root ::= "a" root root | "a" root | ""\n', None), ("chain", chain(), None),
            ("a 131,072-state regular expression, the client gone after 1 s", 'root ::= [a-z]* "x" [a-z]{16}\n', 1.0)]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def stream_times(s, stop, out):
    """Completions streamed one after another until stop is set: the arrival time of
    every chunk (k3-mini writes ~1,000 tokens a second, so one stream is short)."""
    body = json.dumps({"model": M, "prompt": "It was a dark and stormy night", "max_tokens": 1800,
                       "ignore_eos": True, "stream": True, "temperature": 0}).encode()
    while not stop.is_set():
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=300)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        buf = b""
        try:
            while not stop.is_set():
                d = sock.recv(65536)
                if not d:
                    break
                now = time.time()
                buf += d
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    if b"data: {" in ev:
                        out.append(now)
        except OSError:
            return
        finally:
            sock.close()


def hostile(s, grammar, result, timeout):
    body = json.dumps({"model": M, "prompt": "a", "max_tokens": 48, "min_tokens": 48,
                       "structured_outputs": {"grammar": grammar}}).encode()
    t0 = time.time()
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=timeout)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while True:
            d = sock.recv(65536)
            if not d:
                break
            data += d
        head, _, payload = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else None
        try:
            j = json.loads(payload)
            msg = j.get("error", {}).get("message") or json.dumps(j["choices"][0]["text"])[:160]
        except ValueError:
            msg = payload[:160].decode(errors="replace")
        result.update(status=status, seconds=time.time() - t0, message=msg)
    except socket.timeout:
        result.update(status="client left", seconds=time.time() - t0,
                      message=f"no answer in {timeout:.0f} s: the client hung up")
        # a hang-up the server can see (a reset): a close that only sends FIN reads the
        # same as a client that half-closed and still waits for its answer
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


def cpu_s(s):
    """The server's CPU seconds so far (user + system, /proc)."""
    try:
        with open(f"/proc/{s.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def gseconds(s):
    try:
        return h.metric(s.metrics(), "k3:grammar_seconds_total") or 0.0
    except OSError:
        return float("nan")


def main():
    for name, grammar, timeout in GRAMMARS:
        s = h.Server(M, threads=2)
        stop, times = threading.Event(), []
        st = threading.Thread(target=stream_times, args=(s, stop, times), daemon=True)
        st.start()
        h.wait_until(lambda: len(times) >= 40, 120, "the other stream's first 40 tokens")
        c0, t0 = cpu_s(s), time.time()
        time.sleep(2)  # a measurement window: the server's CPU rate with the other stream alone
        rate_before = (cpu_s(s) - c0) / (time.time() - t0)
        t_hostile = time.time()
        res = {}
        hostile(s, grammar, res, timeout or TIMEOUT)
        t_left = time.time()
        g_left = gseconds(s)
        c_left = cpu_s(s)
        # after the hostile client is gone: a small request, and the grammar work still counted
        t0 = time.time()
        try:
            r = h.post(s.url + "/v1/completions", json_body={"model": M, "prompt": "Hi", "max_tokens": 4},
                       timeout=60)
            probe = f"{r.status_code} in {time.time() - t0:.2f} s"
        except OSError as e:
            probe = f"no answer in {time.time() - t0:.0f} s ({e})"
        n_now = len(times)
        try:
            h.wait_until(lambda: len(times) >= n_now + 20, 60, "20 more tokens of the other stream")
        except AssertionError:
            probe += "; the other stream got no 20 more tokens in 60 s"
        g_later = gseconds(s)
        rate_after = (cpu_s(s) - c_left) / (time.time() - t_left)
        stop.set()
        before = [b - a for a, b in zip(times, times[1:]) if b <= t_hostile]
        during = [b - a for a, b in zip(times, times[1:]) if a >= t_hostile - 1e-3 and b <= t_left + 5]
        gaps = [b - a for a, b in zip(times, times[1:]) if b >= t_hostile]
        if times and times[-1] >= t_hostile - 1e-3:
            gaps.append(time.time() - times[-1])  # the gap still open
        gap = max(gaps, default=time.time() - t_hostile)
        print(f"{name} ({len(grammar):,} bytes):")
        print(f"  hostile request: {res.get('status')} after {res.get('seconds', 0):.2f} s: {res.get('message')}")
        print(f"  other stream ITL before: p50 {pct(before, .5) * 1e3:.1f} ms, p99 {pct(before, .99) * 1e3:.1f} ms, "
              f"max {max(before, default=float('nan')) * 1e3:.1f} ms ({len(before)} gaps)")
        print(f"  other stream ITL while it ran: p50 {pct(during, .5) * 1e3:.1f} ms, p99 {pct(during, .99) * 1e3:.1f} "
              f"ms, max {max(during, default=float('nan')) * 1e3:.1f} ms ({len(during)} gaps); "
              f"longest gap from then on {gap:.2f} s")
        print(f"  after the hostile client left: a 4-token request {probe}; grammar seconds {g_left:.2f} when it "
              f"left, {g_later:.2f} later; the server's CPU {rate_before:.2f} s/s with the other stream alone, "
              f"{rate_after:.2f} s/s from the hostile client's leaving on", flush=True)
        s.kill()


if __name__ == "__main__":
    try:
        main()
    finally:
        for sv in h.servers:
            sv.kill()
