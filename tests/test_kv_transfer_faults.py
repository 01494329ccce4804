"""Failure paths of kv_transfer over real Mooncake (TCP, loopback) with separate rank processes:
every affected room ends Failed within its timeout on every surviving rank, the others complete.

Two prefill nodes (PA, PB) and two decode nodes (DA, DB), PP 1 each, bootstrap servers hosted here
(as the prefill fronts would). The processes hold a cluster secret (PDSERVE_INTERNAL_TOKEN), so
every control message is authenticated. Tests run in file order; the last two kill processes.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import msgpack
import pytest
import zmq
from kv_transfer_workers import RankProcess

from pdserve.consensus.kvpoll import KVPoll
from pdserve.infra.channel_auth import Sealer
from pdserve.infra.cluster_secret import ENV as SECRET_ENV
from pdserve.kv_transfer import BootstrapServer, PoolDesc, TransferConfig
from pdserve.kv_transfer.manager import CHANNEL
from pdserve.kv_transfer.messages import KVAbort, KVRegister, KVStatus, encode_message

LAYERS = (0, 30)
TB, PS, NUM_PAGES, N = 128, 16, 256, 100  # tokens per room
AUX_SLOTS = 16  # per decode process (kv_transfer_workers' default)
CFG = dict(
    bootstrap_timeout_s=3.0,
    waiting_timeout_s=20.0,
    transfer_timeout_s=3.0,
    heartbeat_interval_s=0.3,
    heartbeat_misses=3,
)
HB_TIMEOUT = 2.5
FAILED, SUCCESS, WAITING = int(KVPoll.Failed), int(KVPoll.Success), int(KVPoll.WaitingForInput)
DONE = [FAILED, SUCCESS]
rng = random.Random(7)


def spawn(ctx, *names: str) -> dict[str, RankProcess]:
    """Rank processes, started at once (each imports kv_transfer and starts a Mooncake engine)."""
    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(lambda name: RankProcess(ctx, name), names), strict=True))


class Cluster:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.procs, self.servers = {}, {}
        for node in ("A", "B"):
            self.servers[node] = BootstrapServer(heartbeat_timeout_s=HB_TIMEOUT).start()
        self.procs.update(spawn(ctx, "PA", "PB", "DA", "DB"))

        def manager(name: str) -> int:
            node = name[1]
            if name[0] == "P":
                args = ("prefill", "m", CFG, 0, 1, LAYERS, NUM_PAGES, PS, TB)
                return self.procs[name].call(*args, self.servers[node].addr)
            return self.procs[name].call("decode", "m", CFG, 0, [LAYERS], NUM_PAGES, PS, TB)

        with ThreadPoolExecutor(4) as pool:
            self.ports = dict(zip(self.procs, pool.map(manager, self.procs), strict=True))
        assert all(self.procs[p].call("wait_registered", "m", 10) for p in ("PA", "PB"))
        self.pages = {name: list(range(NUM_PAGES)) for name in self.procs}
        self.aux_slots = {name: itertools.cycle(range(AUX_SLOTS)) for name in self.procs}

    def take(self, name: str, n: int) -> list[int]:
        free = self.pages[name]
        pick = rng.sample(free, n)
        self.pages[name] = [p for p in free if p not in pick]
        return pick

    def room(
        self, p: str, d: str, register: bool = True, sender: bool = True
    ) -> tuple[int, list, list]:
        room = rng.getrandbits(63)
        ptab, dtab = self.take(p, 7), self.take(d, 7)
        if sender:
            self.procs[p].call("fill", "m", room, ptab, N)
            self.procs[p].call("create_sender", "m", room)
        self.procs[d].call("create_receiver", "m", room, self.servers[p[1]].addr)
        if register:
            # Each room its own aux slot, as a decode node assigns them: rooms that shared one would
            # overwrite each other's first token and wait for it until their waiting timeout.
            self.procs[d].call("register", "m", room, dtab, next(self.aux_slots[d]))
        return room, ptab, dtab

    def send_all(self, p: str, room: int, ptab: list, start: int = 0, end: int = N) -> None:
        self.procs[p].call(
            "send_chunk", "m", room, ptab, start, end, end == N, b"tok" if end == N else None
        )

    def wait(self, name: str, rooms: list[int], statuses=DONE, timeout: float = 15.0) -> dict:
        return self.procs[name].call("wait", "m", rooms, statuses, timeout, timeout=timeout + 10)

    def stop(self):
        with ThreadPoolExecutor(len(self.procs)) as pool:
            list(pool.map(RankProcess.stop, self.procs.values()))
        for s in self.servers.values():
            s.stop()


SECRET = "kv-faults-cluster-secret"


@pytest.fixture(scope="module")
def cluster():
    c, old = None, os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = SECRET  # inherited by the spawned rank processes
    try:
        c = Cluster()
        yield c
    finally:
        if c is not None:
            c.stop()
        if old is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = old


def _push_all(port: int, frames: list[bytes]) -> None:
    """Sends `frames` from a foreign ZMQ socket (not a KV manager) to a control port."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(f"tcp://127.0.0.1:{port}")
        for f in frames:
            s.send(f)
        s.close()
    finally:
        ctx.term()


