"""The decode side of the in-process KV transfer (tests only): a receiver per room, one manager per
decode rank, joined to an `InMemoryFabric` (kv_transfer/in_memory.py describes the whole)."""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.consensus.kvpoll import KVPoll
from pdserve.kv_transfer.base import BaseDecodeKVManager, BaseKVReceiver
from pdserve.kv_transfer.in_memory import Registration
from pdserve.kv_transfer.layout import PoolDesc, window_start
from pdserve.kv_transfer.manager import AUX_HEADER, TransferConfig, read_aux, write_aux
from pdserve.kv_transfer.stats import TransferStats, kv_bytes
from pdserve.kv_transfer.targets import check_split

if TYPE_CHECKING:
    from pdserve.kv_transfer.in_memory import InMemoryFabric

log = logging.getLogger(__name__)


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
            self._route = mgr.fabric.route(bootstrap_addr, mgr.pool.layers)
        except ValueError as e:
            self._fail("bootstrap_error", str(e))

    def poll(self) -> KVPoll:
        return self._status

    def register(
        self, page_ids, aux_slot: int | None = None, prefix_tokens: int = 0, sliding=None
    ) -> None:
        mgr = self.mgr
        if prefix_tokens < 0 or prefix_tokens % mgr.pool.page_size:
            raise ValueError(f"room {self.room}: prefix of {prefix_tokens} tokens not page-aligned")
        if (sliding is None) != (mgr.sliding_pool is None):
            raise ValueError(f"room {self.room}: a sliding table is for a windowed pool only")
        first, table = sliding if sliding is not None else (0, ())
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
            reg = Registration(
                self.room,
                mgr.pp_rank,
                mgr.dst_slices,
                mgr.pool,
                self._page_ids,
                aux_slot,
                self,
                prefix_tokens,
                mgr.sliding_pool,
                tuple(int(p) for p in table),
                int(first),
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
            assert self._failed_at is not None  # _fail sets it with the Failed status
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
        slide_from = window_start(self._num_tokens, mgr.pool.window, mgr.pool.page_size)
        mgr.stats.add_room_tokens(
            max(0, self._num_tokens - self._prefix),
            self._prefix,
            self._prefix * per_token,
            kv_bytes(mgr.pool, mgr.pool.layers, self._prefix, self._num_tokens, slide_from)[1],
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
        dst_slices: Sequence[tuple[int, ...]],
        aux_slots: int,
        config: TransferConfig,
        sliding_pool: PoolDesc | None = None,
    ):
        self.fabric, self.pool, self.pp_rank, self.config = fabric, pool, pp_rank, config
        if sliding_pool is not None:
            check_split(pool, sliding_pool)
        self.sliding_pool = sliding_pool
        # layers only: the in-memory fabric has no TP (a slice's heads, if given, are all of them)
        if any(len(sl) == 4 and tuple(sl[2:]) != pool.heads for sl in dst_slices):
            raise ValueError("the in-memory KV fabric has no TP: every decode rank holds all heads")
        self.dst_slices = tuple((int(sl[0]), int(sl[1])) for sl in dst_slices)
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
