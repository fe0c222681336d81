# mpi_stream.py -- a client for tests/mpi.sh: one long stream on a server under mpirun
# (max_tokens 3000, ignore_eos), "started" on stdout once its first event came, then read to
# its end; the last line says how it ended:
#   ending: error CODE MESSAGE   an error event, [DONE] and the chunked body's end
#   ending: finished             its finish_reason and [DONE]
#   ending: cut                  anything else (a bare end: what no client may get)
# With --health, /health is polled every 100 ms meanwhile and the first 503 is printed as
# "health: 503 MESSAGE" (the statuses seen before it must all be 200).
# Usage: python3 tests/mpi_stream.py PORT [--health] [--host ADDR]  (ADDR: 127.0.0.1 unless given,
# e.g. a test host's address in tests/hosts.sh)
import json
import socket
import sys
import threading
import time

port = int(sys.argv[1])
health = "--health" in sys.argv
HOST = sys.argv[sys.argv.index("--host") + 1] if "--host" in sys.argv else "127.0.0.1"
stop = threading.Event()


def poll_health():
    seen = []
    while not stop.is_set():
        try:
            s = socket.create_connection((HOST, port), timeout=2)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while True:
                d = s.recv(4096)
                if not d:
                    break
                data += d
            s.close()
            code = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else -1
        except OSError:
            code = -1
        if code == 503:
            msg = json.loads(data.partition(b"\r\n\r\n")[2])["error"]["message"]
            print("health: 503 %s (after %d x 200)" % (msg, seen.count(200)), flush=True)
            return
        if code != 200:
            print("health: %d before any 503 (after %d x 200)" % (code, seen.count(200)), flush=True)
            return
        seen.append(code)
        time.sleep(0.1)


body = json.dumps({"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}).encode()
s = socket.create_connection((HOST, port), timeout=120)
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n" % len(body) + body)
data = b""
started = False
th = None
while True:
    try:
        d = s.recv(65536)
    except OSError:
        break
    if not d:
        break
    data += d
    if not started and b"data: " in data:
        started = True
        print("started", flush=True)
        if health:
            th = threading.Thread(target=poll_health)
            th.start()
stop.set()
if th:
    th.join(10)
head, _, rest = data.partition(b"\r\n\r\n")
# the chunked body: its chunks, and whether the terminating chunk came
payload, pos, complete = b"", 0, False
while True:
    eol = rest.find(b"\r\n", pos)
    if eol < 0:
        break
    size = int(rest[pos:eol] or b"0", 16)
    if size == 0:
        complete = rest[eol + 2:eol + 4] == b"\r\n"
        break
    payload += rest[eol + 2:eol + 2 + size]
    pos = eol + 2 + size + 2
events = [ln[6:] for ln in payload.decode(errors="replace").split("\n") if ln.startswith("data: ")]
if complete and len(events) >= 2 and events[-1] == "[DONE]" and events[-2].startswith('{"error"'):
    e = json.loads(events[-2])["error"]
    print("ending: error %d %s" % (e["code"], e["message"]), flush=True)
elif complete and events and events[-1] == "[DONE]":
    print("ending: finished", flush=True)
else:
    print("ending: cut (%d events, terminating chunk %s)" % (len(events), complete), flush=True)
