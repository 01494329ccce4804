"""What the PD loops call on a KV transfer: the two ends of a room, and the managers making them.

Two implementations: the Mooncake one (sender.py, receiver.py, manager.py: separate processes, TCP
or RDMA writes, ZMQ control messages, a bootstrap server) and the in-memory one (in_memory.py: the
prefill and decode pools of one test process, copied by memmove; tests only).

A room's ends move through KVPoll (consensus/kvpoll.py) only upwards, and `Failed` and `Success`
are terminal. Nothing here blocks on the network: the loops call these methods from the slot loop,
and a rank's local progress reaches a decision only through a vote or the consensus store
(docs/ARCHITECTURE.md section 4).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from pdserve.consensus.kvpoll import KVPoll
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.layout import PoolDesc
from pdserve.kv_transfer.stats import TransferStats


class BaseKVSender(abc.ABC):
    """One prefill rank's end of one room: this rank's layers of the prompt's KV, to every decode
    rank whose layers overlap them.

    Bootstrapping until every overlapping decode rank registered its pages, then WaitingForInput;
    Transferring once a chunk is on its way; Success once every chunk and the aux data landed on
    every decode peer (the peers are told); Failed on an abort, a failed write, a bad registration
    or a timeout (the peers are told).
    """

    room: int
    reason: str | None  # why it failed; None unless Failed

    @abc.abstractmethod
    def poll(self) -> KVPoll:
        """This rank's local status; never blocks."""

    @abc.abstractmethod
    def send_chunk(
        self,
        page_ids: Sequence[int],
        token_start: int,
        token_end: int,
        last: bool = False,
        aux: bytes | None = None,
        total_tokens: int = 0,
    ) -> None:
        """Hands tokens [token_start, token_end) over; `page_ids` is this rank's page table of the
        request from token 0. `total_tokens`: the tokens the whole transfer moves (the last
        chunk's end), by which a sliding layer skips what decode never reads
        (layout.window_start); 0 moves every layer's tokens whole. Chunks move in the order
        given; on the `last` one `aux` (the first
        token and its logprobs) lands after the KV and before Success. The pages must stay
        unchanged until the sender is terminal (the prefill loop holds them until the release
        vote). Ignored once Failed; ValueError for a chunk after the last or a bad range."""

    @abc.abstractmethod
    def abort(self, reason: str = "aborted") -> None:
        """Fails the room here and tells the decode peers (their receivers fail too)."""


class BaseKVReceiver(abc.ABC):
    """One decode rank's end of one room: its layers of the prompt's KV, from every prefill rank
    whose layers overlap them, into pages it preallocated.

    Bootstrapping until `register` (and the route to the prefill ranks) is known; WaitingForInput
    once the registration went out; Success once every prefill rank of the route reported Success
    and the aux data landed; Failed otherwise (a prefill failure or abort, a timeout, its own
    abort). Once registered, a failure tells every prefill rank of the route that has not sent its
    final word, so no sender writes on into pages the decode side will reuse.
    """

    room: int
    reason: str | None  # why it failed; None unless Failed

    @abc.abstractmethod
    def poll(self) -> KVPoll:
        """This rank's local status; never blocks."""

    @abc.abstractmethod
    def register(
        self,
        page_ids: Sequence[int],
        aux_slot: int | None = None,
        prefix_tokens: int = 0,
        sliding: tuple[int, Sequence[int]] | None = None,
    ) -> None:
        """This rank's page table for the prompt and the aux slot the first token lands in; sent to
        the overlapping prefill ranks. Once per room. `prefix_tokens` (a multiple of the page size)
        are held here already (the decode prefix cache): the table starts at their end (page i
        holds tokens [prefix + i*ps, prefix + (i+1)*ps)), and no prefill rank sends or can address
        anything before it. Every decode rank of a room must name the same prefix, else the
        prefill ranks fail the room (`prefix_mismatch`). On a windowed pool (`sliding_pool`),
        `page_ids` are its full-attention layers' and `sliding` is (first page, table) of its
        sliding layers' (kv_transfer/targets.py)."""

    @abc.abstractmethod
    def read_aux(self) -> bytes | None:
        """The aux data (first token and logprobs) once Success; None before."""

    @abc.abstractmethod
    def abort(self, reason: str = "aborted") -> None:
        """Fails the room here; the prefill ranks of the route that may still write are told."""

    @abc.abstractmethod
    def quiesced(self, grace_s: float) -> bool:
        """True once no prefill rank can write into this room's pages any more: Success, never
        registered, every prefill rank of the route sent its final word, or `grace_s` after the
        failure. The decode loop reuses a failed room's pages only then (its release vote)."""


class BaseKVManager(abc.ABC):
    """One rank's transfer endpoint: makes the rooms' ends, counts, and closes."""

    config: TransferConfig
    stats: TransferStats  # `snapshot()` feeds the rank's stats and metrics
    pool: PoolDesc  # this rank's KV pool
    sliding_pool: PoolDesc | None = None  # a windowed decode pool's sliding layers (targets.py)

    @abc.abstractmethod
    def close(self) -> None:
        """Stops the manager's threads, releases what it registered; rooms are left as they are."""


class BasePrefillKVManager(BaseKVManager):
    @abc.abstractmethod
    def create_sender(self, room: int) -> BaseKVSender:
        """The sender of a new room (registrations that arrived before it apply now); ValueError
        for a room that already had one (a room is never reused)."""


class BaseDecodeKVManager(BaseKVManager):
    @abc.abstractmethod
    def create_receiver(self, room: int, bootstrap_addr: str) -> BaseKVReceiver:
        """The receiver of a new room whose prefill node is reached at `bootstrap_addr`; ValueError
        for a room that already had one."""
