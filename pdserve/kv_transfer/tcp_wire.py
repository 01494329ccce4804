"""The wire of pdserve's KV data plane (kv_transfer/tcp_transport.py): its constants and bounds,
the frame and answer layouts, the handshake's MACs, AES-GCM nonces, bounded reads, and the
registered memory a frame may write into."""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import struct
import threading
import time
from collections.abc import Sequence

from pdserve.kv_transfer.layout import Desc

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

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held while a frame is written, and by unregister
        self._regions: dict[int, int] = {}  # start -> length
        # registrations of each start: KV managers sharing the engine may register one pool
        # (an elastic rank's two roles); it stays until the last of them unregisters it
        self._count: dict[int, int] = {}

    def add(self, ptr: int, length: int) -> None:
        if ptr <= 0 or length <= 0:
            raise ValueError(f"bad region {ptr:#x} + {length}")
        with self.lock:
            if ptr in self._regions and self._regions[ptr] != length:
                raise ValueError(f"region {ptr:#x} registered with another length")
            self._regions[ptr] = length
            self._count[ptr] = self._count.get(ptr, 0) + 1

    def remove(self, ptr: int) -> None:
        with self.lock:
            left = self._count.get(ptr, 0) - 1
            if left > 0:
                self._count[ptr] = left
                return
            self._count.pop(ptr, None)
            self._regions.pop(ptr, None)

    def contains(self, addr: int, length: int) -> bool:
        return any(s <= addr and addr + length <= s + n for s, n in self._regions.items())


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
