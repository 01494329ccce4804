"""PPConsensusStore with real ZMQ sockets: ranks > 0 run in separate
(spawned) processes, PP0 here."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from pdserve.consensus import KVPoll, PPConsensusStore
from pdserve.consensus.store import CHANNEL
from pdserve.infra.channel_auth import Sealer

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 10.0
B, W, T, S, F = (
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
    KVPoll.Failed,
)


def _rank_worker(conn) -> None:
    """A rank process: runs store commands sent over `conn` and answers each with ("ok", result)."""
    store = None
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "open":
                store = PPConsensusStore(*args)
                out = None
            elif cmd == "put":
                store[args[0]] = args[1]
                out = None
            elif cmd == "del":
                del store[args[0]]
                out = None
            elif (
                cmd == "script"
            ):  # random puts/deletes/updates, then a marker; returns the final dict
                rng = random.Random(args[0])
                for _ in range(args[1]):
                    room = rng.randrange(40)
                    op = rng.random()
                    if op < 0.2 and room in store:
                        del store[room]
                    elif op < 0.6:
                        store[room] = rng.choice(list(KVPoll))
                    else:
                        store.update_status(
                            room, rng.choice([B, W, T, S, F]) if room in store else B
                        )
                store[args[2]] = S
                out = {k: int(v) for k, v in store.items()}
            elif cmd == "ladder":  # every room climbs B -> W -> T -> S, rooms interleaved
                for status in (B, W, T, S):
                    for room in range(args[0]):
                        store[room] = status
                out = None
            elif cmd == "close":
                store.close()
                out = None
            elif cmd == "exit":
                conn.send(("ok", None))
                return
            conn.send(("ok", out))
        except Exception as e:  # reported to the test
            conn.send(("err", repr(e)))


class Ranks:
    """Rank processes 1..n, each driven through a pipe."""

    def __init__(self, n: int):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_worker, args=(child,), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def call(self, rank: int, *cmd, timeout: float = WAIT_S):
        conn = self.conns[rank - 1]
        conn.send(cmd)
        if not conn.poll(timeout):
            raise TimeoutError(f"rank {rank} did not answer {cmd[0]} within {timeout} s")
        status, out = conn.recv()
        assert status == "ok", out
        return out

    def stop(self) -> None:
        for conn, p in zip(self.conns, self.procs, strict=True):
            try:
                conn.send(("exit",))
            except OSError:
                pass
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)


@pytest.fixture(scope="module")
def ranks():
    r = Ranks(3)
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def cluster(ranks):
    """A PP=4 store: PP0 here, ranks 1..3 in the worker processes."""
    pp0 = PPConsensusStore(0, 4)
    try:
        for r in (1, 2, 3):
            ranks.call(r, "open", r, 4, pp0.address)
        yield pp0, ranks
    finally:
        for r in (1, 2, 3):
            try:
                ranks.call(r, "close")
            except Exception:
                pass
        pp0.close()


def wait_until(
    pred, what: str, store: PPConsensusStore | None = None, timeout: float = WAIT_S
) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if store is not None:
            store.drain(0.01)
        else:
            time.sleep(0.005)


# ---- replication ---------------------------------------------------------------------------------
def test_replicas_match_each_ranks_final_state_after_random_puts_and_deletes(cluster):
    pp0, ranks = cluster
    finals = {r: ranks.call(r, "script", 100 + r, 1500, 10_000 + r) for r in (1, 2, 3)}
    wait_until(lambda: all(pp0.collect(10_000 + r)[r] == S for r in (1, 2, 3)), "markers", pp0)
    for r, final in finals.items():
        for room in range(40):
            got = pp0.collect(room)[r]
            assert (None if got is None else int(got)) == final.get(room), f"rank {r} room {room}"
    assert sum(pp0.dropped.values()) == 0


def test_replication_keeps_each_ranks_write_order(cluster):
    pp0, ranks = cluster
    rooms = 300
    for r in (1, 2, 3):
        ranks.conns[r - 1].send(("ladder", rooms))  # all three write at once
    seen = {r: [[] for _ in range(rooms)] for r in (1, 2, 3)}
    deadline = time.monotonic() + WAIT_S
    while not all(seen[r][room][-1:] == [S] for r in (1, 2, 3) for room in range(rooms)):
        assert time.monotonic() < deadline, "ladder did not arrive"
        pp0.drain(0.001)
        for room in range(rooms):
            for r, v in enumerate(pp0.collect(room)):
                if r and v is not None and seen[r][room][-1:] != [v]:
                    seen[r][room].append(v)
    for r in (1, 2, 3):
        assert ranks.conns[r - 1].recv() == ("ok", None)
        for room in range(rooms):
            assert seen[r][room] == sorted(seen[r][room]), (
                f"rank {r} room {room} went back: {seen[r][room]}"
            )


def test_status_missing_is_bootstrapping_any_failed_is_failed_else_min(cluster):
    pp0, ranks = cluster
    room = 77

    def put(r, v):
        ranks.call(r, "put", room, int(v))
        wait_until(lambda: pp0.collect(room)[r] == v, f"rank {r} = {v.name}", pp0)

    pp0[room] = S
    assert pp0.status(room) == B  # ranks 1..3 have no entry
    put(1, S)
    put(2, S)
    assert pp0.status(room) == B  # rank 3 still missing
    put(3, T)
    assert pp0.status(room) == T  # min
    put(3, S)
    assert pp0.status(room) == S
    assert pp0.statuses([room, room + 1, room]) == [S, B, S]  # one read for many rooms
    put(2, F)
    assert pp0.status(room) == F  # any Failed
    ranks.call(2, "del", room)
    wait_until(lambda: pp0.collect(room)[2] is None, "delete", pp0)
    assert pp0.status(room) == B  # deleted => missing again
    del pp0[room]
    assert pp0.collect(room) == [None, S, None, S]


# ---- bad input -----------------------------------------------------------------------------------
def _sealed_bad_payloads(pk) -> dict[str, list[bytes]]:
    """Payloads a rank of the cluster (it holds the secret) could seal, keyed by the drop reason
    each one must be counted under."""
    return {
        "malformed": [
            b"\xff\x00garbage",
            pickle.dumps([1, 1, 5, 4]),
            b"",
            pk([1, 1, 5, 4]) + b"\x00",
            pk([1, 1, 5, 4, "x" * 100]),
        ],
        "bad_shape": [pk([1, 1, 5]), pk(7), pk("abc"), pk(None)],
        "unknown_op": [
            pk([9, 1, 5, 4]),
            pk([1.0, 1, 5, 4]),
            pk([True, 1, 5, 4]),
            pk(["put", 1, 5, 4]),
        ],
        "bad_rank": [pk([1, 0, 5, 4]), pk([1, 3, 5, 4]), pk([1, -1, 5, 4]), pk([1, "1", 5, 4])],
        "bad_key": [pk([1, 1, "room", 4]), pk([1, 1, 5.5, 4]), pk([1, 1, None, 4])],
        "bad_value": [
            pk([1, 1, 5, 7]),
            pk([1, 1, 5, -1]),
            pk([1, 1, 5, "x"]),
            pk([2, 1, 5, 4]),
            pk([1, 1, 5, None]),
        ],
    }


def _unauthenticated_frames(seal, pk) -> list[bytes]:
    """Frames that fail authentication: unsealed, empty, another cluster's secret, another
    channel, a tampered tag."""
    return [
        pk([1, 1, 5, 4]),
        b"",
        Sealer(CHANNEL, "pp1", secret="another-cluster").seal(pk([1, 1, 5, 4])),
        Sealer("kv-control", "pp1").seal(pk([1, 1, 5, 4])),
        seal(pk([1, 1, 5, 4]))[:-1] + b"\x05",
    ]


def _send_bad_frames(raw, seal, pk, sealed: dict, unsealed: list) -> None:
    """Sends every bad frame in order: sealed garbage, a multi-frame message, the unauthenticated
    frames, a foreign-rank write and a replayed delete."""
    for frames in sealed.values():
        for f in frames:
            raw.send(seal(f))
    raw.send_multipart([seal(pk([1, 1, 5, 4])), b"extra"])  # a multi-frame message is malformed too
    for f in unsealed:
        raw.send(f)
    raw.send(Sealer(CHANNEL, "pp2").seal(pk([1, 1, 5, 4])))  # rank 2 writing rank 1's replica
    once = seal(pk([2, 1, 99, None]))  # a valid delete of a room nobody wrote, then its replay
    raw.send(once)
    raw.send(once)


def _expected_drops(sealed: dict, unsealed: list) -> dict[str, int]:
    """The drop counters _send_bad_frames must leave behind."""
    expect = {k: len(v) for k, v in sealed.items()}
    expect["malformed"] += 1
    expect.update(unauthenticated=len(unsealed), foreign_rank=1, replayed=1)
    return expect


@contextlib.contextmanager
def _store_with_raw_sender(size: int):
    """A store of `size` ranks (PP0 and PP1 of it), and a raw ZMQ socket pushing to PP0's address:
    (pp0, rank1, raw)."""
    pp0 = PPConsensusStore(0, size)
    rank1 = PPConsensusStore(1, size, pp0.address)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(pp0.address)
    try:
        yield pp0, rank1, raw
    finally:
        raw.close()
        ctx.term()
        rank1.close()
        pp0.close()


def test_bad_frames_are_dropped_counted_and_the_store_keeps_working():
    pk = msgpack.packb
    # A rank of this cluster (it holds the secret) sending garbage.
    seal = Sealer(CHANNEL, "pp1").seal
    sealed = _sealed_bad_payloads(pk)
    unsealed = _unauthenticated_frames(seal, pk)
    with _store_with_raw_sender(3) as (pp0, rank1, raw):
        _send_bad_frames(raw, seal, pk, sealed, unsealed)
        expect = _expected_drops(sealed, unsealed)
        wait_until(lambda: sum(pp0.dropped.values()) == sum(expect.values()), "all drops", pp0)
        assert dict(pp0.dropped) == expect
        assert pp0.collect(5) == [None, None, None]  # nothing bad was applied
        rank1[5] = W
        wait_until(lambda: pp0.collect(5)[1] == W, "a good write after the bad ones", pp0)


def test_an_oversized_message_is_dropped_and_the_store_keeps_working():
    """libzmq refuses a message over the socket's MAXMSGSIZE and disconnects its sender only."""
    with _store_with_raw_sender(2) as (pp0, rank1, raw):
        raw.send(b"x" * (1 << 20))
        rank1[7] = W
        wait_until(lambda: pp0.collect(7)[1] == W, "a good write after the oversized one", pp0)
        assert sum(pp0.dropped.values()) == 0  # never reached the store: libzmq dropped it


