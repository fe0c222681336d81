"""The KV events of an engine (tests/kvstore/events_driver.c) decoded as
vLLM's consumers decode them: msgspec structs with vLLM's field layout
(vllm/distributed/kv_events.py: the batch a positional array, each event a
map tagged by "type" from vLLM 0.26 on; positional arrays before), strictly
(a required field missing or of another type fails). The whole stream comes
back through the replay socket; the live PUB messages are three frames
(topic, 8-byte big-endian sequence number, payload) equal to the replayed
ones; the blocks the events leave stored are the ones the engine's prefix
cache holds, and their counts are the publisher's.
Usage: python tests/kv_events.py build/k3-kvev-driver   (prints ok/FAIL lines)
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

import msgspec
import zmq


# ---- vLLM's field layout, as its publisher declares it ----------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# the positional layout of vLLM 0.10 - 0.25
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyBatch(EventBatch):
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]


fails = 0


def check(name, cond, detail=""):
    global fails
    if cond:
        print(f"ok   kvstore: kv events: {name}")
    else:
        fails += 1
        print(f"FAIL kvstore: kv events: {name}" + (f"\n    {detail}" if detail else ""))


def session(driver, legacy):
    tag = "legacy arrays" if legacy else "tagged maps"
    tmp = tempfile.mkdtemp(prefix="k3-kvev-")
    pub_ep, replay_ep = f"ipc://{tmp}/events", f"ipc://{tmp}/replay"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    live = []
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            if sub.poll(50):
                live.append(sub.recv_multipart())

    args = [driver, pub_ep, replay_ep] + (["legacy"] if legacy else [])
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = None
    t = threading.Thread(target=listen)
    try:
        # the engine runs once this subscriber's handshake is done
        listening = p.stdout.readline().strip() == "listening"
        sub.connect(pub_ep)
        shook = mon.poll(10000) and mon.recv_multipart()
        check(f"{tag}: a subscriber connects to the publisher", listening and bool(shook))
        t.start()
        p.stdin.write("go\n")
        p.stdin.flush()
        line = p.stdout.readline()
        state = json.loads(line) if line.startswith("{") else None
        ready = p.stdout.readline().strip() == "ready"
        check(f"{tag}: the driver ran", state is not None and ready, p.stderr.read() if state is None else "")
        if state is None:
            return
        # the whole stream through the replay socket
        rep = ctx.socket(zmq.DEALER)
        rep.connect(replay_ep)
        rep.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while rep.poll(10000):
            fr = rep.recv_multipart()
            if len(fr) != 3 or fr[0] != b"":
                replayed = None
                break
            seq = int.from_bytes(fr[1], "big", signed=True)
            if seq == -1:
                break
            replayed.append((seq, fr[2]))
        rep.close(0)
        check(f"{tag}: the replay socket returns every batch from 0, then -1",
              replayed is not None and [s for s, _ in replayed] == list(range(len(replayed))) and len(replayed) == state["batches"],
              f"{replayed and [s for s, _ in replayed]} vs {state['batches']} batches")
        if not replayed:
            return
        dec = msgspec.msgpack.Decoder(LegacyBatch if legacy else KVEventBatch)
        try:
            batches = [dec.decode(b) for _, b in replayed]
            decoded = True
            err = ""
        except msgspec.ValidationError as e:
            decoded, err = False, str(e)
        check(f"{tag}: every batch decodes with vLLM's layout", decoded, err)
        if not decoded:
            return
        Stored = LegacyBlockStored if legacy else BlockStored
        Removed = LegacyBlockRemoved if legacy else BlockRemoved
        Cleared = LegacyAllBlocksCleared if legacy else AllBlocksCleared
        evs = [e for b in batches for e in b.events]
        check(f"{tag}: the stream starts with AllBlocksCleared", evs and isinstance(evs[0], Cleared))
        check(f"{tag}: batches carry a time and data_parallel_rank 0",
              all(b.data_parallel_rank == 0 and b.ts > 1e9 for b in batches))
        live_set = set()
        ok_blocks, ok_parent, ok_removed = True, True, True
        n_stored = n_removed = 0
        for e in evs:
            if isinstance(e, Cleared):
                live_set.clear()
            elif isinstance(e, Stored):
                n_stored += len(e.block_hashes)
                ok_blocks &= e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes) and e.medium == "GPU"
                ok_blocks &= e.lora_id is None and all(0 <= t < 1024 for t in e.token_ids)
                if not legacy:
                    ok_blocks &= e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention"
                    ok_blocks &= e.extra_keys == [None] * len(e.block_hashes) and e.lora_name is None
                ok_parent &= e.parent_block_hash is None or e.parent_block_hash in live_set
                live_set.update(e.block_hashes)
            elif isinstance(e, Removed):
                n_removed += len(e.block_hashes)
                ok_removed &= e.medium == "GPU" and all(h in live_set for h in e.block_hashes)
                live_set.difference_update(e.block_hashes)
        check(f"{tag}: BlockStored fields (block_size, token_ids per block, medium GPU, group 0)", ok_blocks)
        check(f"{tag}: a stored block's parent is a block stored before it", ok_parent)
        check(f"{tag}: BlockRemoved names stored blocks", ok_removed)
        check(f"{tag}: the blocks left stored are the engine's prefix cache",
              live_set == set(state["cached"]) and len(state["cached"]) > 0,
              f"events {sorted(live_set)} engine {sorted(state['cached'])}")
        check(f"{tag}: counts equal the publisher's ({state['stored_blocks']} stored, {state['removed_blocks']} removed)",
              n_stored == state["stored_blocks"] and n_removed == state["removed_blocks"] and n_removed > 0)
        check(f"{tag}: the engine hit the prefix cache the events announced", state["prefix_hits"] > 0)
        # live messages: three frames, each payload the replayed one of its number
        stop.set()
        t.join()
        by_seq = dict(replayed)
        good = bool(live) and all(len(m) == 3 and m[0] == b"kv-events" and len(m[1]) == 8 and
                                  by_seq.get(int.from_bytes(m[1], "big")) == m[2] for m in live)
        check(f"{tag}: live PUB messages are [topic, seq, payload] equal to the replayed ones ({len(live)} seen)", good)
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        try:
            p.stdin.write("quit\n")
            p.stdin.close()
        except OSError:
            pass
        try:
            rc = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = -1
        check(f"{tag}: the driver exits cleanly", rc == 0)
        sub.disable_monitor()
        mon.close(0)
        sub.close(0)
        ctx.term()
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)


if __name__ == "__main__":
    drv = sys.argv[1] if len(sys.argv) > 1 else "build/k3-kvev-driver"
    session(drv, legacy=False)
    session(drv, legacy=True)
    sys.exit(1 if fails else 0)
