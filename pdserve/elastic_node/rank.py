"""One rank of an elastic node: `main(["--spec", JSON])`, forked by a rank zygote for
`pdserve prefill --elastic` / `pdserve decode --elastic`. It starts in its spec's role and flips
when the front sends `SetRole` (elastic_node/loop.py)."""

from __future__ import annotations

import sys

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


def role_loop(
    role: str,
    parts: RankParts,
    vote: RingVote,
    kv: BasePrefillKVManager | BaseDecodeKVManager,
) -> PDLoop:
    """`role`'s loop over the rank's parts, its transfer `kv` and the node's shared vote."""
    if role == "prefill":
        assert isinstance(kv, BasePrefillKVManager)
        return PrefillLoop(parts, kv, consensus_store(parts), vote)
    assert isinstance(kv, BaseDecodeKVManager)
    return DecodeLoop(parts, kv, decode_rank.AUX_SLOTS, vote)


def make_loop(parts: RankParts) -> ElasticLoop:
    spec = parts.spec
    assert isinstance(spec, PDRankSpec)
    config = transfer_config(parts)
    # one transfer engine for the rank's life: each role's manager registers the pool on it
    engine = make_engine(config.host, config.protocol, config.device)

    def make(role: str, parts: RankParts, vote: RingVote) -> PDLoop:
        kv: BasePrefillKVManager | BaseDecodeKVManager
        if role == "prefill":
            kv = PrefillKVManager(
                config,
                pool_desc(parts),
                spec.pp_rank,
                spec.pp_size,
                spec.bootstrap_addr,
                engine=engine,
            )
        else:
            kv = DecodeKVManager(
                config,
                pool_desc(parts),
                spec.pp_rank,
                decode_rank.dst_slices(parts),
                aux_slots=decode_rank.AUX_SLOTS,
                engine=engine,
            )
        return role_loop(role, parts, vote, kv)

    return ElasticLoop(parts, spec.role, make)


def main(argv: list[str] | None = None) -> int:
    return run_rank(argv, make_loop, spec_cls=PDRankSpec)


if __name__ == "__main__":
    sys.exit(main())
