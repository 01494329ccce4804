"""Router unit tests: policies, prefix tree, circuit breaker, config/CLI parsing (admission:
tests/test_admission.py)."""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.cli import add_router_args, router_config_from_args
from pdserve.router.config import BreakerConfig, CacheAwareConfig, RouterConfig
from pdserve.router.routing.circuit import CircuitBreaker, CircuitState
from pdserve.router.routing.policies import (
    CacheAware,
    LeastLoad,
    PowerOfTwo,
    Random,
    RoundRobin,
    make_policy,
)
from pdserve.router.routing.prefix_tree import PrefixTree
from pdserve.router.worker_spec import WorkerSpec


@dataclass(eq=False)
class W:
    url: str
    in_flight: int = 0


def workers(*loads: int) -> list[W]:
    return [W(f"http://w{i}", load) for i, load in enumerate(loads)]


# --- policies ---------------------------------------------------------------------------------
def test_round_robin_cycles():
    ws = workers(0, 0, 0)
    policy = RoundRobin()
    assert [policy.select(ws, "").url for _ in range(6)] == [w.url for w in ws] * 2


def test_random_uses_every_worker():
    ws = workers(0, 0, 0)
    policy = Random(random.Random(0))
    assert {policy.select(ws, "").url for _ in range(100)} == {w.url for w in ws}


def test_least_load_picks_minimum():
    ws = workers(5, 2, 7)
    assert LeastLoad().select(ws, "") is ws[1]


def test_power_of_two_never_picks_the_most_loaded_of_three():
    ws = workers(10, 0, 5)
    policy = PowerOfTwo(random.Random(1))
    picks = {policy.select(ws, "").url for _ in range(200)}
    assert ws[0].url not in picks and picks == {ws[1].url, ws[2].url}


def test_power_of_two_single_worker():
    ws = workers(3)
    assert PowerOfTwo().select(ws, "") is ws[0]


def test_cache_aware_prefers_worker_holding_prefix():
    ws = workers(0, 0)
    policy = CacheAware()
    first = policy.select(ws, "system: you are helpful\nuser: tell me about cats")
    # Give the other worker a different prompt so sizes tie-break away from `first`.
    other = next(w for w in ws if w is not first)
    policy.tree.insert("something else entirely " * 3, other.url)
    again = policy.select(ws, "system: you are helpful\nuser: tell me about dogs")
    assert again is first


def test_cache_aware_new_prompt_goes_to_emptier_tree():
    ws = workers(0, 0)
    policy = CacheAware()
    a = policy.select(ws, "aaaa aaaa aaaa aaaa")
    b = policy.select(ws, "zzzz zzzz zzzz zzzz")
    assert a is not b


def test_cache_aware_falls_back_to_least_load_when_imbalanced():
    ws = workers(0, 0)
    policy = CacheAware(CacheAwareConfig(balance_abs=4, balance_rel=1.5))
    holder = policy.select(ws, "shared prefix " * 10)
    holder.in_flight = 100
    pick = policy.select(ws, "shared prefix " * 10)
    assert pick is not holder


def test_make_policy_lists_supported_names():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("fastest")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.text("ab", max_size=14), st.sampled_from("xyz")), max_size=30),
    st.text("ab", max_size=14),
)
def test_prefix_tree_match_is_longest_inserted_prefix(entries, query):
    """Blocks of 4 characters here, so prefixes end inside blocks, on their edges and past
    them: the match is still exact to the character, and its holders are every worker whose
    prompt shares it."""
    tree = PrefixTree(max_chars=10**9, block_chars=4)
    for text, url in entries:
        tree.insert(text, url)
    matched, holders = tree.match(query)
    expected = max((len(_common(t, query)) for t, _ in entries), default=0)
    assert matched == expected
    if matched:
        assert holders == {u for t, u in entries if len(_common(t, query)) >= matched}


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_prefix_tree_walks_a_prompt_once_per_block():
    """A 4 MiB prompt is 65,536 blocks of 64 characters: one node each, hashed once for the
    several walks a request makes (issue #45: it was one Python step per character)."""
    tree = PrefixTree(max_chars=10**9)
    text = "".join(chr(97 + (i * 7919) % 26) for i in range(1 << 22))
    tree.insert(text, "w")
    blocks = tree.blocks(text)
    assert len(blocks) == len(tree.nodes) == (1 << 22) // 64
    assert tree.match(text) == (len(text), {"w"}) and tree.blocks(text) is blocks
    assert tree.match(text[: 64 * 10 + 5]) == (645, {"w"})


def test_prefix_tree_evicts_to_its_budget():
    tree = PrefixTree(max_chars=100)
    for i in range(50):
        tree.insert(f"{i:03d}-" + "x" * 20, "w")
    assert tree.chars <= 100


