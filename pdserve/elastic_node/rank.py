"""One rank of an elastic node: `main(["--spec", JSON])`, forked by a rank zygote for
`pdserve prefill --elastic` / `pdserve decode --elastic`. It starts in its spec's role and flips
when the front sends `SetRole` (elastic_node/loop.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from pdserve.consensus.store import PPConsensusStore
from pdserve.consensus.vote import RingVote
from pdserve.decode_node import rank as decode_rank
from pdserve.decode_node.loop import DecodeLoop
from pdserve.elastic_node.loop import ElasticLoop
from pdserve.kv_transfer.base import BaseDecodeKVManager, BasePrefillKVManager
from pdserve.kv_transfer.decode_manager import DecodeKVManager
from pdserve.kv_transfer.prefill_manager import PrefillKVManager
from pdserve.kv_transfer.tcp_transport import make_engine
from pdserve.pd_common.loop_base import PDLoop
from pdserve.pd_common.messages import PDRankSpec
from pdserve.pd_common.rank_setup import pool_desc, transfer_config
from pdserve.prefill_node.loop import PrefillLoop
from pdserve.prefill_node.rank import consensus_store
from pdserve.runtime.rank.process import ZYGOTE_PRELOAD, RankParts, run_rank

__all__ = ["ZYGOTE_PRELOAD", "main"]  # ZYGOTE_PRELOAD: for a rank zygote (infra/zygote.py)

KVManager = BasePrefillKVManager | BaseDecodeKVManager


class TransferEnds:
    """The rank's transfer end of each role (elastic_node/loop.py `RoleEnds`): the KV manager
    `make_kv(role, parts)` gives, made at the role's first use and kept, with one set of transfer
    counters for both; the prefill consensus store likewise."""

    def __init__(self, make_kv: Callable[[str, RankParts], KVManager]):
        self._make_kv = make_kv
        self.kv: dict[str, KVManager] = {}
        self.store: PPConsensusStore | None = None
        self._store_made = False

    def loop(self, role: str, parts: RankParts, vote: RingVote) -> PDLoop:
        kv = self.kv.get(role)
        if kv is None:
            kv = self.kv[role] = self._make_kv(role, parts)
            first = next(iter(self.kv.values()))
            kv.stats = first.stats  # before it made any room: the rank's counters go on
        loop: PDLoop
        if role == "prefill":
            assert isinstance(kv, BasePrefillKVManager)
            if not self._store_made:  # every rank makes it at the same flip (Msg.SYNC)
                self.store, self._store_made = consensus_store(parts), True
            loop = PrefillLoop(parts, kv, self.store, vote)
        else:
            assert isinstance(kv, BaseDecodeKVManager)
            loop = DecodeLoop(parts, kv, decode_rank.AUX_SLOTS, vote)
        loop.owns_transfer = False
        return loop

    def close(self) -> None:
        for kv in self.kv.values():
            kv.close()
        if self.store is not None:
            self.store.close()


def make_loop(parts: RankParts) -> ElasticLoop:
    spec = parts.spec
    assert isinstance(spec, PDRankSpec)
    config = transfer_config(parts)
    # one transfer engine for the rank's life: each role's manager registers the pool on it
    engine = make_engine(config.host, config.protocol, config.device)

    def make_kv(role: str, parts: RankParts) -> KVManager:
        if role == "prefill":
            return PrefillKVManager(
                config,
                pool_desc(parts),
                spec.pp_rank,
                spec.pp_size,
                spec.bootstrap_addr,
                engine=engine,
            )
        return DecodeKVManager(
            config,
            pool_desc(parts),
            spec.pp_rank,
            decode_rank.dst_slices(parts),
            aux_slots=decode_rank.AUX_SLOTS,
            engine=engine,
        )

    return ElasticLoop(parts, spec.role, TransferEnds(make_kv))


def main(argv: list[str] | None = None) -> int:
    return run_rank(argv, make_loop, spec_cls=PDRankSpec)


if __name__ == "__main__":
    sys.exit(main())
