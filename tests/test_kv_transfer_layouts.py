"""Byte-exact KV transfer between separate rank processes over loopback, for independent
prefill/decode PP sizes and page sizes, scattered page tables and chunked sending: on pdserve's
authenticated TCP transport (the default) and on Mooncake's TCP transport."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
from kv_transfer_workers import RankProcess

from pdserve.consensus.kvpoll import KVPoll
from pdserve.engine.model.config import split_layers
from pdserve.kv_transfer import BootstrapServer
from pdserve.kv_transfer.layout import pages_for

NUM_LAYERS = 30
TOKEN_BYTES = 128  # 2 KV heads x head dim 16 x fp32
NUM_PAGES = 64
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 3), (3, 2), (3, 5)]
PAGE_CASES = [(16, 16, False), (4, 4, False), (16, 4, True)]  # prefill page, decode page, checksum
ROOMS = [(150, [50, 150]), (37, [37])]  # prompt tokens, chunk ends
DONE = [int(KVPoll.Success), int(KVPoll.Failed)]


@pytest.fixture(scope="module", params=["tcp", "mooncake-tcp"])
def ranks(request):
    ctx = mp.get_context("spawn")
    procs: dict[str, RankProcess] = {}
    try:
        for name in ["P0", "P1", "P2", "D0", "D1", "D2", "D3", "D4"]:
            procs[name] = RankProcess(ctx, name, protocol=request.param)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _tables(rng: random.Random, page_size: int) -> list[list[int]]:
    """Disjoint page tables, one per room: the first sorted with gaps (contiguous runs to merge),
    the others shuffled (scattered)."""
    free = list(range(NUM_PAGES))
    out = []
    for k, (n, _) in enumerate(ROOMS):
        need = pages_for(n, page_size)
        pick = (
            sorted(rng.sample(free[: need + need // 2 + 2], need))
            if k == 0
            else rng.sample(free, need)
        )
        free = [p for p in free if p not in pick]
        out.append(pick)
    return out


def _start_managers(prefill, decode, name, cfg, p_slices, d_slices, p_ps, d_ps, server) -> None:
    """Starts transfer manager `name` on every prefill and decode rank; waits until every prefill
    rank registered with the bootstrap server."""
    for i, p in enumerate(prefill):
        p.call(
            "prefill",
            name,
            cfg,
            i,
            len(prefill),
            p_slices[i],
            NUM_PAGES,
            p_ps,
            TOKEN_BYTES,
            server.addr,
        )
    for j, d in enumerate(decode):
        d.call("decode", name, cfg, j, d_slices, NUM_PAGES, d_ps, TOKEN_BYTES)
    assert all(p.call("wait_registered", name, 10) for p in prefill)


def _open_rooms(prefill, decode, name, rng: random.Random, p_ps, d_ps, server) -> dict:
    """Opens a room per ROOMS entry on every rank (prefill filled, decode registered); returns
    {room: (tokens, chunk ends, prefill table, decode table, aux slot)}."""
    rooms = {}
    ptabs, dtabs = _tables(rng, p_ps), _tables(rng, d_ps)
    for k, (n, ends) in enumerate(ROOMS):
        rooms[rng.getrandbits(63)] = (n, ends, ptabs[k], dtabs[k], k)
    for room, (n, _, ptab, dtab, slot) in rooms.items():
        for p in prefill:
            p.call("fill", name, room, ptab, n)
            p.call("create_sender", name, room)
        for d in decode:
            d.call("create_receiver", name, room, server.addr)
            d.call("register", name, room, dtab, slot)
    return rooms


def _send_chunks(prefill, name, rooms: dict) -> None:
    """Every prefill rank sends each room in its chunks, the aux data with the last one."""
    for room, (n, ends, ptab, _, _) in rooms.items():
        start = 0
        for end in ends:
            last = end == n
            for p in prefill:
                p.call(
                    "send_chunk",
                    name,
                    room,
                    ptab,
                    start,
                    end,
                    last,
                    f"aux-{room}".encode() if last else None,
                )
            start = end


def _check_rooms_arrived_exactly(prefill, decode, name, rooms: dict) -> None:
    """Every room succeeded on every rank; its KV and aux data arrived byte-exact; nothing failed
    or was dropped; at least the whole KV was sent."""
    for who in prefill + decode:
        got = who.call("wait", name, list(rooms), DONE, 20)
        assert all(s == KVPoll.Success for s, _, _ in got.values()), (who.name, got)
    for room, (n, _, _, dtab, _) in rooms.items():
        for d in decode:
            assert d.call("check", name, room, dtab, n) == 0, (d.name, room, "KV differs")
            assert d.call("read_aux", name, room) == f"aux-{room}".encode()
    for d in decode:
        st = d.call("stats", name)
        assert st["rooms_succeeded"] == len(rooms) and not st["failures"] and not st["dropped"], st
    sent = sum(p.call("stats", name)["bytes_sent"] for p in prefill)
    assert sent >= sum(n for n, *_ in rooms.values()) * NUM_LAYERS * 2 * TOKEN_BYTES


def _close_managers(workers, name) -> None:
    """Closes manager `name` on every rank, ignoring errors (a rank may not have opened it)."""
    for w in workers:
        try:
            w.call("close", name)
        except Exception:
            pass


@pytest.mark.parametrize("p_pp,d_pp", LAYOUTS)
def test_byte_exact_transfer(ranks, p_pp, d_pp):
    p_slices, d_slices = split_layers(NUM_LAYERS, p_pp), split_layers(NUM_LAYERS, d_pp)
    prefill = [ranks[f"P{i}"] for i in range(p_pp)]
    decode = [ranks[f"D{j}"] for j in range(d_pp)]
    rng = random.Random(p_pp * 10 + d_pp)
    for case, (p_ps, d_ps, checksum) in enumerate(PAGE_CASES):
        name = f"L{p_pp}x{d_pp}c{case}"
        cfg = dict(
            bootstrap_timeout_s=15,
            waiting_timeout_s=15,
            transfer_timeout_s=15,
            heartbeat_interval_s=0.5,
            checksum=checksum,
            max_inflight_descriptors=8,
        )
        server = BootstrapServer(heartbeat_timeout_s=10).start()
        try:
            _start_managers(prefill, decode, name, cfg, p_slices, d_slices, p_ps, d_ps, server)
            rooms = _open_rooms(prefill, decode, name, rng, p_ps, d_ps, server)
            for p in prefill:
                got = p.call("wait", name, list(rooms), [int(KVPoll.WaitingForInput), 0], 10)
                assert all(s == KVPoll.WaitingForInput for s, _, _ in got.values()), got
            _send_chunks(prefill, name, rooms)
            _check_rooms_arrived_exactly(prefill, decode, name, rooms)
        finally:
            _close_managers(prefill + decode, name)
            server.stop()