def test_bad_types_raise_on_the_callers_thread_and_send_nothing():
    pp0 = PPConsensusStore(0, 2)
    rank1 = PPConsensusStore(1, 2, pp0.address)
    try:
        for key, value, err in [
            ("room", S, TypeError),
            (1.5, S, TypeError),
            (True, S, TypeError),
            (1 << 64, S, TypeError),
            (1, 9, ValueError),
            (1, "S", TypeError),
            (1, 2.0, TypeError),
        ]:
            with pytest.raises(err):
                rank1[key] = value
        with pytest.raises(ValueError):
            rank1.update_status(3, S)  # a room cannot start at Success
        with pytest.raises(RuntimeError, match="PP0-only"):
            rank1.status(1)
        rank1[1] = B
        assert rank1.update_status(1, W) == W and rank1.update_status(1, B) == W
        wait_until(lambda: pp0.collect(1)[1] == W, "the valid write", pp0)
        assert len(rank1) == 1 and pp0.collect(3) == [None, None] and not pp0.dropped
    finally:
        rank1.close()
        pp0.close()


# ---- lifecycle and fast fail ---------------------------------------------------------------------
def test_close_flushes_queued_writes_and_closes_sockets():
    pp0 = PPConsensusStore(0, 2)
    rank1 = PPConsensusStore(1, 2, pp0.address)
    for room in range(2000):
        rank1[room] = W
    rank1.close()
    assert not rank1._thread.is_alive() and rank1._sock.closed
    with pytest.raises(RuntimeError, match="closed"):
        rank1[1] = S
    wait_until(lambda: pp0.collect(1999)[1] == W, "flushed writes", pp0)
    assert all(pp0.collect(room)[1] == W for room in range(2000))
    pp0.close()
    assert pp0._sock.closed
    pp0.close()  # idempotent


def test_single_rank_store_needs_no_sockets():
    with PPConsensusStore(0, 1) as s:
        assert s.address is None and s.status(1) == B
        s[1] = T
        assert s.status(1) == T and s.collect(1) == [T]
    with pytest.raises(ValueError, match="address"):
        PPConsensusStore(1, 2)


FAULT_SCRIPT = textwrap.dedent("""
    import sys, time
    from pdserve.consensus import KVPoll, PPConsensusStore
    pp0 = PPConsensusStore(0, 2)
    rank1 = PPConsensusStore(1, 2, pp0.address)
    rank1[1] = KVPoll.Bootstrapping
    print("injecting", flush=True)
    rank1.inject_fault()
    time.sleep(30)
    print("still alive", flush=True)
""")


def test_background_thread_failure_ends_the_process_within_one_second():
    proc = subprocess.Popen(
        [sys.executable, "-c", FAULT_SCRIPT],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "injecting"
        t0 = time.monotonic()
        rc = proc.wait(timeout=5)
        elapsed = time.monotonic() - t0
        assert rc != 0
        assert elapsed < 1.0, f"took {elapsed:.2f} s to exit"
        assert "fast fail" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()
