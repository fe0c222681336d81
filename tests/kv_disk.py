"""kv_disk.py -- the prefix cache's disk tier through `k3 serve --kv-cache-dir` (docs/kvstore.md).

Usage: python tests/kv_disk.py K3_BINARY [--isa NAME] [--only TEXT]
On tests/models/tiny, tiny-dsa (prompts past its indexer's top-k of 8) and official-tiny, at a
snapshot boundary, a block boundary, between them, past a run of blocks: the greedy text of a cold
run equals that of a RAM hit, of a disk hit after a restart, and of a disk hit from a second
instance sharing the directory, and the disk hit reads exactly the tokens the RAM hit found. Each
fault is a miss (or a failed load) with the cold run's text and the reason counted: a torn run
file, a damaged payload, another quant mode's file under this one's name, a full disk (a 192 KB
tmpfs; root), two instances writing the same prompt at once (one file per key, nothing left in
tmp/). vLLM's cache_salt and --prefix-cache-per-key keep tenants apart in RAM and on disk. The KV
events (pyzmq + msgspec, vLLM's field layout) agree with /metrics: the blocks BlockStored and
BlockRemoved with medium DISK are the tier's published and evicted blocks, the removed ones were
stored before. Lines `ok   kvdisk: NAME`, closing `kvdisk: N passed, N failed, N skipped`.
--isa passes k3 serve's kernel table (on a Xeon whose AMX table makes a token's numbers depend on
the batch's composition, the equality checks need `--isa avx512`).
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading

import harness as h

ISA = []
ONLY = None
for i, a in enumerate(sys.argv):
    if a == "--isa" and i + 1 < len(sys.argv):
        ISA = ["--isa", sys.argv[i + 1]]
    if a == "--only" and i + 1 < len(sys.argv):
        ONLY = sys.argv[i + 1]
suite = h.Suite("kvdisk", only=ONLY)
TMP = tempfile.mkdtemp(prefix="k3-kvdisk-")
DSA = "tests/models/tiny-dsa"
OFFICIAL = "tests/models/official-tiny"
BS = 16  # tokens per block; a KDA snapshot every 4 blocks (64 tokens) and at each prompt's end


def serve(model, d, *extra, key=None):
    return h.Server(model, "--block-size", str(BS), "--cache-tokens", "4096", "--max-num-seqs", "4",
                    "--kv-cache-dir", d, *ISA, *extra, key=key)


def complete(s, ids, max_tokens=8, salt=None, headers=None):
    body = {"model": s.name, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = h.post(s.url + "/v1/completions", json_body=body, headers=headers, timeout=120)
    assert r.status_code == 200, (r.status_code, r.text[:300])
    j = r.json()
    return j["choices"][0]["text"], j["usage"]["prompt_tokens_details"]["cached_tokens"]


def m(s, name, **labels):
    return s.metric(name, **labels) or 0


def ext_hits(s):
    return m(s, "vllm:external_prefix_cache_hits_total")


def settle(s):
    """Waits until the saves in flight are written (a state of /metrics, never a fixed sleep)."""
    h.wait_until(lambda: m(s, "k3:kv_disk_saves_in_flight") == 0 and m(s, "k3:kv_disk_requests", state="loading") == 0,
                 60, "the disk tier's saves to finish")


def ids_of(n, seed):
    r = random.Random(seed)
    return [r.randrange(10, 700) for _ in range(n)]


def newdir(name):
    d = os.path.join(TMP, name)
    shutil.rmtree(d, ignore_errors=True)
    return d


def files(d, sub):
    p = os.path.join(d, sub)
    return sorted(os.listdir(p)) if os.path.isdir(p) else []


# ---- the same text: cold, RAM hit, disk hit after a restart, a second instance -------------------------

def roundtrip(model, lengths):
    label = os.path.basename(model)
    d = newdir(label)
    prompts = {n: ids_of(n, n * 7 + len(label)) for n in lengths}
    cold, ram = {}, {}
    a = serve(model, d)
    try:
        for n, ids in prompts.items():
            cold[n] = complete(a, ids)
            assert cold[n][1] == 0, f"{n} tokens: a cold run found {cold[n][1]} cached"
        settle(a)
        e0 = ext_hits(a)
        # twice: the first hit leaves a snapshot where its prompt leaves the cached blocks (the
        # junction), the second hits there too; the disk holds both
        for _ in range(2):
            for n, ids in prompts.items():
                ram[n] = complete(a, ids)
                assert ram[n][0] == cold[n][0], \
                    f"{n} tokens: a RAM hit of {ram[n][1]}: {ram[n][0]!r} != cold {cold[n][0]!r}"
        assert ext_hits(a) == e0, "a RAM hit read the disk"
        settle(a)
    finally:
        a.stop()
    suite_note = {n: ram[n][1] for n in prompts}
    b = serve(model, d)
    c = None
    try:
        for n, ids in prompts.items():
            e0 = ext_hits(b)
            text, cached = complete(b, ids)
            assert text == cold[n][0], f"{n} tokens: a disk hit of {cached}: {text!r} != cold {cold[n][0]!r}"
            assert cached == ram[n][1], f"{n} tokens: the disk hit read {cached} tokens, the RAM hit {ram[n][1]}"
            assert ext_hits(b) - e0 == cached, f"{n} tokens: external hits grew by {ext_hits(b) - e0}, not {cached}"
        assert sum(suite_note.values()) > 0, "no prompt hit at all"
        # a second instance on the same directory reads what the first writes
        c = serve(model, d)
        q = ids_of(150, 99)
        tb, cb = complete(b, q)
        assert cb == 0
        settle(b)
        e0 = ext_hits(c)
        tc, cc = complete(c, q)
        assert tc == tb, f"the second instance's disk hit of {cc}: {tc!r} != {tb!r}"
        assert cc > 0 and ext_hits(c) - e0 == cc, f"the second instance read {cc} tokens from disk"
        assert m(b, "k3:kv_disk_loads_total", result="failed") == 0
    finally:
        b.stop()
        if c:
            c.stop()
    return suite_note


def roundtrips():
    # a snapshot boundary (64), one past it (65), a block boundary between snapshots (96), between (87),
    # long (200), past a whole run of blocks (1100 tokens: 64 blocks of 16 make a run file on tiny)
    for model, lengths in ((h.TINY, (64, 65, 87, 96, 200, 1100)), (DSA, (65, 87, 96, 150)),
                           (OFFICIAL, (65, 87, 96, 200))):
        suite.check(f"{os.path.basename(model)}: cold = RAM hit = disk hit after a restart = a second instance's "
                    f"disk hit ({', '.join(map(str, lengths))} tokens)", lambda model=model, lengths=lengths:
                    roundtrip(model, lengths))


# ---- faults: each a miss with the cold run's text ---------------------------------------------------------

def cold_then(model, d, ids, *extra):
    a = serve(model, d, *extra)
    try:
        text, _ = complete(a, ids)
        settle(a)
    finally:
        a.stop()
    return text


def torn_and_damaged():
    ids = ids_of(87, 5)
    d = newdir("torn")
    cold = cold_then(h.TINY, d, ids)
    runs = files(d, "runs")
    assert runs, "no run file was written"
    path = os.path.join(d, "runs", runs[0])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    b = serve(h.TINY, d)
    try:
        text, cached = complete(b, ids)
        assert text == cold and cached == 0, (text, cold, cached)
        assert m(b, "k3:kv_disk_refused_total", reason="torn") >= 1
        assert ext_hits(b) == 0
        assert "refused (a miss)" in b.text(), "no log line names the miss"
    finally:
        b.stop()
    # a payload byte flipped: the header reads fine, the block's checksum fails at load
    d = newdir("damaged")
    cold = cold_then(h.TINY, d, ids)
    path = os.path.join(d, "runs", files(d, "runs")[0])
    with open(path, "r+b") as f:
        # a byte of the first block: the payload starts at the page after the header (its size at byte 12)
        hdr_bytes = int.from_bytes(f.read(16)[12:16], "little")
        f.seek((hdr_bytes + 4095) // 4096 * 4096 + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    b = serve(h.TINY, d)
    try:
        text, cached = complete(b, ids)
        assert text == cold, (text, cold)
        assert m(b, "k3:kv_disk_loads_total", result="failed") == 1
        assert m(b, "k3:kv_disk_refused_total", reason="checksum") == 1
        assert ext_hits(b) == 0
        assert "checksum" in b.text()
        settle(b)
    finally:
        b.stop()
    # the damaged file was removed, and the prompt computed again saved a good one
    c = serve(h.TINY, d)
    try:
        text, cached = complete(c, ids)
        assert text == cold and cached > 0 and ext_hits(c) == cached, (text, cold, cached)
    finally:
        c.stop()


def io_path_and_policy():
    """The path the tier's reads and writes take (O_DIRECT, or the page cache where the filesystem has
    no O_DIRECT) in the log and on /metrics; the stride snapshots the policy keeps in RAM only counted
    on /metrics while only the prompt's end goes to disk."""
    d = newdir("iopath")
    a = serve(h.TINY, d)
    try:
        direct = m(a, "k3:kv_disk_direct_io")
        said = "direct I/O" if direct == 1 else "buffered I/O"
        assert f"kv cache: {d}: {said}" in a.text(), f"the log does not say {said!r}: {a.text()[-600:]}"
        ids = ids_of(200, 12)  # stride snapshots at 64 and 128; the prompt's end at 192
        text, _ = complete(a, ids)
        settle(a)
        ram_only = m(a, "k3:kv_disk_snaps_ram_only_total")
        snaps = files(d, "snaps")
        assert ram_only >= 2 and len(snaps) == 1, f"{ram_only} snapshots in RAM only, {len(snaps)} on disk"
        if direct == 1:
            assert m(a, "vllm:kv_offload_store_bytes_total") > 0
    finally:
        a.stop()
    b = serve(h.TINY, d)
    try:
        text2, cached = complete(b, ids)
        assert text2 == text and cached == 192, (text2, text, cached)
        assert m(b, "k3:kv_disk_direct_io") == direct
    finally:
        b.stop()


