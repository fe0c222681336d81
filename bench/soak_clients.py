"""soak_clients.py -- the clients of bench/soak_drain.sh: N streaming clients against a running
`k3 serve` for a while, a fraction of them leaving mid-stream, then SIGTERM to the server while
they keep going; every request is accounted for.

Each client loops: a random route (completions or chat), one of the prompts (slices of
data/heldout/austen.txt, 8 to 300 words), a random max_tokens of 16..512, greedy with
ignore_eos, streamed. The whole answer of every (route, prompt, max_tokens) is fetched first (a
warm-up, concurrently), so each completed stream is checked against it. Outcomes:
  completed   finish_reason "length", [DONE], the chunked body's end, the text of the whole answer
  wrong       the same, but another text
  aborted     the client left after 1-4 events (the disconnect fraction)
  drained     an error event (503, "shutting down"), [DONE] and the body's end
  refused     a 503 with Retry-After before any stream (a new request during the drain)
  lost        anything else: a bare end, a reset, a body cut short, an unexpected status
A request is started once its bytes are sent; one whose connection is refused (the server has
exited) is not. Prints RSS samples of the server every 10 s and a JSON summary as the last line.
Usage: python3 bench/soak_clients.py PORT SERVER_PID DURATION_S [--clients 64] [--disconnect 0.1]
       [--seed 1] [--model NAME]
"""
import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("port", type=int)
ap.add_argument("pid", type=int)
ap.add_argument("duration", type=float)
ap.add_argument("--clients", type=int, default=64)
ap.add_argument("--disconnect", type=float, default=0.1)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--prompts", type=int, default=24)
ap.add_argument("--text", default="data/heldout/austen.txt")
args = ap.parse_args()

rng = random.Random(args.seed)
words = open(args.text, encoding="utf-8", errors="replace").read().split()
PROMPTS = []
for i in range(args.prompts):
    n = rng.choice([8, 16, 32, 64, 128, 300])
    at = rng.randrange(0, len(words) - n)
    PROMPTS.append(" ".join(words[at:at + n]))
LENGTHS = [16, 32, 64, 128, 512]
ROUTES = ["/v1/completions", "/v1/chat/completions"]


def body_of(route, prompt, n, stream):
    b = {"max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream}
    if route == ROUTES[0]:
        b["prompt"] = prompt
    else:
        b["messages"] = [{"role": "user", "content": prompt}]
    return json.dumps(b).encode()


def send(route, body):
    s = socket.create_connection(("127.0.0.1", args.port), timeout=300)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
              b"Content-Length: %d\r\n\r\n" % (route.encode(), len(body)) + body)
    return s


