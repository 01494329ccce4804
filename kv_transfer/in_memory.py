"""The KV transfer between the pools of one process (tests only; no production path imports this,
tests/test_layering.py checks it).

An `InMemoryFabric` stands for one prefill node's bootstrap server, the control channel and the
Mooncake engine at once: the prefill managers (one per prefill rank) and the decode managers (one
per decode rank) join it, and a room's ends reach each other through it.

    decode rank d: register(pages, aux_slot) -> every prefill rank k whose layers overlap d's
    prefill rank k: Bootstrapping -> WaitingForInput once every overlapping decode rank registered
    send_chunk     build_descriptors (layout.py, the real byte ranges) per decode peer, each
                   descriptor checked to lie inside both pools, then memmove
    last chunk     the aux data into the decode rank's aux slot (manager.py write_aux framing),
                   then Success, told to each decode peer
    decode rank    Success once every prefill rank of its route reported Success and aux landed

Failures follow the Mooncake path (sender.py, receiver.py): a sender's failure reaches its decode
peers (Failed status, or an abort); a decode receiver that fails after registering tells every
prefill rank of its route that has not sent its final word, and a sender that is not done fails
(`aborted_by_decode`) and answers with its final word; an abort that finds no sender yet withdraws
the pending registration and answers at once, and the sender created later fails. Every message is
delivered at once, so a failed room is quiesced as soon as each prefill rank answered.

Copies run synchronously inside `send_chunk`, under the fabric's one lock (every entry point takes
it, and nothing under it blocks), so a test is deterministic given the order of the ranks' calls.
`fail_writes` injects write failures. Not modelled: the network, Mooncake, the bootstrap server and
its HTTP, control sockets and their authentication, heartbeats and the managers' timeouts (a room
ends here only by a transfer, a failure or an abort); those stay with the real-process tests.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from consensus.kvpoll import KVPoll
from kv_transfer.base import (
    BaseDecodeKVManager,
    BaseKVReceiver,
    BaseKVSender,
    BasePrefillKVManager,
)
from kv_transfer.layout import (
    Desc,
    PoolDesc,
    build_descriptors,
    check_compatible,
    intersect,
    overlapping,
)
from kv_transfer.manager import AUX_HEADER, TransferConfig, read_aux, write_aux
from kv_transfer.mooncake import TransferError
from kv_transfer.stats import TransferStats, room_tokens

log = logging.getLogger(__name__)

ADDRESS = "inproc-prefill:0"  # the bootstrap address a decode request names for this fabric


@dataclass(frozen=True)
class _Registration:
    room: int
    dst_rank: int
    dst_slices: tuple[tuple[int, int], ...]
    pool: PoolDesc
    page_ids: tuple[int, ...]
    aux_slot: int | None
    receiver: InMemoryKVReceiver
    prefix_tokens: int = 0  # held by the decode rank: `page_ids` start at its end


@dataclass
class _Failure:
    room: int | None
    prefill_rank: int | None
    count: int | None


class InMemoryFabric:
    """One prefill node's ranks and one decode node's ranks, joined in memory."""

    def __init__(self, prefill_pp_size: int, address: str = ADDRESS):
        self.prefill_pp_size, self.address = prefill_pp_size, address
        self.lock = threading.RLock()
        self.prefill: dict[int, InMemoryPrefillKVManager] = {}
        self._failures: list[_Failure] = []
        self.descriptors = 0  # every descriptor copied, for tests

    def prefill_manager(
        self, pool: PoolDesc, pp_rank: int, config: TransferConfig | None = None
    ) -> InMemoryPrefillKVManager:
        with self.lock:
            if pp_rank in self.prefill or not 0 <= pp_rank < self.prefill_pp_size:
                raise ValueError(f"prefill rank {pp_rank} taken or outside the node")
            mgr = self.prefill[pp_rank] = InMemoryPrefillKVManager(
                self, pool, pp_rank, config or TransferConfig()
            )
            return mgr

    def decode_manager(
        self,
        pool: PoolDesc,
        pp_rank: int,
        dst_slices: Sequence[tuple[int, int]],
        aux_slots: int = 256,
        config: TransferConfig | None = None,
    ) -> InMemoryDecodeKVManager:
        return InMemoryDecodeKVManager(
            self, pool, pp_rank, dst_slices, aux_slots, config or TransferConfig()
        )

    def fail_writes(
        self, room: int | None = None, prefill_rank: int | None = None, count: int | None = None
    ) -> None:
        """The next `count` (None: every) chunk write of `room` by `prefill_rank` fails (None: any
        room, any rank)."""
        with self.lock:
            self._failures.append(_Failure(room, prefill_rank, count))

    # --- under the lock ---------------------------------------------------------------------------
    def _take_failure(self, room: int, prefill_rank: int) -> bool:
        for f in self._failures:
            if f.room in (None, room) and f.prefill_rank in (None, prefill_rank):
                if f.count is None:
                    return True
                if f.count > 0:
                    f.count -= 1
                    return True
        return False

    def _route(self, bootstrap_addr: str, layers: tuple[int, int]) -> list[int]:
        """The prefill ranks whose layers overlap `layers` (what the bootstrap server answers)."""
        if bootstrap_addr != self.address:
            raise ValueError(f"no prefill node at {bootstrap_addr!r} (this one: {self.address})")
        if len(self.prefill) != self.prefill_pp_size:
            raise ValueError(f"{len(self.prefill)} of {self.prefill_pp_size} prefill ranks joined")
        slices = {k: m.pool.layers for k, m in self.prefill.items()}
        return [k for k, _, _ in overlapping(layers, slices)]

    def _copy(
        self,
        src: PoolDesc,
        dst: PoolDesc,
        descs: list[Desc],
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
    ) -> int:
        """memmove of each descriptor, once every one was checked to read only the room's pages
        of the prefill pool and to write only the room's pages of the decode pool, in the layers
        both pools hold (a wrong descriptor fails the room here instead of corrupting memory)."""
        layers = intersect(src.layers, dst.layers)
        for s, d, n in descs:
            _check_inside(src, set(src_pages), layers, s, n, "reads")
            _check_inside(dst, set(dst_pages), layers, d, n, "writes")
        for s, d, n in descs:
            ctypes.memmove(d, s, n)
        self.descriptors += len(descs)
        return sum(n for _, _, n in descs)


def _check_inside(
    pool: PoolDesc, pages: set[int], layers: tuple[int, int], addr: int, n: int, what: str
) -> None:
    """ValueError unless [addr, addr + n) lies in `pages` of `pool`, within `layers` of each."""
    lo = (layers[0] - pool.layer_start) * pool.layer_bytes
    hi = (layers[1] - pool.layer_start) * pool.layer_bytes
    at, end = addr - pool.base_ptr, addr - pool.base_ptr + n
    if at < 0 or end > pool.nbytes:
        raise ValueError(f"a descriptor {what} [{addr}, {addr + n}) outside the pool")
    while at < end:
        page, off = divmod(at, pool.page_bytes)
        upto = min(end - page * pool.page_bytes, pool.page_bytes)
        if page not in pages or off < lo or upto > hi:
            raise ValueError(
                f"a descriptor {what} page {page} bytes [{off}, {upto}), outside the room's "
                f"pages or layers {layers}"
            )
        at = page * pool.page_bytes + upto


# --- prefill side ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Chunk:
    page_ids: tuple[int, ...]
    token_start: int
    token_end: int
    last: bool
    aux: bytes | None


class InMemoryKVSender(BaseKVSender):
    def __init__(self, mgr: InMemoryPrefillKVManager, room: int):
        self.room, self._mgr = room, mgr
        self._status = KVPoll.Bootstrapping
        self.reason: str | None = None
        self._peers: dict[int, _Registration] = {}
        self._expected: frozenset[int] | None = None
        self._chunks: deque[_Chunk] = deque()
        self._last_queued = False
        self._moved: dict[int, int] = {}  # decode rank -> KV bytes copied to it

    def poll(self) -> KVPoll:
        return self._status

    def send_chunk(self, page_ids, token_start, token_end, last=False, aux=None) -> None:
        if self._last_queued:
            raise ValueError(f"room {self.room}: chunk after the last one")
        if not 0 <= token_start <= token_end:
            raise ValueError(f"room {self.room}: bad token range [{token_start}, {token_end})")
        with self._mgr.fabric.lock:
            if self._status == KVPoll.Failed:
                return
            self._chunks.append(
                _Chunk(tuple(int(p) for p in page_ids), token_start, token_end, last, aux)
            )
            self._last_queued = last
            self._drain()

    def abort(self, reason: str = "aborted") -> None:
        with self._mgr.fabric.lock:
            self._fail(reason, abort=True)

    # --- under the fabric's lock ------------------------------------------------------------------
    def on_register(self, reg: _Registration) -> None:
        mgr = self._mgr
        try:
            check_compatible(mgr.pool, reg.pool)
            own = reg.dst_slices[reg.dst_rank] if reg.dst_rank < len(reg.dst_slices) else None
            expected = frozenset(
                r for r, _, _ in overlapping(mgr.pool.layers, dict(enumerate(reg.dst_slices)))
            )
            if own != reg.pool.layers or reg.dst_rank not in expected:
                raise ValueError(f"decode rank {reg.dst_rank} does not overlap {mgr.pool.layers}")
            if reg.prefix_tokens % reg.pool.page_size:
                raise ValueError(f"prefix of {reg.prefix_tokens} tokens is not page-aligned")
            if self._expected is not None and expected != self._expected:
                raise ValueError("decode ranks disagree on the decode node's layer slices")
        except ValueError as e:
            log.warning(
                "room %d: bad registration from decode rank %d: %s", self.room, reg.dst_rank, e
            )
            reg.receiver.on_failed(mgr.pp_rank, "bad_registration")
            self._fail("bad_registration")
            return
        if self._status == KVPoll.Failed:
            reg.receiver.on_failed(mgr.pp_rank, self.reason or "failed")
            return
        if reg.dst_rank in self._peers:
            mgr.stats.add_dropped("duplicate_register")
            return
        if any(p.prefix_tokens != reg.prefix_tokens for p in self._peers.values()):
            log.warning("room %d: decode ranks registered different cached prefixes", self.room)
            reg.receiver.on_failed(mgr.pp_rank, "prefix_mismatch")
            self._fail("prefix_mismatch")
            return
        self._expected = expected
        self._peers[reg.dst_rank] = reg
        if set(self._peers) == self._expected and self._status == KVPoll.Bootstrapping:
            self._status = KVPoll.WaitingForInput
            self._drain()

    def on_decode_abort(self, dst_rank: int) -> None:
        if self._status not in (KVPoll.Failed, KVPoll.Success):
            self._fail("aborted_by_decode")  # the final word goes to every peer, this one too
        elif dst_rank in self._peers:
            self._peers[dst_rank].receiver.on_failed(
                self._mgr.pp_rank, self.reason or "aborted_by_decode"
            )

    def _drain(self) -> None:
        mgr = self._mgr
        while self._chunks and self._status in (KVPoll.WaitingForInput, KVPoll.Transferring):
            chunk = self._chunks.popleft()
            self._status = KVPoll.Transferring
            try:
                self._send(chunk)
            except (TransferError, ValueError) as e:
                log.warning(
                    "room %d: transfer failed on prefill rank %d: %s", self.room, mgr.pp_rank, e
                )
                self._fail("transfer_error" if isinstance(e, TransferError) else "bad_chunk")

    def _send(self, chunk: _Chunk) -> None:
        mgr, fabric = self._mgr, self._mgr.fabric
        if fabric._take_failure(self.room, mgr.pp_rank):
            raise TransferError(f"injected write failure (room {self.room})")
        peers = sorted(self._peers.items())
        for rank, p in peers:
            descs = build_descriptors(
                mgr.pool,
                p.pool,
                chunk.page_ids,
                p.page_ids,
                max(chunk.token_start, p.prefix_tokens),  # the decode rank holds the prefix
                chunk.token_end,
                p.prefix_tokens // p.pool.page_size,
            )
            moved = fabric._copy(mgr.pool, p.pool, descs, chunk.page_ids, p.page_ids)
            self._moved[rank] = self._moved.get(rank, 0) + moved
            mgr.stats.add_write(len(descs), moved)
        if not chunk.last:
            return
        aux_bytes = {}
        for rank, p in peers:
            aux_bytes[rank] = p.receiver.mgr.land_aux(self.room, p.aux_slot, chunk.aux)
        self._status = KVPoll.Success
        for rank, p in peers:
            p.receiver.on_success(
                mgr.pp_rank, aux_bytes[rank], self._moved.get(rank, 0), chunk.token_end
            )
        mgr.stats.add_success(self.room, 0.0)
        mgr.stats.add_room_tokens(*room_tokens(mgr.pool, [p for _, p in peers], chunk.token_end))

    def _fail(self, reason: str, abort: bool = False) -> None:
        if self._status in (KVPoll.Failed, KVPoll.Success):
            return
        self._status, self.reason = KVPoll.Failed, reason
        self._chunks.clear()
        self._mgr.stats.add_failure(reason)
        for p in self._peers.values():
            if abort:
                p.receiver.on_prefill_abort(self._mgr.pp_rank, reason)
            else:
                p.receiver.on_failed(self._mgr.pp_rank, reason)


class InMemoryPrefillKVManager(BasePrefillKVManager):
    def __init__(
        self, fabric: InMemoryFabric, pool: PoolDesc, pp_rank: int, config: TransferConfig
    ):
        self.fabric, self.pool, self.pp_rank, self.config = fabric, pool, pp_rank, config
        self.stats = TransferStats()
        self.senders: dict[int, InMemoryKVSender] = {}
        self._pending: dict[int, list[_Registration]] = {}  # registrations before create_sender
        self._withdrawn: set[int] = set()  # rooms a decode rank gave up before create_sender

    def create_sender(self, room: int) -> InMemoryKVSender:
        with self.fabric.lock:
            if room in self.senders:
                raise ValueError(f"room {room} already has a sender (a room is never reused)")
            sender = self.senders[room] = InMemoryKVSender(self, room)
            for reg in self._pending.pop(room, []):
                sender.on_register(reg)
            if room in self._withdrawn:
                self._withdrawn.discard(room)
                sender._fail("aborted_by_decode")
            return sender

    # --- under the fabric's lock ------------------------------------------------------------------
    def on_register(self, reg: _Registration) -> None:
        sender = self.senders.get(reg.room)
        if sender is None:
            self._pending.setdefault(reg.room, []).append(reg)
        else:
            sender.on_register(reg)

    def on_decode_abort(self, room: int, dst_rank: int) -> None:
        sender = self.senders.get(room)
        if sender is not None:
            if sender._peers.get(dst_rank) is None:
                self.stats.add_dropped("foreign_peer")
            else:
                sender.on_decode_abort(dst_rank)
            return
        regs = self._pending.get(room, [])
        mine = [r for r in regs if r.dst_rank == dst_rank]
        if not mine:
            self.stats.add_dropped("unknown_room")
            return
        rest = [r for r in regs if r.dst_rank != dst_rank]
        if rest:
            self._pending[room] = rest
        else:
            del self._pending[room]
        self._withdrawn.add(room)
        for r in mine:  # the decode rank's final word from this rank
            r.receiver.on_failed(self.pp_rank, "aborted_by_decode")

    def close(self) -> None:
        """Nothing runs in the background."""


# --- decode side ----------------------------------------------------------------------------------
class InMemoryKVReceiver(BaseKVReceiver):
    def __init__(self, mgr: InMemoryDecodeKVManager, room: int, bootstrap_addr: str):
        self.room, self.mgr = room, mgr
        self._status = KVPoll.Bootstrapping
        self.reason: str | None = None
        self._route: list[int] = []
        self._page_ids: tuple[int, ...] | None = None
        self._aux_slot: int | None = None
        self._prefix = 0  # prompt tokens this rank holds already: not sent
        self._num_tokens = 0  # the prompt's tokens, as the prefill ranks reported them
        self._sent = False
        self._done: dict[int, int] = {}  # prefill rank -> aux bytes it wrote
        self._quiet: set[int] = set()  # prefill ranks that sent their final word
        self._aux: bytes | None = None
        self._failed_at: float | None = None
        self._received = 0
        try:
            self._route = mgr.fabric._route(bootstrap_addr, mgr.pool.layers)
        except ValueError as e:
            self._fail("bootstrap_error", str(e))

    def poll(self) -> KVPoll:
        return self._status

    def register(self, page_ids, aux_slot: int | None = None, prefix_tokens: int = 0) -> None:
        mgr = self.mgr
        if prefix_tokens < 0 or prefix_tokens % mgr.pool.page_size:
            raise ValueError(f"room {self.room}: prefix of {prefix_tokens} tokens not page-aligned")
        with mgr.fabric.lock:
            if aux_slot is not None:
                ctypes.memset(mgr.aux_ptr(aux_slot), 0, AUX_HEADER.size)  # validates the slot
            if self._page_ids is not None:
                raise ValueError(f"room {self.room}: registered twice")
            self._page_ids = tuple(int(p) for p in page_ids)
            self._aux_slot = aux_slot
            self._prefix = prefix_tokens
            if self._status != KVPoll.Bootstrapping:
                return
            self._sent, self._status = True, KVPoll.WaitingForInput
            reg = _Registration(
                self.room,
                mgr.pp_rank,
                mgr.dst_slices,
                mgr.pool,
                self._page_ids,
                aux_slot,
                self,
                prefix_tokens,
            )
            for k in self._route:
                mgr.fabric.prefill[k].on_register(reg)

    def read_aux(self) -> bytes | None:
        return self._aux if self._status == KVPoll.Success else None

    def abort(self, reason: str = "aborted") -> None:
        with self.mgr.fabric.lock:
            self._fail(reason)

    def quiesced(self, grace_s: float) -> bool:
        with self.mgr.fabric.lock:
            if self._status == KVPoll.Success or (self._status == KVPoll.Failed and not self._sent):
                return True
            if self._status != KVPoll.Failed:
                return False
            if set(self._route) <= self._quiet:
                return True
            return time.monotonic() - self._failed_at > grace_s

    # --- under the fabric's lock ------------------------------------------------------------------
    def on_failed(self, prefill_rank: int, reason: str) -> None:
        """A prefill rank's final word: it failed (and writes no more)."""
        self._quiet.add(prefill_rank)  # first: _fail tells only the ranks not quiet
        self._fail(f"prefill_failed:{reason}" if reason else "prefill_failed")

    def on_success(self, prefill_rank: int, aux_bytes: int, kv_bytes: int, num_tokens: int) -> None:
        self._quiet.add(prefill_rank)
        self._done[prefill_rank] = aux_bytes
        self._received += kv_bytes
        self._num_tokens = max(self._num_tokens, num_tokens)
        self._try_finish()

    def on_prefill_abort(self, prefill_rank: int, reason: str) -> None:
        self._quiet.add(prefill_rank)
        self._fail("aborted_by_prefill", reason)

    def _try_finish(self) -> None:
        mgr = self.mgr
        if self._status != KVPoll.WaitingForInput or set(self._done) != set(self._route):
            return
        aux = None
        if any(self._done.values()):
            if self._aux_slot is None:
                return self._fail("aux_unexpected")
            aux = read_aux(mgr.aux_ptr(self._aux_slot), self.room, mgr.config.aux_slot_bytes)
            if aux is None:
                return self._fail("aux_corrupt")
        self._aux, self._status = aux, KVPoll.Success
        mgr.stats.add_received(self._received)
        mgr.stats.add_success(self.room, 0.0)
        per_token = mgr.pool.num_layers * 2 * mgr.pool.token_bytes
        mgr.stats.add_room_tokens(
            max(0, self._num_tokens - self._prefix), self._prefix, self._prefix * per_token
        )

    def _fail(self, reason: str, detail: str = "") -> None:
        if self._status in (KVPoll.Failed, KVPoll.Success):
            return
        self._status, self.reason = KVPoll.Failed, reason
        self._failed_at = time.monotonic()
        self.mgr.stats.add_failure(reason.split(":")[0])
        log.info(
            "room %d failed on decode rank %d: %s %s", self.room, self.mgr.pp_rank, reason, detail
        )
        if self._sent:
            for k in self._route:
                if k not in self._quiet:
                    self.mgr.fabric.prefill[k].on_decode_abort(self.room, self.mgr.pp_rank)


