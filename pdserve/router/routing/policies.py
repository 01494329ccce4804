"""Load-balancing policies: pick one worker out of the eligible ones.

Every policy sees only duck-typed workers with `.url` and `.in_flight` (the router's own count of
open requests on that worker), so tests can pass plain objects.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import Protocol

from pdserve.router.config import CacheAwareConfig
from pdserve.router.routing.prefix_tree import PrefixTree


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
