"""Health per (prefill, decode) pair (router/routing/pair_health.py) and the dispatcher's choice of
pairs with it: the breaker's states on a clock the test moves, and `Dispatcher.pick` over a real
registry of two prefill and two decode workers. The same on real hosts with one link cut:
tests/test_multi_host.py."""

from __future__ import annotations

import random

from pdserve.router.config import BreakerConfig, DisaggConfig, RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.routing.dispatch import Dispatcher
from pdserve.router.routing.node_clients import NodeClients
from pdserve.router.routing.pair_health import PairHealth
from pdserve.router.routing.policies import Random
from pdserve.router.routing.workers import WorkerRegistry
from pdserve.router.worker_spec import WorkerSpec

P1, P2, D1, D2 = "http://p1:1", "http://p2:1", "http://d1:1", "http://d2:1"
BODY = {"input_ids": list(range(1, 200))}


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _fail(h: PairHealth, p: str, d: str, ok: bool | None = False) -> None:
    h.on_dispatch(p, d)
    h.record(p, d, ok)


def _gauge(metrics: RouterMetrics, p: str, d: str, state: str) -> float:
    return metrics.registry.get_sample_value(
        "pdserve_router_pair_circuit_state", {"prefill": p, "decode": d, "state": state}
    )


def test_a_pair_opens_after_its_failures_and_closes_after_a_good_trial():
    clock, metrics = Clock(), RouterMetrics()
    h = PairHealth(BreakerConfig(2, 1, 5.0), metrics, clock)
    _fail(h, P1, D1)
    assert h.usable(P1, D1) and h.state(P1, D1) == "closed"
    _fail(h, P1, D1, None)  # a busy node or a client's error says nothing about the link
    _fail(h, P1, D1)
    assert not h.usable(P1, D1) and h.state(P1, D1) == "open"
    assert _gauge(metrics, P1, D1, "open") == 1 and _gauge(metrics, P1, D1, "closed") == 0
    assert h.usable(P1, D2) and h.usable(P2, D1)  # the nodes' other pairs are untouched
    clock.t += 5.0
    assert h.usable(P1, D1) and h.state(P1, D1) == "half_open"
    h.on_dispatch(P1, D1)  # the one trial
    assert not h.usable(P1, D1)
    h.record(P1, D1, True)
    assert h.usable(P1, D1) and h.state(P1, D1) == "closed"
    assert h.describe() == [{"prefill": P1, "decode": D1, "state": "closed", "failures": 2}]
    assert (
        metrics.registry.get_sample_value(
            "pdserve_router_pair_failures_total", {"prefill": P1, "decode": D1}
        )
        == 2
    )


def test_a_failed_trial_opens_the_pair_again_and_forget_drops_it():
    clock = Clock()
    h = PairHealth(BreakerConfig(2, 1, 5.0), RouterMetrics(), clock)
    _fail(h, P1, D1)
    _fail(h, P1, D1)
    clock.t += 5.0
    _fail(h, P1, D1)
    assert h.state(P1, D1) == "open"
    h.forget(D1)
    assert h.describe() == [] and h.usable(P1, D1)


def test_a_request_that_ends_after_its_worker_left_leaves_no_pair_behind():
    """Workers come and go (an autoscaler, docs/DEPLOY.md): a request dispatched to a pair whose
    decode node is removed before it ends settles nothing, and no breaker or series of the pair
    comes back."""
    metrics = RouterMetrics()
    h = PairHealth(BreakerConfig(2, 1, 5.0), metrics, Clock())
    h.on_dispatch(P1, D1)
    h.forget(D1)
    h.record(P1, D1, False)
    assert h.describe() == []
    assert _gauge(metrics, P1, D1, "closed") is None
    assert (
        metrics.registry.get_sample_value(
            "pdserve_router_pair_failures_total", {"prefill": P1, "decode": D1}
        )
        is None
    )


def _dispatcher() -> Dispatcher:
    cfg = RouterConfig(
        workers=[WorkerSpec(P1, "prefill", 1), WorkerSpec(P2, "prefill", 1)]
        + [WorkerSpec(D1, "decode"), WorkerSpec(D2, "decode")],
        disagg=DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=2.0, local_prefill_cost=0),
        pair_breaker=BreakerConfig(1, 1, 60.0),
        prefill_policy="round_robin",
    )
    metrics = RouterMetrics()
    clients = NodeClients(1.0, 8)
    registry = WorkerRegistry(cfg, clients, metrics)
    for spec in cfg.workers:
        registry.add(spec).healthy = True  # what the health loop sets once a node answers
    d = Dispatcher(cfg, registry, clients, metrics)
    d.policies["decode"] = Random(random.Random(0))  # every pair comes up, the same every run
    return d


def _routes(d: Dispatcher, n: int = 40) -> set[tuple[str | None, str]]:
    out = set()
    for i in range(n):
        route = d.pick(f"prompt {i}", set(), body=BODY)
        out.add((route.prefill.url if route.prefill else None, route.decode.url))
    return out


def test_the_dispatcher_never_pairs_two_nodes_whose_pair_is_down():
    d = _dispatcher()
    assert _routes(d) == {(P1, D1), (P1, D2), (P2, D1), (P2, D2)}
    _fail(d.pairs, P1, D1)
    assert _routes(d) == {(P1, D2), (P2, D1), (P2, D2)}
    _fail(d.pairs, P2, D1)  # D1 has no pair left: requests go to D2's pairs
    assert _routes(d) == {(P1, D2), (P2, D2)}
    _fail(d.pairs, P1, D2)
    _fail(d.pairs, P2, D2)  # no pair at all: the decode nodes prefill themselves
    routes = _routes(d)
    assert {p for p, _ in routes} == {None} and {dec for _, dec in routes} == {D1, D2}
    decisions = d.metrics.registry.get_sample_value(
        "pdserve_router_route_decisions_total", {"path": "decode_only", "reason": "pair_down"}
    )
    assert decisions == 40
