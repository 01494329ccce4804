"""One prefill PP rank: `main(["--spec", JSON])`, in a process forked by a rank zygote for
`pdserve prefill` (infra/zygote.py); `python -m pdserve.prefill_node.rank --spec JSON` runs one
too."""

from __future__ import annotations

import sys

from pdserve.consensus.store import PPConsensusStore
from pdserve.kv_transfer.base import BasePrefillKVManager
from pdserve.kv_transfer.prefill_manager import PrefillKVManager
from pdserve.pd_common.messages import PDRankSpec
from pdserve.pd_common.rank_setup import pool_desc, transfer_config
from pdserve.prefill_node.loop import PrefillLoop
from pdserve.runtime.rank.pp_comm import Msg
from pdserve.runtime.rank.process import ZYGOTE_PRELOAD, RankParts, run_rank

__all__ = ["ZYGOTE_PRELOAD", "main"]  # ZYGOTE_PRELOAD: for a rank zygote (infra/zygote.py)


def consensus_store(parts: RankParts) -> PPConsensusStore | None:
    """PP0 binds the store's socket and tells every other rank its address over the PP group.
    In a TP group only the lead has a store (it writes its group's MIN, prefill_node/loop.py); a
    follower takes the address from its lead's replay, in order, and keeps no store."""
    comm, spec = parts.comm, parts.spec
    if comm is None or spec.pp_size == 1:
        return None
    lead = spec.tp_rank == 0
    if spec.pp_rank == 0:
        if not lead:
            return None
        store = PPConsensusStore(0, spec.pp_size, host=spec.transfer_host)
        for r in range(1, spec.pp_size):
            comm.send_obj(r, store.address, Msg.SYNC)
        comm.flush()
        return store
    address = comm.recv(0, Msg.SYNC)
    return PPConsensusStore(spec.pp_rank, spec.pp_size, address=address) if lead else None


# A finished request keeps its pages until the release vote: a transfer may still read them.
BUILD_KWARGS = {"hold_kv_on_finish": True}


def make_loop(parts: RankParts, kv: BasePrefillKVManager | None = None) -> PrefillLoop:
    """The rank's loop over `kv` (None: this rank's Mooncake manager; the in-process tests pass
    an in-memory one)."""
    spec = parts.spec
    if kv is None:
        kv = PrefillKVManager(
            transfer_config(parts),
            pool_desc(parts),
            spec.pp_rank,
            spec.pp_size,
            spec.bootstrap_addr,
            tp=(spec.tp_rank, spec.tp_size),
        )
    return PrefillLoop(parts, kv, consensus_store(parts))


def main(argv: list[str] | None = None) -> int:
    return run_rank(argv, make_loop, build_kwargs=BUILD_KWARGS, spec_cls=PDRankSpec)


if __name__ == "__main__":
    sys.exit(main())
