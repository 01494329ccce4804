"""The ring seam under the votes and the leader sync:
send to the next rank, receive from the previous.

Ranks form a ring: rank k sends to (k+1) % size and receives from (k-1) % size. The votes use the
chain links k -> k+1 and the ring link last -> 0; nothing else.

Contract of a `RingTransport`:
* Messages are plain msgpack-able data (lists, ints, strings, bytes, None); never pickled.
* Per link, messages arrive in the order they were sent (FIFO), and every message arrives once.
* `send_next` must not wait for the receiver (it is buffered or asynchronous), otherwise a ring of
  sends could wait on itself.
* `recv_prev` blocks for at most `timeout_s` and then raises `ConsensusTimeout`.

Two implementations:
* `InMemoryRing(size).transport(rank)`: one queue per link, for threads standing in for ranks.
  Messages go through the msgpack codec, so nothing that could not cross a real wire can pass and
  no rank shares mutable objects with another.
* `PPGroupTransport`: an adapter over two callables supplied by the engine's PP group,
  `send_obj(dst, payload: bytes)` and `recv_obj(src, timeout_s) -> bytes`; the payload is the
  msgpack encoding of the message, so the group only moves bytes.
"""

from __future__ import annotations

import abc
import queue
from collections.abc import Callable
from typing import Any

import msgpack

# A control message is a few lists of ids; anything larger than this is a bug or an attack.
MAX_MESSAGE_BYTES = 64 << 20


class ConsensusError(RuntimeError):
    """The ranks broke the vote protocol (call order, slot, or message shape differs between
    ranks)."""


class ConsensusTimeout(ConsensusError):
    """A blocking receive waited longer than its timeout: the previous rank is stuck or dead."""


def encode(obj: Any) -> bytes:
    """msgpack bytes of plain data; TypeError for anything that is not plain data."""
    return msgpack.packb(obj, use_bin_type=True)


def decode(data: bytes) -> Any:
    """Plain data from msgpack bytes, with size limits; ValueError
    (or msgpack's errors) on bad input."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)


class RingTransport(abc.ABC):
    """Send to the next rank, receive from the previous one (see the module contract)."""

    rank: int
    size: int

    @abc.abstractmethod
    def send_next(self, obj: Any) -> None:
        """Queue `obj` for rank (rank + 1) % size; returns without waiting for the receiver."""

    @abc.abstractmethod
    def recv_prev(self) -> Any:
        """The next message from rank (rank - 1) % size; ConsensusTimeout after the timeout."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


def _check_rank(rank: int, size: int) -> None:
    if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
        raise ValueError(f"need 0 <= rank < size and size >= 1, got rank={rank!r} size={size!r}")


class InMemoryRing:
    """A ring of `size` in-process links; `transport(rank)` is one rank's end of it."""

    def __init__(self, size: int, timeout_s: float = 10.0):
        _check_rank(0, size)
        self.size = size
        self.timeout_s = timeout_s
        # _links[k] carries messages from rank k to rank (k + 1) % size.
        self._links: list[queue.SimpleQueue[bytes]] = [queue.SimpleQueue() for _ in range(size)]

    def transport(self, rank: int) -> InMemoryTransport:
        return InMemoryTransport(self, rank)


class InMemoryTransport(RingTransport):
    def __init__(self, ring: InMemoryRing, rank: int):
        _check_rank(rank, ring.size)
        self.ring, self.rank, self.size = ring, rank, ring.size

    def send_next(self, obj: Any) -> None:
        self.ring._links[self.rank].put(encode(obj))

    def recv_prev(self) -> Any:
        prev = (self.rank - 1) % self.size
        try:
            data = self.ring._links[prev].get(timeout=self.ring.timeout_s)
        except queue.Empty:
            raise ConsensusTimeout(
                f"rank {self.rank}: nothing from rank {prev} within {self.ring.timeout_s} s"
            ) from None
        return decode(data)


class PPGroupTransport(RingTransport):
    """The real ring: the engine's PP group moves the bytes.

    `send_obj(dst, payload)` must be asynchronous (docs/ARCHITECTURE.md section 3: async send, sync
    recv) and keep per-link order; `recv_obj(src, timeout_s)` returns the next payload from `src`
    and raises `TimeoutError` when none arrived in time (translated here into `ConsensusTimeout`).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        send_obj: Callable[[int, bytes], None],
        recv_obj: Callable[[int, float], bytes],
        timeout_s: float = 60.0,
    ):
        _check_rank(rank, size)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._send, self._recv = send_obj, recv_obj

    def send_next(self, obj: Any) -> None:
        self._send((self.rank + 1) % self.size, encode(obj))

    def recv_prev(self) -> Any:
        prev = (self.rank - 1) % self.size
        try:
            data = self._recv(prev, self.timeout_s)
        except TimeoutError:
            raise ConsensusTimeout(
                f"rank {self.rank}: nothing from rank {prev} within {self.timeout_s} s"
            ) from None
        return decode(data)
