"""The authenticated KV data plane (kv_transfer/tcp_transport.py) with real sockets: byte-exact
writes, the listener's address, and hostile peers aiming at a known registered buffer (no secret,
a wrong secret, raw frames without a handshake, a recorded connection replayed, malformed frames,
ranges outside registered memory, a flood of connections). After each, the buffer's bytes are
unchanged and the engine still serves its real peer."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
import time

import psutil
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdserve.kv_transfer import tcp_transport as tt
from pdserve.kv_transfer.mooncake import TransferError
from pdserve.kv_transfer.tcp_transport import TcpTransferEngine

SECRET = "data-plane-secret"
N = 1 << 20


class Buffer:
    """Memory at a fixed address, filled with a known pattern."""

    def __init__(self, n: int = N, seed: int = 0):
        self.n = n
        self.raw = (ctypes.c_char * n)()
        self.ptr = ctypes.addressof(self.raw)
        self.fill(seed)

    def fill(self, seed: int) -> None:
        ctypes.memmove(
            self.raw, bytes((i * 7 + seed) % 251 for i in range(256)) * (self.n // 256), self.n
        )

    def bytes(self) -> bytes:
        return bytes(self.raw)


@pytest.fixture
def pair():
    """A writer engine and a target engine with one registered buffer, both on loopback."""
    writer, target = TcpTransferEngine("127.0.0.1", SECRET), TcpTransferEngine("127.0.0.1", SECRET)
    dst, src = Buffer(seed=1), Buffer(seed=2)
    target.register(dst.ptr, dst.n)
    yield writer, target, src, dst
    writer.close()
    target.close()


def _legit_write_lands(writer, target, src: Buffer, dst: Buffer) -> None:
    src.fill(int(time.monotonic_ns()) % 200)
    assert writer.write(target.session_id, [(src.ptr, dst.ptr, 4096)], 1) == 4096
    assert dst.bytes()[:4096] == src.bytes()[:4096]


def test_writes_are_byte_exact_in_frames_of_every_size(pair):
    writer, target, src, dst = pair
    # many small ranges (more than one frame's entries) and one range larger than a frame
    small = [(src.ptr + i * 64, dst.ptr + i * 64, 64) for i in range(tt.MAX_ENTRIES + 10)]
    assert writer.write(target.session_id, small, 4) == 64 * len(small)
    big_src, big_dst = (
        Buffer(tt.MAX_FRAME_BYTES + 3 * 4096, 5),
        Buffer(tt.MAX_FRAME_BYTES + 3 * 4096, 6),
    )
    target.register(big_dst.ptr, big_dst.n)
    assert writer.write(target.session_id, [(big_src.ptr, big_dst.ptr, big_src.n)], 1) == big_src.n
    assert big_dst.bytes() == big_src.bytes()
    assert dst.bytes()[: 64 * len(small)] == src.bytes()[: 64 * len(small)]


def test_the_listener_is_on_the_given_address_only(pair):
    _, target, _, _ = pair
    port = int(target.session_id.rsplit(":", 1)[1])
    mine = [
        c.laddr
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert mine == [("127.0.0.1", port)]


def _connect(target) -> socket.socket:
    host, port = target.session_id.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_by_peer(s: socket.socket) -> bool:
    """True once the peer closed the connection (no answer but EOF or a reset)."""
    s.settimeout(10)
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _frame(seq: int, addr: int, payload: bytes, key: bytes = b"\0" * 32) -> bytes:
    """A write frame as a writer seals it (AES-256-GCM under the connection's key)."""
    head = tt._FRAME.pack(tt.WRITE, seq, 1, len(payload))
    entries = tt._ENTRY.pack(addr, len(payload))
    return head + entries + AESGCM(key).encrypt(tt._nonce(0, seq), payload, head + entries)


def test_peers_without_the_secret_change_nothing(pair):
    writer, target, src, dst = pair
    before = dst.bytes()
    attacks = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a port scanner's probe
        os.urandom(4096),  # noise
        _frame(1, dst.ptr, b"\xff" * 4096),  # a well-formed write frame, no handshake
        b"PKV1" + b"\0" * 64 + _frame(1, dst.ptr, b"\xff" * 4096),  # a hello with a forged proof
    ]
    for attack in attacks:
        with _connect(target) as s:
            s.recv(len(tt.MAGIC) + tt.NONCE)  # the listener's challenge
            s.sendall(attack)
            assert _closed_by_peer(s), attack[:40]
    wrong = TcpTransferEngine("127.0.0.1", SECRET + "-not")
    try:
        with pytest.raises(TransferError, match="refused the handshake"):
            wrong.write(target.session_id, [(src.ptr, dst.ptr, 4096)], 1)
    finally:
        wrong.close()
    assert dst.bytes() == before
    assert target.refused >= 3
    _legit_write_lands(writer, target, src, dst)


