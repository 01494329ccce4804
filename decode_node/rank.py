"""One decode PP rank: `python -m decode_node.rank --spec JSON` (started by `pdserve decode`)."""

from __future__ import annotations

import sys

from decode_node.loop import DecodeLoop
from infra.cluster_secret import cluster_secret
from kv_transfer.layout import PoolDesc
from kv_transfer.manager import TransferConfig
from kv_transfer.receiver import DecodeKVManager
from runtime.rank_process import RankParts, run_rank, split_layers

AUX_SLOTS = 256


def make_loop(parts: RankParts) -> DecodeLoop:
    spec = parts.spec
    pool = parts.runner.pool
    lay = pool.layout
    desc = PoolDesc(
        pool.data_ptr,
        lay.num_pages,
        lay.page_size,
        lay.layer_start,
        lay.layer_end,
        lay.token_bytes,
        str(lay.dtype).removeprefix("torch."),
    )
    cfg = TransferConfig.from_env(
        host=spec.extra.get("transfer_host", "127.0.0.1"), auth_token=cluster_secret()
    )
    slices = split_layers(parts.mcfg.num_layers, spec.pp_size)
    kv = DecodeKVManager(cfg, desc, spec.pp_rank, slices, aux_slots=AUX_SLOTS)
    return DecodeLoop(parts, kv, AUX_SLOTS)


def main(argv: list[str] | None = None) -> int:
    # Decode keeps no prefix cache: its prompt KV arrives from the prefill node.
    return run_rank(argv, make_loop, build_kwargs={"prefix_cache": False})


if __name__ == "__main__":
    sys.exit(main())