def other_mode():
    """A file another quant mode wrote, under the name this mode looks for: refused (another quant mode)."""
    ids = ids_of(87, 6)
    d = newdir("modes")
    cold_then(h.TINY, d, ids)
    none_runs = set(files(d, "runs"))
    cold_w8 = cold_then(h.TINY, d, ids, "--quant", "w8a8")
    w8_runs = set(files(d, "runs")) - none_runs
    assert len(none_runs) == 1 and len(w8_runs) == 1, (none_runs, w8_runs)
    w8 = os.path.join(d, "runs", w8_runs.pop())
    shutil.copyfile(os.path.join(d, "runs", none_runs.pop()), w8)
    b = serve(h.TINY, d, "--quant", "w8a8")
    try:
        text, cached = complete(b, ids)
        assert text == cold_w8 and cached == 0, (text, cold_w8, cached)
        assert m(b, "k3:kv_disk_refused_total", reason="model") >= 1
        assert "another quant mode" in b.text(), "the log does not say why"
    finally:
        b.stop()
    # another model on the same directory: its own namespace, nothing of tiny's is read
    o = serve(DSA, d)
    try:
        t1, c1 = complete(o, ids)
        assert c1 == 0 and ext_hits(o) == 0
    finally:
        o.stop()


def full_disk():
    if os.geteuid() != 0:
        raise h.Skip("mounting a tmpfs needs root")
    mnt = tempfile.mkdtemp(prefix="k3-kvdisk-full-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", mnt], capture_output=True, text=True)
    if r.returncode:
        os.rmdir(mnt)
        raise h.Skip(f"mount -t tmpfs failed: {r.stderr.strip()}")
    try:
        ids = ids_of(600, 8)  # 37 blocks of 10 KB in one run file: more than the tmpfs holds
        d = os.path.join(mnt, "cache")
        a = serve(h.TINY, d)
        try:
            cold, _ = complete(a, ids)
            settle(a)
            assert m(a, "k3:kv_disk_saves_total", result="failed") >= 1, "no save failed on a full disk"
            assert "No space left on device" in a.text()
        finally:
            a.stop()
        assert not os.listdir(os.path.join(d, "tmp")), "a failed save left a file in tmp/"
        b = serve(h.TINY, d)
        try:
            text, cached = complete(b, ids)
            assert text == cold, (text, cold)
            assert m(b, "k3:kv_disk_loads_total", result="failed") == 0
        finally:
            b.stop()
    finally:
        subprocess.run(["umount", mnt])
        os.rmdir(mnt)