def _grew(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


# a loaded 2-core machine delays threads; the bound proves "ends, by its timeout", not speed
SLACK_S = 5.0


def _assert(got: dict, want: int, within: float | None = None):
    for room, (status, reason, seconds) in got.items():
        assert status == want, (room, status, reason)
        if within is not None:
            assert seconds <= within + SLACK_S, (room, reason, seconds)


def test_normal_rooms_complete(cluster):
    c = cluster
    rooms = [c.room("PA", "DA"), c.room("PA", "DB"), c.room("PB", "DA")]
    for p, (room, ptab, _) in zip(["PA", "PA", "PB"], rooms, strict=True):
        _assert(c.wait(p, [room], [WAITING, FAILED]), WAITING)
        c.send_all(p, room, ptab, 0, 40)
        c.send_all(p, room, ptab, 40, N)
    for d, (room, _, dtab) in zip(["DA", "DB", "DA"], rooms, strict=True):
        _assert(c.wait(d, [room]), SUCCESS)
        assert c.procs[d].call("check", "m", room, dtab, N) == 0
        assert c.procs[d].call("read_aux", "m", room) == b"tok"


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_from_either_side(cluster, side):
    c = cluster
    (ra, pa, _), (rb, pb, _) = c.room("PA", "DA"), c.room("PA", "DA")
    _assert(c.wait("PA", [ra, rb], [WAITING, FAILED]), WAITING)
    c.send_all("PA", ra, pa, 0, 16)  # ra is mid-transfer when aborted
    c.procs["PA" if side == "prefill" else "DA"].call("abort", "m", ra)
    c.send_all("PA", rb, pb)
    _assert(c.wait("PA", [ra], timeout=5), FAILED, within=2)
    _assert(c.wait("DA", [ra], timeout=5), FAILED, within=2)
    _assert(c.wait("DA", [rb]), SUCCESS)
    _assert(c.wait("PA", [rb]), SUCCESS)
    reason = c.procs["PA"].call("poll", "m", [ra])[ra][1]
    assert reason == ("aborted" if side == "prefill" else "aborted_by_decode")


def test_decode_own_failure_tells_the_prefill(cluster):
    """Finding 1 of docs/PROTOCOL_MODEL.md. A decode rank that gives up a registered room on its own
    (here its waiting timeout; peer_dead, bootstrap_lost, a bad checksum or aux take the same path)
    sends KVAbort to the room's prefill rank: the sender ends Failed (`aborted_by_decode`) and sends
    its final word, so the decode side may reuse the pages without trusting the quarantine grace,
    and the sender's later chunks go nowhere. Before, only a client abort sent KVAbort: the sender
    stayed WaitingForInput and wrote its chunks into the pages of the failed room, which the decode
    node frees once the grace ran out and gives to the next request."""
    c = cluster
    # A second decode manager in DB's process, with a waiting timeout that fires before any chunk.
    c.procs["DB"].call(
        "decode", "fast", {**CFG, "waiting_timeout_s": 1.0}, 0, [LAYERS], NUM_PAGES, PS, TB
    )
    try:
        before = c.procs["PA"].call("stats", "m")["failures"]
        room, ptab, dtab = (
            rng.getrandbits(63),
            c.take("PA", 7),
            list(range(7)),
        )  # "fast" has its own pool
        c.procs["PA"].call("fill", "m", room, ptab, N)
        c.procs["PA"].call("create_sender", "m", room)
        c.procs["DB"].call("create_receiver", "fast", room, c.servers["A"].addr)
        c.procs["DB"].call("register", "fast", room, dtab, 0)
        got = c.procs["DB"].call("wait", "fast", [room], DONE, 15, timeout=25)
        assert got[room][:2] == (FAILED, "waiting_timeout"), got
        # The prefill rank learns it (its own waiting timeout, 20 s, is far beyond this wait).
        got = c.wait("PA", [room], timeout=10)
        assert got[room][:2] == (FAILED, "aborted_by_decode"), (
            f"the prefill sender was not told of the decode's own failure: {got}"
        )
        assert _grew(before, c.procs["PA"].call("stats", "m")["failures"]) == {
            "aborted_by_decode": 1
        }
        # Its final word reached the decode rank: nothing can write into the pages any more.
        assert c.procs["DB"].call("wait_quiesced", "fast", room, 10, timeout=20)
        c.send_all("PA", room, ptab)  # the prefill node's chunks for the room: dropped
        pieces = (LAYERS[1] - LAYERS[0]) * 2 * -(-N // PS)
        assert c.procs["DB"].call("check", "fast", room, dtab, N) == pieces  # untouched
    finally:
        c.procs["DB"].call("close", "fast")


def test_decode_abort_before_the_sender_exists(cluster):
    """A decode rank registers and gives the room up before the prefill rank created its sender
    (a prefill queue, or a prefill rank resuming from a stall reads both messages at once): the
    prefill rank withdraws the pending registration and answers with its final word, and the sender
    created later fails at once. Before, the KVAbort was dropped as `unknown_room` and the sender
    took the pending registration and wrote into the pages of the aborted room."""
    c = cluster
    room, ptab, dtab = c.room("PA", "DA", sender=False)
    _assert(c.wait("DA", [room], [WAITING, FAILED]), WAITING)  # the registration went out
    c.procs["DA"].call("abort", "m", room)
    assert c.procs["DA"].call("wait_quiesced", "m", room, 10, timeout=20), (
        "no final word from the prefill rank"
    )
    before = c.procs["PA"].call("stats", "m")["failures"]
    c.procs["PA"].call("fill", "m", room, ptab, N)
    c.procs["PA"].call("create_sender", "m", room)
    got = c.procs["PA"].call("poll", "m", [room])
    assert got[room] == (FAILED, "aborted_by_decode"), got
    assert _grew(before, c.procs["PA"].call("stats", "m")["failures"]) == {"aborted_by_decode": 1}
    c.send_all("PA", room, ptab)
    assert c.procs["DA"].call("check", "m", room, dtab, N) == (LAYERS[1] - LAYERS[0]) * 2 * -(
        -N // PS
    )


def test_room_nobody_registered(cluster):
    c = cluster
    lonely, _, _ = c.room("PA", "DA", register=False)  # sender, decode never registers
    orphan, _, _ = c.room("PA", "DB", sender=False)  # decode registers, no sender ever
    ok, ptab, _ = c.room("PA", "DA")
    _assert(c.wait("PA", [ok], [WAITING, FAILED]), WAITING)
    c.send_all("PA", ok, ptab)
    _assert(c.wait("DA", [ok]), SUCCESS)
    _assert(c.wait("PA", [lonely], timeout=8), FAILED, within=CFG["bootstrap_timeout_s"] + 1.5)
    _assert(c.wait("DB", [orphan], timeout=8), FAILED, within=CFG["bootstrap_timeout_s"] + 1.5)
    assert c.procs["PA"].call("poll", "m", [lonely])[lonely][1] == "bootstrap_timeout"


def test_bootstrap_server_never_answers(cluster):
    c = cluster
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(16)  # accepts connections in the kernel, never answers
    try:
        c.procs["DA"].call("create_receiver", "m", 424242, f"127.0.0.1:{mute.getsockname()[1]}")
        c.procs["DA"].call("register", "m", 424242, [0, 1], None)
        ok, ptab, _ = c.room("PA", "DA")
        _assert(c.wait("PA", [ok], [WAITING, FAILED]), WAITING)
        c.send_all("PA", ok, ptab)
        _assert(c.wait("DA", [ok]), SUCCESS)
        _assert(c.wait("DA", [424242], timeout=10), FAILED, within=CFG["bootstrap_timeout_s"] + 2.5)
    finally:
        mute.close()


def test_malformed_control_messages_dropped(cluster):
    c = cluster
    before = {n: c.procs[n].call("stats", "m")["dropped"] for n in ("PA", "DA")}
    insider = Sealer(CHANNEL, "127.0.0.1:1/1")  # holds the secret: its frames reach the decoder
    for name in ("PA", "DA"):
        bad = [
            b"\xc1 garbage",  # not msgpack
            msgpack.packb({"t": "status", "room": "x"}),  # wrong keys/types
            msgpack.packb({"t": "abort", "room": 1, "side": "decode", "rank": -1, "reason": "r"}),
            msgpack.packb([1, 2, 3]),
        ]  # not a map
        _push_all(
            c.ports[name],
            bad
            + [insider.seal(f) for f in bad]
            + [insider.seal(encode_message(KVStatus(99, 0, int(KVPoll.Success), "", 1, 0, None)))],
        )
    ok, ptab, dtab = c.room("PA", "DA")
    _assert(c.wait("PA", [ok], [WAITING, FAILED]), WAITING)
    c.send_all("PA", ok, ptab)
    _assert(c.wait("DA", [ok]), SUCCESS)
    assert c.procs["DA"].call("check", "m", ok, dtab, N) == 0
    after = {n: c.procs[n].call("stats", "m")["dropped"] for n in ("PA", "DA")}
    grew = {n: {k: v - before[n].get(k, 0) for k, v in after[n].items()} for n in after}
    for n in ("PA", "DA"):  # unsealed: not authenticated; sealed: authenticated, then malformed
        assert grew[n].get("unauthenticated") == 4 and grew[n].get("malformed") == 4, grew
    assert grew["PA"].get("unexpected") == 1 and grew["DA"].get("unknown_room") == 1, grew


def _forged_registers(c, room: int, da_id: str, da_pool: dict, aux_base: int, aux_size: int):
    """A KVRegister for `room` with DA's identity that would redirect its writes to another
    request's pages, and the same with DA's pool moved by one page."""
    pool = PoolDesc.from_wire(da_pool)
    session, port = da_id.rsplit("/", 1)
    other_pages = c.take("DA", 7)  # another request's pages in the same pool
    aux_len = TransferConfig().aux_slot_bytes  # what DA registers with (same place, other pages)
    reg = KVRegister(
        room,
        0,
        ((*LAYERS, *pool.heads),),  # DA's slice: its layers and KV heads
        "127.0.0.1",
        int(port),
        session,
        pool,
        tuple(other_pages),
        aux_base,
        aux_len,
        aux_base,
        aux_size,
    )
    moved = replace(reg, pool=PoolDesc(**{**da_pool, "base_ptr": pool.base_ptr + pool.page_bytes}))
    return reg, moved


def _push_forgeries(c, room: int, reg, moved, da_id: str, pa_id: str, aux_base: int, aux_size: int):
    """Pushes PA the forged registers and DA the forged statuses and abort: unsigned, signed with
    another secret, signed by a member that is not the room's peer, and (registers) as DA."""
    as_da = Sealer(CHANNEL, da_id)  # a cluster member claiming to be DA
    ok = encode_message(KVStatus(room, 0, int(KVPoll.Success), "", N, 0, None))
    fail = encode_message(KVStatus(room, 0, int(KVPoll.Failed), "forged", 0, 0, None))
    abort = encode_message(KVAbort(room, "prefill", 0, "forged"))
    stranger = Sealer(CHANNEL, "127.0.0.1:9/9")  # has the secret, is not a peer of the room
    outsider = Sealer(CHANNEL, pa_id, secret="another-cluster")
    _push_all(
        c.ports["PA"],
        [
            encode_message(reg),
            outsider.seal(encode_message(reg)),
            stranger.seal(encode_message(reg)),  # a register naming another sender
            as_da.seal(encode_message(moved)),  # pool changed
            as_da.seal(encode_message(replace(reg, page_ids=(NUM_PAGES,)))),  # outside
            as_da.seal(encode_message(replace(reg, aux_ptr=aux_base + aux_size))),  # outside
            as_da.seal(encode_message(reg)),  # re-register
        ],
    )
    _push_all(
        c.ports["DA"],
        [
            ok,
            fail,
            abort,
            outsider.seal(ok),
            outsider.seal(fail),
            stranger.seal(ok),
            stranger.seal(fail),
            stranger.seal(abort),
        ],
    )


def test_forged_register_and_status_are_dropped_and_the_room_completes_exactly(cluster):
    """While a real room is registered, a foreign socket sends KVRegisters that would redirect its
    writes (other pages, another pool) and KVStatus messages that would end it (Success, Failed):
    unsigned, signed with another secret, signed by a cluster member that is not the room's peer,
    and as the room's own decode rank re-registering. All are dropped and counted; the room's KV
    lands byte-exact in its own pages."""
    c = cluster
    room, ptab, dtab = c.room("PA", "DA")
    _assert(c.wait("PA", [room], [WAITING, FAILED]), WAITING)
    da_id, da_pool, aux_base, aux_size = c.procs["DA"].call("identity", "m")
    pa_id = c.procs["PA"].call("identity", "m")[0]
    before = {n: c.procs[n].call("stats", "m")["dropped"] for n in ("PA", "DA")}
    reg, moved = _forged_registers(c, room, da_id, da_pool, aux_base, aux_size)
    _push_forgeries(c, room, reg, moved, da_id, pa_id, aux_base, aux_size)
    c.send_all("PA", room, ptab)
    _assert(c.wait("DA", [room]), SUCCESS)
    _assert(c.wait("PA", [room]), SUCCESS)
    assert c.procs["DA"].call("check", "m", room, dtab, N) == 0
    assert c.procs["DA"].call("read_aux", "m", room) == b"tok"
    grew = {n: _grew(before[n], c.procs[n].call("stats", "m")["dropped"]) for n in before}
    assert grew["PA"] == {
        "unauthenticated": 2,
        "foreign_peer": 1,
        "pool_changed": 1,
        "bad_pages": 1,
        "bad_aux": 1,
        "duplicate_register": 1,
    }, grew
    assert grew["DA"] == {"unauthenticated": 5, "foreign_peer": 3}, grew


def test_a_decode_rank_back_from_a_stall_is_used_again(cluster):
    """A decode rank that stops for longer than the heartbeat timeout (SIGSTOP here; a starved CPU
    in production) is declared dead and its room fails with peer_dead. Once it runs again, its
    next registration is proof of life: the room completes. Before, the prefill rank refused every
    later registration from that session (`bad_registration`), and PD was down for good."""
    c = cluster
    room, _, _ = c.room("PA", "DA")
    _assert(c.wait("PA", [room], [WAITING, FAILED]), WAITING)
    pid = c.procs["DA"].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:  # stopped until PA has given the room up
        got = c.wait("PA", [room], timeout=10)
    finally:
        os.kill(pid, signal.SIGCONT)
    _assert(got, FAILED)
    assert got[room][1] == "peer_dead", got
    _assert(c.wait("DA", [room], timeout=15), FAILED)
    again, ptab, _ = c.room("PA", "DA")
    c.send_all("PA", again, ptab)
    _assert(c.wait("DA", [again], timeout=15), SUCCESS)
    _assert(c.wait("PA", [again]), SUCCESS)


def test_a_registration_outranks_a_stale_heartbeat_verdict(cluster):
    """A decode rank back from a stall registers a room with a prefill rank before its heartbeat
    reaches that prefill node's bootstrap server (it beats each server in turn; a starved process
    later still). The server still calls it silent, but the registration is newer proof of life:
    the room completes. The proof lasts one heartbeat timeout: a room of a rank that stays silent
    fails with peer_dead. (Before, the new room failed at once with peer_dead: CI saw it in
    test_decode_killed_mid_transfer, right after the stall test above.)

    DS's own heartbeat interval is longer than the test. Its first room looks the route up, which
    the server counts as a beat; the second uses the cached route after a silence longer than the
    server's timeout: the state right after a stall, without the race."""
    c = cluster
    c.procs.update(spawn(mp.get_context("spawn"), "DS"))
    c.pages["DS"] = list(range(NUM_PAGES))
    c.aux_slots["DS"] = itertools.cycle(range(AUX_SLOTS))
    c.procs["DS"].call(
        "decode", "m", {**CFG, "heartbeat_interval_s": 600.0}, 0, [LAYERS], NUM_PAGES, PS, TB
    )
    first, ptab, _ = c.room("PB", "DS")
    c.send_all("PB", first, ptab)
    _assert(c.wait("DS", [first]), SUCCESS)
    time.sleep(HB_TIMEOUT + 0.5)  # silent for longer than the server's timeout
    room, ptab, dtab = c.room("PB", "DS")
    _assert(c.wait("PB", [room], [WAITING, FAILED]), WAITING)
    # several of PB's beats, each answered "DS is silent"
    time.sleep(4 * CFG["heartbeat_interval_s"])
    _assert(c.wait("PB", [room], [WAITING, FAILED], timeout=0), WAITING)
    c.send_all("PB", room, ptab)
    _assert(c.wait("DS", [room]), SUCCESS)
    _assert(c.wait("PB", [room]), SUCCESS)
    assert c.procs["DS"].call("check", "m", room, dtab, N) == 0
    # DS stays silent: once its registrations are older than the timeout, it is dead.
    left, _, _ = c.room("PB", "DS")
    got = c.wait("PB", [left], timeout=HB_TIMEOUT + SLACK_S + 2)
    _assert(got, FAILED, within=HB_TIMEOUT + 2 * CFG["heartbeat_interval_s"])
    assert got[left][1] == "peer_dead", got
    c.procs.pop("DS").stop()


def test_decode_killed_mid_transfer(cluster):
    c = cluster
    to_da = [c.room("PA", "DA"), c.room("PB", "DA")]
    to_db = [c.room("PA", "DB"), c.room("PB", "DB")]
    for p, (room, ptab, _) in zip(["PA", "PB", "PA", "PB"], to_da + to_db, strict=True):
        _assert(c.wait(p, [room], [WAITING, FAILED]), WAITING)
        c.send_all(p, room, ptab, 0, 32)
    c.procs["DA"].kill()
    for p, (room, ptab, _) in zip(["PA", "PB", "PA", "PB"], to_da + to_db, strict=True):
        c.send_all(p, room, ptab, 32, N)
    limit = max(CFG["transfer_timeout_s"], HB_TIMEOUT + 2 * CFG["heartbeat_interval_s"]) + 1.5
    _assert(c.wait("PA", [to_da[0][0]], timeout=10), FAILED, within=limit)
    _assert(c.wait("PB", [to_da[1][0]], timeout=10), FAILED, within=limit)
    # The survivors may queue behind a write to the dead peer until the engine gives up on it.
    _assert(c.wait("DB", [r for r, _, _ in to_db], timeout=30), SUCCESS)
    _assert(c.wait("PA", [to_db[0][0]]), SUCCESS)
    _assert(c.wait("PB", [to_db[1][0]]), SUCCESS)


def test_prefill_killed(cluster):
    c = cluster
    (doomed, _, _), (ok, ptab, _) = c.room("PB", "DB"), c.room("PA", "DB")
    _assert(c.wait("PB", [doomed], [WAITING, FAILED]), WAITING)
    _assert(c.wait("DB", [doomed, ok], [WAITING, FAILED]), WAITING)
    c.procs["PB"].kill()
    c.send_all("PA", ok, ptab)
    limit = HB_TIMEOUT + 2 * CFG["heartbeat_interval_s"] + 1.5
    got = c.wait("DB", [doomed], timeout=10)
    _assert(got, FAILED, within=limit)
    assert got[doomed][1] == "peer_dead", got
    _assert(c.wait("DB", [ok]), SUCCESS)


def test_prefill_restarted_on_the_same_address(cluster):
    """A prefill node (PC) dies while no room of DC's uses it, then comes back as a new process on
    the same bootstrap server. DC looked up PC's route for an earlier room; nothing failed on DC to
    tell it that route died. Its heartbeats see that the server's ranks changed, so its next room to
    PC looks the route up again and completes (the stale route would register with the dead process
    and time out)."""
    c = cluster
    c.servers["C"] = BootstrapServer(heartbeat_timeout_s=HB_TIMEOUT).start()
    # PC2, the process PC comes back as, starts with them and does nothing until PC is dead.
    c.procs.update(spawn(mp.get_context("spawn"), "PC", "DC", "PC2"))
    for name in ("PC", "DC"):
        c.pages[name] = list(range(NUM_PAGES))
        c.aux_slots[name] = itertools.cycle(range(AUX_SLOTS))

    def start_pc():
        c.procs["PC"].call(
            "prefill", "m", CFG, 0, 1, LAYERS, NUM_PAGES, PS, TB, c.servers["C"].addr
        )
        assert c.procs["PC"].call("wait_registered", "m", 10)

    def one_room():
        room, ptab, dtab = c.room("PC", "DC")
        _assert(c.wait("PC", [room], [WAITING, FAILED]), WAITING)
        c.send_all("PC", room, ptab)
        _assert(c.wait("DC", [room]), SUCCESS)
        assert c.procs["DC"].call("check", "m", room, dtab, N) == 0

    start_pc()
    c.procs["DC"].call("decode", "m", CFG, 0, [LAYERS], NUM_PAGES, PS, TB)
    one_room()
    c.procs["PC"].kill()
    c.procs["PC"] = c.procs.pop("PC2")
    c.pages["PC"] = list(range(NUM_PAGES))
    start_pc()
    # a few of DC's heartbeats to PC's server: 8 beats, since on a loaded machine (tests in 3
    # processes) 3 were not always enough for one to land and the room timed out its bootstrap
    time.sleep(8 * CFG["heartbeat_interval_s"])
    one_room()
