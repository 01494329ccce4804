"""The router's cores: those of its same-host workers' fronts.

A node's core plan (runtime/placement.py) keeps a core for I/O, where its fronts run and where the
router should run too, away from the ranks' compute threads. `pdserve up` starts its router there;
a router started by hand next to `pdserve serve` (the colocated recipe) floated over every core and
took its share of the rank's. So when a worker at a loopback address reports the cores its front is
bound to (`/server_info` "front_cpus"), the router moves every one of its threads onto the union of
those cores; it only ever narrows the cores it was started with (a router started with taskset
elsewhere stays there), and logs the move once per change. A worker removed takes its fronts with
it: the router follows the ones left, or goes back to the cores it started with when none is left.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from urllib.parse import urlsplit

from pdserve.infra import internal_auth
from pdserve.infra.affinity import bind_all_threads

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")

MAX_CPUS = 4096  # a front_cpus list longer than this, or a core past it, is not a core list


def is_loopback(url: str) -> bool:
    """Whether the worker at `url` is on this host: a loopback address or localhost (no DNS
    lookup: this runs on the router's event loop)."""
    return internal_auth.is_loopback(urlsplit(url).hostname or "", resolve=False)


def parse_front_cpus(value: object) -> frozenset[int] | None:
    """A /server_info "front_cpus" value as a set of cores, or None where it is not a non-empty
    list of core numbers."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CPUS:
        return None
    if not all(type(c) is int and 0 <= c < MAX_CPUS for c in value):
        return None
    return frozenset(value)


class FrontCores:
    """Follows the fronts of the router's same-host workers onto their cores."""

    def __init__(self, allowed: Iterable[int] | None = None):
        self.allowed = frozenset(allowed if allowed is not None else os.sched_getaffinity(0))
        self._by_url: dict[str, frozenset[int]] = {}
        self.bound: frozenset[int] | None = None  # None: on `allowed`, where it started

    @property
    def fronts(self) -> frozenset[int]:
        """The cores of the same-host workers' fronts it knows of."""
        return frozenset().union(*self._by_url.values())

    def learn(self, url: str, front_cpus: object) -> frozenset[int] | None:
        """Takes a worker's reported front cores; returns the cores the router moved to, if it
        moved."""
        cpus = parse_front_cpus(front_cpus)
        if cpus is None or not is_loopback(url):
            return None
        self._by_url[url] = cpus
        return self._follow()

    def forget(self, url: str) -> frozenset[int] | None:
        """A worker left the router: its fronts no longer count. Returns the cores the router
        moved to, if it moved."""
        if self._by_url.pop(url, None) is None:
            return None
        return self._follow()

    def _follow(self) -> frozenset[int] | None:
        want = self.fronts & self.allowed or self.allowed  # no front left here: where it started
        if want == (self.bound or self.allowed):
            return None
        try:
            bind_all_threads(want)
        except OSError as e:  # e.g. the cores left this process's cpuset since it started
            logger.warning("router stays on its cores: moving to %s failed: %s", sorted(want), e)
            return None
        self.bound = None if want == self.allowed else want
        logger.info(
            "router on cores %s: %s",
            ",".join(map(str, sorted(want))),
            "where its same-host workers' fronts run (their I/O cores)"
            if self.fronts & self.allowed
            else "those it started with (no same-host front among them)",
        )
        return want
