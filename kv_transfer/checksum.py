"""Debug KV checksum: crc32 of a request's KV for a layer run, independent of the page size.

The bytes are read in (layer, k/v, token) order, so a prefill rank and a decode rank with different
page sizes compute the same value over the same tokens.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Sequence

from kv_transfer.layout import PoolDesc, pages_for


def kv_checksum(
    pool: PoolDesc, page_ids: Sequence[int], layers: tuple[int, int], num_tokens: int
) -> int:
    ps, tb = pool.page_size, pool.token_bytes
    crc = 0
    for layer in range(*layers):
        for kv in (0, 1):
            for i in range(pages_for(num_tokens, ps)):
                n = min(ps, num_tokens - i * ps)
                crc = zlib.crc32(
                    ctypes.string_at(pool.addr(page_ids[i], layer, kv, 0), n * tb), crc
                )
    return crc