# --- circuit breaker ----------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_half_opens_and_closes():
    clock = Clock()
    cb = CircuitBreaker(BreakerConfig(failure_threshold=3, success_threshold=2, open_s=10), clock)
    for _ in range(2):
        cb.on_dispatch()
        cb.record(False)
    assert cb.state is CircuitState.CLOSED
    cb.on_dispatch()
    cb.record(False)
    assert cb.state is CircuitState.OPEN and not cb.can_pass()
    clock.t = 10.0
    assert cb.state is CircuitState.HALF_OPEN and cb.can_pass()
    cb.on_dispatch()
    assert not cb.can_pass(), "half-open lets one request at a time"
    cb.record(True)
    assert cb.state is CircuitState.HALF_OPEN and cb.can_pass()
    cb.on_dispatch()
    cb.record(True)
    assert cb.state is CircuitState.CLOSED


def test_breaker_half_open_failure_reopens_and_neutral_outcome_frees_probe():
    clock = Clock()
    cb = CircuitBreaker(BreakerConfig(failure_threshold=1, success_threshold=1, open_s=5), clock)
    cb.on_dispatch()
    cb.record(False)
    clock.t = 5.0
    cb.on_dispatch()
    cb.record(None)  # client went away: no verdict
    assert cb.state is CircuitState.HALF_OPEN and cb.can_pass()
    cb.on_dispatch()
    cb.record(False)
    assert cb.state is CircuitState.OPEN


def test_breaker_success_resets_failure_count():
    cb = CircuitBreaker(BreakerConfig(failure_threshold=2))
    for ok in (False, True, False, True, False):
        cb.on_dispatch()
        cb.record(ok)
    assert cb.state is CircuitState.CLOSED


# --- config and CLI -----------------------------------------------------------------------
def parse(*argv: str) -> RouterConfig:
    return router_config_from_args(add_router_args(argparse.ArgumentParser()).parse_args(argv))


def test_cli_prefill_with_and_without_bootstrap_port():
    cfg = parse(
        "--prefill",
        "http://127.0.0.1:30000",
        "8998",
        "--prefill",
        "http://127.0.0.1:30002",
        "--decode",
        "http://127.0.0.1:30001",
        "--policy",
        "round_robin",
        "--max-concurrent",
        "8",
    )
    assert cfg.workers[0] == WorkerSpec("http://127.0.0.1:30000", "prefill", 8998)
    assert cfg.workers[1].bootstrap_port is None
    assert cfg.workers[2].role == "decode"
    assert cfg.prefill_policy == cfg.decode_policy == "round_robin"
    assert cfg.max_concurrent == 8 and cfg.host == "127.0.0.1"


def test_cli_colocated_and_env_secrets(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "k1")
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "t1")
    cfg = parse("--worker", "http://127.0.0.1:30000/")
    assert cfg.workers == (WorkerSpec("http://127.0.0.1:30000", "colocated"),)
    assert cfg.api_key == "k1" and cfg.internal_token == "t1"


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--prefill", "http://a:1"), "needs at least one --decode"),
        (("--decode", "http://a:1"), "needs at least one --prefill"),
        (("--prefill", "http://a:1", "x", "--decode", "http://b:1"), "not a number"),
        (("--worker", "a:1"), "must look like"),
    ],
)
def test_cli_rejects_bad_worker_lists(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_stop_reason_names_a_stop_string_or_stop_token_but_not_the_eos_token():
    from pdserve.router.openai_api.responses import stop_reason

    ids = frozenset({7})
    assert stop_reason({"finish_reason": {"type": "stop", "matched": "\n\n"}}, ids) == "\n\n"
    assert stop_reason({"finish_reason": {"type": "stop", "matched": 7}}, ids) == 7
    assert stop_reason({"finish_reason": {"type": "stop", "matched": 2}}, ids) is None, "EOS"
    assert stop_reason({"finish_reason": {"type": "length"}}, ids) is None
    assert stop_reason({"finish_reason": None}, ids) is None


def test_node_pools_share_one_tls_context():
    """Every connection pool of every node uses the one TLS context NodeClients built: a client
    built without one loads the CA bundle itself (about 75 ms of CPU), 8 of them on a node's first
    request at the default 256 concurrent requests."""
    from pdserve.router.routing.node_clients import NodeClients

    async def main():
        clients = NodeClients(5.0, 256)
        try:
            pools = [clients.get(f"http://127.0.0.1:{port}") for port in (1, 2) for _ in range(8)]
            contexts = {id(c._transport._pool._ssl_context) for c in pools}
            assert len({id(c) for c in pools}) == 16  # 8 shards per node, two nodes
            assert len(contexts) == 1, f"{len(contexts)} TLS contexts for 16 pools"
        finally:
            await clients.aclose()

    asyncio.run(main())


def test_every_migration_cause_is_a_counted_label():
    """pdserve_router_migrations_total has every cause the router can migrate for from start-up."""
    from pdserve.router.metrics import MIGRATION_CAUSES
    from pdserve.router.routing.migration import MIGRATED_ABORTS

    broken = {"connection", "stream_cut", "node_unhealthy", "idle_timeout"}
    assert set(MIGRATION_CAUSES) == broken | MIGRATED_ABORTS
