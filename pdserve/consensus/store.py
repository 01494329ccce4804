"""PPConsensusStore: room -> KVPoll on every rank, replicated to PP0
(docs/ARCHITECTURE.md section 5, way 3).

Each rank reads and writes its own entries like a dict. On PP0 the store also holds a replica of
every other rank's entries and answers `status(room)`: `Bootstrapping` while any rank has no entry
for the room, else the min over all ranks (so any `Failed` gives `Failed`). PP0's conclusion then
goes down the chain by leader sync.

Wire: PP0 binds a ZMQ PULL socket on `tcp://{host}:*` and exposes `.address`; the caller shares it
(the engine broadcasts it over the PP group) and every other rank connects one PUSH socket to it.
Each put/delete is one msgpack frame `[op, rank, key, value]` (op PUT=1 with a KVPoll int, DELETE=2
with None); never pickle. The frame is sealed (infra/channel_auth.py, channel "consensus-store",
sender "pp<rank>"): an HMAC of the cluster secret and a per-rank sequence number, so PP0 applies
only frames a rank of this cluster sent, once, in order;
the socket takes no message larger than a frame.

Contract:
* Writes never block on the network: the frame is encoded on the caller's thread (a bad key or
  value raises there) and queued; one background thread per rank sends the queue in order on one
  socket, so PP0 sees each rank's writes in the order they were made.
* PP0 reads incoming frames on its caller's thread (`drain`, called by `status` and `collect`):
  no thread, no lock, and a read sees every frame that reached PP0 before it.
* A frame that is not exactly that shape (unsealed or wrongly sealed, replayed, garbage, pickle,
  wrong rank, unknown op, wrong key or value type) is dropped with a warning and counted in
  `dropped[reason]`; the store keeps working.
* Fast fail: an unexpected error in the background thread logs one critical line and ends the
  process at once (`os._exit(1)`); a rank whose writes silently stopped would stall the cluster.
* `close()` stops the thread (queued frames are flushed, bounded by a linger) and closes sockets.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import sys
import threading
from collections.abc import Iterable, Iterator, MutableMapping
from typing import TypeGuard, cast

import msgpack
import zmq

from pdserve.consensus.kvpoll import KVPoll, update_status
from pdserve.infra.channel_auth import AuthError, Opener, Sealer, limit_size

logger = logging.getLogger(__name__)

PUT, DELETE = 1, 2
_KEY_MIN, _KEY_MAX = -(1 << 63), (1 << 64) - 1  # what a msgpack int can carry
_MAX_FRAME = 64  # [op, rank, key, value] packs into <= 16 bytes
_STOP, _FAULT = object(), object()
CHANNEL = "consensus-store"
FLUSH_LINGER_MS = 2000


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_key(room: object) -> int:
    if not _is_int(room) or not _KEY_MIN <= room <= _KEY_MAX:
        raise TypeError(f"store keys are rooms (ints in 64-bit range), got {room!r}")
    return room


class PPConsensusStore(MutableMapping):
    """A dict room -> KVPoll whose writes on PP>0 are replicated to PP0
    (see the module contract)."""

    def __init__(
        self, pp_rank: int, pp_size: int, address: str | None = None, host: str = "127.0.0.1"
    ):
        if not (_is_int(pp_size) and pp_size >= 1 and _is_int(pp_rank) and 0 <= pp_rank < pp_size):
            raise ValueError(
                f"need 0 <= pp_rank < pp_size, got pp_rank={pp_rank!r} pp_size={pp_size!r}"
            )
        self.rank, self.size = pp_rank, pp_size
        self._local: dict[int, KVPoll] = {}
        self.dropped: collections.Counter[str] = collections.Counter()
        self.address: str | None = None
        self._closed = False
        self._ctx = self._sock = self._thread = None
        self._queue: queue.SimpleQueue | None = None
        if pp_size == 1:
            self._replicas = [self._local]
            return
        self._ctx = zmq.Context()
        if pp_rank == 0:
            self._replicas = [self._local] + [{} for _ in range(pp_size - 1)]
            self._sock = self._ctx.socket(zmq.PULL)
            self._sock.setsockopt(zmq.RCVHWM, 0)
            self._sock.setsockopt(zmq.LINGER, 0)
            limit_size(self._sock, _MAX_FRAME)
            self._opener = Opener(CHANNEL)
            self._sock.bind(f"tcp://{host}:*")
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            if not address:
                self._ctx.term()
                raise ValueError(
                    f"rank {pp_rank} needs PP0's store address (PPConsensusStore.address on PP0)"
                )
            self.address = address
            self._sock = self._ctx.socket(zmq.PUSH)
            self._sock.setsockopt(zmq.SNDHWM, 0)
            self._sock.setsockopt(zmq.LINGER, FLUSH_LINGER_MS)
            limit_size(self._sock, _MAX_FRAME)
            self._sealer = Sealer(CHANNEL, f"pp{pp_rank}")
            self._sock.connect(address)
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._send_loop, daemon=True, name=f"pp{pp_rank}-consensus-store"
            )
            self._thread.start()

    # ---- dict interface (local entries) -------------------------------------------------------
    def __getitem__(self, room: int) -> KVPoll:
        return self._local[room]

    def __setitem__(self, room: int, status: KVPoll | int) -> None:
        room = _check_key(room)
        if not _is_int(status):
            raise TypeError(f"store values are KVPoll, got {status!r}")
        status = KVPoll(status)
        self._push(PUT, room, int(status))
        self._local[room] = status

    def __delitem__(self, room: int) -> None:
        del self._local[room]
        self._push(DELETE, room, None)

    def __iter__(self) -> Iterator[int]:
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)

    def update_status(self, room: int, status: KVPoll | int) -> KVPoll:
        """Apply kvpoll.update_status to this rank's entry; writes
        (and replicates) only a change."""
        new = update_status(self._local.get(room), status)
        if self._local.get(room) != new:
            self[room] = new
        return new

    # ---- PP0 -----------------------------------------------------------------------------------
    def status(self, room: int) -> KVPoll:
        """PP0 only: Bootstrapping while any rank has no entry for `room`,
        else the min over ranks."""
        self._need_leader("status")
        self.drain()
        return self._status(room)

    def statuses(self, rooms: Iterable[int]) -> list[KVPoll]:
        """PP0 only: `status` of each room, in order, reading the socket once
        (the per-iteration call)."""
        self._need_leader("statuses")
        self.drain()
        return [self._status(room) for room in rooms]

    def _status(self, room: int) -> KVPoll:
        worst = KVPoll.Success
        for replica in self._replicas:
            s = replica.get(room)
            if s is None:
                return KVPoll.Bootstrapping
            if s < worst:
                worst = s
        return worst

    def collect(self, room: int) -> list[KVPoll | None]:
        """PP0 only: every rank's entry for `room` (None where a rank has none), PP0 first."""
        self._need_leader("collect")
        self.drain()
        return [replica.get(room) for replica in self._replicas]

    def drain(self, timeout_s: float = 0.0) -> int:
        """PP0: apply the frames that arrived (waiting up to `timeout_s` for a first one);
        returns the count."""
        if self.rank != 0 or self._sock is None:
            return 0
        if timeout_s > 0 and not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return 0
        n = 0
        # pyzmq types getsockopt as int | bytes; EVENTS is an int option
        while cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._apply(self._sock.recv_multipart(zmq.NOBLOCK, copy=True))
            n += 1
        return n

    def _apply(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            return self._drop("malformed", frames)
        try:
            sender, payload = self._opener.open(frames[0])
        except AuthError as e:
            return self._drop(e.reason, frames)
        if len(payload) > _MAX_FRAME:
            return self._drop("malformed", frames)
        try:
            msg = msgpack.unpackb(
                payload,
                raw=False,
                use_list=True,
                max_str_len=_MAX_FRAME,
                max_bin_len=_MAX_FRAME,
                max_array_len=4,
                max_map_len=0,
                max_ext_len=0,
            )
        except (
            ValueError,
            msgpack.UnpackException,
        ):  # ExtraData, FormatError, StackError, OutOfData
            return self._drop("malformed", frames)
        if not (isinstance(msg, list) and len(msg) == 4):
            return self._drop("bad_shape", frames)
        op, rank, key, value = msg
        if op not in (PUT, DELETE) or not _is_int(op):
            return self._drop("unknown_op", frames)
        if not (_is_int(rank) and 1 <= rank < self.size):
            return self._drop("bad_rank", frames)
        if sender != f"pp{rank}":  # a rank writes only its own replica
            return self._drop("foreign_rank", frames)
        if not (_is_int(key) and _KEY_MIN <= key <= _KEY_MAX):
            return self._drop("bad_key", frames)
        if op == PUT:
            if not (_is_int(value) and 0 <= value <= int(KVPoll.Success)):
                return self._drop("bad_value", frames)
            self._replicas[rank][key] = KVPoll(value)
        else:
            if value is not None:
                return self._drop("bad_value", frames)
            self._replicas[rank].pop(key, None)

    def _drop(self, reason: str, frames: list[bytes]) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] > 1:  # a flood must not flood the log: the first of each kind
            return
        logger.warning(
            "pid %d pp0: dropped consensus store frame (%s): %r",
            os.getpid(),
            reason,
            b"|".join(frames)[:48],
        )

    def _need_leader(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(
                f"{what}() is PP0-only (this is rank {self.rank}); PP0 sends its "
                "conclusion down the chain with LeaderSync"
            )

    # ---- replication (PP > 0) -----------------------------------------------------------------
    def _push(self, op: int, room: int, value: int | None) -> None:
        if self._closed:
            raise RuntimeError("PPConsensusStore is closed")
        if self._queue is not None:
            self._queue.put(msgpack.packb([op, self.rank, room, value]))

    def _send_loop(self) -> None:
        try:
            # the thread runs only on ranks > 0, which set both before starting it (__init__)
            assert self._queue is not None and self._sock is not None
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                if item is _FAULT:
                    raise RuntimeError("fault injected by inject_fault()")
                self._sock.send(self._sealer.seal(item))
            self._sock.close()  # lingers up to FLUSH_LINGER_MS to flush what is queued
        except BaseException as e:  # fast fail: a silent replication stop would stall the cluster
            line = (
                f"pid {os.getpid()} pp{self.rank}: consensus store sender thread failed: "
                f"{type(e).__name__}: {e}; exiting now (fast fail)\n"
            )
            logger.critical(line.rstrip())
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            finally:
                os._exit(1)

    def inject_fault(self) -> None:
        """Test hook: make the background sender thread raise (the process then exits with 1)."""
        if self._queue is None:
            raise RuntimeError("only ranks > 0 of a PP > 1 store have a background thread")
        self._queue.put(_FAULT)

    def close(self) -> None:
        """Flush and stop the sender thread (ranks > 0), close the socket and the ZMQ context."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            assert self._queue is not None  # set with the thread (__init__)
            self._queue.put(_STOP)
            self._thread.join(timeout=FLUSH_LINGER_MS / 1000 + 1)
        elif self._sock is not None:
            self._sock.close()
        if self._ctx is not None and (self._thread is None or not self._thread.is_alive()):
            self._ctx.term()

    def __enter__(self) -> PPConsensusStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
