"""The fair prefill cap's accounting within one forward: apart from the scheduler, which only
asks how much a tenant may still take and records what it took."""

from __future__ import annotations

from pdserve.engine.core import Req


class PrefillShares:
    """The prompt tokens each tenant computes in one forward, against the fair cap (0: none):
    another tenant's next step then waits for at most `cap` tokens of a tenant's prefill."""

    def __init__(self, cap: int):
        self.cap = cap
        self.used: dict[str, int] = {}  # tenant -> prompt tokens this forward

    def left(self, req: Req) -> int:
        if not self.cap:
            return 1 << 62
        return self.cap - self.used.get(req.share.tenant, 0)

    def take(self, req: Req, n: int) -> None:
        if self.cap:
            self.used[req.share.tenant] = self.used.get(req.share.tenant, 0) + n
