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

Modules: this one (the fabric), in_memory_prefill.py (the senders), in_memory_decode.py (the
receivers). Copies run synchronously inside `send_chunk`, under the fabric's one lock (every entry
point takes it, and nothing under it blocks), so a test is deterministic given the order of the
ranks' calls.
`fail_writes` injects write failures. Not modelled: the network, Mooncake, the bootstrap server and
its HTTP, control sockets and their authentication, heartbeats and the managers' timeouts (a room
ends here only by a transfer, a failure or an abort); those stay with the real-process tests.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.layout import Desc, PoolDesc, overlapping, shared_layers

if TYPE_CHECKING:
    from pdserve.kv_transfer.in_memory_decode import InMemoryDecodeKVManager, InMemoryKVReceiver
    from pdserve.kv_transfer.in_memory_prefill import InMemoryPrefillKVManager

log = logging.getLogger(__name__)

ADDRESS = "inproc-prefill:0"  # the bootstrap address a decode request names for this fabric


@dataclass(frozen=True)
class Registration:
    room: int
    dst_rank: int
    dst_slices: tuple[tuple[int, int], ...]
    pool: PoolDesc
    page_ids: tuple[int, ...]
    aux_slot: int | None
    receiver: InMemoryKVReceiver
    prefix_tokens: int = 0  # held by the decode rank: `page_ids` start at its end
    sliding_pool: PoolDesc | None = None  # a windowed pool's sliding layers (targets.py)
    sliding_page_ids: tuple[int, ...] = ()
    sliding_first_page: int = 0


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
        from pdserve.kv_transfer.in_memory_prefill import InMemoryPrefillKVManager

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
        dst_slices: Sequence[tuple[int, ...]],
        aux_slots: int = 256,
        config: TransferConfig | None = None,
        sliding_pool: PoolDesc | None = None,
    ) -> InMemoryDecodeKVManager:
        from pdserve.kv_transfer.in_memory_decode import InMemoryDecodeKVManager

        return InMemoryDecodeKVManager(
            self, pool, pp_rank, dst_slices, aux_slots, config or TransferConfig(), sliding_pool
        )

    def fail_writes(
        self, room: int | None = None, prefill_rank: int | None = None, count: int | None = None
    ) -> None:
        """The next `count` (None: every) chunk write of `room` by `prefill_rank` fails (None: any
        room, any rank)."""
        with self.lock:
            self._failures.append(_Failure(room, prefill_rank, count))

    # --- under the lock ---------------------------------------------------------------------------
    def take_failure(self, room: int, prefill_rank: int) -> bool:
        for f in self._failures:
            if f.room in (None, room) and f.prefill_rank in (None, prefill_rank):
                if f.count is None:
                    return True
                if f.count > 0:
                    f.count -= 1
                    return True
        return False

    def route(self, bootstrap_addr: str, layers: tuple[int, int]) -> list[int]:
        """The prefill ranks whose layers overlap `layers` (what the bootstrap server answers)."""
        if bootstrap_addr != self.address:
            raise ValueError(f"no prefill node at {bootstrap_addr!r} (this one: {self.address})")
        if len(self.prefill) != self.prefill_pp_size:
            raise ValueError(f"{len(self.prefill)} of {self.prefill_pp_size} prefill ranks joined")
        slices = {k: m.pool.layers for k, m in self.prefill.items()}
        return [k for k, _, _ in overlapping(layers, slices)]

    def copy(
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
        layers = set(shared_layers(src, dst))
        for s, d, n in descs:
            _check_inside(src, set(src_pages), layers, s, n, "reads")
            _check_inside(dst, set(dst_pages), layers, d, n, "writes")
        for s, d, n in descs:
            ctypes.memmove(d, s, n)
        self.descriptors += len(descs)
        return sum(n for _, _, n in descs)


def _check_inside(
    pool: PoolDesc, pages: set[int], layers: set[int], addr: int, n: int, what: str
) -> None:
    """ValueError unless [addr, addr + n) lies in `pages` of `pool`, within `layers` of each."""
    at, end = addr - pool.base_ptr, addr - pool.base_ptr + n
    if at < 0 or end > pool.nbytes:
        raise ValueError(f"a descriptor {what} [{addr}, {addr + n}) outside the pool")
    while at < end:
        page, off = divmod(at, pool.page_bytes)
        upto = min(end - page * pool.page_bytes, pool.page_bytes)
        spans = pool.holds[off // pool.layer_bytes : -(-upto // pool.layer_bytes)]
        if page not in pages or not set(spans) <= layers:
            raise ValueError(
                f"a descriptor {what} page {page} bytes [{off}, {upto}), outside the room's "
                f"pages or layers {layers}"
            )
        at = page * pool.page_bytes + upto


# --- prefill side ---------------------------------------------------------------------------------
