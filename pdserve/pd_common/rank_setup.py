"""What both PD rank entry points build the same way: the KV pool's description for the transfer,
and the transfer configuration (the node's settings, from the rank's spec)."""

from __future__ import annotations

from pdserve.infra.cluster_secret import cluster_secret
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.layout import PoolDesc
from pdserve.pd_common.messages import PDRankSpec
from pdserve.runtime.rank.process import RankParts


def pool_desc(parts: RankParts) -> PoolDesc:
    """This rank's KV pool as the transfer sees it: addresses and shapes, no tensors. On a
    windowed pool (engine/kv_cache.py), its full-attention layers' buffer."""
    pool = parts.runner.pool
    lay = pool.layout
    sliding = _sliding_layers(parts)
    whole = range(lay.layer_start, lay.layer_end)
    held = None if pool.sliding_kv is None else tuple(x for x in whole if x not in sliding)
    return _desc(parts, pool.data_ptr, lay.num_pages, held)


def sliding_pool_desc(parts: RankParts) -> PoolDesc | None:
    """A windowed pool's sliding layers' buffer, its allocator's pages (the zero page after them
    takes no write); None for a pool without one, or without sliding layers."""
    pool = parts.runner.pool
    if pool.sliding_kv is None or pool.sliding_allocator is None or not _sliding_layers(parts):
        return None  # (a slice of full-attention layers only: its sliding buffer has no bytes)
    n = pool.sliding_allocator.num_pages
    return _desc(parts, pool.sliding_kv.data_ptr(), n, _sliding_layers(parts))


def _sliding_layers(parts: RankParts) -> tuple[int, ...]:
    lay = parts.runner.pool.layout
    return tuple(x for x in range(lay.layer_start, lay.layer_end) if parts.mcfg.is_sliding(x))


def _desc(parts: RankParts, base: int, num_pages: int, held: tuple[int, ...] | None) -> PoolDesc:
    lay = parts.runner.pool.layout
    # the KV heads this rank holds: its share under TP (engine/model/tensor_parallel.py), else all
    heads = lay.num_kv_heads
    return PoolDesc(
        base,
        num_pages,
        lay.page_size,
        lay.layer_start,
        lay.layer_end,
        lay.token_bytes,
        str(lay.dtype).removeprefix("torch."),
        window=parts.mcfg.sliding_window,
        sliding=_sliding_layers(parts),
        head_start=parts.spec.tp_rank * heads,
        num_heads=heads,
        held=held,
    )


def transfer_config(parts: RankParts) -> TransferConfig:
    """The node's transfer settings (PDRankSpec.transfer), at this rank's address, with the
    cluster secret; ValueError names a setting that is wrong."""
    spec = parts.spec
    assert isinstance(spec, PDRankSpec)
    return TransferConfig.from_spec(spec.transfer, spec.transfer_host, cluster_secret())
