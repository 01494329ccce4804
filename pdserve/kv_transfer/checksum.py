"""Debug KV checksum: crc32 of a request's KV for a layer run, independent of the page size.

The bytes are read in (layer, k/v, token) order, so a prefill rank and a decode rank with different
page sizes compute the same value over the same tokens.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Sequence

from pdserve.kv_transfer.layout import PoolDesc


def kv_checksum(
    pool: PoolDesc,
    page_ids: Sequence[int],
    layers: tuple[int, int],
    num_tokens: int,
    token_start: int = 0,
    first_page: int = 0,
    slide_from: int = 0,
    heads: tuple[int, int] | None = None,
    sliding: tuple[PoolDesc, Sequence[int], int] | None = None,
) -> int:
    """crc32 of tokens [token_start, num_tokens), from `slide_from` on for a sliding layer (what
    the transfer moved: layout.build_descriptors), of the KV heads `heads` (None: all the
    pool's); `page_ids[0]` is the request's page `first_page` (a decode table after a cached
    prefix). `sliding`: where a windowed pool keeps its sliding layers (kv_transfer/targets.py),
    as (buffer, page table, the request's page its first entry holds)."""
    whole = heads is None or heads == pool.heads
    at = 0 if whole or heads is None else (heads[0] - pool.head_start) * pool.head_bytes
    width = pool.token_bytes if whole or heads is None else (heads[1] - heads[0]) * pool.head_bytes
    crc = 0
    for layer in range(*layers):
        buf, table, first = (pool, page_ids, first_page)
        if sliding is not None and layer in sliding[0].holds:
            buf, table, first = sliding
        for kv in (0, 1):
            t = max(token_start, slide_from) if layer in pool.sliding else token_start
            while t < num_tokens:
                page, off = divmod(t, pool.page_size)
                # whole tokens: a page's run at once; some of the heads: a token at a time
                n = min(pool.page_size - off, num_tokens - t) if whole else 1
                addr = buf.addr(table[page - first], layer, kv, off) + at
                crc = zlib.crc32(ctypes.string_at(addr, n * width), crc)
                t += n
    return crc
