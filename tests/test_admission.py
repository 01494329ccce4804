"""The router's admission queue (pdserve/router/admission.py): units, order, limits, tenants.

Every scenario runs on one event loop with no timing in it: a waiter's turn is checked after the
loop has run the tasks that could take it (`settle`)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.admission import MAX_COST, MAX_TENANTS_KEPT, Admission, Demand, Rejected


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_queue_and_reject():
    async def scenario():
        adm = Admission(max_concurrent=2, max_queue=1, queue_timeout_s=5)
        a = await adm.acquire()
        b = await adm.acquire()
        queued = asyncio.create_task(adm.acquire())
        await settle()
        assert adm.waiting == 1
        with pytest.raises(Rejected):
            await adm.acquire()
        a.release()
        c = await asyncio.wait_for(queued, 1)
        assert adm.running == 2 and adm.waiting == 0
        b.release()
        c.release()
        c.release()  # a second release does nothing
        assert adm.running == 0

    run(scenario)


def test_queue_timeout_and_cancel_keep_counts():
    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=4, queue_timeout_s=0.05)
        held = await adm.acquire()
        with pytest.raises(Rejected):
            await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await settle()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert adm.waiting == 0
        held.release()
        assert adm.running == 0

    run(scenario)


def test_a_request_with_n_choices_counts_as_n():
    """With 4 units, an n=3 request and a plain one fill them, an n=16 request (capped at 4 so it
    can run alone) waits its turn in arrival order without being passed by a small one behind."""

    async def scenario():
        adm = Admission(max_concurrent=4, max_queue=8, queue_timeout_s=5)
        three = await adm.acquire(Demand(units=3))
        one = await adm.acquire()
        big = asyncio.create_task(adm.acquire(Demand(units=16)))
        small = asyncio.create_task(adm.acquire())
        await settle()
        assert adm.running == 4 and adm.waiting == 2
        one.release()  # one unit free: the big one does not fit, the small one waits behind it
        await settle()
        assert adm.running == 3 and adm.waiting == 2 and not small.done()
        three.release()
        big_ticket = await asyncio.wait_for(big, 1)
        assert adm.running == 4 and not small.done()
        big_ticket.release()
        (await asyncio.wait_for(small, 1)).release()
        assert adm.running == 0

    run(scenario)


def test_a_large_waiter_that_gives_up_lets_the_rest_in():
    async def scenario():
        adm = Admission(max_concurrent=2, max_queue=8, queue_timeout_s=5)
        await adm.acquire()
        big = asyncio.create_task(adm.acquire(Demand(units=2)))
        small = asyncio.create_task(adm.acquire())
        await settle()
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)
        await asyncio.wait_for(small, 1)  # it fits beside the one running, once nothing is ahead
        assert adm.running == 2 and adm.waiting == 0

    run(scenario)


async def _order(adm: Admission, demands: list[Demand]) -> list[int]:
    """Queues the demands behind one held unit, frees it, and returns the order they ran in."""
    held = await adm.acquire()
    order: list[int] = []

    async def one(i: int, d: Demand) -> None:
        ticket = await adm.acquire(d)
        order.append(i)
        await settle()
        ticket.release()

    tasks = [asyncio.create_task(one(i, d)) for i, d in enumerate(demands)]
    await settle()
    held.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return order


def test_one_tenant_is_served_in_arrival_order():
    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=64, queue_timeout_s=5)
        demands = [Demand(cost=c) for c in (900, 10, 500, 1, 1, 3000)]
        assert await _order(adm, demands) == list(range(6))

    run(scenario)


def test_weighted_fair_queuing_between_tenants():
    """A flood of long prompts from one tenant queued first does not hold back the other's
    short requests: each is served by its finish tag, its tenant's cost so far over its weight."""

    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=64, queue_timeout_s=5)
        flood = [Demand(tenant="a", cost=2000) for _ in range(6)]
        victim = [Demand(tenant="b", cost=200) for _ in range(3)]
        order = await _order(adm, flood + victim)
        # b's three requests (tags 200, 400, 600) go before a's first (2000)
        assert order[:3] == [6, 7, 8] and order[3:] == list(range(6))
        # with a weighted 10x, a's tags are 200, 400, ...: the two interleave
        adm = Admission(max_concurrent=1, max_queue=64, queue_timeout_s=5, weights={"a": 10.0})
        order = await _order(adm, flood[:3] + victim[:3])
        assert order == [0, 3, 1, 4, 2, 5]

    run(scenario)


def test_a_waiter_that_gives_up_costs_its_tenant_nothing():
    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=64, queue_timeout_s=5)
        held = await adm.acquire()
        gave_up = asyncio.create_task(adm.acquire(Demand(tenant="a", cost=10_000)))
        await settle()
        gave_up.cancel()
        await asyncio.gather(gave_up, return_exceptions=True)
        held.release()
        # a's next request is tagged as if the cancelled one had never been: it goes before b's
        order = await _order(adm, [Demand(tenant="b", cost=500), Demand(tenant="a", cost=100)])
        assert order == [1, 0]

    run(scenario)


def test_one_huge_cost_cannot_blind_the_clock():
    """A request's cost is capped, so the virtual clock stays where a float still tells the
    tenants' costs apart after it ran."""

    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=64, queue_timeout_s=5)
        (await adm.acquire(Demand(tenant="x", cost=1e30))).release()
        (await adm.acquire(Demand(tenant="x", cost=1e30))).release()
        assert adm.clock <= MAX_COST
        order = await _order(adm, [Demand(tenant="a", cost=900)] * 2 + [Demand(tenant="b")])
        assert order == [2, 0, 1]  # b (1 token) still goes before a's 900

    run(scenario)