class InMemoryDecodeKVManager(BaseDecodeKVManager):
    def __init__(
        self,
        fabric: InMemoryFabric,
        pool: PoolDesc,
        pp_rank: int,
        dst_slices: Sequence[tuple[int, int]],
        aux_slots: int,
        config: TransferConfig,
    ):
        self.fabric, self.pool, self.pp_rank, self.config = fabric, pool, pp_rank, config
        self.dst_slices = tuple((int(a), int(b)) for a, b in dst_slices)
        if self.dst_slices[pp_rank] != pool.layers:
            raise ValueError(f"decode rank {pp_rank}: pool layers {pool.layers} differ")
        self.stats = TransferStats()
        self.receivers: dict[int, InMemoryKVReceiver] = {}
        self.aux_slots = aux_slots
        self._aux = (ctypes.c_char * (aux_slots * config.aux_slot_bytes))()

    def create_receiver(self, room: int, bootstrap_addr: str) -> InMemoryKVReceiver:
        with self.fabric.lock:
            if room in self.receivers:
                raise ValueError(f"room {room} already has a receiver (a room is never reused)")
            recv = self.receivers[room] = InMemoryKVReceiver(self, room, bootstrap_addr)
            return recv

    def aux_ptr(self, slot: int) -> int:
        if not 0 <= slot < self.aux_slots:
            raise ValueError(f"aux slot {slot} outside [0, {self.aux_slots})")
        return ctypes.addressof(self._aux) + slot * self.config.aux_slot_bytes

    def land_aux(self, room: int, slot: int | None, aux: bytes | None) -> int:
        """A prefill rank's aux write into `slot` (manager.py framing); the payload's length."""
        if aux is None:
            return 0
        if slot is None or AUX_HEADER.size + len(aux) > self.config.aux_slot_bytes:
            raise ValueError(f"room {room}: aux data of {len(aux)} bytes has no slot to land in")
        write_aux(self.aux_ptr(slot), room, aux)
        return len(aux)

    def close(self) -> None:
        """Nothing runs in the background."""
