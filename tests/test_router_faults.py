"""Router fault handling against stub nodes: dead and returning nodes, circuit breaker, retries,
prefill errors and hangs, saturation (429) and client disconnects (abort to both nodes)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from stub_node import Cluster

from pdserve.router.config import BreakerConfig, HealthConfig, RetryConfig

MODEL = "stub-model"
CHAT = [{"role": "user", "content": "one two three"}]
FAST_RETRY = RetryConfig(max_retries=2, initial_backoff_s=0.01, max_backoff_s=0.05)


def chat(cluster, timeout=10.0, **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **kw}
    return httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=timeout)


def wait_until(predicate, timeout=5.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def worker_view(cluster, url) -> dict:
    workers = httpx.get(cluster.url + "/workers", timeout=5).json()["workers"]
    return next(w for w in workers if w["url"] == url)


def test_one_of_two_decode_nodes_killed_requests_keep_succeeding():
    # Probes every 0.5 s (3 failed ones mark a node): the first requests reach the dead node before
    # the router marks it, so they must be retried (at 0.1 s the router could mark it first).
    health = HealthConfig(interval_s=0.5, timeout_s=1.0)
    with Cluster(
        prefill=1, decode=2, decode_policy="round_robin", retry=FAST_RETRY, health=health
    ) as cluster:
        dead, alive = cluster.decode
        dead.kill()
        for _ in range(8):
            r = chat(cluster)
            assert r.status_code == 200, r.text
        assert alive.stats.generate == 8
        metrics = httpx.get(cluster.url + "/metrics", timeout=5).text
        assert "pdserve_router_retries_total 0.0" not in metrics
        wait_until(
            lambda: not worker_view(cluster, dead.url)["healthy"], what="dead node unhealthy"
        )


def test_node_dies_and_comes_back_health_and_breaker():
    health = HealthConfig(interval_s=0.1, timeout_s=0.5, failure_threshold=2, success_threshold=2)
    # open_s: long enough that the checks of the open state finish before it half-opens on a
    # loaded machine (at 0.5 s, a run next to another test process read it half-open already)
    breaker = BreakerConfig(failure_threshold=1, success_threshold=1, open_s=3.0)
    with Cluster(prefill=1, decode=1, health=health, breaker=breaker, retry=FAST_RETRY) as cluster:
        decode = cluster.decode[0]
        assert chat(cluster).status_code == 200
        # Breaker: the node answers 500 (its /health still passes) -> open -> half-open -> closed.
        decode.behavior.fail = "500"
        r = chat(cluster)
        assert r.status_code == 502 and r.json()["error"]["code"] == "decode_failed", r.text
        assert worker_view(cluster, decode.url)["circuit"] == "open"
        text = httpx.get(cluster.url + "/metrics", timeout=5).text
        assert f'pdserve_router_circuit_state{{state="open",worker="{decode.url}"}} 1.0' in text
        assert chat(cluster).json()["error"]["code"] == "no_available_workers"
        decode.behavior.fail = None
        wait_until(
            lambda: worker_view(cluster, decode.url)["circuit"] == "half_open", what="half-open"
        )
        assert chat(cluster).status_code == 200  # the half-open probe succeeds ...
        assert worker_view(cluster, decode.url)["circuit"] == "closed"  # ... and closes it

        # Health: the node dies -> unhealthy -> 503; comes back -> healthy -> 200.
        decode.kill()
        wait_until(lambda: not worker_view(cluster, decode.url)["healthy"], what="unhealthy")
        assert httpx.get(cluster.url + "/health", timeout=5).status_code == 503
        r = chat(cluster)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_available_workers"
        text = httpx.get(cluster.url + "/metrics", timeout=5).text
        assert f'pdserve_router_worker_healthy{{role="decode",worker="{decode.url}"}} 0.0' in text
        decode.revive()
        wait_until(lambda: worker_view(cluster, decode.url)["healthy"], what="healthy again")
        assert chat(cluster).status_code == 200
        assert httpx.get(cluster.url + "/health", timeout=5).status_code == 200


def test_a_failed_prefill_leg_is_retried_decode_only_and_counted():
    """The prefill node answers 500: the decode node's half of that try is aborted, and the retry
    goes to the decode node alone (no bootstrap fields: it prefills itself). The client gets 200."""
    with Cluster(
        prefill=1, decode=1, retry=FAST_RETRY, node_kw={"first_token_delay_s": 0.5}
    ) as cluster:
        cluster.prefill[0].behavior.fail = "500"
        r = chat(cluster)
        assert r.status_code == 200, r.text
        decode = cluster.decode[0]
        assert decode.stats.generate == 2, "the PD try, then one decode-only try"
        assert "bootstrap_room" in decode.stats.bodies[0]
        assert not any(k.startswith("bootstrap_") for k in decode.stats.bodies[1])
        assert len(cluster.prefill[0].stats.rooms) == 1, "the prefill node is not tried again"
        wait_until(
            lambda: decode.stats.rids[0] in decode.stats.aborts,
            what="abort sent to the decode node for the failed try",
        )
        text = httpx.get(cluster.url + "/metrics", timeout=5).text
        assert (
            'pdserve_router_route_decisions_total{path="decode_only",reason="prefill_failed"} 1.0'
            in text
        )
        assert (
            'pdserve_router_route_decisions_total{path="disaggregated",reason="default"} 1.0'
            in text
        )


def test_without_a_prefill_node_the_decode_node_serves_alone():
    with Cluster(prefill=1, decode=1, retry=FAST_RETRY) as cluster:
        cluster.prefill[0].kill()
        wait_until(
            lambda: not worker_view(cluster, cluster.prefill[0].url)["healthy"], what="unhealthy"
        )
        assert httpx.get(cluster.url + "/health", timeout=5).status_code == 200
        for _ in range(3):
            assert chat(cluster).status_code == 200
        decode = cluster.decode[0]
        assert all("bootstrap_room" not in b for b in decode.stats.bodies[-3:])
        text = httpx.get(cluster.url + "/metrics", timeout=5).text
        assert (
            'pdserve_router_route_decisions_total{path="decode_only",reason="no_prefill"} 3.0'
            in text
        )


def test_prefill_hang_times_out_with_body():
    with Cluster(
        prefill=1,
        decode=1,
        request_timeout_s=0.5,
        retry=RetryConfig(max_retries=0),
        node_kw={"first_token_delay_s": 10.0},
    ) as cluster:
        cluster.prefill[0].behavior.fail = "hang"
        r = chat(cluster, stream=True)
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        rid = cluster.decode[0].stats.rids[-1]
        for node in cluster.nodes:
            wait_until(lambda node=node: rid in node.stats.aborts, what="aborts to both nodes")


def test_saturation_gives_429_with_retry_after():
    with Cluster(
        prefill=1,
        decode=1,
        max_concurrent=1,
        max_queue=1,
        retry_after_s=2,
        node_kw={"first_token_delay_s": 0.8},
    ) as cluster:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            results = list(pool.map(lambda _: chat(cluster), range(5)))
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 2 and codes.count(429) >= 2, codes
        rejected = next(r for r in results if r.status_code == 429)
        assert rejected.headers["retry-after"] == "2"
        assert rejected.json()["error"]["type"] == "rate_limit_error"
        text = httpx.get(cluster.url + "/metrics", timeout=5).text
        assert "pdserve_router_rejected_total 0.0" not in text
        assert chat(cluster).status_code == 200, "capacity comes back"


def test_client_disconnect_mid_stream_aborts_both_nodes():
    with Cluster(
        prefill=1, decode=1, node_kw={"token_delay_s": 0.1, "natural_tokens": 200}
    ) as cluster:
        body = {"model": MODEL, "messages": CHAT, "stream": True}
        with (
            httpx.Client(timeout=10) as client,
            client.stream("POST", cluster.url + "/v1/chat/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            data = [line for line in (next(lines) for _ in range(6)) if line]
            assert len(data) >= 2
        rid = cluster.decode[0].stats.rids[-1]
        assert cluster.prefill[0].stats.rids[-1] == rid
        for node in cluster.nodes:
            wait_until(lambda node=node: rid in node.stats.aborts, what="abort on both nodes")
        router = cluster.app.state.router
        wait_until(lambda: router.admission.running == 0, what="admission slot released")
        assert all(w.in_flight == 0 for w in router.registry.all())


def test_client_timeout_before_answer_aborts_both_nodes():
    with Cluster(prefill=1, decode=1, node_kw={"first_token_delay_s": 5.0}) as cluster:
        with pytest.raises(httpx.ReadTimeout):
            chat(cluster, timeout=0.5)
        rid = cluster.decode[0].stats.rids[-1]
        for node in cluster.nodes:
            wait_until(lambda node=node: rid in node.stats.aborts, what="abort on both nodes")


def test_node_error_mid_stream_reaches_sdk_as_error():
    with Cluster(prefill=1, decode=1) as cluster:
        cluster.decode[0].behavior.fail = "midstream"
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", timeout=10, max_retries=0)
        stream = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        cluster.decode[0].behavior.fail = None
        assert chat(cluster).status_code == 200


def test_decode_abort_before_first_byte_is_retried_on_other_node():
    with Cluster(prefill=1, decode=2, decode_policy="round_robin", retry=FAST_RETRY) as cluster:
        cluster.decode[0].behavior.fail = "abort"
        for stream in (False, True, False, True):
            r = chat(cluster, stream=stream)
            assert r.status_code == 200 and "error" not in r.text, r.text
