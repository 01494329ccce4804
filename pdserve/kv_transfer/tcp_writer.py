"""The writing end of the KV data plane (kv_transfer/tcp_transport.py): one authenticated
connection to a peer's listener, which seals the ranges of a write into frames, flushes them and
reads the peer's answers."""

from __future__ import annotations

import ctypes
import hmac
import logging
import secrets
import socket
import struct
import time
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdserve.kv_transfer.layout import Desc
from pdserve.kv_transfer.mooncake import TransferError
from pdserve.kv_transfer.tcp_wire import (
    _ACK,
    _ENTRY,
    _FRAME,
    BAD_RANGE,
    FLUSH,
    FLUSH_BYTES,
    MAGIC,
    MAX_FRAME_BYTES,
    NONCE,
    OK,
    SEAL,
    TAG,
    WRITE,
    _frames,
    _mac,
    _nonce,
    _recv_exactly,
)

logger = logging.getLogger(__name__)


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
