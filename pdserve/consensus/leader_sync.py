"""Leader sync: PP0 decides, the list goes down the chain unchanged
(docs/ARCHITECTURE.md section 5, way 1).

PP0 passes its list of conclusions (for example the bootstrap status of each room in its bootstrap
queue, in queue order, from `PPConsensusStore.status`); every other rank passes None and gets PP0's
list back. PP0 sends to PP1, each middle rank receives and forwards, the last rank only receives.

Call order: every rank calls `sync(tag, ...)` with the same tags in the same order in the same
iteration (it shares the ring links with the votes, whose order is fixed the same way). A message
with another tag means the ranks are out of step: `ConsensusError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.consensus.kvpoll import KVPoll
from pdserve.consensus.transport import ConsensusError, ConsensusTimeout, RingTransport

_POLLS = tuple(KVPoll)  # index = value; faster than KVPoll(v) per item


class LeaderSync:
    def __init__(self, transport: RingTransport):
        self.t = transport

    def sync(self, tag: str, values: Sequence[Any] | None) -> list:
        """PP0: `values` (plain msgpack-able items) is sent down; others:
        pass None, get PP0's list."""
        if self.t.is_first:
            if values is None:
                raise ValueError("PP0 must pass the list to sync (other ranks pass None)")
            out = list(values)
        else:
            if values is not None:
                raise ValueError(f"rank {self.t.rank} is not the leader; pass None, got a list")
            try:
                msg = self.t.recv_prev()
            except ConsensusTimeout as e:
                raise ConsensusTimeout(f"{e} (waiting for leader sync {tag!r})") from None
            if not (
                isinstance(msg, list)
                and len(msg) == 3
                and msg[0] == "lead"
                and msg[1] == tag
                and isinstance(msg[2], list)
            ):
                raise ConsensusError(
                    f"rank {self.t.rank}: expected leader sync {tag!r}, "
                    f"got {str(msg)[:200]}; ranks are out of step"
                )
            out = msg[2]
        if not self.t.is_last:
            self.t.send_next(["lead", tag, out])
        return out

    def sync_polls(self, polls: Sequence[KVPoll] | None, tag: str = "bootstrap") -> list[KVPoll]:
        """`sync` for a list of KVPoll (PP0's consensus statuses in queue order)."""
        raw = self.sync(tag, None if polls is None else [int(p) for p in polls])
        if raw and not (set(map(type, raw)) == {int} and min(raw) >= 0 and max(raw) <= 4):
            raise ConsensusError(
                f"rank {self.t.rank}: leader sync {tag!r} carried a non-KVPoll: {str(raw)[:200]}"
            )
        return [_POLLS[v] for v in raw]
