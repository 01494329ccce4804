"""The scheduler's hold on a guided request until the sampling rank has compiled its guide.

A structured-output guide compiles on the sampling rank's own thread (engine/grammar.py), from
milliseconds up to seconds. While it does, the request is `guide_pending` on every rank: the
scheduler computes all of it but the token that samples (`held` once only that token is left),
and no batch waits for the compile. The sampling rank reports the compiles that ended; every rank
applies the report (`guides_compiled`) at the same point of the lockstep (runtime/rank/
slot_loop.py), so the hold ends in the same schedule everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.consensus.rank_checker import rank_consensus
from pdserve.engine.core import Req


def held(req: Req) -> bool:
    """Held at its next sample until its guide is compiled: nothing else is left to compute."""
    return req.guide_pending and req.seq_len - req.kv_len <= 1


class GuideHold:
    """The scheduler's requests' holds (a mixin of engine/scheduler.py `Scheduler`)."""

    reqs: dict[str, Req]  # the scheduler's live requests

    @property
    def guides_pending(self) -> int:
        """Live requests whose guide's compile the sampling rank has not yet reported done."""
        return sum(r.guide_pending for r in self.reqs.values())

    @rank_consensus("guides_compiled", args=lambda self, rids: list(rids))
    def guides_compiled(self, rids: Iterable[str]) -> None:
        """The sampling rank's report: these requests' guides are compiled, so they may sample
        from the next schedule on. Requests that ended since are skipped."""
        for rid in rids:
            if (req := self.reqs.get(rid)) is not None:
                req.guide_pending = False
