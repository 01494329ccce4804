"""Load-balancing policies: pick one worker out of the eligible ones.

Every policy sees only duck-typed workers with `.url` and `.in_flight` (the router's own count of
open requests on that worker), so tests can pass plain objects.
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Sequence
from typing import Protocol

from pdserve.router.config import CacheAwareConfig


class Loaded(Protocol):
    url: str
    in_flight: int


class Policy(abc.ABC):
    @abc.abstractmethod
    def select(self, workers: Sequence[Loaded], key: str) -> Loaded:
        """Return one of `workers` (never empty). `key` is the prompt text, for prefix affinity."""


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._next = 0

    def select(self, workers, key):
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker


class Random(Policy):
    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def select(self, workers, key):
        return self._rng.choice(workers)


class LeastLoad(Policy):
    def select(self, workers, key):
        return min(workers, key=lambda w: w.in_flight)


class PowerOfTwo(Policy):
    """Sample two distinct workers, keep the less loaded one."""

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def select(self, workers, key):
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if a.in_flight <= b.in_flight else b


class _Node:
    __slots__ = ("edge", "children", "seen")

    def __init__(self, edge: str):
        self.edge = edge
        self.children: dict[str, _Node] = {}
        self.seen: dict[str, float] = {}  # worker url -> last time a prompt through here went there


class PrefixTree:
    """A character radix tree remembering which workers saw which prompt prefixes.

    `insert(text, url)` marks every node on text's path with url; `match(text)` returns the length
    of the longest stored prefix of text and the workers recorded at its end. When the tree holds
    more than `max_chars` characters, the least recently used leaves are dropped.
    """

    def __init__(self, max_chars: int):
        self.root = _Node("")
        self.max_chars = max_chars
        self.chars = 0
        self.chars_by_worker: dict[str, int] = {}

    def insert(self, text: str, url: str) -> None:
        now = time.monotonic()
        node, i = self.root, 0
        node.seen[url] = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = _Node(text[i:])
                node.children[text[i]] = child
                self.chars += len(child.edge)
                self._credit(child, url, len(child.edge))
                child.seen[url] = now
                break
            common = _common_len(child.edge, text, i)
            if common < len(child.edge):  # split the edge at `common`
                tail = _Node(child.edge[common:])
                tail.children, tail.seen = child.children, dict(child.seen)
                child.edge, child.children = child.edge[:common], {tail.edge[0]: tail}
            if url not in child.seen:
                self._credit(child, url, len(child.edge))
            child.seen[url] = now
            node, i = child, i + common
        if self.chars > self.max_chars:
            self._evict()

    def match(self, text: str) -> tuple[int, set[str]]:
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            common = _common_len(child.edge, text, i)
            i += common
            node = child
            if common < len(child.edge):
                break
        return i, set(node.seen)

    def _credit(self, node: _Node, url: str, n: int) -> None:
        self.chars_by_worker[url] = self.chars_by_worker.get(url, 0) + n

    def _evict(self) -> None:
        leaves: list[tuple[float, _Node, _Node]] = []
        stack = [self.root]
        while stack:
            parent = stack.pop()
            for child in parent.children.values():
                if child.children:
                    stack.append(child)
                else:
                    leaves.append((max(child.seen.values(), default=0.0), parent, child))
        leaves.sort(key=lambda t: t[0])
        for _, parent, leaf in leaves:
            if self.chars <= self.max_chars * 0.9:
                break
            del parent.children[leaf.edge[0]]
            self.chars -= len(leaf.edge)
            for url in leaf.seen:
                self.chars_by_worker[url] = self.chars_by_worker.get(url, 0) - len(leaf.edge)


def _common_len(edge: str, text: str, start: int) -> int:
    n = min(len(edge), len(text) - start)
    k = 0
    while k < n and edge[k] == text[start + k]:
        k += 1
    return k


class CacheAware(Policy):
    """Prefix affinity, unless the load is imbalanced (then least load).

    With balanced load: if the longest cached prefix covers at least `cache_threshold` of the
    prompt, pick the least loaded worker holding it; otherwise the worker with the least cached text
    (most room to cache the new prompt). The chosen worker is then recorded for the prompt.
    """

    def __init__(self, cfg: CacheAwareConfig | None = None):
        self.cfg = cfg or CacheAwareConfig()
        self.tree = PrefixTree(self.cfg.max_tree_chars)

    def select(self, workers, key):
        loads = [w.in_flight for w in workers]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.cfg.balance_abs and hi > lo * self.cfg.balance_rel:
            chosen = min(workers, key=lambda w: w.in_flight)
        else:
            matched, holders = self.tree.match(key)
            candidates = [w for w in workers if w.url in holders]
            if key and candidates and matched / len(key) >= self.cfg.cache_threshold:
                chosen = min(candidates, key=lambda w: w.in_flight)
            else:
                sizes = self.tree.chars_by_worker
                chosen = min(workers, key=lambda w: (sizes.get(w.url, 0), w.in_flight))
        if key:
            self.tree.insert(key, chosen.url)
        return chosen


POLICIES = {
    "round_robin": RoundRobin,
    "random": Random,
    "power_of_two": PowerOfTwo,
    "least_load": LeastLoad,
    "cache_aware": CacheAware,
}


def make_policy(name: str, cache_cfg: CacheAwareConfig | None = None) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; supported: {', '.join(POLICIES)}")
    if name == "cache_aware":
        return CacheAware(cache_cfg)
    return POLICIES[name]()
