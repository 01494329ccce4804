"""KV between prefill and decode layouts of different (PP, TP), through the real managers, the
bootstrap server and pdserve's TCP transport between separate processes (docs/ARCHITECTURE.md
section 6): the bootstrap routes each decode rank to the prefill ranks that hold its layers and
KV heads, each prefill rank writes only those into its pages, and the bytes each decode rank
counts are its layer x head overlap with each prefill rank, token by token."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
from kv_transfer_workers import RankProcess
from test_kv_transfer_layouts import DONE, NUM_PAGES, ROOMS, _close_managers, _tables

from pdserve.consensus.kvpoll import KVPoll
from pdserve.engine.model.config import split_layers
from pdserve.kv_transfer import BootstrapServer

NUM_LAYERS = 6
HEADS = 2
TOKEN_BYTES = 128  # all heads: 2 KV heads x head dim 16 x fp32
HEAD_BYTES = TOKEN_BYTES // HEADS
# (prefill PP, TP), (decode PP, TP): #49's layouts, and the two TP sizes against a PP cut
LAYOUTS = [
    ((1, 2), (1, 1)),
    ((1, 1), (1, 2)),
    ((2, 2), (1, 2)),
    ((1, 2), (2, 1)),
    ((2, 1), (1, 2)),
    ((2, 2), (2, 1)),
]


@pytest.fixture(scope="module")
def ranks():
    ctx = mp.get_context("spawn")
    procs: dict[str, RankProcess] = {}
    try:
        for name in ["P0", "P1", "P2", "P3", "D0", "D1"]:
            procs[name] = RankProcess(ctx, name, protocol="tcp")
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def layout(pp: int, tp: int) -> list[tuple[int, int, int, int]]:
    """Each rank's (layer start, end, head start, end), by PP rank x TP size + TP rank."""
    share = HEADS // tp
    return [
        (a, b, t * share, (t + 1) * share)
        for a, b in split_layers(NUM_LAYERS, pp)
        for t in range(tp)
    ]


def overlap_bytes(src, dst, tokens: int) -> int:
    layers = max(0, min(src[1], dst[1]) - max(src[0], dst[0]))
    heads = max(0, min(src[3], dst[3]) - max(src[2], dst[2]))
    return layers * heads * HEAD_BYTES * 2 * tokens


@pytest.mark.parametrize("p,d", LAYOUTS, ids=[f"{a[0]}x{a[1]}-{b[0]}x{b[1]}" for a, b in LAYOUTS])
def test_kv_moves_between_tp_layouts(p, d, ranks):
    name = f"tp-{p}-{d}"
    cfg = {"protocol": "tcp", "checksum": True}
    src, dst = layout(*p), layout(*d)
    prefill = [ranks[f"P{i}"] for i in range(len(src))]
    decode = [ranks[f"D{j}"] for j in range(len(dst))]
    server = BootstrapServer().start()
    rng = random.Random(str(name))
    try:
        for i, (w, s) in enumerate(zip(prefill, src, strict=True)):
            tp = (i % p[1], p[1])
            w.call(
                "prefill",
                name,
                cfg,
                i // p[1],
                p[0],
                s[:2],
                NUM_PAGES,
                16,
                TOKEN_BYTES,
                server.addr,
                tp=tp,
                heads=(*s[2:], HEADS),
            )
        for j, (w, s) in enumerate(zip(decode, dst, strict=True)):
            tp = (j % d[1], d[1])
            w.call(
                "decode",
                name,
                cfg,
                j // d[1],
                dst,
                NUM_PAGES,
                16,
                TOKEN_BYTES,
                tp=tp,
                heads=(*s[2:], HEADS),
            )
        assert all(w.call("wait_registered", name, 10) for w in prefill)
        ptabs, dtabs = _tables(rng, 16), _tables(rng, 16)
        rooms = {
            rng.getrandbits(63): (n, ends, ptabs[k], dtabs[k], k)
            for k, (n, ends) in enumerate(ROOMS)
        }
        for room, (n, _, ptab, dtab, slot) in rooms.items():
            for w in prefill:
                w.call("fill", name, room, ptab, n)
                w.call("create_sender", name, room)
            for w in decode:
                w.call("create_receiver", name, room, server.addr)
                w.call("register", name, room, dtab, slot)
        for room, (n, ends, ptab, _, _) in rooms.items():
            start = 0
            for end in ends:
                for w in prefill:
                    aux = f"aux-{room}".encode() if end == n else None
                    w.call("send_chunk", name, room, ptab, start, end, end == n, aux)
                start = end
        for w in prefill + decode:
            got = w.call("wait", name, list(rooms), DONE, 30)
            assert all(s == KVPoll.Success for s, _, _ in got.values()), (w.name, got)
        tokens = sum(n for n, *_ in rooms.values())
        for w, mine in zip(decode, dst, strict=True):
            for room, (n, _, _, dtab, _) in rooms.items():
                assert w.call("check", name, room, dtab, n) == 0, (w.name, room, "KV differs")
                assert w.call("read_aux", name, room) == f"aux-{room}".encode()
            st = w.call("stats", name)
            assert not st["failures"] and not st["dropped"], st
            want = sum(overlap_bytes(s, mine, tokens) for s in src)
            assert st["bytes_received"] == want, (w.name, st["bytes_received"], want)
        # the heads path moves token by token: exactly the overlap; whole pages only where the
        # heads are the same on both sides
        sent = sum(w.call("stats", name)["bytes_sent"] for w in prefill)
        assert sent >= NUM_LAYERS * 2 * TOKEN_BYTES * tokens
    finally:
        _close_managers(prefill + decode, name)
        server.stop()
