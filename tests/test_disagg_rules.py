"""Conditional disaggregation (router/disagg.py): the rules on their own, then through a router in
front of stub nodes (tests/stub_node.py), where a decode-only request is one without bootstrap
fields and every decision is counted by reason."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import pytest
from stub_node import Cluster

from router.config import DisaggConfig
from router.disagg import Disaggregation, TokenEstimator


@dataclass
class W:
    url: str
    queued_prompt_tokens: int = 0
    prefix_cache: bool = True


P, D = W("http://p"), W("http://d")


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


def test_a_deep_prefill_queue_sends_the_prompt_to_the_idle_decode_node():
    cfg = DisaggConfig(
        min_prompt_tokens=0,
        decode_prefix_fraction=2,
        local_prefill_cost=4.0,
        transfer_overhead_tokens=64,
    )
    d = Disaggregation(cfg)
    body = ids(100)
    assert d.decide(body, "k", W("p", 0), W("d", 0)).path == "disaggregated"  # 164 < 400
    # 300 + 100 + 64 = 464 > 4 * 100
    assert d.decide(body, "k", W("p", 300), W("d", 0)).reason == "prefill_queue"
    # the decode node's own local queue counts against it: 4 * (50 + 100) = 600
    assert d.decide(body, "k", W("p", 300), W("d", 50)).path == "disaggregated"
    assert Disaggregation(DisaggConfig(local_prefill_cost=0)).decide(
        body, "k", W("p", 10**6), W("d", 0)
    ).path == ("disaggregated")


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
            *(
                ("decode_only", r)
                for r in (
                    "no_prefill",
                    "prefill_failed",
                    "short_prompt",
                    "decode_prefix_hit",
                    "prefill_queue",
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
    resent prompt is a decode_prefix_hit only when it does."""
    cfg = DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=0.8, local_prefill_cost=0)
    with Cluster(prefill=1, decode=1, disagg=cfg, node_kw={"prefix_cache": cache}) as cluster:
        workers = httpx.get(cluster.url + "/workers", timeout=5).json()["workers"]
        assert [w["prefix_cache"] for w in workers] == [cache, cache]
        for _ in range(2):
            assert generate(cluster, list(range(64))).status_code == 200
        hits = decisions(cluster)[("decode_only", "decode_prefix_hit")]
        assert hits == (1 if cache else 0)


def test_queued_prompt_tokens_return_to_zero():
    """The router's prefill-queue estimate is charged per attempt and uncharged when the prompt
    is prefilled or the attempt ends: after the requests, every worker is back at 0."""
    cfg = DisaggConfig(min_prompt_tokens=16, decode_prefix_fraction=2, local_prefill_cost=4)
    with Cluster(prefill=1, decode=1, disagg=cfg) as cluster:
        for n in (5, 40, 300, 8):
            assert generate(cluster, list(range(n))).status_code == 200
        workers = httpx.get(cluster.url + "/workers", timeout=5).json()["workers"]
        assert [w["queued_prompt_tokens"] for w in workers] == [0, 0]
