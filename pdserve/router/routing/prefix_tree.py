"""Which workers saw which prompt prefixes: the router's estimate of the nodes' prefix caches
(the cache_aware policy, router/routing/policies.py; the decode-side prefix rule,
router/routing/disagg.py).

The router has no tokenizer, so a prompt is its text (or its token ids as text). It is cut into
blocks of `BLOCK_CHARS` characters, like the nodes' KV pages, and each block is named by a hash
chained over every block before it: a block's hash names the whole prefix up to its end. The tree
is one dict from those hashes to nodes, so a walk costs one C-level string hash and one dict
lookup per block, not a Python step per character, and a PD request walks its prompt several
times (bench/bench_prefix_tree.py measures both trees). The blocks of the last prompt are
kept, so those walks hash it once.

A match is exact to the character: after the whole blocks, the next chunk is compared character
by character with the blocks stored after them (one block's work per walk). Two prefixes whose
64-bit hashes collide would look alike: a wrong guess of where a prefix is cached, which costs a
cache miss, never a wrong answer.
"""

from __future__ import annotations

import time

BLOCK_CHARS = 64


class _Node:
    __slots__ = ("parent", "chunk", "kids", "seen")

    def __init__(self, parent: int | None, chunk: str):
        self.parent, self.chunk = parent, chunk  # parent block's hash (None: a first block)
        self.kids: set[int] = set()  # the hashes of the blocks stored after this one
        self.seen: dict[str, float] = {}  # worker url -> last time a prompt through here went there


class PrefixTree:
    """`insert(text, url)` marks every block on text's path with url; `match(text)` returns the
    length of the longest stored prefix of text and the workers whose prompts share it. Past
    `max_chars` characters stored, the least recently used leaves go."""

    def __init__(self, max_chars: int, block_chars: int = BLOCK_CHARS):
        self.max_chars, self.block_chars = max_chars, block_chars
        self.nodes: dict[int, _Node] = {}
        self.roots: set[int] = set()  # first blocks
        self.chars = 0
        self.chars_by_worker: dict[str, int] = {}
        self._last: tuple[str, list[tuple[int, str]]] = ("", [])

    def blocks(self, text: str) -> list[tuple[int, str]]:
        """(chained hash, chunk) of each block of text; the last text's are reused."""
        if text is self._last[0] or text == self._last[0]:
            return self._last[1]
        out, h, b = [], 0, self.block_chars
        for i in range(0, len(text), b):
            chunk = text[i : i + b]
            h = hash((h, chunk))
            out.append((h, chunk))
        self._last = (text, out)
        return out

    def insert(self, text: str, url: str) -> None:
        now, parent = time.monotonic(), None
        for h, chunk in self.blocks(text):
            node = self.nodes.get(h)
            if node is None:
                node = self.nodes[h] = _Node(parent, chunk)
                self.chars += len(chunk)
                (self.roots if parent is None else self.nodes[parent].kids).add(h)
            if url not in node.seen:
                self.chars_by_worker[url] = self.chars_by_worker.get(url, 0) + len(chunk)
            node.seen[url] = now
            parent = h
        if self.chars > self.max_chars:
            self._evict()

    def match(self, text: str) -> tuple[int, set[str]]:
        """Whole blocks by their hashes, then the next chunk character by character against the
        blocks stored after the last one (one block's work): exact to the character."""
        blocks = self.blocks(text)
        matched, last, i = 0, None, 0
        while i < len(blocks) and len(blocks[i][1]) == self.block_chars:
            node = self.nodes.get(blocks[i][0])
            if node is None:
                break
            matched, last, i = matched + self.block_chars, node, i + 1
        holders = set(last.seen) if last is not None else set()
        if i < len(blocks):
            kids = self.roots if last is None else last.kids
            common = {h: _common_len(self.nodes[h].chunk, blocks[i][1]) for h in kids}
            best = max(common.values(), default=0)
            if best:
                matched += best
                holders = {u for h, c in common.items() if c == best for u in self.nodes[h].seen}
        return matched, holders

    def _evict(self) -> None:
        """Drops the least recently used leaves until 90 % of the budget is left (a parent whose
        last child went is a leaf of the next round)."""
        while self.chars > self.max_chars * 0.9 and self.nodes:
            leaves = sorted(
                (max(n.seen.values(), default=0.0), h) for h, n in self.nodes.items() if not n.kids
            )
            for _, h in leaves:
                if self.chars <= self.max_chars * 0.9:
                    return
                node = self.nodes.pop(h)
                self.chars -= len(node.chunk)
                for url in node.seen:
                    self.chars_by_worker[url] = self.chars_by_worker.get(url, 0) - len(node.chunk)
                (self.roots if node.parent is None else self.nodes[node.parent].kids).discard(h)


def _common_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k
