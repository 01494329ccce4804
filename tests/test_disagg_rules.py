"""Conditional disaggregation (router/routing/disagg.py): the rules on their own, then through a
router in front of stub nodes (tests/stub_node.py), where a decode-only request is one without
bootstrap fields and every decision is counted by reason."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import pytest
from stub_node import Cluster

from pdserve.router.config import DisaggConfig
from pdserve.router.routing.disagg import Disaggregation, TokenEstimator


@dataclass
class W:
    url: str
    queued_prompt_tokens: int = 0
    queued_by_tenant: dict[str, int] = field(default_factory=dict)
    queued_requests_by_tenant: dict[str, int] = field(default_factory=dict)
    prefix_cache: bool = True
    in_flight: int = 0  # requests the router has open there
    role: str = "decode"  # the latency model has a fit per role


def Pn(queued: int = 0, **kw) -> W:
    """A prefill node."""
    return W("http://p", queued, role="prefill", **kw)


P, D = Pn(), W("http://d", in_flight=4)  # the decode node has streams running


def ids(n: int) -> dict:
    return {"input_ids": list(range(n))}


def test_short_prompts_go_decode_only_by_exact_count_for_token_ids():
    d = Disaggregation(DisaggConfig(min_prompt_tokens=32, local_prefill_cost=0))
    assert d.decide(ids(31), "x" * 31, P, D).reason == "short_prompt"
    assert d.decide(ids(32), "y" * 32, P, D).path == "disaggregated"


def test_text_prompts_are_estimated_with_a_learnt_ratio():
    est = TokenEstimator(chars_per_token=4.0, weight=0.5)
    assert est.estimate({}, "a" * 400) == 100
    for _ in range(20):  # the nodes keep saying: 2 characters per token
        est.learn(400, 200)
    assert est.estimate({}, "a" * 400) == pytest.approx(200, abs=2)
    est.learn(400, 0)  # nonsense is not learnt
    est.learn(0, 10)
    est.learn(400, True)
    assert est.estimate({}, "a" * 400) == pytest.approx(200, abs=2)


def test_a_decode_node_holding_most_of_the_prompt_prefills_it():
    d = Disaggregation(
        DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=0.8, local_prefill_cost=0)
    )
    turn1 = "system: be brief\nuser: " + "tell me about pages " * 20
    assert d.decide({}, turn1, P, D).path == "disaggregated"
    d.routed(turn1, D.url)
    turn2 = turn1 + "\nassistant: ok\nuser: more"
    hit = d.decide({}, turn2, P, D)
    assert (hit.path, hit.reason) == ("decode_only", "decode_prefix_hit")
    assert 0 < hit.prompt_tokens < d.tokens.estimate({}, turn2) // 4  # only the rest is charged
    # another decode node never saw the conversation
    assert d.decide({}, turn2, P, W("http://d2")).path == "disaggregated"
    # a new conversation shares too little
    assert d.decide({}, "user: something else entirely " * 5, P, D).path == "disaggregated"
    # a decode node started with --no-prefix-cache keeps nothing, whatever it was sent
    assert d.decide({}, turn2, P, W(D.url, prefix_cache=False)).path == "disaggregated"


def test_a_prompt_both_nodes_hold_stays_disaggregated():
    """One shared system prompt before every request: both nodes' caches hold it and each would
    compute only the rest, so the request stays disaggregated and its prefill stays off the decode
    streams' core. (When only the decode node's cache counted, such requests went decode_only:
    44 of 53 in an aiperf run at concurrency 8.)"""
    d = Disaggregation(
        DisaggConfig(
            min_prompt_tokens=0,
            decode_prefix_fraction=0.8,
            local_prefill_cost=1.5,
            transfer_overhead_tokens=16,
        )
    )
    system = "system\n" + "you are a careful assistant. " * 60
    first = system + "user\n" + "a" * 400
    assert d.decide({}, first, P, D).path == "disaggregated"
    d.routed(first, D.url, P.url)
    later = system + "user\n" + "b" * 400  # both hold over 80 % of it
    n = d.tokens.estimate({}, later)
    held = d.held_tokens(d.decode_cache, later, D, n)
    assert held >= 0.8 * n and held == d.held_tokens(d.prefill_cache, later, P, n)
    dec = d.decide({}, later, P, D)
    assert (dec.path, dec.reason) == ("disaggregated", "default")
    assert dec.prompt_tokens == n - held  # the prefill node's queue is charged only the rest
    # a prefill node started with --no-prefix-cache holds nothing: the decode node's hit counts
    assert d.decide({}, later, Pn(prefix_cache=False), D).reason == "decode_prefix_hit"
    # the prefill node's queue still counts: behind a deep one the decode node prefills it
    assert d.decide({}, later, Pn(10_000), D).reason == "prefill_queue"
    # a request the decode node prefilled alone is not recorded as held by the prefill node
    other = "user\nsomething else entirely " * 20
    d.routed(other, D.url)
    assert d.held_tokens(d.prefill_cache, other, P, 100) == 0


def test_a_deep_prefill_queue_sends_the_prompt_to_the_idle_decode_node():
    cfg = DisaggConfig(
        min_prompt_tokens=0,
        decode_prefix_fraction=2,
        local_prefill_cost=4.0,
        transfer_overhead_tokens=64,
    )
    d = Disaggregation(cfg)
    body = ids(100)
    busy = dict(in_flight=2)  # streams decode there: a local prefill delays them
    assert d.decide(body, "k", Pn(0), W("d", 0, **busy)).path == "disaggregated"  # 164 < 400
    # 300 + 100 + 64 = 464 > 4 * 100
    assert d.decide(body, "k", Pn(300), W("d", 0, **busy)).reason == "prefill_queue"
    # the decode node's own local queue counts against it: 4 * (50 + 100) = 600
    assert d.decide(body, "k", Pn(300), W("d", 50, **busy)).path == "disaggregated"
    assert Disaggregation(DisaggConfig(local_prefill_cost=0)).decide(
        body, "k", Pn(10**6), W("d", 0)
    ).path == ("disaggregated")


def test_a_migrated_streams_replay_counts_the_tokens_already_sent():
    """A replay (router/routing/migration.py) prefills the prompt and the tokens sent: the rules
    weigh both, so a short prompt with a long answer so far can go through a prefill node."""
    resume = {"resume": {"token_ids": list(range(90)), "text_chars": 300}}
    est = TokenEstimator(chars_per_token=4.0)
    assert est.estimate({**ids(10), **resume}, "k") == 100
    assert est.estimate(resume, "a" * 40) == 100
    d = Disaggregation(DisaggConfig(min_prompt_tokens=32, local_prefill_cost=0))
    assert d.decide(ids(10), "k", P, D).reason == "short_prompt"
    got = d.decide({**ids(10), **resume}, "k", P, D)
    assert (got.path, got.prompt_tokens) == ("disaggregated", 100)


def test_an_idle_decode_node_prefills_at_the_cost_of_what_it_computes():
    """With no request open on the decode node, its prefill delays no stream: the queue rule
    weighs its tokens 1, not the local cost, so the transfer overhead decides between equals (on
    the 2-core host, where the prefill rank shares the client's core, this is the faster path)."""
    cfg = DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=2, local_prefill_cost=1.5)
    d = Disaggregation(cfg)
    body = ids(300)
    idle, busy = W("d", 0, in_flight=0), W("d", 0, in_flight=1)
    assert d.decide(body, "k", Pn(0), idle).reason == "prefill_queue"  # 300 < 316
    assert d.decide(body, "k", Pn(0), busy).path == "disaggregated"  # 450 > 316
    # --disagg-idle-local-prefill-cost at the local cost: the rule as it was
    same = DisaggConfig(**{**cfg.__dict__, "idle_local_prefill_cost": 1.5})
    assert Disaggregation(same).decide(body, "k", Pn(0), idle).path == "disaggregated"
    with pytest.raises(ValueError):
        DisaggConfig(idle_local_prefill_cost=-1)
    # a cost below 1 stays as set
    low = Disaggregation(DisaggConfig(min_prompt_tokens=0, local_prefill_cost=0.5))
    assert low.decide(ids(600), "k", Pn(0), W("d", 700, in_flight=0)).path == "disaggregated"
    assert low.decide(ids(600), "k", Pn(0), W("d", 10, in_flight=0)).reason == "prefill_queue"


