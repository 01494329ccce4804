"""The prefill side of the in-process KV transfer (tests only): a sender per room, one manager per
prefill rank, joined to an `InMemoryFabric` (kv_transfer/in_memory.py describes the whole)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.consensus.kvpoll import KVPoll
from pdserve.kv_transfer.base import BaseKVSender, BasePrefillKVManager
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.in_memory import Registration
from pdserve.kv_transfer.layout import PoolDesc, check_compatible, overlapping
from pdserve.kv_transfer.mooncake import TransferError
from pdserve.kv_transfer.stats import TransferStats, room_tokens
from pdserve.kv_transfer.targets import target_descriptors, targets

if TYPE_CHECKING:
    from pdserve.kv_transfer.in_memory import InMemoryFabric

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Chunk:
    page_ids: tuple[int, ...]
    token_start: int
    token_end: int
    last: bool
    aux: bytes | None
    total_tokens: int = 0


class InMemoryKVSender(BaseKVSender):
    def __init__(self, mgr: InMemoryPrefillKVManager, room: int):
        self.room, self._mgr = room, mgr
        self._status = KVPoll.Bootstrapping
        self.reason: str | None = None
        self._peers: dict[int, Registration] = {}
        self._expected: frozenset[int] | None = None
        self._chunks: deque[_Chunk] = deque()
        self._last_queued = False
        self._moved: dict[int, int] = {}  # decode rank -> KV bytes copied to it

    def poll(self) -> KVPoll:
        return self._status

    def send_chunk(
        self, page_ids, token_start, token_end, last=False, aux=None, total_tokens=0
    ) -> None:
        if self._last_queued:
            raise ValueError(f"room {self.room}: chunk after the last one")
        if not 0 <= token_start <= token_end:
            raise ValueError(f"room {self.room}: bad token range [{token_start}, {token_end})")
        with self._mgr.fabric.lock:
            if self._status == KVPoll.Failed:
                return
            self._chunks.append(
                _Chunk(
                    tuple(int(p) for p in page_ids), token_start, token_end, last, aux, total_tokens
                )
            )
            self._last_queued = last
            self._drain()

    def abort(self, reason: str = "aborted") -> None:
        with self._mgr.fabric.lock:
            self._fail(reason, abort=True)

    # --- under the fabric's lock ------------------------------------------------------------------
    def on_register(self, reg: Registration) -> None:
        mgr = self._mgr
        try:
            check_compatible(mgr.pool, reg.pool)
            if reg.sliding_pool is not None:
                check_compatible(mgr.pool, reg.sliding_pool)
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
        if fabric.take_failure(self.room, mgr.pp_rank):
            raise TransferError(f"injected write failure (room {self.room})")
        peers = sorted(self._peers.items())
        for rank, p in peers:
            moved = 0
            for t in targets(p, chunk.total_tokens):
                chunk_range = (chunk.token_start, chunk.token_end)
                descs = target_descriptors(
                    mgr.pool, t, chunk.page_ids, chunk_range, chunk.total_tokens
                )
                n = fabric.copy(mgr.pool, t.pool, descs, chunk.page_ids, t.page_ids)
                mgr.stats.add_write(len(descs), n)
                moved += n
            self._moved[rank] = self._moved.get(rank, 0) + moved
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
        self._pending: dict[int, list[Registration]] = {}  # registrations before create_sender
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
    def on_register(self, reg: Registration) -> None:
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
        """Nothing runs in the background; the rank leaves the fabric (an elastic rank that
        becomes a prefill rank again joins it anew)."""
        with self.fabric.lock:
            if self.fabric.prefill.get(self.pp_rank) is self:
                del self.fabric.prefill[self.pp_rank]


# --- decode side ----------------------------------------------------------------------------------