def _relay(target, recorded: bytearray) -> tuple[socket.socket, str]:
    """A TCP relay in front of the target's port that records what the client sends."""
    host, port = target.session_id.rsplit(":", 1)
    relay = socket.create_server(("127.0.0.1", 0))

    def pump(a: socket.socket, b: socket.socket, record: bool) -> None:
        try:
            while chunk := a.recv(65536):
                if record:
                    recorded.extend(chunk)
                b.sendall(chunk)
        except OSError:
            pass
        finally:
            b.close()

    def serve() -> None:
        client, _ = relay.accept()
        upstream = socket.create_connection((host, int(port)), timeout=10)
        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
        pump(client, upstream, True)

    threading.Thread(target=serve, daemon=True).start()
    return relay, f"127.0.0.1:{relay.getsockname()[1]}"


def test_a_relay_cannot_pass_a_connection_on(pair):
    """The writer's proof names the session it dialled: a relay under another address (a man in
    the middle) is refused by the real listener, and nothing is written."""
    writer, target, src, dst = pair
    before = dst.bytes()
    relay, relayed = _relay(target, bytearray())
    with relay, pytest.raises(TransferError):
        writer.write(relayed, [(src.ptr, dst.ptr, 4096)], 1)
    assert dst.bytes() == before
    _legit_write_lands(writer, target, src, dst)


def test_a_recorded_connection_replays_to_nothing(pair, monkeypatch):
    """Everything a real writer sent on one connection, recorded at its socket and sent again on
    a new connection: the challenge differs, so the recorded proof and frames are refused."""
    writer, target, src, dst = pair
    recorded = bytearray()
    connect = socket.create_connection

    class Recording(socket.socket):
        def sendall(self, data, *args):
            recorded.extend(data)
            return super().sendall(data, *args)

    def recording_connection(*args, **kwargs) -> Recording:
        plain = connect(*args, **kwargs)
        timeout = plain.gettimeout()
        s = Recording(fileno=plain.detach())
        s.settimeout(timeout)
        return s

    with monkeypatch.context() as m:
        m.setattr(socket, "create_connection", recording_connection)
        src.fill(99)
        assert writer.write(target.session_id, [(src.ptr, dst.ptr, N)], 1) == N
    assert dst.bytes() == src.bytes() and len(recorded) > N
    dst.fill(3)
    before = dst.bytes()
    with _connect(target) as s:
        s.recv(len(tt.MAGIC) + tt.NONCE)
        s.sendall(bytes(recorded))
        assert _closed_by_peer(s)
    assert dst.bytes() == before
    _legit_write_lands(writer, target, src, dst)


def test_an_authenticated_peer_cannot_write_outside_registered_memory(pair):
    writer, target, src, dst = pair
    neighbour = Buffer(seed=4)  # memory of the target's process it never registered
    before_dst, before_neighbour = dst.bytes(), neighbour.bytes()
    for bad in (
        [(src.ptr, neighbour.ptr, 4096)],
        [(src.ptr, dst.ptr + dst.n - 100, 4096)],  # runs past the end of the region
        [(src.ptr, dst.ptr, 4096), (src.ptr, neighbour.ptr, 16)],  # one bad range spoils the frame
    ):
        with pytest.raises(TransferError, match="outside its registered memory"):
            writer.write(target.session_id, bad, 1)
    assert dst.bytes() == before_dst and neighbour.bytes() == before_neighbour
    target.unregister(dst.ptr)  # unregistered memory is closed to writes at once
    with pytest.raises(TransferError, match="outside its registered memory"):
        writer.write(target.session_id, [(src.ptr, dst.ptr, 4096)], 1)
    assert dst.bytes() == before_dst
    target.register(dst.ptr, dst.n)
    _legit_write_lands(writer, target, src, dst)


