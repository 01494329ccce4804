"""One worker node as the router sees it: its facts, load and health state. Kept apart from the
registry so that what routes, tries and describes failures needs the worker, not the health loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from urllib.parse import urlparse

from pdserve.router.routing.circuit import CircuitBreaker


@dataclass(eq=False)
class Worker:
    url: str
    role: str
    breaker: CircuitBreaker
    bootstrap_port: int | None = None
    model: str | None = None  # learnt from /server_info
    max_context: int | None = None  # learnt from /server_info
    tool_format: str | None = None  # learnt from /server_info: its model's tool-call format
    prefix_cache: bool = True  # learnt from /server_info: it keeps finished prompts' KV
    healthy: bool = False
    draining: bool = False  # its /health says so (runtime/front/drain.py): chosen no more
    ever_healthy: bool = False
    good_probes: int = 0  # consecutive
    bad_probes: int = 0  # consecutive
    in_flight: int = 0  # requests the router has open on this worker
    queued_prompt_tokens: int = 0  # estimated prompt tokens sent here and not yet prefilled
    prompts_queued: int = 0  # how many prompts ever joined that queue (a stream's clean check)
    # the same by tenant (only tenants with some queued): a node prefills tenants in fair turn
    queued_by_tenant: dict[str, int] = field(default_factory=dict)
    queued_requests_by_tenant: dict[str, int] = field(default_factory=dict)  # their number
    bootstrap_host: str = field(init=False)
    pushed_servers: list[str] | None = None  # decode: the allowlist it acknowledged last
    push_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    elastic: bool = False  # learnt from /server_info: it can change role (POST /workers/role)
    changing_to: str | None = None  # a role change under way: chosen for neither role meanwhile
    changed_by_router: bool = False  # this router's change_role runs (the probes leave it be)
    start_role: str | None = None  # learnt from /server_info: the role an elastic node started in
    replica: int | None = None  # its index in its autoscaled StatefulSet (POST /workers)

    def __post_init__(self) -> None:
        self.bootstrap_host = urlparse(self.url).hostname or ""

    def queue(self, tenant: str, tokens: int, requests: int) -> None:
        """Charges `requests` of `tenant`'s prompts, `tokens` in all, to this worker's prefill
        queue (negative: they left it); a tenant with none left is dropped, so the maps hold only
        queued tenants."""
        self.queued_prompt_tokens += tokens
        self.prompts_queued += max(0, requests)
        left = self.queued_requests_by_tenant.get(tenant, 0) + requests
        if left > 0:
            self.queued_by_tenant[tenant] = self.queued_by_tenant.get(tenant, 0) + tokens
            self.queued_requests_by_tenant[tenant] = left
        else:
            self.queued_by_tenant.pop(tenant, None)
            self.queued_requests_by_tenant.pop(tenant, None)

    def eligible(self) -> bool:
        if self.role == "prefill" and self.bootstrap_port is None:
            return False
        return (
            self.healthy
            and not self.draining
            and self.changing_to is None
            and self.breaker.can_pass()
        )

    def describe(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "model": self.model,
            "healthy": self.healthy,
            "draining": self.draining,
            "good_probes": self.good_probes,  # consecutive: how long it has been answering
            "bad_probes": self.bad_probes,
            "circuit": self.breaker.state.name.lower(),
            "in_flight": self.in_flight,
            "queued_prompt_tokens": self.queued_prompt_tokens,
            "queued_tenants": len(self.queued_by_tenant),
            "bootstrap_port": self.bootstrap_port,
            "max_context": self.max_context,
            "prefix_cache": self.prefix_cache,
            "elastic": self.elastic,
            "changing_to": self.changing_to,
            "replica": self.replica,
        }
