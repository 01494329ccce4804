"""One decode PP rank: `python -m decode_node.rank --spec JSON` (started by `pdserve decode`)."""

from __future__ import annotations

import sys

from decode_node.loop import DecodeLoop
from engine.model_config import split_layers
from kv_transfer.receiver import DecodeKVManager
from pd_common.rank_setup import pool_desc, transfer_config
from runtime.rank_process import RankParts, run_rank

AUX_SLOTS = 256


def make_loop(parts: RankParts) -> DecodeLoop:
    slices = split_layers(parts.mcfg.num_layers, parts.spec.pp_size)
    kv = DecodeKVManager(
        transfer_config(parts), pool_desc(parts), parts.spec.pp_rank, slices, aux_slots=AUX_SLOTS
    )
    return DecodeLoop(parts, kv, AUX_SLOTS)


def main(argv: list[str] | None = None) -> int:
    # Decode keeps no prefix cache: its prompt KV arrives from the prefill node.
    return run_rank(argv, make_loop, build_kwargs={"prefix_cache": False})


if __name__ == "__main__":
    sys.exit(main())
