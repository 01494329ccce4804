"""The KV manager of a decode rank: looks rooms up in the prefill nodes' bootstrap servers (on the
allowlist), creates one KVReceiver per room, routes control messages to them, and watches the
prefill peers' liveness (kv_transfer/receiver.py has one room's receiver)."""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.consensus.kvpoll import KVPoll
from pdserve.kv_transfer.base import BaseDecodeKVManager
from pdserve.kv_transfer.bootstrap import PrefillRankInfo
from pdserve.kv_transfer.bootstrap_client import BootstrapClient
from pdserve.kv_transfer.layout import PoolDesc
from pdserve.kv_transfer.manager import AUX_HEADER, KVManagerBase, TransferConfig
from pdserve.kv_transfer.messages import KVAbort, KVRegister, Message
from pdserve.kv_transfer.mooncake import MooncakeEngine
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.tcp_transport import TcpTransferEngine


class DecodeKVManager(KVManagerBase, BaseDecodeKVManager):
    """The KV manager of one decode rank; `dst_slices` are the slices of all decode ranks of its
    node, by `rank`: (layer_start, layer_end, head_start, head_end), or (layer_start, layer_end)
    for a node without TP (every rank holds the pool's heads)."""

    side = "decode"

    def __init__(
        self,
        config: TransferConfig,
        pool: PoolDesc,
        pp_rank: int,
        dst_slices,
        aux_slots: int = 256,
        engine: MooncakeEngine | TcpTransferEngine | None = None,
        tp: tuple[int, int] = (0, 1),
        sliding_pool: PoolDesc | None = None,
    ):
        super().__init__(
            config,
            pool,
            pp_rank,
            aux_slots=aux_slots,
            engine=engine,
            tp=tp,
            sliding_pool=sliding_pool,
        )
        self.dst_slices = tuple(
            tuple(int(x) for x in s) if len(s) == 4 else (int(s[0]), int(s[1]), *pool.heads)
            for s in dst_slices
        )
        if self.dst_slices[self.rank] != (*pool.layers, *pool.heads):
            raise ValueError(
                f"decode rank {self.rank}: pool layers {pool.layers} and heads {pool.heads} "
                f"differ from {self.dst_slices[self.rank]}"
            )
        self._receivers: dict[int, KVReceiver] = {}
        self._clients: dict[str, BootstrapClient] = {}
        self._routes: dict[str, Future] = {}
        self._misses: dict[str, int] = {}
        self._lookups = ThreadPoolExecutor(4, thread_name_prefix=f"kv-route{self.rank}")
        self._start_threads()

    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        with self._lock:
            if room in self._receivers:
                raise ValueError(f"room {room} already has a receiver (a room is never reused)")
            recv = self._receivers[room] = KVReceiver(self, room, bootstrap_addr)
            fut = self._routes.get(bootstrap_addr)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._routes[bootstrap_addr] = self._lookups.submit(
                    self._lookup, bootstrap_addr
                )
        fut.add_done_callback(recv.on_route)
        return recv

    def clear_aux(self, ptr: int) -> None:
        ctypes.memset(ptr, 0, AUX_HEADER.size)

    def _client(self, addr: str) -> BootstrapClient:
        with self._lock:
            if addr not in self._clients:
                self._clients[addr] = BootstrapClient(
                    addr, self.config.auth_token, min(2.0, self.config.heartbeat_interval_s * 2)
                )
            return self._clients[addr]

    def _lookup(self, addr: str) -> list[PrefillRankInfo]:
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        return self._client(addr).route(
            self.pool.layer_start, self.pool.layer_end, self.session_id, deadline, self.pool.heads
        )

    def _on_message(self, msg: Message, sender: str) -> None:
        if isinstance(msg, KVRegister) or (isinstance(msg, KVAbort) and msg.side != "prefill"):
            self.stats.add_dropped("unexpected")
            return
        recv = self._receivers.get(msg.room)
        if recv is None:
            self.stats.add_dropped("unknown_room")
        elif not recv.is_peer(msg.rank if isinstance(msg, KVAbort) else msg.src_rank, sender):
            self._drop(
                "foreign_peer",
                "room %d: %s from %s, not a prefill rank of the room, dropped",
                msg.room,
                type(msg).__name__,
                sender,
            )
        elif isinstance(msg, KVAbort):
            recv.note_quiet(msg.rank)  # first: no KVAbort goes back to the rank that sent it
            recv._fail("aborted_by_prefill", detail=msg.reason)
        else:
            recv.on_status(msg)

    def _tick(self, now: float) -> None:
        with self._lock:
            receivers = list(self._receivers.values())
            for r in receivers:
                if r.finished_at is not None and now - r.finished_at > self.config.terminal_ttl_s:
                    del self._receivers[r.room]
        for r in receivers:
            if r.finished_at is None:
                r.check_timeouts(now)

    def _heartbeat(self) -> None:
        """Beats to every bootstrap server this rank has used (so prefill ranks there see it alive),
        and fails the rooms whose prefill peers went silent or whose server stayed unreachable."""
        with self._lock:
            active = [r for r in self._receivers.values() if r.finished_at is None]
            addrs = sorted(self._clients)
        by_addr: dict[str, list[KVReceiver]] = {a: [] for a in addrs}
        for r in active:
            by_addr.setdefault(r.bootstrap_addr, []).append(r)
        for addr, recvs in by_addr.items():
            peers = sorted({s for r in recvs for s in r.prefill_sessions()})
            try:
                beat = self._client(addr).heartbeat(self.session_id, peers)
                dead, registered = set(beat.dead), beat.ranks
                self._misses[addr] = 0
                # A cached route naming a session the server no longer has is stale: the node was
                # restarted on the same address with new ranks. Without this check the route would
                # outlive the restart whenever no room of ours was active when the old ranks died.
                stale = self._cached_sessions(addr) - registered
                if stale:
                    self.info("prefill node %s has new ranks; looking its route up again", addr)
                    dead |= stale
            except Exception as e:
                self._misses[addr] = self._misses.get(addr, 0) + 1
                if self._misses[addr] < self.config.heartbeat_misses:
                    continue
                self.warn(
                    "bootstrap server %s unreachable for %d beats: %s", addr, self._misses[addr], e
                )
                dead = set(peers)
                for r in recvs:
                    if r.poll() == KVPoll.WaitingForInput:
                        r._fail("bootstrap_lost")
                if not recvs:  # forget a server nobody uses any more
                    with self._lock:
                        self._routes.pop(addr, None)
                        client = self._clients.pop(addr, None)
                    self._misses.pop(addr, None)
                    if client is not None:
                        client.close()
            if dead:
                with self._lock:
                    self._routes.pop(addr, None)  # the node will re-register with new sessions
                for r in recvs:
                    if dead.intersection(r.prefill_sessions()):
                        r._fail("peer_dead")

    def _cached_sessions(self, addr: str) -> set[str]:
        with self._lock:
            fut = self._routes.get(addr)
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return set()
        return {r.session_id for r in fut.result()}

    def close(self) -> None:
        super().close()
        self._lookups.shutdown(wait=False, cancel_futures=True)
        for c in self._clients.values():
            c.close()
