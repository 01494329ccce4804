"""One decode PP rank: `main(["--spec", JSON])`, in a process forked by a rank zygote for
`pdserve decode` (infra/zygote.py); `python -m pdserve.decode_node.rank --spec JSON` runs one
too."""

from __future__ import annotations

import sys

from pdserve.decode_node.loop import DecodeLoop
from pdserve.engine.model.config import split_layers
from pdserve.kv_transfer.base import BaseDecodeKVManager
from pdserve.kv_transfer.decode_manager import DecodeKVManager
from pdserve.pd_common.messages import PDRankSpec
from pdserve.pd_common.rank_setup import pool_desc, sliding_pool_desc, transfer_config
from pdserve.runtime.rank.process import ZYGOTE_PRELOAD, RankParts, run_rank

__all__ = ["ZYGOTE_PRELOAD", "main"]  # ZYGOTE_PRELOAD: for a rank zygote (infra/zygote.py)

AUX_SLOTS = 256


# Decode keeps a prefix cache like any node (on unless --no-prefix-cache): finished requests' pages
# stay, and a room registers only the prompt pages after its cached prefix (decode_node/prefix.py).
BUILD_KWARGS: dict = {}


def make_loop(parts: RankParts, kv: BaseDecodeKVManager | None = None) -> DecodeLoop:
    """The rank's loop over `kv` (None: this rank's Mooncake manager; the in-process tests pass
    an in-memory one, made with `AUX_SLOTS` aux slots over `dst_slices(parts)`)."""
    if kv is None:
        kv = DecodeKVManager(
            transfer_config(parts),
            pool_desc(parts),
            parts.spec.pp_rank,
            dst_slices(parts),
            aux_slots=AUX_SLOTS,
            tp=(parts.spec.tp_rank, parts.spec.tp_size),
            sliding_pool=sliding_pool_desc(parts),
        )
    return DecodeLoop(parts, kv, AUX_SLOTS)


def dst_slices(parts: RankParts) -> list[tuple[int, int, int, int]]:
    """The layers and KV heads of every rank of this decode node, by its place in the node (PP
    rank x TP size + TP rank, KVManagerBase.rank)."""
    tp, heads = parts.spec.tp_size, parts.mcfg.num_kv_heads
    share = heads // tp
    return [
        (a, b, t * share, (t + 1) * share)
        for a, b in split_layers(parts.mcfg.num_layers, parts.spec.pp_size)
        for t in range(tp)
    ]


def main(argv: list[str] | None = None) -> int:
    return run_rank(argv, make_loop, build_kwargs=BUILD_KWARGS, spec_cls=PDRankSpec)


if __name__ == "__main__":
    sys.exit(main())
