"""Admission control: at most `max_concurrent` units of work run, at most `max_queue` requests
wait for a turn, and the waiting ones are served weighted-fair between tenants.

A request costs what it sends to the nodes: one unit, or n for a request with `n` choices (n
node requests), capped at `max_concurrent` so that any request can run alone. `acquire()` either
returns a `Ticket` (the caller now holds the units and must `release()` the ticket exactly once) or
raises `Rejected`: at once when the queue is full, or after `queue_timeout_s` in the queue.

Whom the next free units go to (a request that arrives while others wait joins them):
  1. the lowest `priority` first (vLLM's: lower runs earlier, 0 by default);
  2. within a priority, weighted fair queuing between tenants (a tenant is an API key): each
     request gets a finish tag, its tenant's last tag (or the queue's virtual time, if later) plus
     its `cost` over the tenant's weight, and the smallest tag goes first. The cost is what the
     request asks of both pools (prompt tokens to prefill and move, tokens to decode), so a tenant
     of long prompts is charged for them. With one tenant the tags grow in arrival order: FIFO.
  3. a tenant at `tenant_max_concurrent` units waits while others pass it.
The head request waits until its units are free and the ones behind it wait with it, so a large
request is never starved. With `max_backlog`, requests also wait while the nodes' queued prompt
tokens (`backlog()`) reach it, so less of a flood is already on a node (whose own queue is fair
too: engine/fair_queue.py, fed the tenant by routing/attempt.py `node_share`); `poke()` re-checks
when a prompt leaves a node's queue.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

ANONYMOUS = "anonymous"
MAX_COST = 1e7  # one request's cost, in tokens: a client's max_tokens cannot push its tags to where
# the clock's float loses the others' costs
MAX_TENANTS_KEPT = 4096  # idle tenants' tags beyond this are forgotten (they restart at the clock)


class Rejected(Exception):
    pass


# The ticket the running request holds: its first attempt marks its prompt as charged to a node
# (router/routing/attempt.py), so the node backlog counts it once, from the moment it is let through
ADMITTED: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("admitted", default=None)


@dataclass(frozen=True)
class Demand:
    """What a request asks of admission."""

    units: int = 1
    tenant: str = ANONYMOUS
    priority: int = 0
    cost: float = 1.0  # prompt + output tokens, estimated
    prompt_tokens: int = 0  # estimated


@dataclass(eq=False)
class Ticket:
    admission: Admission
    units: int
    tenant: str
    prompt_tokens: int = 0
    weight: float = 1.0  # the tenant's
    priority: int = 0
    released: bool = False
    uncharged: bool = False  # let through, its prompt not yet in a node's queue

    def charged(self) -> None:
        """Its prompt is now counted in a node's queue (once)."""
        if self.uncharged:
            self.uncharged = False
            self.admission.uncharged_tokens -= self.prompt_tokens
            self.admission.poke()  # the route may charge less than the estimate

    def release(self) -> None:
        """Frees the units (once; a second call does nothing)."""
        if not self.released:
            self.charged()
            self.released = True
            self.admission._free(self)


@dataclass(eq=False)
class _Waiter:
    turn: asyncio.Future
    ticket: Ticket
    key: tuple  # (priority, finish tag, arrival, start tag)
    prompt_tokens: int


@dataclass
class _Tenant:
    finish: float = 0.0  # the last finish tag given
    running: int = 0  # units held
    waiting: int = 0


