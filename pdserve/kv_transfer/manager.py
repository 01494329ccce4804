"""What the prefill and decode KV managers share: config, engine, aux buffer, control sockets,
threads.

Threads of one manager (none of them ever runs scheduler code):
  recv       opens (infra/channel_auth.py: HMAC of the cluster secret) and decodes control messages
             from the PULL socket and hands them to `_on_message` with their authenticated sender;
             unauthenticated, replayed and malformed ones are dropped and counted
  reaper     every `tick_s`: timeouts and clean-up (`_tick`), so rooms end even if nobody polls
  heartbeat  every `heartbeat_interval_s`: liveness of peers through bootstrap servers
The transfer pool (prefill) and route look-ups (decode) live in the subclasses.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import zlib

import zmq

from pdserve.infra.channel_auth import AuthError, Opener, Sealer, limit_size
from pdserve.kv_transfer.config import AUX_HEADER, TransferConfig
from pdserve.kv_transfer.layout import PoolDesc
from pdserve.kv_transfer.messages import Message, MessageError, decode_message, encode_message
from pdserve.kv_transfer.mooncake import MooncakeEngine
from pdserve.kv_transfer.stats import TransferStats
from pdserve.kv_transfer.targets import check_split
from pdserve.kv_transfer.tcp_transport import TcpTransferEngine, make_engine

logger = logging.getLogger(__name__)

MAX_CONTROL_BYTES = 8 << 20  # a KVRegister of ~900k page ids; anything larger is not ours
CHANNEL = "kv-control"


def write_aux(ptr: int, room: int, payload: bytes) -> int:
    """Lays out header + payload at `ptr`; returns the byte count."""
    data = AUX_HEADER.pack(room, len(payload), zlib.crc32(payload)) + payload
    ctypes.memmove(ptr, data, len(data))
    return len(data)


def read_aux(ptr: int, room: int, capacity: int) -> bytes | None:
    """The payload at `ptr` if its header names `room` and its crc matches, else None."""
    hroom, n, crc = AUX_HEADER.unpack(ctypes.string_at(ptr, AUX_HEADER.size))
    if hroom != room or n > capacity - AUX_HEADER.size:
        return None
    payload = ctypes.string_at(ptr + AUX_HEADER.size, n)
    return payload if zlib.crc32(payload) == crc else None


class KVManagerBase:
    side = "?"

    def __init__(
        self,
        config: TransferConfig,
        pool: PoolDesc,
        pp_rank: int,
        aux_slots: int,
        engine: MooncakeEngine | TcpTransferEngine | None = None,
        tp: tuple[int, int] = (0, 1),
        sliding_pool: PoolDesc | None = None,
    ):
        self.config, self.pool, self.pp_rank = config, pool, pp_rank
        if sliding_pool is not None:
            check_split(pool, sliding_pool)
        self.sliding_pool = sliding_pool
        # Under TP a stage is several ranks, each with its own pool and manager: the control
        # messages name a rank by its place in its node, PP rank x TP size + TP rank (`rank`).
        self.tp_rank, self.tp_size = tp
        self.rank = pp_rank * self.tp_size + self.tp_rank
        self.stats = TransferStats()
        where = f"pp{pp_rank}" + (f"-tp{self.tp_rank}" if self.tp_size > 1 else "")
        self._prefix = f"[pid {os.getpid()} {self.side} {where}]"
        self.engine = engine or make_engine(config.host, config.protocol, config.device)
        if pool.nbytes:  # a windowed pool's slice of sliding layers only has no other bytes
            self.engine.register(pool.base_ptr, pool.nbytes)
        if sliding_pool is not None:  # its allocator's pages: the zero page after them is not
            self.engine.register(sliding_pool.base_ptr, sliding_pool.nbytes)
        self.aux_slots = aux_slots
        self._aux = (ctypes.c_char * (aux_slots * config.aux_slot_bytes))()
        self.aux_base = ctypes.addressof(self._aux)
        self.engine.register(self.aux_base, aux_slots * config.aux_slot_bytes)
        self._lock = threading.RLock()  # guards the room tables of the subclass
        self._stop = threading.Event()
        self._zmq = zmq.Context()
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        limit_size(self._pull, MAX_CONTROL_BYTES)
        if config.ctrl_port:
            self._pull.bind(f"tcp://{config.host}:{config.ctrl_port}")
            self.ctrl_port = config.ctrl_port
        else:
            self.ctrl_port = self._pull.bind_to_random_port(f"tcp://{config.host}")
        # Who this manager is on the wire: its Mooncake session and control port, inside every MAC.
        self.sender_id = sender_id(self.engine.session_id, self.ctrl_port)
        self._sealer = Sealer(CHANNEL, self.sender_id)
        self._opener = Opener(CHANNEL)
        self._logged_drops: set[str] = set()
        self._push: dict[tuple[str, int], tuple[zmq.Socket, threading.Lock]] = {}
        self._push_lock = threading.Lock()
        self._threads = [
            threading.Thread(
                target=fn, name=f"kv-{self.side}{self.rank}-{fn.__name__}", daemon=True
            )
            for fn in (self._recv_loop, self._reaper_loop, self._heartbeat_loop)
        ]

    def _start_threads(self) -> None:
        for t in self._threads:
            t.start()

    def info(self, msg, *args):
        logger.info(f"{self._prefix} {msg}", *args)

    def debug(self, msg, *args):
        logger.debug(f"{self._prefix} {msg}", *args)

    def warn(self, msg, *args):
        logger.warning(f"{self._prefix} {msg}", *args)

    @property
    def session_id(self) -> str:
        return self.engine.session_id

    def aux_ptr(self, slot: int) -> int:
        if not 0 <= slot < self.aux_slots:
            raise ValueError(f"aux slot {slot} outside [0, {self.aux_slots})")
        return self.aux_base + slot * self.config.aux_slot_bytes

    # ---- control messages -------------------------------------------------------------------

    def send(self, host: str, port: int, msg: Message) -> bool:
        """Queues one control message without blocking; False (and counted) if it cannot go now."""
        data = encode_message(msg)
        with self._push_lock:
            entry = self._push.get((host, port))
            if entry is None:
                sock = self._zmq.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 10000)
                limit_size(sock, MAX_CONTROL_BYTES)
                sock.connect(f"tcp://{host}:{port}")
                entry = self._push[(host, port)] = (sock, threading.Lock())
        sock, lock = entry
        try:
            with lock:  # sealed under the socket's lock: frames leave in seq order
                sock.send(self._sealer.seal(data), flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            self.warn("control message to %s:%d not sent: %s", host, port, e)
            self.stats.add_dropped("send_failed")
            return False

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            data = self._pull.recv(copy=True)
            try:
                sender, payload = self._opener.open(data)
                msg = decode_message(payload)
            except AuthError as e:
                self._drop(e.reason, "dropped a control message (%d bytes): %s", len(data), e)
                continue
            except MessageError as e:
                self._drop(
                    "malformed", "dropped a malformed control message (%d bytes): %s", len(data), e
                )
                continue
            try:
                self._on_message(msg, sender)
            except Exception:
                self.stats.add_dropped("handler_error")
                logger.exception("%s control message %s failed", self._prefix, type(msg).__name__)

    def _drop(self, reason: str, fmt: str, *args) -> None:
        """Counts a dropped message; logs the first of each reason (a flood must not flood logs)."""
        self.stats.add_dropped(reason)
        if reason not in self._logged_drops:
            self._logged_drops.add(reason)
            self.warn(fmt + " (further drops of this kind are only counted)", *args)

    def _reaper_loop(self) -> None:
        while not self._stop.wait(self.config.tick_s):
            try:
                self._tick(time.monotonic())
            except Exception:
                logger.exception("%s reaper tick failed", self._prefix)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            try:
                self._heartbeat()
            except Exception:
                logger.exception("%s heartbeat failed", self._prefix)

    def _on_message(self, msg: Message, sender: str) -> None:
        """`sender`: the authenticated `sender_id` of the manager that sent `msg`."""
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        raise NotImplementedError

    def _heartbeat(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stops the threads, closes the sockets and unregisters the memory (the pool may be freed
        afterwards); rooms still open are left as they are."""
        self._stop.set()
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=5)
        with self._push_lock:
            for sock, _ in self._push.values():
                sock.close(0)
            self._push.clear()
        self._pull.close(0)
        self._zmq.term()
        self.engine.unregister(self.aux_base)
        if self.pool.nbytes:
            self.engine.unregister(self.pool.base_ptr)
        if self.sliding_pool is not None:
            self.engine.unregister(self.sliding_pool.base_ptr)


def sender_id(session_id: str, ctrl_port: int) -> str:
    """A KV manager's name on the control channel: Mooncake session and control port (unique)."""
    return f"{session_id}/{ctrl_port}"