def test_priority_goes_before_fairness():
    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=64, queue_timeout_s=5)
        demands = [
            Demand(tenant="a", cost=1),
            Demand(tenant="b", cost=5000, priority=-1),  # lower first, as vLLM's
            Demand(tenant="a", cost=1, priority=3),
        ]
        assert await _order(adm, demands) == [1, 0, 2]

    run(scenario)


def test_a_tenant_at_its_limit_waits_while_others_pass():
    async def scenario():
        adm = Admission(max_concurrent=8, max_queue=64, queue_timeout_s=5, tenant_max_concurrent=2)
        a1 = await adm.acquire(Demand(tenant="a"))
        await adm.acquire(Demand(tenant="a"))
        a3 = asyncio.create_task(adm.acquire(Demand(tenant="a")))
        b1 = asyncio.create_task(adm.acquire(Demand(tenant="b")))
        await settle()
        assert b1.done() and not a3.done()
        assert adm.describe()["tenants"]["a"] == {"running": 2, "waiting": 1}
        a1.release()
        await asyncio.wait_for(a3, 1)
        assert adm.running == 3

    run(scenario)


def test_the_node_backlog_holds_the_queue_until_poked():
    async def scenario():
        backlog = [0]
        adm = Admission(
            max_concurrent=8, max_queue=64, queue_timeout_s=5, max_backlog=100,
            backlog=lambda: backlog[0],
        )  # fmt: skip
        first = await adm.acquire()
        backlog[0] = 150  # what the first one sent is queued at its node
        second = asyncio.create_task(adm.acquire())
        await settle()
        assert not second.done() and adm.waiting == 1
        backlog[0] = 40  # its prompt was prefilled
        adm.poke()
        await asyncio.wait_for(second, 1)
        # with nothing running, the backlog holds nobody (no request could lower it)
        (await second).release()
        first.release()
        backlog[0] = 10_000
        (await asyncio.wait_for(adm.acquire(), 1)).release()

    run(scenario)


def test_idle_tenants_are_forgotten_past_the_bound():
    async def scenario():
        adm = Admission(max_concurrent=4, max_queue=8, queue_timeout_s=5)
        for i in range(MAX_TENANTS_KEPT + 50):
            (await adm.acquire(Demand(tenant=f"t{i}"))).release()
        assert len(adm._tenants) <= MAX_TENANTS_KEPT

    run(scenario)


def test_queued_prompt_tokens_count_those_ahead_by_priority():
    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=8, queue_timeout_s=5)
        held = await adm.acquire()
        tasks = [
            asyncio.create_task(adm.acquire(Demand(prompt_tokens=100, priority=p)))
            for p in (0, 0, 5)
        ]
        await settle()
        assert adm.queued_prompt_tokens(0) == 200 and adm.queued_prompt_tokens(5) == 300
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        held.release()

    run(scenario)


def test_through_a_router_a_held_flood_lets_another_tenant_go_first():
    """--max-queued-prompt-tokens: while one tenant's first long prompt is queued at the node, its
    next five wait in the router; another tenant's short request, sent after them, reaches the
    node before any of them (its finish tag is smaller), and every request is answered."""
    import threading
    import time

    import httpx
    from stub_node import Cluster

    from pdserve.router.config import FairnessConfig

    fair = FairnessConfig(max_queued_prompt_tokens=20)  # one prompt queued at a time
    node_kw = {"first_token_delay_s": 0.3}
    with Cluster(prefill=0, decode=0, colocated=1, node_kw=node_kw, fairness=fair) as c:
        statuses: list[int] = []

        def send(token: str, first_id: int, n: int, **extra) -> None:
            body = {"input_ids": [first_id] + [1] * (n - 1), "sampling_params": {"max_tokens": 4}}
            body.update(extra)
            r = httpx.post(
                c.url + "/generate",
                json=body,
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            statuses.append(r.status_code)

        flood = [threading.Thread(target=send, args=("a", 1000 + i, 400)) for i in range(6)]
        for t in flood:
            t.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = httpx.get(c.url + "/dashboard/state", timeout=5).json()
            if state["router"]["admission"]["waiting"] == 5:
                break
            time.sleep(0.02)
        assert state["router"]["admission"]["waiting"] == 5, state["router"]["admission"]
        # blocks until answered; what it claims of its share is not what the node gets
        send("b", 7, 30, tenant="a-spoof", tenant_weight=1000.0, priority=-5)
        for t in flood:
            t.join(30)
        firsts = [b["input_ids"][0] for b in c.colocated[0].stats.bodies]
        assert firsts[1] == 7, firsts  # whichever of a's came first
        assert sorted(firsts[:1] + firsts[2:]) == list(range(1000, 1006))
        assert statuses == [200] * 7
        # every request names its tenant to the node, for the node's own fair queue
        shares = {
            (b["tenant"], b["tenant_weight"], b["priority"]) for b in c.colocated[0].stats.bodies
        }
        assert len(shares) == 2 and {w for _, w, _ in shares} == {1.0}, shares
        assert {p for _, _, p in shares} == {0} and all(t.startswith("key-") for t, _, _ in shares)
