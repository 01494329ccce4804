"""The sliding-window layers' pages of the requests on a windowed pool (engine/kv_cache.py): a
request holds there only the pages a query can still read, not its whole context.

A query at position q reads the sliding layers' keys k with q - k < window. A request's next query
is at `start`, the first token it computes, and every later one is further on, so the keys before
start - window + 1 are never read again: their whole pages go back at once. The tokens of the
forward (`start` to `start + n`) get their pages first, as they write their keys and read each
other's. So a request holds at most (window + n) / page_size + 2 of these pages, n at most a
chunk: `sliding_pool_pages` sizes the pool so that every running request can.

The logical page table keeps its length: the freed pages read as the pool's zero page, which the
window masks (the gather path and the extend kernel) or skips (the decode kernels). Allocation and
freeing happen at `Scheduler._place`, which every rank runs alike, so the page ids agree across
the ranks like the other pool's.

With the prefix cache, the tree owns some sliding pages (engine/prefix_cache.py): those of the
window at the end of a cached prompt, which a request continuing from it reads (`adopt`), and the
ones a request gave it. A request lets go of those without freeing them; it gives its own to the
tree when its prompt is complete and at finish (`own_pages`). Where the pool is short, the tree
frees sliding pages that no live request's table holds. Every live table holds at most the bound
above, so that always suffices.

A PD decode node's rooms get their table before their KV arrives (`for_transfer`: the window of
their tokens' end, which the transfer writes). No max_running bounds those rooms, so there the
sizing above proves nothing: every admission checks instead that the pool holds every live
holder at its bound (`watch`, `_fits`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import Req
from pdserve.engine.kv_cache import PageAllocator, pages_needed
from pdserve.engine.model.config import ModelConfig, split_layers
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.scheduler_config import SchedulerConfig


def pages_per_request(window: int, chunk_size: int, page_size: int, max_context: int = 0) -> int:
    """The most sliding pages one request holds: its window and one chunk, each page-aligned,
    and never more than its whole context's (`max_context` > 0)."""
    most = pages_needed(window + chunk_size, page_size) + 1
    return min(most, pages_needed(max_context, page_size)) if max_context > 0 else most


def sliding_pool_pages(
    num_pages: int,
    window: int,
    chunk_size: int,
    page_size: int,
    max_running: int,
    max_context: int = 0,
) -> int:
    """The sliding pool's pages (besides its zero page, KVPool): enough for `max_running` requests
    each at its most, or `num_pages` less the zero page if that is fewer. In that case the full
    pool gets no more pages than this (`windowed_pool_pages`): a request holds no more sliding
    pages than full ones, nor a prefix-cache node more than one of each, so the sliding pool
    cannot run short either."""
    each = pages_per_request(window, chunk_size, page_size, max_context)
    return max(1, min(num_pages - 1, max_running * each))  # -1: the zero page's memory