def decisions(cluster) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(cluster.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve_router_route_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            path = labels.split('path="')[1].split('"')[0]
            reason = labels.split('reason="')[1].split('"')[0]
            out[(path, reason)] = float(value)
    return out


def generate(cluster, ids_: list[int]) -> httpx.Response:
    body = {"input_ids": ids_, "sampling_params": {"max_tokens": 2}}
    return httpx.post(cluster.url + "/generate", json=body, timeout=10)


def test_routes_by_prompt_length_and_counts_every_reason_from_the_start():
    cfg = DisaggConfig(min_prompt_tokens=16, decode_prefix_fraction=2, local_prefill_cost=0)
    with Cluster(prefill=1, decode=1, disagg=cfg) as cluster:
        start = decisions(cluster)
        assert set(start) == {
            ("disaggregated", "default"),
            ("disaggregated", "decode_streams"),
            ("disaggregated", "migration"),
            *(
                ("decode_only", r)
                for r in (
                    "no_prefill",
                    "prefill_failed",
                    "short_prompt",
                    "decode_prefix_hit",
                    "prefill_queue",
                    "pair_down",
                    "migration",
                )
            ),
        }
        assert not any(start.values())
        assert generate(cluster, list(range(5))).status_code == 200
        assert generate(cluster, list(range(40))).status_code == 200
        decode, prefill = cluster.decode[0], cluster.prefill[0]
        assert "bootstrap_room" not in decode.stats.bodies[0]
        assert "bootstrap_room" in decode.stats.bodies[1]
        deadline = time.monotonic() + 5  # the prefill leg may answer after the decode leg
        while not prefill.stats.rooms and time.monotonic() < deadline:
            time.sleep(0.02)
        assert prefill.stats.rooms == [decode.stats.bodies[1]["bootstrap_room"]]
        end = decisions(cluster)
        assert end[("decode_only", "short_prompt")] == 1
        assert end[("disaggregated", "default")] == 1


@pytest.mark.parametrize("cache", [True, False])
def test_a_decode_node_without_a_prefix_cache_never_counts_as_holding_the_prompt(cache):
    """The router learns from /server_info whether the decode node keeps finished prompts' KV; a
    longer prompt after one the decode node prefilled alone (too short to disaggregate, so the
    prefill node never saw it) is a decode_prefix_hit only when it does."""
    cfg = DisaggConfig(min_prompt_tokens=40, decode_prefix_fraction=0.8, local_prefill_cost=0)
    with Cluster(prefill=1, decode=1, disagg=cfg, node_kw={"prefix_cache": cache}) as cluster:
        workers = httpx.get(cluster.url + "/workers", timeout=5).json()["workers"]
        assert [w["prefix_cache"] for w in workers] == [cache, cache]
        for n in (39, 44):
            assert generate(cluster, list(range(n))).status_code == 200
        counts = decisions(cluster)
        assert counts[("decode_only", "short_prompt")] == 1
        assert counts[("decode_only", "decode_prefix_hit")] == (1 if cache else 0)


def test_queued_prompt_tokens_return_to_zero():
    """The router's prefill-queue estimate is charged per attempt and uncharged when the prompt
    is prefilled or the attempt ends: after the requests, every worker is back at 0."""
    cfg = DisaggConfig(min_prompt_tokens=16, decode_prefix_fraction=2, local_prefill_cost=4)
    with Cluster(prefill=1, decode=1, disagg=cfg) as cluster:
        for n in (5, 40, 300, 8):
            assert generate(cluster, list(range(n))).status_code == 200
        workers = httpx.get(cluster.url + "/workers", timeout=5).json()["workers"]
        assert [w["queued_prompt_tokens"] for w in workers] == [0, 0]
        assert [w["queued_tenants"] for w in workers] == [0, 0]
