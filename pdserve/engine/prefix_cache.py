"""A page-aligned prefix (radix) cache: requests that share a prompt prefix share its KV pages.

The tree's edges are whole pages of token ids (`page_size` tokens each), so a match is always a list
of full pages and never splits a page. A node is referenced (locked) by every live request whose
page table starts with its path; only unreferenced leaves are evicted, least recently used first.

Determinism (docs/ARCHITECTURE.md section 4): every PP rank runs the same call sequence, so the
tree, the LRU order and therefore every eviction must be a pure function of that sequence.
"Recently" is a logical clock bumped on every call, never wall time; children live in
insertion-ordered dicts; ties in the eviction order break on the page id.

Page ownership, for one request (P = page_size):

    pages[0 : cached_pages]        shared, owned by the tree, locked by the request's handle
    pages[cached_pages : ]         the request's own pages, allocated from the pool
    at prefill completion (`cache_prefix`): the prompt's own full pages whose chunk is new to the
    tree become tree nodes at once, still locked by the request, so a sibling admitted later (an
    OpenAI `n` > 1 choice) shares them instead of computing the prompt again; the request keeps
    its page table unchanged (a PD prefill node may still be sending those pages).
    at finish: own full pages whose token chunk is new to the tree move into the tree; a chunk the
    tree already has (a twin request inserted it first) and the partial last page go back to the
    pool. A page `cache_prefix` already put in the tree is found there with the same page id and
    stays.

Sliding windows: a PD decode rank receives a sliding layer's KV only from the window of the
prompt's end on (kv_transfer/layout.window_start), so the prompt's pages before it hold only the
full-attention layers' KV. Such a page is a `partial` node. A request that continues from a
cached prefix of M tokens reads sliding keys back to M - window, so a match is cut back to its
longest prefix with no partial page within `window` tokens before the end (`_usable`); the pages
past the cut are computed (or received) again.
A node keeps the flag of the page it was made with: a twin's whole copy goes back to the pool.

A windowed pool (engine/window_pages.py, `sliding_allocator`): the sliding layers' KV of a node is a
page of the sliding pool, `sliding`, or none (-1: freed behind a request's window; the node is then
`partial`, as above). The tree owns the sliding pages of its nodes (`owns_sliding`): a request
that reads one through its window never frees it, and the tree frees it with its node, or alone
(`evict_sliding`, the node turning partial) when the sliding pool runs short. A request that
matches k pages reads the sliding pages of the window before token k * page_size from the tree
(`window_of`).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass, field

from pdserve.engine.kv_cache import PageAllocator


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    refs: int = 0
    last_use: int = 0
    partial: bool = False  # the page holds no sliding layer's KV (module docstring)
    sliding: int = -1  # a windowed pool's sliding page of these tokens (-1: none)


class PrefixCache:
    """Shares page-aligned prompt prefixes. All state changes go through the methods below."""

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        window: int = 0,
        sliding_allocator: PageAllocator | None = None,
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.window = window  # the model's sliding window (0: none)
        self.sliding_allocator = sliding_allocator  # a windowed pool's (module docstring)
        self._sliding_of: dict[int, _Node] = {}  # sliding page -> the node that owns it
        self.root = _Node(key=(), page=-1, parent=None, refs=1)
        self._clock = 0
        self.num_cached_pages = 0  # pages owned by the tree
        self.hit_tokens_total = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _chunks(self, tokens: list[int], n_pages: int):
        P = self.page_size
        for i in range(n_pages):
            yield tuple(tokens[i * P : (i + 1) * P])

    # --- lookups --------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_tokens: int) -> tuple[list[int], _Node]:
        """Longest cached page-aligned prefix of `tokens` with at most `max_tokens` tokens.

        Returns (pages, handle). The caller must `lock(handle)` before relying on the pages and
        `unlock(handle)` when done; an unlocked match may be evicted by the next `evict`.
        """
        now = self._tick()
        path: list[_Node] = []
        node = self.root
        for key in self._chunks(tokens, max(0, max_tokens) // self.page_size):
            child = node.children.get(key)
            if child is None:
                break
            child.last_use = now
            path.append(child)
            node = child
        path = path[: self._usable(path)]
        return [n.page for n in path], path[-1] if path else self.root

    def _usable(self, path: list[_Node]) -> int:
        """How many pages of a matched `path` a request can continue from: the most k such that
        no partial page lies in the window before token k * page_size."""
        if not self.window or not any(n.partial for n in path):
            return len(path)
        P = self.page_size
        last_partial = -1  # the last partial page index below k
        best = 0
        for k in range(1, len(path) + 1):
            if path[k - 1].partial:
                last_partial = k - 1
            # pages holding tokens [k * P - window, k * P): from this index on
            if last_partial < max(0, k * P - self.window) // P:
                best = k
        return best

    def lock(self, handle: _Node) -> None:
        node: _Node | None = handle
        while node is not None:
            node.refs += 1
            node = node.parent

    def unlock(self, handle: _Node) -> None:
        node: _Node | None = handle
        while node is not None:
            node.refs -= 1
            assert node.refs >= 0, "prefix-cache node unlocked more often than locked"
            node = node.parent

    # --- insertion --------------------------------------------------------------------------------
    def insert(
        self,
        tokens: list[int],
        pages: list[int],
        num_tokens: int,
        cached_pages: int,
        partial_pages: int = 0,
        sliding: dict[int, int] | None = None,
    ) -> list[int]:
        """Gives a finished request's pages to the tree; returns the pages to free to the pool.

        `tokens[:num_tokens]` have KV in `pages`; the first `cached_pages` pages came from `match`
        (tree-owned, skipped); the first `partial_pages` hold no sliding layer's KV. Full pages
        with a new chunk become tree nodes; the rest are returned. A windowed pool's `sliding`
        (logical page -> the request's own sliding page) goes to the new nodes, or to old ones
        that have none; the tree frees the rest.
        """
        sliding = dict(sliding or {})
        now = self._tick()
        full = num_tokens // self.page_size
        node, to_free = self.root, []
        for i, key in enumerate(self._chunks(tokens, full)):
            child = node.children.get(key)
            if i < cached_pages:
                assert child is not None and child.page == pages[i], (
                    "cached prefix changed under a lock"
                )
            elif child is None:
                child = self._new_node(key, pages[i], node, i < partial_pages, sliding.pop(i, -1))
            elif child.page != pages[i]:
                to_free.append(pages[i])  # a twin request inserted this chunk first
                if self._adopt_sliding(child, sliding.get(i, -1)):
                    del sliding[i]
            child.last_use = now
            node = child
        to_free.extend(pages[max(full, cached_pages) :])
        self._free_sliding(sliding.values())
        return to_free

    def _new_node(self, key, page: int, parent: _Node, partial: bool, sliding: int) -> _Node:
        windowed = self.sliding_allocator is not None
        child = _Node(key, page, parent, partial=partial or (windowed and sliding < 0))
        parent.children[key] = child
        self.num_cached_pages += 1
        self._adopt_sliding(child, sliding)
        return child

    def _adopt_sliding(self, node: _Node, sliding: int) -> bool:
        """Gives `node` a request's own sliding page where it has none; False: not taken."""
        if sliding < 0 or node.sliding >= 0:
            return False
        node.sliding, node.partial = sliding, False
        self._sliding_of[sliding] = node
        return True

    def _free_sliding(self, pages) -> None:
        if self.sliding_allocator is not None:
            self.sliding_allocator.free(list(pages))

    def cache_prefix(
        self,
        tokens: list[int],
        pages: list[int],
        num_pages: int,
        handle: _Node,
        partial_pages: int = 0,
        sliding: dict[int, int] | None = None,
    ) -> _Node:
        """Puts the first `num_pages` full pages of a running request into the tree (SGLang's
        "cache unfinished request"); returns its new lock handle, locked (`handle` is unlocked).

        A chunk the tree already holds under another page (a twin inserted it first) is walked
        through, not replaced: the request's own copy goes back to the pool at `insert`. A
        windowed pool's `sliding` pages (as `insert`'s) go to the new nodes, and the request keeps
        reading them, now the tree's.
        """
        sliding = sliding or {}
        now = self._tick()
        node = self.root
        for i, key in enumerate(self._chunks(tokens, num_pages)):
            child = node.children.get(key)
            if child is None:
                child = self._new_node(key, pages[i], node, i < partial_pages, sliding.get(i, -1))
            elif child.page != pages[i]:  # a twin's: it may still lack what the window needs
                self._adopt_sliding(child, sliding.get(i, -1))
            child.last_use = now
            node = child
        self.lock(node)
        self.unlock(handle)
        return node

    # --- eviction ---------------------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        return sum(1 for n in self._iter_nodes() if n.refs == 0)

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` unreferenced leaf pages, least recently used first.
        Returns the count."""
        if num_pages <= 0:
            return 0
        heap = [
            (n.last_use, n.page, n) for n in self._iter_nodes() if n.refs == 0 and not n.children
        ]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, n = heapq.heappop(heap)
            parent = n.parent
            del parent.children[n.key]
            freed.append(n.page)
            if n.sliding >= 0:
                self._free_sliding([self._drop_sliding(n)])
            if parent is not self.root and parent.refs == 0 and not parent.children:
                heapq.heappush(heap, (parent.last_use, parent.page, parent))
        self.allocator.free(freed)
        self.num_cached_pages -= len(freed)
        return len(freed)

    # --- a windowed pool's sliding pages ---------------------------------------------------------
    def owns_sliding(self, page: int) -> bool:
        return page in self._sliding_of

    def window_of(self, handle: _Node, num_pages: int) -> tuple[int, list[int]]:
        """(first logical page, sliding pages from it to `num_pages`) that a request continuing
        from the match `handle` of `num_pages` pages reads through its window: `_usable` made sure
        each has one."""
        first = max(0, num_pages * self.page_size - self.window) // self.page_size
        path: list[_Node] = []
        node: _Node | None = handle
        while node is not None and node is not self.root and len(path) < num_pages - first:
            path.append(node)
            node = node.parent
        out = [n.sliding for n in reversed(path)]
        assert all(p >= 0 for p in out), "a usable match without its window's sliding pages"
        return first, out

    def evict_sliding(self, num_pages: int, in_use: Collection[int]) -> int:
        """Frees up to `num_pages` sliding pages that no request's window reads (`in_use`: the
        pages in the live requests' sliding tables), least recently used first; their nodes stay,
        partial. A lock does not keep them: it keeps the full pages a request reads whole, while
        a request never reads a sliding page again once it is behind its window. Returns the
        count."""
        nodes = [n for n in self._sliding_of.values() if n.sliding not in in_use]
        nodes.sort(key=lambda n: (n.last_use, n.sliding))
        freed = [self._drop_sliding(n) for n in nodes[: max(0, num_pages)]]
        self._free_sliding(freed)
        return len(freed)

    def _drop_sliding(self, node: _Node) -> int:
        page, node.sliding, node.partial = node.sliding, -1, True
        del self._sliding_of[page]
        return page

    def check_integrity(self) -> None:
        n = sum(1 for _ in self._iter_nodes())
        assert n == self.num_cached_pages, (
            f"tree holds {n} pages, counter says {self.num_cached_pages}"
        )