def test_malformed_frames_from_an_authenticated_peer_are_cut_off(pair):
    """A peer that passed the handshake and then sends frames out of sequence, over the bounds,
    with ranges that do not add up or a wrong tag: the connection ends, nothing is written."""
    writer, target, src, dst = pair
    before = dst.bytes()
    payload = b"\xab" * 64

    def session() -> tuple[socket.socket, bytes]:
        s = _connect(target)
        client = tt._Client.handshake(s, writer._key, target.session_id, time.monotonic() + 10)
        return s, client.key  # the connection's key, which seals its frames

    cases = [
        lambda k: _frame(2, dst.ptr, payload, k),  # sequence skips
        lambda k: _frame(1, dst.ptr, payload, b"\1" * 32),  # tag under another key
        lambda k: tt._FRAME.pack(tt.WRITE, 1, tt.MAX_ENTRIES + 1, 64),  # too many ranges
        lambda k: tt._FRAME.pack(tt.WRITE, 1, 1, tt.MAX_FRAME_BYTES + 1),  # too large
        lambda k: tt._FRAME.pack(tt.WRITE, 1, 1, 64) + tt._ENTRY.pack(dst.ptr, 32) + payload,
        lambda k: tt._FRAME.pack(b"READ", 1, 1, 64),  # there is no read
    ]
    for make in cases:
        s, key = session()
        with s:
            s.sendall(make(key) + b"\0" * 64)
            assert _closed_by_peer(s)
    assert dst.bytes() == before
    _legit_write_lands(writer, target, src, dst)


def test_connections_are_bounded_and_idle_handshakes_time_out(monkeypatch):
    monkeypatch.setattr(tt, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(tt, "HANDSHAKE_TIMEOUT_S", 0.5)
    writer, target = TcpTransferEngine("127.0.0.1", SECRET), TcpTransferEngine("127.0.0.1", SECRET)
    src, dst = Buffer(seed=2), Buffer(seed=1)
    target.register(dst.ptr, dst.n)
    try:
        idle = [_connect(target) for _ in range(4)]  # say nothing: hold every slot
        with _connect(target) as extra:
            assert _closed_by_peer(extra)  # over the bound: closed at once
        for s in idle:
            assert _closed_by_peer(s)  # the handshake's time ran out
            s.close()
        _legit_write_lands(writer, target, src, dst)
    finally:
        writer.close()
        target.close()


def test_a_frame_header_says_what_the_writer_sends():
    """The layout both sides agree on (a change here is a protocol change: bump MAGIC)."""
    assert (tt._FRAME.size, tt._ENTRY.size, tt._ACK.size) == (20, 12, 16)
    assert tt.MAGIC == b"PKV1" and struct.calcsize("<4sQII") == tt._FRAME.size


def test_a_trickled_handshake_is_cut_at_its_deadline(pair, monkeypatch):
    """One byte at a time, each well inside a read's timeout: the whole handshake still ends at
    HANDSHAKE_TIMEOUT_S, so a slow peer holds no slot for long."""
    monkeypatch.setattr(tt, "HANDSHAKE_TIMEOUT_S", 1.0)
    _, target, _, _ = pair
    with _connect(target) as s:
        s.recv(len(tt.MAGIC) + tt.NONCE)
        closed = False
        for _ in range(60):  # 60 x 0.1 s: past the deadline, each byte within it
            try:
                s.sendall(b"P")
            except OSError:
                closed = True
                break
            s.settimeout(0.1)
            try:
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        # 60 bytes, never the 68 of a hello: with a timeout per read only, it stays open
        assert closed


def test_a_writer_that_leaves_without_its_flush_writes_nothing(pair):
    """Frames are held until their flush: a writer that gave up (its deadline, an error) and
    closed leaves nothing to land later in pages another request may own by then."""
    writer, target, _, dst = pair
    before, payload, at = dst.bytes(), b"\xab" * 4096, 8192
    serving = len(target._open)
    s = _connect(target)
    client = tt._Client.handshake(s, writer._key, target.session_id, time.monotonic() + 10)
    s.sendall(_frame(1, dst.ptr + at, payload, client.key))
    s.close()
    deadline = time.monotonic() + 10  # until the listener is done with that connection
    while len(target._open) > serving:
        assert time.monotonic() < deadline, "the listener still serves the closed connection"
        time.sleep(0.01)
    assert dst.bytes() == before  # nothing of the abandoned frame, then or later
    s = _connect(target)  # the same frame with its flush: written
    client = tt._Client.handshake(s, writer._key, target.session_id, time.monotonic() + 10)
    with s:
        s.sendall(_frame(1, dst.ptr + at, payload, client.key))
        client.seq = 1
        client._read_ack(client._send_flush(time.monotonic() + 10), time.monotonic() + 10)
    assert dst.bytes()[at : at + 4096] == payload
