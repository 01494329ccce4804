"""The fair prefill cap's accounting within one forward: apart from the scheduler, which only
asks how much a tenant may still take and records what it took.

While more than one tenant is on the node, a forward computes one tenant's prompt tokens, at most
the cap: the tenant first in fair order (the scheduler offers chunks in that order). Sharing each
forward between tenants (the cap for each) made a light tenant's prompt pay for a flooder's chunk
in every forward it took: one forward of its own costs it about half as much (bench/results/
fairness.md). Decode steps are not prompt tokens: every tenant's streams step in every forward."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pdserve.engine.core import Req, Share
from pdserve.engine.scheduler_config import SchedulerConfig


def fair_cap(
    cfg: SchedulerConfig, reqs: Iterable[Req], held_elsewhere: Callable[[], Iterable[Share]]
) -> int:
    """`fair_prefill_tokens` while requests of more than one tenant are on the node (the
    scheduler's `reqs`, or a PD loop's queues: `held_elsewhere`); else 0, no cap."""
    if cfg.fair_prefill_tokens:
        tenants = {r.share.tenant for r in reqs}
        tenants.update(sh.tenant for sh in held_elsewhere())
        if len(tenants) < 2:
            return 0
    return cfg.fair_prefill_tokens


class PrefillShares:
    """The prompt tokens of one forward, against the fair cap (0: none): the first tenant to take
    some is the only one that may, up to `cap`, so another tenant's next step waits for at most
    `cap` prompt tokens."""

    def __init__(self, cap: int):
        self.cap = cap
        self.used: dict[str, int] = {}  # tenant -> prompt tokens this forward

    def left(self, req: Req) -> int:
        if not self.cap:
            return 1 << 62
        if self.used and req.share.tenant not in self.used:
            return 0  # another tenant's forward
        return self.cap - self.used.get(req.share.tenant, 0)

    def take(self, req: Req, n: int) -> None:
        if self.cap:
            self.used[req.share.tenant] = self.used.get(req.share.tenant, 0) + n
