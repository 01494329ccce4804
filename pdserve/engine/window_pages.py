"""The sliding-window layers' pages of the requests on a windowed pool (engine/kv_cache.py): a
request holds there only the pages a query can still read, not its whole context.

A query at position q reads the sliding layers' keys k with q - k < window. A request's next query
is at `start`, the first token it computes, and every later one is further on, so the keys before
start - window + 1 are never read again: their whole pages go back at once. The tokens of the
forward (`start` to `start + n`) get their pages first, as they write their keys and read each
other's. So a request holds at most (window + n) / page_size + 2 of these pages, n at most a
chunk: `sliding_pool_pages` sizes the pool so that every running request can.

The logical page table keeps its length: the freed pages read as page 0, which the window masks
(the gather path) or skips (the kernels). Allocation and freeing happen at `Scheduler._place`,
which every rank runs alike, so the page ids agree across the ranks like the other pool's.
"""

from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import Req
from pdserve.engine.kv_cache import PageAllocator, pages_needed
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.scheduler_config import SchedulerConfig


def pages_per_request(window: int, chunk_size: int, page_size: int) -> int:
    """The most sliding pages one request holds: its window and one chunk, each page-aligned."""
    return pages_needed(window + chunk_size, page_size) + 1


def sliding_pool_pages(
    num_pages: int, window: int, chunk_size: int, page_size: int, max_running: int
) -> int:
    """The sliding pool's pages: enough for `max_running` requests each at its most, and never
    more than the full pool's (a request holds no more pages there than here)."""
    return min(num_pages, max_running * pages_per_request(window, chunk_size, page_size))


def full_pool_pages(num_pages: int, sliding_pages: int, layers: int, sliding: int) -> int:
    """The full pool's pages beside a sliding pool of `sliding_pages`: the memory of `num_pages`
    pages of all `layers` (what the pool takes without a window) less the sliding pool's, in pages
    of the `layers - sliding` full-attention layers. From the model's counts, not a slice's, so
    every rank gets the same and hands out the same ids. At least `num_pages`."""
    full = layers - sliding
    if not sliding_pages or not full:
        return num_pages
    return (num_pages * layers - sliding_pages * sliding) // full


def windowed_pool_pages(cfg: EngineConfig, mcfg: ModelConfig, max_context: int) -> tuple[int, int]:
    """(full pool pages, sliding pool pages) for `cfg` on the model `mcfg`: (num_pages, 0) without
    `windowed_kv`. With it, the sliding pool can hold every running request at its most, or as
    many pages as `num_pages` if that is fewer, and the memory left of what `num_pages` pages of
    every layer take goes to the full pool: the same memory, and more context where the sliding
    pool needs less than its share."""
    if not cfg.windowed_kv:
        return cfg.num_pages, 0
    if not mcfg.sliding_window or not mcfg.sliding_layers:
        raise ValueError("windowed_kv: this model has no sliding-window layers")
    chunk = min(cfg.chunk_size, max_context)
    sliding = sliding_pool_pages(
        cfg.num_pages, mcfg.sliding_window, chunk, cfg.page_size, cfg.max_running
    )
    full = full_pool_pages(cfg.num_pages, sliding, mcfg.num_layers, len(mcfg.sliding_layers))
    return full, sliding


class WindowPages:
    def __init__(self, allocator: PageAllocator, page_size: int, window: int):
        if window < 1:
            raise ValueError(f"a windowed pool needs the model's window, got {window}")
        self.allocator, self.page_size, self.window = allocator, page_size, window

    @classmethod
    def make(
        cls, allocator: PageAllocator | None, cfg: SchedulerConfig, hold_kv_on_finish: bool
    ) -> WindowPages | None:
        """The scheduler's, where its pool is windowed (a sliding pool's `allocator`)."""
        if allocator is None:
            return None
        # The prefix cache keeps pages for later requests, and a PD prefill node keeps them for
        # the transfer: both need the whole context's pages, which this frees.
        if cfg.enable_prefix_cache or hold_kv_on_finish:
            raise ValueError("a windowed KV pool takes no prefix cache and no PD hand-off")
        return cls(allocator, cfg.page_size, cfg.window)

    def place(self, req: Req, start: int, n: int) -> None:
        """Before `req` computes tokens [start, start + n): frees what no query from `start` on
        reads, and allocates pages up to start + n."""
        dead = max(0, start - self.window + 1) // self.page_size  # pages wholly behind the window
        if dead > req.sliding_first:
            drop = dead - req.sliding_first
            self.allocator.free(req.sliding_pages[:drop])
            del req.sliding_pages[:drop]
            req.sliding_first = dead
        have = req.sliding_first + len(req.sliding_pages)
        need = pages_needed(start + n, self.page_size) - have
        if need > 0:
            req.sliding_pages.extend(self.allocator.alloc(need))

    def release(self, req: Req) -> None:
        self.allocator.free(req.sliding_pages)
        req.sliding_pages = []
        req.sliding_first = 0

    @staticmethod
    def page_table(req: Req) -> list[int]:
        """Logical page i -> sliding pool page; 0 for the pages already freed."""
        return [0] * req.sliding_first + req.sliding_pages
