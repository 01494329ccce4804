"""KV writes over an authenticated TCP transport: the default where there is no RDMA.

Why not Mooncake's TCP transport: in 0.3.13 its data listener and its handshake listener accept on
every interface whatever address it is given, neither authenticates the peer, and the handshake
hands any caller the addresses of the registered buffers, which the data port then reads and
writes (docs/SECURITY.md). This transport has the same seam as kv_transfer/mooncake.py
(`register`, `unregister`, `write`, `session_id`) and:

- listens only on the address it is given (loopback for a local cluster);
- admits a connection only after a challenge-response on the cluster secret (the secret itself
  never crosses the wire), in both directions, from which a key for this connection is derived;
- carries writes in frames sealed with AES-256-GCM under that key (the header and the ranges as
  associated data, the nonce from the direction and the frame's sequence number): the KV is
  encrypted, and a frame from anyone else, replayed, reordered or changed fails its tag, is
  refused and the connection closed. AES-GCM (the `cryptography` package, OpenSSL's AES-NI code)
  seals and opens several times faster than HMAC-SHA256 hashes, which had bounded the transport
  (measured: bench/results/HISTORY.md, "The KV data plane that only the cluster can use");
- writes a frame only once its tag holds and every range it names lies inside memory this process
  registered, so nothing else of the process can be touched; it has no read operation at all;
- writes a flush group's frames only when the writer's flush arrives: a writer that gave up (a
  timeout, an error) and closed its connection leaves nothing behind to land in pages that may
  already belong to another request;
- bounds everything: unauthenticated handshakes (in all and per source address) apart from the
  authenticated connections, the frame size, the entries of a frame, the bytes awaiting a flush,
  and the time of a whole handshake, of a frame and of an idle connection.

Without a cluster secret (loopback-only development) the key is derived from the empty secret, as
for the ZMQ channels (infra/channel_auth.py): then anyone on the host could forge it, which is why
a node refuses a non-loopback bind without one.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdserve.infra.channel_auth import channel_key
from pdserve.kv_transfer.layout import Desc
from pdserve.kv_transfer.mooncake import TransferError, write_bounds

logger = logging.getLogger(__name__)

CHANNEL = "kv-data"
MAGIC = b"PKV1"
NONCE = 32
TAG = 32  # handshake proofs (HMAC-SHA256)
SEAL = 16  # a frame's AES-GCM tag
_FRAME = struct.Struct("<4sQII")  # kind, seq, entries, payload bytes
_ENTRY = struct.Struct("<QI")  # destination address, length
_ACK = struct.Struct("<4sQI")  # b"ACK_", seq, status
WRITE, FLUSH = b"WRIT", b"FLSH"
MAX_FRAME_BYTES = 8 << 20  # payload of one frame
MAX_ENTRIES = 4096  # ranges of one frame
MAX_CONNECTIONS = 256  # authenticated, at once, per listening process
MAX_HANDSHAKES = 32  # unauthenticated connections at once: they cannot fill the above
MAX_HANDSHAKES_PER_SOURCE = 4  # of those, from one address
FLUSH_BYTES = 16 << 20  # a writer flushes at least this often; the listener holds them till then
HANDSHAKE_TIMEOUT_S = 5.0
FRAME_TIMEOUT_S = 30.0  # to receive a whole frame once it has begun
IDLE_TIMEOUT_S = 600.0  # a pooled connection with no frame for this long is closed
POOL_PER_PEER = 8  # idle connections kept per peer
OK, BAD_FRAME, BAD_RANGE = 0, 1, 2


def _mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _nonce(direction: int, seq: int) -> bytes:
    """Unique per key: one key per connection, 0 for the writer's frames, 1 for the answers."""
    return bytes([direction]) + seq.to_bytes(8, "little") + b"\0\0\0"