def concurrent_writers():
    ids = ids_of(1100, 9)  # long enough that both instances look it up before either has saved it
    d = newdir("writers")
    a1, a2 = serve(h.TINY, d), serve(h.TINY, d)
    out = {}
    try:
        ts = [threading.Thread(target=lambda s=s, k=k: out.__setitem__(k, complete(s, ids))) for k, s in
              (("a1", a1), ("a2", a2))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert out["a1"][0] == out["a2"][0], out
        print(f"    both instances cold: {out['a1'][1] == 0 and out['a2'][1] == 0} (cached {out['a1'][1]}, "
              f"{out['a2'][1]})", flush=True)
        settle(a1)
        settle(a2)
    finally:
        a1.stop()
        a2.stop()
    ls = json.loads(subprocess.run([h.K3, "cache", "ls", d, "--json"], capture_output=True, text=True,
                                   check=True).stdout)
    assert ls["tmp_files"] == 0 and ls["bad_files"] == 0 and ls["counter_bytes"] == ls["bytes"], ls
    runs = files(d, "runs")
    assert len(runs) == 2, runs  # a full run of 64 blocks and the partial one after it
    b = serve(h.TINY, d)
    try:
        text, cached = complete(b, ids)
        assert text == out["a1"][0] and cached > 0, (text, cached)
    finally:
        b.stop()


# ---- tenants ------------------------------------------------------------------------------------------

def salts():
    ids = ids_of(87, 10)
    d = newdir("salts")
    a = serve(h.TINY, d)
    try:
        ta, ca = complete(a, ids, salt="tenant-a")
        assert ca == 0
        t, c = complete(a, ids, salt="tenant-a")
        assert c > 0 and t == ta, "the same salt did not hit"
        t, c = complete(a, ids, salt="tenant-b")
        assert c == 0 and t == ta, "another salt hit tenant-a's prompt in RAM"
        t, c = complete(a, ids)
        assert c == 0, "no salt hit a salted prompt"
        r = h.post(a.url + "/v1/completions", json_body={"model": a.name, "prompt": ids, "cache_salt": ""})
        assert r.status_code == 400 and "cache_salt" in r.text, r.text
        settle(a)
    finally:
        a.stop()
    b = serve(h.TINY, d)
    try:
        t, c = complete(b, ids, salt="tenant-c")
        assert c == 0 and ext_hits(b) == 0, "another salt hit tenant-a's prompt on disk"
        t, c = complete(b, ids, salt="tenant-a")
        assert c > 0 and t == ta and ext_hits(b) == c, "tenant-a's own prompt was not a disk hit"
    finally:
        b.stop()
    # a salt per API key (no --api-key here: a gateway in front presents each tenant's own)
    d = newdir("perkey")
    k = serve(h.TINY, d, "--prefix-cache-per-key")
    try:
        k1, k2 = {"Authorization": "Bearer key-one"}, {"Authorization": "Bearer key-two"}
        t1, c = complete(k, ids, headers=k1)
        assert c == 0
        t, c = complete(k, ids, headers=k1)
        assert c > 0 and t == t1
        t, c = complete(k, ids, headers=k2)
        assert c == 0, "one key hit another's prompt"
    finally:
        k.stop()


# ---- the events against /metrics ---------------------------------------------------------------------

def events():
    try:
        import msgspec
        import zmq
        import kv_events as kve
    except ImportError as e:
        raise h.Skip(f"pyzmq and msgspec: {e}")
    d = newdir("events")
    ep, rep_ep = "ipc://" + os.path.join(TMP, "events.sock"), "ipc://" + os.path.join(TMP, "replay.sock")
    ctx = zmq.Context()
    got = []

    def replay():
        """The whole stream from batch 0, through the replay socket."""
        r = ctx.socket(zmq.DEALER)
        r.connect(rep_ep)
        r.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while r.poll(10000):
            fr = r.recv_multipart()
            if int.from_bytes(fr[1], "big", signed=True) == -1:
                break
            out.append([fr[2]])
        r.close(0)
        got[:] = out
        return out
    # a budget of about three prompts' files: the later ones evict the earlier ones
    s = serve(h.TINY, d, "--kv-events-endpoint", ep, "--kv-events-replay-endpoint", rep_ep, "--kv-cache-disk-bytes",
              "600K")
    try:
        for i in range(8):
            complete(s, ids_of(300, 100 + i))
            settle(s)
        h.wait_until(lambda: m(s, "k3:kv_disk_blocks_removed_total") > 0, 30, "an eviction")

        def totals():
            t = {"gs": 0, "gr": 0, "ds": 0, "dr": 0}
            for frames in replay():
                batch = msgspec.msgpack.decode(frames[-1], type=kve.KVEventBatch)
                for ev in batch.events:
                    if isinstance(ev, kve.BlockStored):
                        t["ds" if ev.medium == "DISK" else "gs"] += len(ev.block_hashes)
                    elif isinstance(ev, kve.BlockRemoved):
                        t["dr" if ev.medium == "DISK" else "gr"] += len(ev.block_hashes)
            return t
        seen = []

        def agree():
            """One scrape of /metrics against the whole stream replayed after it (the publisher
            flushes within 10 ms: they agree once it has sent what the tier counted)."""
            mm = s.metrics()
            want = {k: h.metric(mm, "k3:kv_events_blocks_total", event=e, medium=md) for k, e, md in
                    (("gs", "stored", "GPU"), ("gr", "removed", "GPU"), ("ds", "stored", "DISK"),
                     ("dr", "removed", "DISK"))}
            tier = (h.metric(mm, "k3:kv_disk_blocks_stored_total"), h.metric(mm, "k3:kv_disk_blocks_removed_total"))
            t = totals()
            seen[:] = [t, want, tier]
            return t == want and (t["ds"], t["dr"]) == tier and t["dr"] > 0
        try:
            h.wait_until(agree, 20, "the events to add up to /metrics'", every=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}: events, /metrics, the tier's counters: {seen}") from None
        stored, removed_ok = set(), True
        for frames in got:
            for ev in msgspec.msgpack.decode(frames[-1], type=kve.KVEventBatch).events:
                if isinstance(ev, kve.BlockStored) and ev.medium == "DISK":
                    assert len(ev.token_ids) == BS * len(ev.block_hashes) and ev.block_size == BS
                    stored.update(ev.block_hashes)
                elif isinstance(ev, kve.BlockRemoved) and ev.medium == "DISK":
                    removed_ok &= all(x in stored for x in ev.block_hashes)
        assert removed_ok, "a DISK BlockRemoved names a block never stored on DISK"
        assert m(s, "k3:kv_disk_bytes") <= 600 * 1024, "the directory is over its budget"
    finally:
        s.stop()
        ctx.term()


def run():
    roundtrips()
    suite.check("a torn run file and a damaged payload: misses with the cold text, counted and logged",
                torn_and_damaged)
    suite.check("the I/O path (O_DIRECT or the page cache) in the log and /metrics; RAM-only snapshots counted",
                io_path_and_policy)
    suite.check("another quant mode's file under this mode's name: refused, the cold text; another model reads "
                "nothing", other_mode)
    suite.check("a full disk (a 192 KB tmpfs): the save fails, nothing in tmp/, a miss with the cold text", full_disk)
    suite.check("two instances writing one prompt at once: one file per key, then a disk hit", concurrent_writers)
    suite.check("cache_salt and --prefix-cache-per-key keep tenants apart in RAM and on disk", salts)
    suite.check("the KV events' DISK blocks (stored, removed by eviction) equal /metrics'", events)


def cleanup():
    h.stop_all()
    shutil.rmtree(TMP, ignore_errors=True)


suite.main(run, cleanup)
