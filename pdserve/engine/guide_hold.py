"""The scheduler's hold on a guided request until the sampling rank has compiled its guide.

A structured-output guide compiles on the sampling rank's own thread (engine/grammar.py), from
milliseconds up to seconds. While it does, the request is `guide_pending` on every rank: the
scheduler computes all of it but the token that samples (`held` once only that token is left),
and no batch waits for the compile. The sampling rank reports the compiles that ended; every rank
applies the report (`guides_compiled`) at the same point of the lockstep (runtime/rank/
slot_loop.py), so the hold ends in the same schedule everywhere.

The KNOWN_GUIDES guides most recently reported, or used by a request that was not held, are
known compiled on every rank alike (`guides_known`), at most KNOWN_BYTES of compiled grammar
between them (the report carries each one's bytes, so every rank bounds them alike), so a request
with one of them is not held:
in a pipeline the report takes a turn of the request's slot to come round, which a cached guide
would otherwise pay. The sampling rank's cache keeps every known guide (GrammarSampler.pinned),
so its compile is done there, and every guide a held request waits for (`guides_awaited`): its
report, on its way round a pipeline, will make it known.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pdserve.consensus.rank_checker import rank_consensus
from pdserve.engine.core import Req
from pdserve.engine.grammar import MAX_COMPILED

# fewer than the sampling rank's cache keeps, which must also hold guides not yet known
KNOWN_GUIDES = MAX_COMPILED // 2
# the known guides' compiled bytes: the sampling rank keeps every known guide (never evicted)
KNOWN_BYTES = 128 << 20


def held(req: Req) -> bool:
    """Held at its next sample until its guide is compiled: nothing else is left to compute."""
    return req.guide_pending and req.seq_len - req.kv_len <= 1


class GuideHold:
    """The scheduler's requests' holds (a mixin of engine/scheduler.py `Scheduler`)."""

    reqs: dict[str, Req]  # the scheduler's live requests

    def __init__(self) -> None:
        # guides reported compiled, oldest first, with their compiled bytes: the same on every
        # rank (replicated)
        self.guides_known: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.known_bytes = 0

    def hold(self, req: Req) -> None:
        """As a loop applies a request, on every rank: a guided one samples nothing until the
        sampling rank reports its guide compiled, unless a report named that guide already. A
        request that ended at add (a resumed stream's end) holds nothing."""
        if req.params.guide is not None and not req.finished:
            req.guide_pending = req.params.guide not in self.guides_known
            if not req.guide_pending:  # in use: it stays known (the same on every rank)
                self.guides_known.move_to_end(req.params.guide)

    def guides_awaited(self) -> set[tuple[str, str]]:
        """The guides held requests wait for: their report, once applied, makes them known, so
        the sampling rank's cache keeps them meanwhile (engine/grammar.py `_keep`)."""
        return {r.params.guide for r in self.reqs.values() if r.guide_pending and r.params.guide}

    @property
    def guides_pending(self) -> int:
        """Live requests whose guide's compile the sampling rank has not yet reported done."""
        return sum(r.guide_pending for r in self.reqs.values())

    @rank_consensus("guides_compiled", args=lambda self, report: [list(x) for x in report])
    def guides_compiled(self, report: Iterable[tuple[str, int]]) -> None:
        """The sampling rank's report: these requests' guides are compiled (rid, compiled bytes),
        so they may sample from the next schedule on. Requests that ended since are skipped. A
        guide becomes known, and the oldest known go while there are more than KNOWN_GUIDES or
        they hold more than KNOWN_BYTES (the newest stays, whatever its size)."""
        for rid, nbytes in report:
            if (req := self.reqs.get(rid)) is None:
                continue
            req.guide_pending = False
            guide = req.params.guide
            if guide is not None:
                self.known_bytes += nbytes - self.guides_known.pop(guide, 0)
                self.guides_known[guide] = nbytes
                while len(self.guides_known) > 1 and (
                    len(self.guides_known) > KNOWN_GUIDES or self.known_bytes > KNOWN_BYTES
                ):
                    self.known_bytes -= self.guides_known.popitem(last=False)[1]
