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
    """One rank's KV memory (`layout`) plus the allocator of its pages.

    Windowed (`sliding_pages` > 0, `sliding` naming the slice's sliding-window layers by local
    index): those layers' KV lives apart, in `sliding_kv`, pages of their own from
    `sliding_allocator`, so a request holds only the pages its window still reads there
    (engine/window_pages.py); `kv` then holds the other (full-attention) layers only. `layer_kv(i)`
    is local layer i's KV, wherever it lives."""

    def __init__(
        self,
        layout: KVLayout,
        device: str | torch.device = "cpu",
        sliding: tuple[int, ...] = (),
        sliding_pages: int = 0,
    ):
        self.layout = layout
        self.page_size = layout.page_size
        split = sliding_pages > 0
        full = [i for i in range(layout.num_layers) if not (split and i in sliding)]
        windowed = [i for i in range(layout.num_layers) if split and i in sliding]
        # local layer -> (in sliding_kv?, its index there or in kv)
        self._where = {i: (False, j) for j, i in enumerate(full)}
        self._where.update({i: (True, j) for j, i in enumerate(windowed)})
        self.kv = self._tensor(layout.num_pages, len(full), device)
        self.allocator = PageAllocator(layout.num_pages)
        self.sliding_kv: torch.Tensor | None = None
        self.sliding_allocator: PageAllocator | None = None
        if split:  # one page more: the zero page a freed logical page reads (window_pages.py)
            self.sliding_kv = self._tensor(sliding_pages + 1, len(windowed), device)
            self.sliding_allocator = PageAllocator(sliding_pages)

    def _tensor(self, pages: int, layers: int, device: str | torch.device) -> torch.Tensor:
        lay = self.layout
        shape = (pages, layers, 2, lay.page_size, lay.num_kv_heads, lay.head_dim)
        return torch.zeros(shape, dtype=lay.dtype, device=device)

    def is_windowed(self, local_layer: int) -> bool:
        """Whether local layer `local_layer`'s KV is in `sliding_kv` (pages of its own)."""
        return self._where[local_layer][0]

    def layer_kv(self, local_layer: int) -> torch.Tensor:
        """[pages, 2, page_size, kv_heads, head_dim]: the layer's KV, in the pool that holds it."""
        windowed, j = self._where[local_layer]
        kv = self.sliding_kv if windowed else self.kv
        assert kv is not None
        return kv[:, j]

    @property
    def held_bytes_per_page(self) -> tuple[int, int]:
        """Bytes of one page of `kv` and of one page of `sliding_kv` (0 where there is none)."""
        lay = self.layout
        one = 2 * lay.page_size * lay.token_bytes  # one layer's K and V of a page
        sliding = self.sliding_kv.shape[1] if self.sliding_kv is not None else 0
        return self.kv.shape[1] * one, sliding * one

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
        kv = self.layer_kv(local_layer)
        kv[pages, 0, offs] = k
        kv[pages, 1, offs] = v

    def gather(
        self, local_layer: int, pages: torch.Tensor, offs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at (pages, offs) index tensors of any shape S:
        returns [*S, kv_heads, head_dim] each."""
        layer = self.layer_kv(local_layer)
        return layer[pages, 0, offs], layer[pages, 1, offs]


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