def full_pool_pages(
    num_pages: int, sliding_pages: int, slices: list[tuple[int, int]], is_sliding
) -> int:
    """The full pool's pages beside a sliding pool of `sliding_pages`: on each PP slice (its
    layers [a, b), `is_sliding(layer)`), the memory of `num_pages` pages of all its layers (what
    the slice's pool takes without a window) less its sliding pool's, in pages of its
    full-attention layers; the least over the slices, so that no rank takes more memory than it
    would without the window, and every rank computes the same count (the ids must agree). The
    sliding pool's zero page counts too."""
    most = []
    for a, b in slices:
        sliding = sum(1 for x in range(a, b) if is_sliding(x))
        if sliding_pages and b - a > sliding:  # a slice of sliding layers only bounds nothing
            most.append((num_pages * (b - a) - (sliding_pages + 1) * sliding) // (b - a - sliding))
    return max(1, min(most, default=num_pages))  # at least num_pages where S + 1 <= num_pages


def windowed_pool_pages(
    cfg: EngineConfig, mcfg: ModelConfig, max_context: int, pp_size: int = 1
) -> tuple[int, int]:
    """(full pool pages, sliding pool pages) for `cfg` on the model `mcfg` split over `pp_size`
    ranks: (num_pages, 0) without `windowed_kv`. With it, the sliding pool can hold every running
    request at its most, or as many pages as `num_pages` if that is fewer, and the memory left of
    what `num_pages` pages of every layer take goes to the full pool: on no rank more memory, and
    more context where the sliding pool needs less than its share."""
    if not cfg.windowed_kv:
        return cfg.num_pages, 0
    if not mcfg.sliding_window or not mcfg.sliding_layers:
        raise ValueError("windowed_kv: this model has no sliding-window layers")
    chunk = min(cfg.chunk_size, max_context)
    sliding = sliding_pool_pages(
        cfg.num_pages, mcfg.sliding_window, chunk, cfg.page_size, cfg.max_running, max_context
    )
    slices = split_layers(mcfg.num_layers, pp_size)
    full = full_pool_pages(cfg.num_pages, sliding, slices, mcfg.is_sliding)
    each = pages_per_request(mcfg.sliding_window, chunk, cfg.page_size, max_context)
    if sliding < cfg.max_running * each:  # the requests' bound does not hold the pool: the
        full = min(full, sliding)  # full pool's size does (sliding_pool_pages)
    return full, sliding


Holder = tuple[Req, bool]  # a request holding sliding pages, and whether it only decodes now


class WindowPages:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        window: int,
        cache: PrefixCache | None = None,
        live: Callable[[], Iterable[Holder]] = tuple,
        chunk_size: int = 1,
    ):
        if window < 1:
            raise ValueError(f"a windowed pool needs the model's window, got {window}")
        self.allocator, self.page_size, self.window = allocator, page_size, window
        self.cache = cache  # it owns the sliding pages of its nodes (engine/prefix_cache.py)
        self.chunk_size = chunk_size
        self._holders = [live]  # the scheduler's running requests, and `watch`'s
        # A colocated node admits at most max_running requests, which its pool holds at their most
        # (sliding_pool_pages). A PD decode node also holds rooms that no such bound counts: there
        # every admission keeps what each holder may still take (`_fits`).
        self.strict = False

    def watch(self, holders: Callable[[], Iterable[Holder]]) -> None:
        """Requests outside the scheduler's slots that hold sliding pages (a PD decode node's rooms
        waiting for their KV): the tree's eviction spares their pages, and from now on every
        admission leaves room for what each holder may still take."""
        self._holders.append(holders)
        self.strict = True

    def _live(self) -> list[Holder]:
        return [h for holders in self._holders for h in holders()]

    def in_use(self) -> set[int]:
        return {p for req, _ in self._live() for p in req.sliding_pages}

    def _most(self, decoding: bool) -> int:
        """The most pages a request holds: its window and a token, or a chunk while it computes
        its prompt."""
        return pages_per_request(self.window, 1 if decoding else self.chunk_size, self.page_size)

    @property
    def chunk_pages(self) -> int:
        """The most pages a request computing its prompt holds."""
        return self._most(decoding=False)

    def _fits(self, most: int, spare: Collection[int] = (), keep: int = 0) -> bool:
        """Whether a new holder of at most `most` pages fits beside the live ones, each of which
        may grow to its bound, and `keep` more pages. The pool must hold the union of their
        tables, each at its bound (or more, until its next `place`), so the free pages, with what
        the tree gives up, must cover the sum of the bounds less the pages the tables hold already
        (`spare`: the tree's pages the new holder reads, counted as held; a page in several
        tables counts once there and more than once in the sum, which errs on the safe side)."""
        live = self._live()
        held = {p for r, _ in live for p in r.sliding_pages} | set(spare)
        bounds = sum(max(self._most(d), len(r.sliding_pages)) for r, d in live)
        want = most + bounds + keep - len(held)
        short = want - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict_sliding(short, held)
        return self.allocator.num_free >= want

    def admits(self, handle, cached_pages: int) -> bool:
        """Whether a request the scheduler admits now, continuing from `cached_pages` cached pages
        (`handle`, locked), can hold its pages at their most; always on a colocated node, whose
        sizing sees to it (`strict`)."""
        if not self.strict:
            return True
        spare: list[int] = []
        if cached_pages and self.cache is not None:
            spare = self.cache.window_of(handle, cached_pages)[1]
        return self._fits(self.chunk_pages, spare)

    @classmethod
    def make(
        cls,
        allocator: PageAllocator | None,
        cfg: SchedulerConfig,
        hold_kv_on_finish: bool,
        cache: PrefixCache | None,
        live: Callable[[], Iterable[Holder]],
    ) -> WindowPages | None:
        """The scheduler's, where its pool is windowed (a sliding pool's `allocator`)."""
        if allocator is None:
            return None
        if hold_kv_on_finish:  # a PD prefill node keeps the whole context's pages to send them
            raise ValueError("a windowed KV pool takes no PD hand-off")
        return cls(allocator, cfg.page_size, cfg.window, cache, live, cfg.chunk_size)

    def _own(self, page: int) -> bool:
        return self.cache is None or not self.cache.owns_sliding(page)

    def adopt(self, req: Req, handle, num_pages: int) -> None:
        """A request admitted with a cached prefix of `num_pages` pages (its `handle`, locked):
        it reads the window before the prefix's end from the tree's sliding pages."""
        if num_pages and self.cache is not None:
            req.sliding_first, req.sliding_pages = self.cache.window_of(handle, num_pages)

    def place(self, req: Req, start: int, n: int) -> None:
        """Before `req` computes tokens [start, start + n): lets go of what no query from `start`
        on reads (its own pages back to the pool; the tree keeps its own), and allocates pages up
        to start + n, taking sliding pages from the tree's unused nodes if the pool is short."""
        dead = max(0, start - self.window + 1) // self.page_size  # pages wholly behind the window
        if dead > req.sliding_first:
            drop = req.sliding_pages[: dead - req.sliding_first]
            self.allocator.free([p for p in drop if self._own(p)])
            del req.sliding_pages[: len(drop)]
            req.sliding_first = dead
        have = req.sliding_first + len(req.sliding_pages)
        need = pages_needed(start + n, self.page_size) - have
        if need > 0:
            short = need - self.allocator.num_free
            if short > 0 and self.cache is not None:
                self.cache.evict_sliding(short, self.in_use())
            req.sliding_pages.extend(self.allocator.alloc(need))

    def for_transfer(
        self, req: Req, num_tokens: int, start: int, handle, cached_pages: int, keep: int = 0
    ) -> tuple[int, list[int]] | None:
        """A PD decode room of `num_tokens` tokens whose first `cached_pages` pages it holds from
        the tree (`handle`, locked): gives `req` the sliding table its first decode step reads,
        from page `start` on (where the transfer starts the sliding layers' KV, its
        `window_start`): the tree's pages up to the prefix's end, then its own. Returns the
        logical page of the first own one and the own ones, which the transfer writes
        (kv_transfer/targets.py). None, with nothing taken, where the pool cannot hold them beside
        what every live holder may still take and `keep` pages more (requests waiting to be
        admitted again)."""
        tree: list[int] = []
        if cached_pages > start and self.cache is not None:
            first, window = self.cache.window_of(handle, cached_pages)
            tree = window[start - first :]
        need = pages_needed(num_tokens, self.page_size) - max(start, cached_pages)
        if not self._fits(max(self._most(True), len(tree) + need), tree, keep):
            return None
        own = self.allocator.alloc(need)
        req.sliding_first, req.sliding_pages = start, tree + own
        return start + len(tree), own

    def own_pages(self, req: Req) -> dict[int, int]:
        """Logical page -> sliding page, for the pages the request owns (not the tree)."""
        first = req.sliding_first
        return {first + i: p for i, p in enumerate(req.sliding_pages) if self._own(p)}

    def release(self, req: Req, given_to_cache: bool = False) -> None:
        """The request's sliding pages go: back to the pool, or (`given_to_cache`) already
        handed to the tree's `insert`, which kept or freed each."""
        if not given_to_cache:
            self.allocator.free(list(self.own_pages(req).values()))
        req.sliding_pages = []
        req.sliding_first = 0

    def page_table(self, req: Req) -> list[int]:
        """Logical page i -> sliding pool page; for the pages already freed, the pool's zero page
        (KVPool: one past the allocator's, never written), which the window masks or skips, so
        that a masked read never touches another request's keys."""
        return [self.allocator.num_pages] * req.sliding_first + req.sliding_pages
