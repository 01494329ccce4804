"""Where a decode rank's KV for one room lands: one buffer and page table, or two on a windowed
pool (`--windowed-kv`, engine/window_pages.py).

    pool,         page_ids          from the page of token `prefix_tokens` (the decode rank's
                                    cached prefix ends there): every layer, or on a windowed pool
                                    its full-attention layers (`PoolDesc.held`)
    sliding_pool, sliding_page_ids  the sliding layers' own buffer, from page `sliding_first_page`:
                                    the window's start of the room's tokens (layout.window_start),
                                    or the cached prefix's end where that is later (the pages before
                                    it are the prefix cache's and take no write)

A registration (messages.KVRegister, or the in-memory fabric's Registration) names both; `targets`
turns it into the tables the descriptors are built against, on both sides alike, and refuses a
sliding table that does not start where the sliding layers' KV must start (a table that starts
later would leave the window's first keys unsent, one that starts earlier would name the tree's
pages)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv_transfer.layout import Desc, PoolDesc, chunk_descriptors, window_start


@dataclass(frozen=True)
class Target:
    """One decode buffer of a room: `page_ids[0]` is the request's page `first_page`."""

    pool: PoolDesc
    page_ids: tuple[int, ...]
    first_page: int


def sliding_first_page(num_tokens: int, prefix_tokens: int, pool: PoolDesc) -> int:
    """The first page of a room's sliding table: its window's start or its cached prefix's end."""
    return max(window_start(num_tokens, pool.window, pool.page_size), prefix_tokens) // (
        pool.page_size
    )


def check_split(pool: PoolDesc, sliding: PoolDesc) -> None:
    """ValueError unless `pool` and `sliding` are one windowed pool's two buffers: one slice and
    heads, `sliding` holding the slice's sliding layers and `pool` the others."""
    whole = set(range(*pool.layers))
    if (
        pool.layers != sliding.layers
        or pool.heads != sliding.heads
        or set(sliding.holds) != set(pool.sliding)
        or set(pool.holds) != whole - set(pool.sliding)
        or not pool.sliding
    ):
        raise ValueError(
            f"not one windowed pool: layers {pool.holds} and {sliding.holds} of {pool.layers}, "
            f"sliding {pool.sliding}"
        )


def targets(reg, num_tokens: int) -> list[Target]:
    """The decode buffers of registration `reg` for a room of `num_tokens` tokens."""
    main = Target(reg.pool, tuple(reg.page_ids), reg.prefix_tokens // reg.pool.page_size)
    if reg.sliding_pool is None:
        return [main]
    first = sliding_first_page(num_tokens, reg.prefix_tokens, reg.sliding_pool)
    if reg.sliding_first_page != first:
        raise ValueError(
            f"sliding table from page {reg.sliding_first_page}; a room of {num_tokens} tokens "
            f"after a prefix of {reg.prefix_tokens} needs page {first}"
        )
    return [main, Target(reg.sliding_pool, tuple(reg.sliding_page_ids), first)]


def target_descriptors(
    src: PoolDesc,
    target: Target,
    src_pages: Sequence[int],
    chunk: tuple[int, int],
    num_tokens: int,
) -> list[Desc]:
    """A sender's descriptors for tokens [chunk) into `target`, of a room of `num_tokens`."""
    ps = target.pool.page_size
    return chunk_descriptors(
        src, target.pool, src_pages, target.page_ids, chunk, target.first_page * ps, num_tokens
    )
