"""The listening end of the KV data plane (kv_transfer/tcp_transport.py): one authenticated
connection from a peer, whose frames are checked, held until the writer's flush and only then
written into registered memory."""

from __future__ import annotations

import ctypes
import logging
import socket
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdserve.kv_transfer.tcp_wire import (
    _ACK,
    _ENTRY,
    _FRAME,
    BAD_RANGE,
    FLUSH,
    FLUSH_BYTES,
    FRAME_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_ENTRIES,
    MAX_FRAME_BYTES,
    OK,
    SEAL,
    WRITE,
    _nonce,
    _recv_exactly,
    _Regions,
)

logger = logging.getLogger(__name__)


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
                        assert base is not None  # a bytes object's buffer is never NULL
                        for addr, k in ranges:  # from the plaintext in place, no slice copies
                            ctypes.memmove(addr, base + off, k)
                            off += k
        self._held, self._held_bytes = [], 0
        ack = _ACK.pack(b"ACK_", seq, self.failed)
        self.sock.sendall(ack + self.aead.encrypt(_nonce(1, seq), b"", ack))
        return self.failed == OK
