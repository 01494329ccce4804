"""Agreement between PP ranks: KVPoll, PPConsensusStore, two-pass ring votes,
leader sync (no torch).

kvpoll.py       KVPoll and its update rule
store.py        PPConsensusStore: room -> KVPoll replicated to PP0 (bootstrap consensus)
transport.py    the ring seam: InMemoryRing for tests, PPGroupTransport over the engine's PP group
vote.py         two-pass ring votes bound to microbatch slots
leader_sync.py  PP0's conclusions sent down the chain
rank_checker.py debug check that every rank makes the same decisions
"""

from pdserve.consensus.kvpoll import KVPoll, done_for, is_transfer_done, update_status
from pdserve.consensus.leader_sync import LeaderSync
from pdserve.consensus.store import PPConsensusStore
from pdserve.consensus.transport import (
    ConsensusError,
    ConsensusTimeout,
    InMemoryRing,
    InMemoryTransport,
    PPGroupTransport,
    RingTransport,
)
from pdserve.consensus.vote import KINDS, PREALLOC, RELEASE, TRANSFERRED, Ballot, RingVote, Verdict

__all__ = [
    "KVPoll",
    "update_status",
    "done_for",
    "is_transfer_done",
    "PPConsensusStore",
    "LeaderSync",
    "RingTransport",
    "InMemoryRing",
    "InMemoryTransport",
    "PPGroupTransport",
    "ConsensusError",
    "ConsensusTimeout",
    "RingVote",
    "Ballot",
    "Verdict",
    "KINDS",
    "RELEASE",
    "TRANSFERRED",
    "PREALLOC",
]
