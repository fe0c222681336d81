# mpi_serve.py -- an outside client for tests/mpi.sh: greedy /v1/completions
# on a server under mpirun against the same on a one-process server (the
# same text), a repeated long prompt hitting the prefix cache (the KDA
# restore path), two requests in flight at once, and with --metrics the
# cross-rank counters present in /metrics (summed over the ranks: sent =
# received for every kind), and those of the kinds named by
# --grow (sent bytes and calls) growing after a request of 12 tokens (over
# tiny-dsa's index_topk of 8, so DSA rows exchange candidates).
# With --images IMG,IMG (a checkpoint with a vision tower): chat requests
# with those images instead -- the same greedy text as one process (rank 0
# encodes, the rows travel with the batch), twice, and two images in one turn.
# With --preempt: four requests at once on a pool too small for them (the
# server runs with --cache-tokens 320): preemptions, the same texts.
# Usage: python3 tests/mpi_serve.py MPI_PORT ONE_PORT [--metrics [--grow KIND,KIND...]] [--images IMG,IMG]
#        [--preempt]
import base64
import json
import sys
import threading
import urllib.request


def post(port, body):
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=30) as r:
        return r.read().decode()


def comp(port, ids, n=6):
    return post(port, {"prompt": ids, "max_tokens": n, "temperature": 0})


def chat_images(port, paths, text, n=8):
    content = []
    for p in paths:
        with open(p, "rb") as f:
            kind = "jpeg" if p.endswith(".jpg") else "png"
            content.append({"type": "image_url", "image_url": {
                "url": "data:image/%s;base64,%s" % (kind, base64.b64encode(f.read()).decode())}})
    body = {"messages": [{"role": "user", "content": content + [{"type": "text", "text": text}]}],
            "max_tokens": n, "temperature": 0}
    req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % port, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


mpi, one = int(sys.argv[1]), int(sys.argv[2])
if "--preempt" in sys.argv:
    # four requests at once on a server whose pool is too small for them
    # (--cache-tokens 320): the engine preempts and recomputes, the blocks
    # change hands on every rank, and the texts stay the one-process ones
    prompts = [[(i * 53 + 7 * k) % 1000 for i in range(60 + 10 * k)] for k in range(4)]
    def ign(port, ids):
        return post(port, {"prompt": ids, "max_tokens": 40, "temperature": 0, "ignore_eos": True})["choices"][0]["text"]
    ref = [ign(one, p) for p in prompts]
    got = [None] * 4
    th = [threading.Thread(target=lambda k=k: got.__setitem__(k, ign(mpi, prompts[k]))) for k in range(4)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    m = metrics(mpi)
    pre = sum(float(l.rsplit(" ", 1)[1]) for l in m.splitlines() if l.startswith("vllm:num_preemptions_total"))
    ok = got == ref and pre > 0
    print(("ok   " if ok else "FAIL ") + "4 requests over a 320-token pool: %d preemptions, same texts" % pre +
          ("" if ok else ": %r vs %r" % (got, ref)))
    sys.exit(0 if ok else 1)
if "--images" in sys.argv:
    imgs = sys.argv[sys.argv.index("--images") + 1].split(",")
    fails = 0
    for name, paths in (("one image", imgs[:1]), ("the same image again", imgs[:1]), ("%d images" % len(imgs), imgs)):
        a, b = chat_images(mpi, paths, "What is this?"), chat_images(one, paths, "What is this?")
        ta, tb = a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]
        cached = a["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        ok = ta == tb and a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        if name == "the same image again":  # the image's blocks hit the prefix cache on every rank
            ok = ok and cached > 0
        print(("ok   " if ok else "FAIL ") + "chat with %s: same greedy text as one process (%d prompt tokens, %d cached)"
              % (name, a["usage"]["prompt_tokens"], cached) + ("" if ok else ": %r vs %r" % (ta, tb)))
        fails += 0 if ok else 1
    sys.exit(1 if fails else 0)
short = [(i * 37 + 11) % 1000 for i in range(9)]
long_ = [(i * 53 + 7) % 1000 for i in range(150)]  # > 2 blocks of 64: cacheable
fails = 0


def check(name, cond, detail=""):
    global fails
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else ": " + detail))
    fails += 0 if cond else 1


for name, ids in (("short", short), ("long", long_)):
    a, b = comp(mpi, ids), comp(one, ids)
    check("%s prompt: same greedy text as one process" % name,
          a["choices"][0]["text"] == b["choices"][0]["text"], "%r vs %r" % (a["choices"][0]["text"], b["choices"][0]["text"]))
a, b = comp(mpi, long_), comp(one, long_)
cached = a["usage"]["prompt_tokens_details"]["cached_tokens"]
check("repeated prompt: %d cached tokens, same text" % cached,
      cached > 0 and a["choices"][0]["text"] == b["choices"][0]["text"], json.dumps(a))
# two at once
ref = [comp(one, long_[:100], 8), comp(one, short[::-1], 8)]
got = [None, None]
th = [threading.Thread(target=lambda k=k, ids=ids: got.__setitem__(k, comp(mpi, ids, 8)))
      for k, ids in enumerate((long_[:100], short[::-1]))]
for t in th:
    t.start()
for t in th:
    t.join()
check("two requests in flight: same texts",
      all(g and g["choices"][0]["text"] == r["choices"][0]["text"] for g, r in zip(got, ref)), repr(got))
if "--metrics" in sys.argv:
    def dist_lines(txt):
        return {l.rsplit(" ", 1)[0]: float(l.rsplit(" ", 1)[1]) for l in txt.splitlines()
                if l.startswith("k3:dist_")}
    grow = sys.argv[sys.argv.index("--grow") + 1].split(",") if "--grow" in sys.argv else ["ep_dispatch", "ep_combine"]
    m0 = dist_lines(metrics(mpi))
    comp(mpi, [(i * 29 + 3) % 1000 for i in range(12)], 4)
    m1 = dist_lines(metrics(mpi))
    names = ["k3:dist_%s{kind=\"%s\"%s}" % (n, k, d) for k in ("topk_exchange", "lse_merge", "ep_dispatch", "ep_combine")
             for n, d in (("bytes_total", ',dir="sent"'), ("bytes_total", ',dir="received"'), ("calls_total", ""),
                          ("seconds_total", ""))]
    check("/metrics has the cross-rank counters", all(n in m1 for n in names),
          "missing %s" % [n for n in names if n not in m1])
    # summed over the ranks, every byte sent is a byte received
    kinds = ("topk_exchange", "lse_merge", "ep_dispatch", "ep_combine", "control")
    check("/metrics: summed over the ranks, sent = received for every kind",
          all(m1.get('k3:dist_bytes_total{kind="%s",dir="sent"}' % k) ==
              m1.get('k3:dist_bytes_total{kind="%s",dir="received"}' % k) for k in kinds) and
          m1.get('k3:dist_bytes_total{kind="control",dir="received"}', 0) > 0, repr(m1))
    for k in grow:
        b, c = 'k3:dist_bytes_total{kind="%s",dir="sent"}' % k, 'k3:dist_calls_total{kind="%s"}' % k
        check("/metrics: %s bytes and calls grow after a request (%s -> %s bytes)" % (k, m0.get(b), m1.get(b)),
              b in m0 and c in m0 and m1.get(b, 0) > m0[b] > 0 and m1.get(c, 0) > m0[c] > 0)
sys.exit(1 if fails else 0)