def parse(data):
    """status, headers (lower-case), body (chunks decoded), ended properly"""
    head, sep, rest = data.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return -1, {}, b"", False
    hdr = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        hdr[k.strip().lower()] = v.strip()
    if hdr.get("transfer-encoding", "").lower() != "chunked":
        n = int(hdr.get("content-length", "-1"))
        return status, hdr, rest[:n] if n >= 0 else rest, n >= 0 and len(rest) >= n
    body, pos = b"", 0
    while True:
        eol = rest.find(b"\r\n", pos)
        if eol < 0:
            return status, hdr, body, False
        size = int(rest[pos:eol] or b"0", 16)
        if size == 0:
            return status, hdr, body, rest[eol + 2:eol + 4] == b"\r\n"
        if len(rest) < eol + 2 + size + 2:
            return status, hdr, body, False
        body += rest[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


def whole(route, prompt, n):
    s = send(route, body_of(route, prompt, n, False))
    data = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        data += d
    s.close()
    status, _, body, _ = parse(data)
    assert status == 200, (status, body[:200])
    c = json.loads(body)["choices"][0]
    if route == ROUTES[0]:
        return c["text"]
    m = c["message"]
    return (m.get("reasoning_content") or "") + "\x00" + (m.get("content") or "")


def stream_text(route, events):
    """(text, finish_reason) of a stream's chunks; the error object if one came."""
    reasoning, content, fin, err = "", "", None, None
    for ev in events:
        if "error" in ev:
            err = ev["error"]
            continue
        for c in ev.get("choices") or []:
            if c.get("finish_reason"):
                fin = c["finish_reason"]
            if route == ROUTES[0]:
                content += c.get("text") or ""
            else:
                d = c.get("delta") or {}
                reasoning += d.get("reasoning_content") or ""
                content += d.get("content") or ""
    return (content if route == ROUTES[0] else reasoning + "\x00" + content), fin, err


counts = {k: 0 for k in ("started", "completed", "wrong", "aborted", "drained", "refused", "lost")}
lost_examples = []
lock = threading.Lock()
term_at = [None]
stop = threading.Event()


def count(k, example=None):
    with lock:
        counts[k] += 1
        if example and len(lost_examples) < 5:
            lost_examples.append(example)


def client(cid, refs):
    r = random.Random(args.seed * 1000 + cid)
    while not stop.is_set():
        route, p, n = r.choice(ROUTES), r.randrange(len(PROMPTS)), r.choice(LENGTHS)
        leave_after = r.randint(1, 4) if r.random() < args.disconnect else 0
        try:
            s = send(route, body_of(route, PROMPTS[p], n, True))
        except OSError:
            if term_at[0] is not None:
                return  # the server has exited
            time.sleep(0.1)
            continue
        count("started")
        data, n_events, left = b"", 0, False
        try:
            while True:
                d = s.recv(65536)
                if not d:
                    break
                data += d
                if leave_after:
                    n_events = data.count(b"\ndata: ") + data.startswith(b"data: ")
                    if n_events >= leave_after:
                        left = True
                        break
        except OSError as e:
            data += b"\0reset: " + str(e).encode()
        s.close()
        if left:
            count("aborted")
            continue
        status, hdr, body, ended = parse(data)
        if status == 503 and hdr.get("retry-after"):
            count("refused")
            time.sleep(0.2)
            continue
        events = []
        for ln in body.decode(errors="replace").split("\n"):
            if ln.startswith("data: "):
                events.append(ln[6:])
        done = bool(events) and events[-1] == "[DONE]"
        try:
            objs = [json.loads(e) for e in events if e != "[DONE]"]
        except ValueError:
            objs = None
        if status != 200 or not ended or not done or objs is None:
            count("lost", {"status": status, "ended": ended, "done": done, "tail": data[-200:].decode(errors="replace")})
            continue
        text, fin, err = stream_text(route, objs)
        if err:
            if err.get("code") == 503 and "shutting down" in err.get("message", ""):
                count("drained")
            else:
                count("lost", {"error": err})
            continue
        if fin != "length":
            count("lost", {"finish_reason": fin})
        elif text != refs[(route, p, n)]:
            count("wrong", {"route": route, "prompt": p, "n": n, "got": text[:80], "want": refs[(route, p, n)][:80]})
        else:
            count("completed")


def rss_kb():
    try:
        for ln in open(f"/proc/{args.pid}/status"):
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1])
    except OSError:
        return None
    return None


def main():
    t0 = time.time()
    # the whole answers, 16 at a time (also the warm-up)
    keys = [(rt, p, n) for rt in ROUTES for p in range(len(PROMPTS)) for n in LENGTHS]
    refs = {}
    todo = list(keys)

    def ref_worker():
        while True:
            with lock:
                if not todo:
                    return
                k = todo.pop()
            refs[k] = whole(k[0], PROMPTS[k[1]], k[2])

    th = [threading.Thread(target=ref_worker) for _ in range(16)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    print(f"references: {len(refs)} whole answers in {time.time() - t0:.1f} s, RSS {rss_kb()} kB", flush=True)
    if len(refs) != len(keys):
        print(json.dumps({"error": "the whole answers could not all be had"}), flush=True)
        return 2
    samples = []
    t1 = time.time()

    def sampler():
        while not stop.is_set() or term_at[0] is None:
            v = rss_kb()
            if v is None:
                return
            samples.append((round(time.time() - t1), v))
            print(f"RSS t={samples[-1][0]:4d} s: {v / 1024:.1f} MB  ({dict(counts)})", flush=True)
            stop.wait(10)

    st = threading.Thread(target=sampler, daemon=True)
    st.start()
    cl = [threading.Thread(target=client, args=(i, refs)) for i in range(args.clients)]
    for t in cl:
        t.start()
    time.sleep(args.duration)
    term_at[0] = time.time()
    with lock:
        at_term = dict(counts)
    os.kill(args.pid, signal.SIGTERM)
    # the clients go on (new requests meet the drain) until the server is gone
    while True:
        try:
            os.kill(args.pid, 0)
        except OSError:
            break
        if os.path.exists(f"/proc/{args.pid}/stat") and open(f"/proc/{args.pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    exited = time.time() - term_at[0]
    stop.set()
    for t in cl:
        t.join(60)
    rep = dict(counts)
    rep.update({"clients": args.clients, "disconnect_fraction": args.disconnect, "duration_s": args.duration,
                "exit_after_sigterm_s": round(exited, 2), "started_before_sigterm": at_term["started"],
                "rss_kb": samples, "lost_examples": lost_examples})
    print(json.dumps(rep), flush=True)
    return 0 if counts["lost"] == 0 and counts["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
