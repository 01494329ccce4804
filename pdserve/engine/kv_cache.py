"""The paged KV pool of one rank and its page allocator.

Layout (docs/ARCHITECTURE.md section 6): one page holds **all of this rank's layers** for
`page_size` tokens,

    kv[page, local_layer, k_or_v, token_in_page, kv_head, head_dim]

so a page is one contiguous block of `page_bytes`, and inside it layer-major, then K/V, then tokens.
Sending a page's KV for a contiguous run of layers is one contiguous byte range: the transfer engine
moves a few large descriptors instead of thousands of small per-layer pieces.

Token slots are flat: slot = page * page_size + offset. Page ids come from the allocator, which is a
pure function of its call sequence, so every PP rank hands out the same ids
(docs/ARCHITECTURE.md section 4).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


class PageAllocator:
    """Hands out page ids, lowest free id first; never the same page twice while it is held.

    Deterministic: the state after a sequence of `alloc`/`free` calls depends only on that sequence.
    `can_alloc(n)` is the check before the commit (`alloc` raises rather than over-commit).
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap; range() is already a valid heap
        self._held = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free of {self.num_pages}")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._held[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self._held[p]:
                raise AssertionError(f"page {p} freed twice or never allocated")
            self._held[p] = 0
            heapq.heappush(self._free, p)


@dataclass(frozen=True)
class KVLayout:
    """What a rank's pool looks like in memory; also what kv_transfer is told (as plain data)."""

    num_pages: int
    page_size: int
    layer_start: int
    layer_end: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) for one layer."""
        return self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        return self.num_layers * 2 * self.page_size * self.token_bytes


class KVPool:
    """One rank's KV memory (`layout`) plus the allocator of its pages."""

    def __init__(self, layout: KVLayout, device: str | torch.device = "cpu"):
        self.layout = layout
        self.page_size = layout.page_size
        self.kv = torch.zeros(
            (
                layout.num_pages,
                layout.num_layers,
                2,
                layout.page_size,
                layout.num_kv_heads,
                layout.head_dim,
            ),
            dtype=layout.dtype,
            device=device,
        )
        self.allocator = PageAllocator(layout.num_pages)

    @property
    def data_ptr(self) -> int:
        return self.kv.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def write(
        self, local_layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Stores K/V ([T, kv_heads, head_dim]) of `local_layer` at flat token `slots` ([T])."""
        pages = torch.div(slots, self.page_size, rounding_mode="floor")
        offs = slots - pages * self.page_size
        self.kv[pages, local_layer, 0, offs] = k
        self.kv[pages, local_layer, 1, offs] = v

    def gather(
        self, local_layer: int, pages: torch.Tensor, offs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at (pages, offs) index tensors of any shape S:
        returns [*S, kv_heads, head_dim] each."""
        layer = self.kv[:, local_layer]
        return layer[pages, 0, offs], layer[pages, 1, offs]


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
