"""Authenticated ZMQ frames: every message between ranks and nodes carries an HMAC of the cluster
secret.

Frame = b"PA1" | tag (32 bytes) | seq (u64) | sender length (u8) | sender | payload, where
tag = HMAC-SHA256(channel key, everything after the tag) and the channel key is
HMAC-SHA256(cluster secret, "pdserve/" + channel). So:
* a frame from a process without the secret is rejected (constant-time compare);
* a frame of one channel (say a front event) is rejected on another (KV control, consensus store);
* `sender` (who sent it, e.g. a decode rank's session) is inside the MAC, so receivers may trust it;
* `seq` grows strictly per Sealer, so a receiver drops a replayed or reordered frame of a sender it
  has heard from (`Opener` keeps the last seq of the senders it heard from recently).

Why HMAC and not ZMQ CURVE: every process of a cluster holds one shared secret, so CURVE keypairs
would all be derived from it and name no one; CURVE needs a ZAP authenticator thread per context
(asyncio ones included) and rejects peers silently, while a per-message MAC lets each reader count
what it drops and binds the sender identity into the message. Control messages need integrity, not
secrecy (the KV itself crosses Mooncake in the clear):
confidentiality comes from the private network.

Without a secret (`cluster_secret()` is None: tests and loopback-only development) the same frames
are used with an empty key, which anyone can forge: the control plane is then unauthenticated, which
the node refuses on non-loopback binds unless --insecure was given (docs/SECURITY.md).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
import time
from collections import OrderedDict

import zmq

from pdserve.infra.cluster_secret import cluster_secret

MAGIC = b"PA1"
TAG_BYTES = 32
_HEAD = struct.Struct("<QB")  # seq, sender length
OVERHEAD = len(MAGIC) + TAG_BYTES + _HEAD.size + 255  # the most a frame adds to its payload
SENDERS_KEPT = 4096  # replay memory: this many recent senders per Opener


class AuthError(ValueError):
    """A frame that is not sealed with this cluster's secret for this channel, or a replay.
    `reason` is the counter name: "unauthenticated" or "replayed"."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def channel_key(channel: str, secret: str | None = None) -> bytes:
    """The key of one channel; `secret` defaults to the cluster secret of this process."""
    if secret is None:
        secret = cluster_secret() or ""
    return hmac.new(secret.encode(), b"pdserve/" + channel.encode(), hashlib.sha256).digest()


class Sealer:
    """The sending end of a channel for one sender. Thread-safe; seal and send under one lock per
    socket so frames leave in seq order."""

    def __init__(self, channel: str, sender: str, secret: str | None = None):
        self._key = channel_key(channel, secret)
        self._sender = sender.encode()
        if len(self._sender) > 255:
            raise ValueError(f"sender name {sender!r} is longer than 255 bytes")
        self._seq = 0
        self._lock = threading.Lock()

    def seal(self, payload: bytes) -> bytes:
        with self._lock:
            # Strictly increasing, and at least the wall clock (ns): a restarted sender continues
            # above its earlier frames, so a receiver that remembers the old incarnation accepts it.
            self._seq = seq = max(self._seq + 1, time.time_ns())
        body = _HEAD.pack(seq, len(self._sender)) + self._sender + payload
        return MAGIC + hmac.new(self._key, body, hashlib.sha256).digest() + body


class Opener:
    """The receiving end of a channel. Not thread-safe (each reader owns one)."""

    def __init__(self, channel: str, secret: str | None = None, check_replay: bool = True):
        self._key = channel_key(channel, secret)
        self._check_replay = check_replay
        self._last: OrderedDict[bytes, int] = OrderedDict()

    def open(self, frame: bytes) -> tuple[str, bytes]:
        """(sender, payload) of an authentic, fresh frame; AuthError otherwise
        (never anything else)."""
        start = len(MAGIC) + TAG_BYTES
        if len(frame) < start + _HEAD.size or frame[: len(MAGIC)] != MAGIC:
            raise AuthError("unauthenticated", "not a sealed frame")
        body = memoryview(frame)[start:]
        want = hmac.new(self._key, body, hashlib.sha256).digest()
        if not hmac.compare_digest(want, frame[len(MAGIC) : start]):
            raise AuthError(
                "unauthenticated", "bad signature (another secret or channel, or forged)"
            )
        seq, n = _HEAD.unpack_from(body)
        if len(body) < _HEAD.size + n:
            raise AuthError("unauthenticated", "truncated sender")
        sender = bytes(body[_HEAD.size : _HEAD.size + n])
        if self._check_replay:
            last = self._last.get(sender)
            if last is not None and seq <= last:
                raise AuthError("replayed", f"seq {seq} of {sender!r} is not after {last}")
            self._last[sender] = seq
            self._last.move_to_end(sender)
            if len(self._last) > SENDERS_KEPT:
                self._last.popitem(last=False)
        return sender.decode("utf-8", "replace"), bytes(body[_HEAD.size + n :])


def limit_size(sock, max_payload: int) -> None:
    """Bounds what `sock` accepts (ZMQ_MAXMSGSIZE, a sealed frame of `max_payload` bytes): libzmq
    drops a larger message and disconnects its peer, without touching the other peers."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_payload + OVERHEAD)