def _recv_exactly(
    sock: socket.socket, n: int, into: memoryview | None = None, deadline: float | None = None
) -> bytes:
    """`n` bytes; with a deadline the whole read is bounded by it (a peer that trickles one byte
    at a time cannot stretch it)."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("read deadline passed")
            sock.settimeout(left)
        k = sock.recv_into(buf[got:n])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return buf[:n].tobytes() if into is None else b""


class _Regions:
    """The memory this process registered; a write must lie inside one region."""

    def __init__(self):
        self.lock = threading.Lock()  # held while a frame is written, and by unregister
        self._regions: dict[int, int] = {}  # start -> length

    def add(self, ptr: int, length: int) -> None:
        if ptr <= 0 or length <= 0:
            raise ValueError(f"bad region {ptr:#x} + {length}")
        with self.lock:
            self._regions[ptr] = length

    def remove(self, ptr: int) -> None:
        with self.lock:
            self._regions.pop(ptr, None)

    def contains(self, addr: int, length: int) -> bool:
        return any(s <= addr and addr + length <= s + n for s, n in self._regions.items())


class TcpTransferEngine:
    """One per process, like MooncakeEngine: a listener on `host` for the writes of peers, and a
    pool of authenticated connections to the peers this process writes to."""

    protocol = "tcp"
    device = ""

    def __init__(self, host: str, secret: str | None = None, port: int = 0):
        self._key = channel_key(CHANNEL, secret)
        self._regions = _Regions()
        self._stop = threading.Event()
        self._listener = socket.create_server((host, port), backlog=128)
        self.host = host
        self.session_id = f"{host}:{self._listener.getsockname()[1]}"
        self._conns = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._handshakes: dict[str, int] = {}  # source address -> handshakes under way
        self._handshakes_lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._pool: dict[str, list[_Client]] = {}
        self._pool_lock = threading.Lock()
        self.refused = 0  # connections or frames refused (a counter for tests and logs)
        threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True).start()
        logger.debug("KV transfer engine: authenticated TCP, session %s", self.session_id)

    # --- the seam ---------------------------------------------------------------------------
    def register(self, ptr: int, length: int) -> None:
        self._regions.add(ptr, length)

    def unregister(self, ptr: int) -> None:
        self._regions.remove(ptr)

    def write(
        self, session_id: str, descs: Sequence[Desc], max_inflight: int, should_stop=lambda: False
    ) -> int:
        """Writes every descriptor to the peer (blocking) and returns the bytes moved. A failed
        write is tried once more on a new connection (writes are idempotent). It returns or raises
        only once the peer has answered for every frame sent, so after it the destination is never
        written by this call again (a peer that does not answer within the drain time is cut off
        and logged). `max_inflight` is Mooncake's window: one TCP stream needs none."""
        total, deadline = write_bounds(descs, max_inflight)
        if not descs:
            return 0
        for attempt in (1, 2):
            client = None
            try:
                client = self._take(session_id, deadline)
                client.write(descs, should_stop, deadline)
                self._give_back(session_id, client)
                return total
            except TransferError:
                if client is not None:
                    client.close()
                raise
            except (OSError, ConnectionError, ValueError) as e:
                if client is not None:
                    client.close()
                if attempt == 2 or should_stop() or time.monotonic() > deadline:
                    raise TransferError(f"write to {session_id} failed: {e}", session_id) from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._stop.set()
        for s in [self._listener, *self._open]:  # shutdown wakes a thread blocked on it
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        with self._pool_lock:
            for clients in self._pool.values():
                for c in clients:
                    c.close()
            self._pool.clear()
        with self._open_lock:
            for s in self._open:
                s.close()

    # --- client side --------------------------------------------------------------------------
    def _take(self, session_id: str, deadline: float) -> _Client:
        with self._pool_lock:
            idle = self._pool.get(session_id)
            if idle:
                return idle.pop()
        host, _, port = session_id.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(f"bad peer session {session_id!r}", session_id)
        timeout = max(0.1, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic()))
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        try:
            handshake_deadline = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S)
            return _Client.handshake(sock, self._key, session_id, handshake_deadline)
        except BaseException:
            sock.close()
            raise

    def _give_back(self, session_id: str, client: _Client) -> None:
        with self._pool_lock:
            idle = self._pool.setdefault(session_id, [])
            if len(idle) < POOL_PER_PEER:
                idle.append(client)
                return
        client.close()

    # --- server side --------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._stop.is_set():
                    return
                # out of descriptors or buffers for a moment: the listener must outlive it
                logger.warning("KV data port %s: accept failed: %s", self.session_id, e)
                self._stop.wait(0.1)
                continue
            if self._stop.is_set():
                sock.close()
                return
            source = addr[0]
            if not self._begin_handshake(source):
                sock.close()  # at a handshake bound: the peer retries later
                self.refused += 1
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(sock, source), name="kv-tcp-conn", daemon=True
                ).start()
            except RuntimeError:  # no thread to be had
                self._end_handshake(source)
                sock.close()

    def _begin_handshake(self, source: str) -> bool:
        with self._handshakes_lock:
            mine = self._handshakes.get(source, 0)
            if (
                mine >= MAX_HANDSHAKES_PER_SOURCE
                or sum(self._handshakes.values()) >= MAX_HANDSHAKES
            ):
                return False
            self._handshakes[source] = mine + 1
            return True

    def _end_handshake(self, source: str) -> None:
        with self._handshakes_lock:
            left = self._handshakes.get(source, 1) - 1
            if left:
                self._handshakes[source] = left
            else:
                self._handshakes.pop(source, None)

    def _serve(self, sock: socket.socket, source: str) -> None:
        with self._open_lock:
            self._open.add(sock)
        admitted = False
        try:
            try:
                key = self._server_handshake(sock)
            finally:
                self._end_handshake(source)
            if key is None:
                self.refused += 1
                return
            # only an authenticated connection takes one of the connection slots
            admitted = self._conns.acquire(blocking=False)
            if not admitted:
                self.refused += 1
                return
            _Server(sock, key, self._regions, self).run()
        except (OSError, ConnectionError, ValueError) as e:
            logger.debug("KV connection from %s ended: %s", source, e)
        finally:
            with self._open_lock:
                self._open.discard(sock)
            sock.close()
            if admitted:
                self._conns.release()

    def _server_handshake(self, sock: socket.socket) -> bytes | None:
        """Challenge-response: the peer proves it holds the secret for this listener's session,
        then this side proves it back; returns the connection's key, or None (refused)."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S  # for the whole handshake
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        mine = secrets.token_bytes(NONCE)
        sock.sendall(MAGIC + mine)
        hello = _recv_exactly(sock, len(MAGIC) + NONCE + TAG, deadline=deadline)
        magic, theirs, proof = hello[:4], hello[4 : 4 + NONCE], hello[4 + NONCE :]
        expected = _mac(self._key, b"client", mine, theirs, self.session_id.encode())
        if magic != MAGIC or not hmac.compare_digest(proof, expected):
            logger.warning("KV data port %s: refused a peer without the secret", self.session_id)
            return None
        sock.sendall(_mac(self._key, b"server", theirs, mine))
        return _mac(self._key, b"session", mine, theirs)


class _Client:
    """One authenticated connection to a peer's listener, used by one write at a time."""

    def __init__(self, sock: socket.socket, key: bytes, session_id: str):
        self.sock, self.aead, self.seq, self.session_id = sock, AESGCM(key), 0, session_id
        self.key = key  # the connection's key: tests seal their own frames with it
        self._buf = bytearray()  # one frame's payload, gathered

    @classmethod
    def handshake(
        cls, sock: socket.socket, key: bytes, session_id: str, deadline: float
    ) -> _Client:
        hello = _recv_exactly(sock, len(MAGIC) + NONCE, deadline=deadline)
        if hello[:4] != MAGIC:
            raise ConnectionError(f"{session_id} is not a KV data port")
        theirs, mine = hello[4:], secrets.token_bytes(NONCE)
        sock.sendall(MAGIC + mine + _mac(key, b"client", theirs, mine, session_id.encode()))
        try:
            proof = _recv_exactly(sock, TAG, deadline=deadline)
        except ConnectionError as e:
            raise ConnectionError(f"{session_id} refused the handshake (another secret?)") from e
        if not hmac.compare_digest(proof, _mac(key, b"server", mine, theirs)):
            raise ConnectionError(f"{session_id} does not hold the cluster secret")
        return cls(sock, _mac(key, b"session", theirs, mine), session_id)

    def write(self, descs: Sequence[Desc], should_stop, deadline: float) -> None:
        """Frames in flush groups, the flushes not waited for until the end (the listener writes
        group k while group k + 1 is on the way); then every acknowledgement. On an error the
        connection is reset, so the listener drops what it has not read yet."""
        try:
            self._write(descs, should_stop, deadline)
        except TransferError:
            raise
        except BaseException:
            self.reset()
            raise

    def _write(self, descs: Sequence[Desc], should_stop, deadline: float) -> None:
        stopped, unflushed, flushes = False, 0, []
        for frame in _frames(descs):
            if unflushed >= FLUSH_BYTES - MAX_FRAME_BYTES:  # the listener holds at most this
                flushes.append(self._send_flush(deadline))
                unflushed = 0
            if should_stop():
                stopped = True
                break
            self._settimeout(deadline)
            self.seq += 1
            size = sum(d[2] for d in frame)
            head = _FRAME.pack(WRITE, self.seq, len(frame), size)
            entries = b"".join(_ENTRY.pack(d[1], d[2]) for d in frame)
            # the frame's ranges gathered into one buffer: one MAC update and one send per frame
            # (per range, the Python calls cost more than the bytes; bench/results/HISTORY.md)
            payload = self._gather(frame, size)
            sealed = self.aead.encrypt(_nonce(0, self.seq), payload, head + entries)
            self.sock.sendall(head + entries)
            self.sock.sendall(sealed)
            unflushed += size
        flushes.append(self._send_flush(deadline))
        for seq in flushes:
            self._read_ack(seq, deadline)
        if stopped:
            raise TransferError("stopped")

    def _gather(self, frame: Sequence[Desc], size: int) -> memoryview:
        if len(self._buf) < size:
            self._buf = bytearray(size)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        off = 0
        for src, _, n in frame:
            ctypes.memmove(base + off, src, n)
            off += n
        return memoryview(self._buf)[:size]

    def _send_flush(self, deadline: float) -> int:
        """Asks the listener to write what it holds; returns the flush's sequence number."""
        self._settimeout(deadline)
        self.seq += 1
        head = _FRAME.pack(FLUSH, self.seq, 0, 0)
        self.sock.sendall(head + self.aead.encrypt(_nonce(0, self.seq), b"", head))
        return self.seq

    def _read_ack(self, flush_seq: int, deadline: float) -> None:
        """Every frame before that flush has been written (or refused) once this arrives."""
        ack = _recv_exactly(self.sock, _ACK.size + SEAL, deadline=deadline)
        kind, seq, status = _ACK.unpack(ack[: _ACK.size])
        try:
            self.aead.decrypt(_nonce(1, seq), ack[_ACK.size :], ack[: _ACK.size])
        except InvalidTag:
            raise ConnectionError("bad acknowledgement") from None
        if kind != b"ACK_" or seq != flush_seq:
            raise ConnectionError("bad acknowledgement")
        if status != OK:
            what = "a range outside its registered memory" if status == BAD_RANGE else "a frame"
            raise TransferError(f"{self.session_id} refused a write: {what}", self.session_id)

    def reset(self) -> None:
        """Closes with a reset (SO_LINGER 0): the listener's unread bytes are dropped."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.sock.close()

    def _settimeout(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("write deadline passed")
        self.sock.settimeout(left)

    def close(self) -> None:
        self.sock.close()


def _frames(descs: Sequence[Desc]):
    """Descriptors in frames of at most MAX_ENTRIES ranges and MAX_FRAME_BYTES bytes (a larger
    descriptor is split)."""
    frame: list[Desc] = []
    size = 0
    for src, dst, n in descs:
        while n > 0:
            take = min(n, MAX_FRAME_BYTES - size)
            frame.append((src, dst, take))
            size += take
            src, dst, n = src + take, dst + take, n - take
            if size == MAX_FRAME_BYTES or len(frame) == MAX_ENTRIES:
                yield frame
                frame, size = [], 0
    if frame:
        yield frame


class _Server:
    """The listener's side of one connection: frames in order, each checked whole and held; a
    flush writes what it holds (if every range is still registered) and answers for it."""

    def __init__(self, sock: socket.socket, key: bytes, regions: _Regions, engine):
        self.sock, self.aead, self.regions, self.engine = sock, AESGCM(key), regions, engine
        self.seq = 0
        self.failed = OK  # once a frame is refused, nothing more is written on this connection
        self._payload = bytearray()
        self._held: list[tuple[list[tuple[int, int]], bytes]] = []  # (ranges, plaintext)
        self._held_bytes = 0

    def run(self) -> None:
        while True:
            self.sock.settimeout(IDLE_TIMEOUT_S)
            first = self.sock.recv(1, socket.MSG_PEEK)
            if not first:
                return  # the writer left: what it did not flush is dropped, never written
            deadline = time.monotonic() + FRAME_TIMEOUT_S
            head = _recv_exactly(self.sock, _FRAME.size, deadline=deadline)
            kind, seq, n, size = _FRAME.unpack(head)
            if seq != self.seq + 1 or kind not in (WRITE, FLUSH):
                raise ValueError(f"frame out of order or of unknown kind {kind!r}")
            self.seq = seq
            if kind == FLUSH:
                if not self._flush(head, seq, deadline):
                    return
                continue
            if not (0 < n <= MAX_ENTRIES and 0 < size <= MAX_FRAME_BYTES):
                raise ValueError(f"frame of {n} ranges, {size} bytes: over the bounds")
            if self._held_bytes + size > FLUSH_BYTES:
                raise ValueError(f"over {FLUSH_BYTES} bytes without a flush")
            self._hold_frame(head, n, size, deadline)

    def _hold_frame(self, head: bytes, n: int, size: int, deadline: float) -> None:
        entries = _recv_exactly(self.sock, n * _ENTRY.size, deadline=deadline)
        ranges = [_ENTRY.unpack_from(entries, i * _ENTRY.size) for i in range(n)]
        if sum(r[1] for r in ranges) != size or any(r[1] == 0 for r in ranges):
            raise ValueError("frame ranges do not add up to its payload")
        if len(self._payload) < size + SEAL:
            self._payload = bytearray(size + SEAL)
        sealed = memoryview(self._payload)[: size + SEAL]
        _recv_exactly(self.sock, size + SEAL, sealed, deadline=deadline)
        try:
            payload = self.aead.decrypt(_nonce(0, self.seq), sealed, head + entries)
        except InvalidTag:
            self.engine.refused += 1
            raise ValueError("bad frame tag") from None  # not from the authenticated peer: cut off
        if self.failed != OK:
            return
        with self.regions.lock:
            if not all(self.regions.contains(addr, k) for addr, k in ranges):
                self.failed = BAD_RANGE  # the whole write is refused: nothing of it lands
                self.engine.refused += 1
                self._held, self._held_bytes = [], 0
                return
        self._held.append((ranges, payload))
        self._held_bytes += size

    def _flush(self, head: bytes, seq: int, deadline: float) -> bool:
        """Writes the held frames, answers; False once the connection is done."""
        try:
            self.aead.decrypt(
                _nonce(0, seq), _recv_exactly(self.sock, SEAL, deadline=deadline), head
            )
        except InvalidTag:
            raise ValueError("bad flush tag") from None
        if self.failed == OK:
            with self.regions.lock:  # checked again: a region may have gone since
                if not all(self.regions.contains(a, k) for r, _ in self._held for a, k in r):
                    self.failed = BAD_RANGE
                    self.engine.refused += 1
                else:
                    for ranges, payload in self._held:
                        off = 0
                        base = ctypes.cast(ctypes.c_char_p(payload), ctypes.c_void_p).value
                        for addr, k in ranges:  # from the plaintext in place, no slice copies
                            ctypes.memmove(addr, base + off, k)
                            off += k
        self._held, self._held_bytes = [], 0
        ack = _ACK.pack(b"ACK_", seq, self.failed)
        self.sock.sendall(ack + self.aead.encrypt(_nonce(1, seq), b"", ack))
        return self.failed == OK


def make_engine(host: str, protocol: str | None, device: str | None):
    """The transfer engine for a KV manager: this transport for TCP, Mooncake for RDMA (and for
    Mooncake's own TCP transport, only when asked for by name)."""
    from pdserve.kv_transfer.mooncake import MooncakeEngine, resolve_protocol

    protocol, device = resolve_protocol(protocol, device)
    if protocol == "tcp":
        return TcpTransferEngine(host)
    return MooncakeEngine(host, protocol, device)
