"""Rank consensus checker: proves that every PP rank makes the same decisions.

Decision points (scheduling result, prefix-cache match/insert/evict, allocator, finish checks) are
decorated with `@rank_consensus("name", args=..., result=...)`. When
`PDSERVE_RANK_CONSENSUS_CHECK=1` each call appends `(name, selected args, selected result)` to its
rank's log and folds it into a running SHA-1 digest. The slot loop calls `checker().digest63()`
every few iterations and compares the digests across ranks (MIN/MAX all-reduce of the digest's
leading 63 bits); on a mismatch every rank prints its recent calls so the first diverging call can
be found, and exits.

Whose log: a rank process has one, `CHECKER`. A thread may `bind` its own checker (the in-process
test clusters of tests/inproc.py run each rank as a thread of one process); calls on that thread
then go to it, and every other thread still uses `CHECKER`.

When the switch is off, a decorated call costs one flag test (a few decision calls per step). The
switch is read per call, not when a decision point is defined: a rank forked from a zygote
(infra/zygote.py) imported these modules under the zygote's environment and calls
`configure_from_env()` with its own; `enable()` turns it on in a test process.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

ENV = "PDSERVE_RANK_CONSENSUS_CHECK"
log = logging.getLogger(__name__)


def _env_says_on() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0", "false", "False")


ENABLED = _env_says_on()


def _canon(x: Any) -> Any:
    """A rank-independent representation: no ids, no addresses, no unordered containers."""
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if isinstance(x, (list, tuple)):
        return [_canon(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted(_canon(v) for v in x)
    if isinstance(x, dict):
        return sorted((str(k), _canon(v)) for k, v in x.items())
    rid = getattr(x, "rid", None)
    if rid is not None:
        return f"req:{rid}"
    return type(x).__name__


class RankChecker:
    def __init__(self, keep: int = 256):
        self._sha = hashlib.sha1()
        self.calls = 0
        self.keep = keep
        self.recent: deque[tuple[int, str, str]] = deque(maxlen=keep)  # (call index, name, record)

    def record(self, name: str, args: Any, result: Any) -> None:
        line = repr((name, _canon(args), _canon(result)))
        self._sha.update(line.encode())
        self.calls += 1
        self.recent.append((self.calls, name, line))

    @staticmethod
    def line_hash(line: str) -> int:
        return int.from_bytes(hashlib.sha1(line.encode()).digest()[:8], "big") & ((1 << 63) - 1)

    def window(self) -> list[int]:
        """[index of the oldest kept call, then one hash per kept call],
        padded to a fixed length."""
        first = self.recent[0][0] if self.recent else self.calls + 1
        hashes = [self.line_hash(line) for _, _, line in self.recent]
        return [first] + hashes + [-1] * (self.keep - len(hashes))

    def describe_first_divergence(self, windows: list[list[int]]) -> str:
        """Given every rank's `window()`, the first call index at which they differ,
        and this rank's call."""
        first = max(w[0] for w in windows)
        for idx in range(first, self.calls + 1):
            vals = {w[1 + idx - w[0]] if 0 <= idx - w[0] < self.keep else None for w in windows}
            if len(vals) > 1:
                mine = next((line for i, _, line in self.recent if i == idx), "<no call>")
                return f"first diverging call #{idx}: {mine}"
        return "no diverging call inside the kept window; this rank's last calls:\n" + self.dump()

    def digest63(self) -> int:
        return int.from_bytes(self._sha.digest()[:8], "big") & ((1 << 63) - 1)

    def dump(self, n: int = 20) -> str:
        return "\n".join(f"  #{i} {line}" for i, _, line in list(self.recent)[-n:])


CHECKER = RankChecker()  # the rank process's checker
_bound = threading.local()  # .checker: a thread's own checker (a rank run as a thread)


def checker() -> RankChecker:
    """The checker of the calling thread's rank: the one it bound, else the process's `CHECKER`."""
    return getattr(_bound, "checker", CHECKER)


def bind(c: RankChecker | None) -> None:
    """Makes `c` the calling thread's checker (None: back to the process's `CHECKER`)."""
    if c is None:
        _bound.__dict__.pop("checker", None)
    else:
        _bound.checker = c


def enable() -> None:
    """Turns the checker on in this process (tests)."""
    global ENABLED
    ENABLED = True


def configure_from_env() -> None:
    """Reads the switch from this process's environment again: a rank forked from a zygote
    (infra/zygote.py) was imported under the zygote's environment, and runs under its node's."""
    global ENABLED
    ENABLED = _env_says_on()


def rank_consensus(
    name: str, args: Callable[..., Any] | None = None, result: Callable[[Any], Any] | None = None
):
    """Marks a decision point. `args(*a, **kw)` and `result(r)` select what must agree across
    ranks."""

    def deco(fn):
        # the switch is read per call (a few calls per step): a forked rank sets it after import
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if not ENABLED:
                return fn(*a, **kw)
            chosen = args(*a, **kw) if args else None  # before the call: it may mutate them
            r = fn(*a, **kw)
            checker().record(name, chosen, result(r) if result else None)
            return r

        return wrapper

    return deco


class RankDivergence(RuntimeError):
    pass


def compare_across_ranks(pp: Any, t: int) -> None:
    """Compares this rank's digest with every other rank of its pipeline `pp` (a PPLink: MIN/MAX
    all-reduce); on a mismatch, logs the first diverging call and raises RankDivergence."""
    c = checker()
    lo, hi = pp.all_min_max([c.digest63()])
    if lo[0] != hi[0]:
        where = c.describe_first_divergence(pp.all_gather(c.window()))
        log.error(
            "rank consensus check FAILED at iteration %d on pp_rank %d: %s", t, pp.rank, where
        )
        raise RankDivergence(f"pp_rank {pp.rank} diverged at iteration {t}: {where}")
