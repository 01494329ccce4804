"""`n` > 1 in the router against stub nodes (router/openai_api/n_choices.py): where the choices go,
their seeds, and what happens to all of them when one fails or the client leaves. The real
prefix-cache sharing is tested on real nodes in tests/test_openai_choices.py."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from stub_node import Cluster

MODEL = "stub-model"
CHAT = [{"role": "user", "content": "one two three four"}]


def sdk(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=10, max_retries=0)


def until(cond, what: str, timeout_s: float = 10.0) -> None:
    """Waits for `cond()` (a background abort lands after the answer), failing after a timeout."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("seed", [7, None])
def test_choices_follow_choice_0s_pair_and_choice_i_gets_seed_plus_i(seed):
    """Round robin would spread three requests over three nodes: the choices all go where choice 0
    went (its node holds the prompt in its prefix cache)."""
    with Cluster(prefill=0, decode=0, colocated=3, decode_policy="round_robin") as cluster:
        out = sdk(cluster).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=3, n=3, seed=seed
        )
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.message.content for c in out.choices] == ["one two three"] * 3
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 9)
        served = [n for n in cluster.colocated if n.stats.generate]
        assert len(served) == 1 and served[0].stats.generate == 3
        bodies = served[0].stats.bodies
        assert all(b["stream"] for b in bodies), "every choice streams from its node"
        # choices 1 and 2 go at once: either may reach the node first
        seeds = sorted(b["sampling_params"].get("seed") or 0 for b in bodies)
        assert seeds == ([7, 8, 9] if seed is not None else [0] * 3)
        assert len({b["rid"] for b in bodies}) == 3


def test_a_pd_pairs_choices_go_to_one_prefill_node():
    with Cluster(prefill=2, decode=2, prefill_policy="round_robin") as cluster:
        out = sdk(cluster).completions.create(model=MODEL, prompt="a b c", max_tokens=2, n=4)
        assert [c.text for c in out.choices] == ["a b"] * 4
        # The router sends each pair's two legs at once and the stub decode node answers without
        # waiting for its prefill leg, so a prefill leg can arrive after the client has its answer.
        deadline = time.monotonic() + 10
        while sum(n.stats.generate for n in cluster.prefill) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(n.stats.generate for n in cluster.prefill) == [0, 4]


def test_a_client_leaving_a_stream_aborts_every_choice():
    node_kw = {"natural_tokens": 50, "token_delay_s": 0.05}
    with Cluster(prefill=0, decode=0, colocated=1, node_kw=node_kw) as cluster:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 50, "n": 3, "stream": True}
        with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if '"index":2' in line.replace(" ", ""):
                    break  # every choice has started: leave
        node = cluster.colocated[0]
        until(lambda: len(node.stats.aborts) == 3, f"aborts: {node.stats.aborts}")
        assert set(node.stats.aborts) == set(node.stats.rids)


def test_one_choice_failing_mid_stream_ends_the_stream_with_an_error_and_aborts_all():
    with Cluster(prefill=0, decode=0, colocated=1, node_kw={"fail": "midstream"}) as cluster:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "n": 2, "stream": True}
        r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200
        events = [x for x in r.text.split("\n\n") if x]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
        node = cluster.colocated[0]
        until(lambda: len(node.stats.aborts) == 2, f"aborts: {node.stats.aborts}")
        whole = httpx.post(
            cluster.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=10
        )
        assert whole.status_code == 502 and whole.json()["error"]["code"] == "node_aborted"