@dataclass
class Admission:
    max_concurrent: int
    max_queue: int
    queue_timeout_s: float
    tenant_max_concurrent: int = 0  # units per tenant (0: no limit)
    weights: dict[str, float] = field(default_factory=dict)  # tenant -> weight (default 1)
    max_backlog: int = 0  # nodes' queued prompt tokens that hold the queue (0: no limit)
    backlog: Callable[[], int] = lambda: 0

    def __post_init__(self) -> None:
        self.running = 0  # units held
        self.uncharged_tokens = 0  # prompts let through and not yet charged to a node
        self.clock = 0.0  # virtual time: the start tag of the last request let through
        self._waiting: list[_Waiter] = []
        self._tenants: dict[str, _Tenant] = {}
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def cost(self, units: int) -> int:
        return max(1, min(units, self.max_concurrent))

    def queued_prompt_tokens(self, priority: int = 0) -> int:
        """Prompt tokens of the requests waiting here that go before one of `priority`."""
        return sum(w.prompt_tokens for w in self._waiting if w.key[0] <= priority)

    async def acquire(self, demand: Demand = Demand()) -> Ticket:
        units = self.cost(demand.units)
        tenant = self._tenants.setdefault(demand.tenant, _Tenant())
        weight = self.weights.get(demand.tenant, 1.0)
        ticket = Ticket(self, units, demand.tenant, demand.prompt_tokens, weight, demand.priority)
        start = max(self.clock, tenant.finish)
        finish = start + min(max(demand.cost, 1.0), MAX_COST) / weight
        if not self._waiting and self._fits(ticket, tenant):
            tenant.finish = finish
            self._let_through(ticket, tenant, start)
            return ticket
        if len(self._waiting) >= self.max_queue:
            raise Rejected(f"{self.running} units running and {len(self._waiting)} queued")
        tenant.finish = finish
        waiter = _Waiter(
            asyncio.get_running_loop().create_future(),
            ticket,
            (demand.priority, tenant.finish, next(self._arrivals), start),
            demand.prompt_tokens,
        )
        self._waiting.append(waiter)
        tenant.waiting += 1
        self.poke()  # those ahead may all be tenants at their limit
        try:
            if not waiter.turn.done():
                await asyncio.wait_for(asyncio.shield(waiter.turn), self.queue_timeout_s)
            return ticket
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.turn.done():  # the units were handed over just as we gave up: pass them on
                ticket.release()
            else:
                self._waiting.remove(waiter)
                tenant.waiting -= 1
                # it ran nothing: its tenant is not charged for it
                tenant.finish -= waiter.key[1] - waiter.key[3]
                waiter.turn.cancel()
                self.poke()  # a large request that gave up may unblock the ones behind it
            if isinstance(exc, asyncio.TimeoutError):
                raise Rejected(f"waited {self.queue_timeout_s:.0f} s in the queue") from None
            raise

    def _fits(self, ticket: Ticket, tenant: _Tenant) -> bool:
        if self.running + ticket.units > self.max_concurrent:
            return False
        if self._over_tenant_limit(ticket, tenant):
            return False
        if not (self.max_backlog and self.running):
            return True
        return self.backlog() + self.uncharged_tokens < self.max_backlog

    def _let_through(self, ticket: Ticket, tenant: _Tenant, start: float) -> None:
        self.running += ticket.units
        tenant.running += ticket.units
        ticket.uncharged = True
        self.uncharged_tokens += ticket.prompt_tokens
        self.clock = max(self.clock, start)

    def _free(self, ticket: Ticket) -> None:
        self.running -= ticket.units
        tenant = self._tenants[ticket.tenant]
        tenant.running -= ticket.units
        assert self.running >= 0 and tenant.running >= 0, "a ticket freed more than it took"
        self.poke()

    def poke(self) -> None:
        """Hands free units to the first waiters in order that fit; a tenant at its own limit is
        passed over, anything else that does not fit stops the hand-over."""
        passed: set[str] = set()
        through: set[int] = set()
        for head in sorted(self._waiting, key=lambda w: w.key):  # once per poke: O(W log W)
            if head.ticket.tenant in passed or head.turn.done():
                continue
            tenant = self._tenants[head.ticket.tenant]
            if not self._fits(head.ticket, tenant):
                if self._over_tenant_limit(head.ticket, tenant):
                    passed.add(head.ticket.tenant)
                    continue
                break
            through.add(id(head))
            tenant.waiting -= 1
            self._let_through(head.ticket, tenant, head.key[3])
            head.turn.set_result(None)
        if through:
            self._waiting = [w for w in self._waiting if id(w) not in through]
        self._forget_idle()

    def _over_tenant_limit(self, ticket: Ticket, tenant: _Tenant) -> bool:
        limit = self.tenant_max_concurrent
        return bool(limit and tenant.running and tenant.running + ticket.units > limit)

    def _forget_idle(self) -> None:
        if len(self._tenants) <= MAX_TENANTS_KEPT:
            return
        for name in [n for n, t in self._tenants.items() if not t.running and not t.waiting]:
            del self._tenants[name]

    def describe(self, top: int = 16) -> dict:
        """The status page's view: units held and requests waiting, per busiest tenant."""
        busy = sorted(
            ((n, t) for n, t in self._tenants.items() if t.running or t.waiting),
            key=lambda item: (-item[1].running - item[1].waiting, item[0]),
        )[:top]
        return {
            "running_units": self.running,
            "waiting": len(self._waiting),
            "tenants": {n: {"running": t.running, "waiting": t.waiting} for n, t in busy},
        }
