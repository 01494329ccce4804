"""The router's latency model (router/routing/latency_model.py), its SLO admission and goodput
(router/slo.py), and tenants (router/tenants.py): the fits on their own, then through a router in
front of stub nodes whose delays are set (tests/stub_node.py)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from stub_node import Cluster

from pdserve.router.config import BreakerConfig, DisaggConfig, FairnessConfig, SloConfig
from pdserve.router.routing.circuit import CircuitBreaker
from pdserve.router.routing.disagg import Disaggregation
from pdserve.router.routing.latency_model import LatencyModel, LinearFit, queue_ahead
from pdserve.router.routing.worker import Worker
from pdserve.router.tenants import Tenants, read_tenant_keys


@dataclass
class W:
    url: str
    queued_prompt_tokens: int = 0
    queued_by_tenant: dict[str, int] = field(default_factory=dict)
    queued_requests_by_tenant: dict[str, int] = field(default_factory=dict)
    prefix_cache: bool = True
    in_flight: int = 0
    role: str = "decode"


def test_a_fit_starts_at_its_prior_and_follows_what_is_measured():
    fit = LinearFit(0.01, 0.001)
    assert fit.predict(100) == pytest.approx(0.11)
    rng = random.Random(1)
    for _ in range(100):  # the node is measured 3x slower, with 50 ms fixed
        x = rng.randrange(2000)
        fit.observe(x, 0.05 + 0.003 * x)
    a, b = fit.coefficients()
    assert a == pytest.approx(0.05, rel=0.25) and b == pytest.approx(0.003, rel=0.02)
    for _ in range(200):  # then all at one size: the slope keeps what the spread taught it
        fit.observe(500, 0.05 + 0.003 * 500)
    assert fit.predict(500) == pytest.approx(1.55, rel=0.02)
    assert fit.coefficients()[1] >= 0


def test_one_slow_request_scales_the_priors_rate_not_its_fixed_cost():
    """Measured: a prefill node sharing its core with the benchmark client prefilled 533 tokens in
    1.277 s (2.4 ms a token against the prior's 0.5). Read as the prior's rate plus a fixed cost,
    a queue of 1,200 tokens was predicted at 1.85 s; the prior scaled to that speed predicts what
    the node does."""
    fit = LinearFit(0.01, 0.0005)
    fit.observe(533, 1.277)
    assert fit.predict(533) == pytest.approx(1.277, rel=0.01)
    assert fit.predict(1200) == pytest.approx(
        1.277 * (10 + 0.5 * 1200) / (10 + 0.5 * 533), rel=0.01
    )
    faster = LinearFit(0.01, 0.0005)
    faster.observe(400, 0.05)  # 4x faster than the prior: its fixed cost shrinks too
    assert faster.predict(0) == pytest.approx(0.01 * 0.05 / 0.21, rel=0.01)


def test_a_fit_never_predicts_less_time_for_more_work():
    fit = LinearFit(0.01, 0.001)
    for x in range(100):  # noise that slopes down
        fit.observe(x * 10, 1.0 - x * 0.001)
    assert fit.coefficients()[1] == 0.0 and fit.predict(0) > 0


def test_routes_follow_the_measured_rates_not_the_priors():
    """The priors (local prefill 1.5x a prefill node's) send a 300-token prompt to the pair while
    the decode node has streams; once the decode node is measured to prefill it 4x faster than
    the prefill node, the same request goes decode-only; measured slower, back to the pair."""
    d = Disaggregation(DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=2))
    p, dec, body = W("p", role="prefill"), W("d", in_flight=2), {"input_ids": list(range(300))}
    assert d.decide(body, "k", p, dec).path == "disaggregated"
    m = d.model
    for x in range(50, 1000, 10):
        m.observe_prefill("p", "prefill", False, x, 0.004 * x)
        m.observe_prefill("d", "decode", True, x, 0.001 * x)
        m.observe_handoff("d", x, 0.005)
    got = d.decide(body, "k", p, dec)
    assert (got.path, got.reason) == ("decode_only", "prefill_queue")
    assert got.predicted_ttft_s == pytest.approx(0.3, rel=0.1)
    for x in range(50, 1000, 10):
        m.observe_prefill("d", "decode", True, x, 0.02 * x)
    assert d.decide(body, "k", p, dec).path == "disaggregated"


def test_the_delay_to_open_streams_weighs_against_the_decode_node_alone():
    """Measured rates where the decode node gives the first token sooner (1 ms a token against
    the pair's 2 ms): with 8 streams open there, a 300-token prefill delays each by about 0.3 s.
    Weighed at 0.5 per stream-second that outweighs the 0.3 s the request gains, and the pair
    takes it (reason `decode_streams`); at weight 0, or with no stream open, the decode node."""

    def decide(weight: float, streams: int):
        cfg = DisaggConfig(
            min_prompt_tokens=0, decode_prefix_fraction=2, stream_delay_weight=weight
        )
        d = Disaggregation(cfg)
        for x in range(50, 1000, 10):
            d.model.observe_prefill("p", "prefill", False, x, 0.002 * x)
            d.model.observe_prefill("d", "decode", True, x, 0.001 * x)
            d.model.observe_prefill("d", "decode", False, x, 0.001 * x)
            d.model.observe_handoff("d", x, 0.005)
        p, dec = W("p", role="prefill"), W("d", in_flight=streams)
        got = d.decide({"input_ids": list(range(300))}, "k", p, dec)
        return got.path, got.reason

    assert decide(0.0, 8) == ("decode_only", "prefill_queue")
    assert decide(0.5, 8) == ("disaggregated", "decode_streams")
    assert decide(0.5, 0) == ("decode_only", "prefill_queue")
    assert decide(0.05, 8) == ("decode_only", "prefill_queue")  # 0.12 s weighed < 0.3 s gained


def queued(**by_tenant: tuple[int, int]) -> W:
    """A decode node with (tokens, requests) queued for each tenant."""
    tokens = {t: n for t, (n, _) in by_tenant.items()}
    requests = {t: r for t, (_, r) in by_tenant.items()}
    return W("d", sum(tokens.values()), tokens, requests)


def test_a_tenant_waits_behind_its_own_queue_and_the_others_prompts_that_end_first():
    """A node prefills tenants in fair order, one tenant's prompts a forward (engine/
    fair_queue.py): a prompt waits for its own tenant's queue and for those of another tenant's
    prompts whose fair tags end before its own."""
    flood = queued(A=(9000, 9))  # nine prompts of 1000
    assert queue_ahead(flood, "B", 200) == 0  # each of them ends after B's 200
    assert queue_ahead(flood, "A", 200) == 9000  # the flood waits behind itself
    assert queue_ahead(flood, None, 200) == 9000  # no tenant: first come first served
    chat = queued(A=(9000, 45))  # 45 prompts of 200
    assert queue_ahead(chat, "B", 200) == 200  # one of them ends with B's: they take turns
    assert queue_ahead(chat, "B", 650) == 600
    both = queued(A=(9000, 9), B=(300, 1))
    assert queue_ahead(both, "B", 200) == 300  # B's own; B's 500 end before any of A's 1000
    assert queue_ahead(both, "B", 1800) == 300 + 2000
    assert queue_ahead(both, "A", 200) == 9000 + 300
    assert queue_ahead(W("d", queued_prompt_tokens=0), "B", 200) == 0


def test_a_worker_charges_and_uncharges_prompts_per_tenant():
    """What `queue_ahead` reads, kept by the real `Worker`: tokens and requests per tenant, the
    maps empty again once every prompt left the queue."""
    w = Worker("http://d:1", "decode", CircuitBreaker(BreakerConfig()))
    for tenant, n in [("A", 1000), ("A", 1200), ("B", 179), ("A", 800)]:
        w.queue(tenant, n, 1)
    assert w.queued_prompt_tokens == 3179
    assert (w.queued_by_tenant, w.queued_requests_by_tenant) == (
        {"A": 3000, "B": 179},
        {"A": 3, "B": 1},
    )
    assert queue_ahead(w, "B", 179) == 179  # B's own; none of A's (1000 each) ends first
    for tenant, n in [("A", 1200), ("B", 179), ("A", 1000), ("A", 800)]:
        w.queue(tenant, -n, -1)
    assert (w.queued_prompt_tokens, w.queued_by_tenant, w.queued_requests_by_tenant) == (0, {}, {})
    w.queue("C", 0, 1)  # a prompt the node holds whole in its cache: nothing to compute
    assert w.queued_requests_by_tenant == {"C": 1} and queue_ahead(w, "B", 179) == 0
    w.queue("C", 0, -1)
    assert w.queued_requests_by_tenant == {}


def test_a_light_tenant_beside_a_flood_is_routed_by_its_own_wait():
    """Measured: the prefill node 2 ms a prompt token, the decode node 1 ms. Another tenant's
    9,000 tokens queued on the decode node, in prompts of 1,000: read first come first served, a
    200-token prompt would wait 9 s there and go to the pair; in the node's fair order it waits
    for none of them, and the decode node alone gives it the first token sooner."""
    d = Disaggregation(DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=2))
    for x in range(50, 1000, 10):
        d.model.observe_prefill("p", "prefill", False, x, 0.002 * x)
        d.model.observe_prefill("d", "decode", True, x, 0.001 * x)
        d.model.observe_handoff("d", x, 0.005)
    p = W("p", role="prefill")
    dec = queued(A=(9000, 9))
    dec.in_flight = 4
    body = {"input_ids": list(range(200))}
    assert d.decide(body, "k", p, dec).path == "disaggregated"  # no tenant named
    got = d.decide(body, "k", p, dec, tenant="B")
    assert (got.path, got.reason) == ("decode_only", "prefill_queue")
    assert got.predicted_ttft_s == pytest.approx(0.2, rel=0.15)
    assert d.decide(body, "k", p, dec, tenant="A").path == "disaggregated"


def test_prediction_errors_are_kept_bounded_and_summarised():
    m = LatencyModel(DisaggConfig())
    for i in range(5000):
        m.record_error("decode_only", 1.0 + (i % 10) / 10, 1.0, 300)
    assert m.record_error("decode_only", 1.0, 0.0, 300) is None
    summary = m.describe()["predicted_over_actual"]["decode_only"]
    assert summary["count"] == 2048 and 1.0 <= summary["p10"] <= summary["p50"] <= summary["p90"]
    m.observe_step("http://d", 3, 0.05)
    m.observe_prefill("http://p", "prefill", False, 10, 0.1)
    m.forget("http://d")  # a worker removed: its fits go
    assert set(m.describe()["fits"]) == {"http://p"}


def slo_rejections(cluster) -> dict[str, float]:
    out = {}
    for line in httpx.get(cluster.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(("pdserve_router_slo_rejections_total{", "pdserve_router_goodput")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def stream(cluster, n: int = 50) -> httpx.Response:
    body = {"input_ids": list(range(n)), "sampling_params": {"max_tokens": 4}, "stream": True}
    return httpx.post(cluster.url + "/generate", json=body, timeout=10)


def under_load(cluster, until) -> tuple[list[int], list[tuple[httpx.Response, float]]]:
    """Requests one after another while a second thread keeps sending too (so something is
    running when each is checked), until `until(response)`; the other thread's statuses and this
    one's (response, seconds) in order."""
    stop, other, mine = threading.Event(), [], []

    def load() -> None:
        while not stop.is_set():
            other.append(stream(cluster).status_code)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        for _ in range(80):
            t0 = time.perf_counter()
            r = stream(cluster)
            mine.append((r, time.perf_counter() - t0))
            if until(r):
                break
    finally:
        stop.set()
        thread.join(30)
    return other, mine


def test_a_request_predicted_to_miss_the_ttft_slo_gets_a_typed_429_at_once():
    """The node answers its first token after 150 ms; under a 60 ms SLO the first requests pass
    (the prior predicts well under it), the model learns the node's time from them, and then a
    request is refused at once with 429 slo_unattainable and Retry-After, never reaching the
    node. With nothing running, a request is let through whatever the prediction (else a model
    that predicts too much could refuse everything for good). Requests that passed count as
    goodput only when they met the SLO."""
    node_kw = {"first_token_delay_s": 0.15}
    slo = SloConfig(ttft_ms=60)
    with Cluster(prefill=0, decode=0, colocated=1, node_kw=node_kw, slo=slo) as cluster:
        node = cluster.colocated[0]
        other, mine = under_load(cluster, lambda r: r.status_code == 429)
        r, elapsed = mine[-1]
        assert mine[0][0].status_code == 200 and r.status_code == 429, [m[0] for m in mine]
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "slo_unattainable")
        assert "ttft predicted" in err["message"] and int(r.headers["retry-after"]) >= 1
        assert elapsed < node_kw["first_token_delay_s"]  # refused before any node could answer
        admitted = other.count(200) + sum(m[0].status_code == 200 for m in mine)
        assert node.stats.generate == admitted  # no refused request reached the node
        assert stream(cluster).status_code == 200  # nothing running: let through
        metrics = slo_rejections(cluster)
        assert metrics['pdserve_router_slo_rejections_total{slo="ttft"}'] >= 1
        assert metrics["pdserve_router_goodput_requests_total"] == 0  # none met 60 ms


def test_without_an_slo_nothing_is_refused_and_every_answer_is_goodput():
    with Cluster(prefill=0, decode=0, colocated=1, node_kw={"first_token_delay_s": 0.05}) as c:
        assert [stream(c).status_code for _ in range(12)] == [200] * 12
        metrics = slo_rejections(c)
        assert metrics["pdserve_router_goodput_requests_total"] == 12
        assert metrics['pdserve_router_slo_rejections_total{slo="ttft"}'] == 0


def test_the_itl_slo_refuses_by_the_decode_step_it_measured():
    node_kw = {"token_delay_s": 0.05, "natural_tokens": 6}
    with Cluster(prefill=0, decode=0, colocated=1, node_kw=node_kw, slo=SloConfig(itl_ms=30)) as c:
        _, mine = under_load(c, lambda r: r.status_code == 429)
        r = mine[-1][0]
        assert mine[0][0].status_code == 200 and r.status_code == 429
        assert "itl predicted" in r.json()["error"]["message"]


def test_priority_needs_priority_scheduling():
    body = {"model": "stub-model", "prompt": "hi", "max_tokens": 2, "priority": -5}
    with Cluster(prefill=0, decode=0, colocated=1) as c:
        r = httpx.post(c.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert (
            httpx.post(c.url + "/v1/completions", json={**body, "priority": 0}).status_code == 200
        )
    with Cluster(
        prefill=0, decode=0, colocated=1, fairness=FairnessConfig(priority_scheduling=True)
    ) as c:
        assert httpx.post(c.url + "/v1/completions", json=body, timeout=10).status_code == 200


def test_tenants_are_api_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# name key weight\nalpha k-alpha 2\nbeta k-beta\n\n")
    keys = read_tenant_keys(str(path))
    t = Tenants(None, keys)
    assert t.required and t.weights == {"alpha": 2.0, "beta": 1.0}
    assert t.identify("Bearer k-alpha") == "alpha" and t.identify("Bearer k-beta") == "beta"
    assert t.identify("Bearer other") is None and t.identify(None) is None
    both = Tenants("main", keys)
    assert both.identify("Bearer main").startswith("key-") and both.identify("Bearer x") is None
    open_ = Tenants(None)
    assert not open_.required and open_.identify(None) == "anonymous"
    assert open_.identify("Bearer a") != open_.identify("Bearer b")
    for bad, why in (("a", "NAME KEY"), ("a k 0", "weight"), ("a k x", "not a number")):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=why):
            read_tenant_keys(str(path))
    path.write_text("a k1\na k2\n")
    with pytest.raises(ValueError, match="twice"):
        read_tenant_keys(str(path))


def test_fixed_costs_route_by_the_priors_and_the_flags_parse():
    import argparse

    from pdserve.router.cli import add_router_args, router_config_from_args

    def parse(*argv):
        return router_config_from_args(add_router_args(argparse.ArgumentParser()).parse_args(argv))

    cfg = parse("--disagg-fixed-costs", "--ttft-slo-ms", "800", "--tenant-max-concurrent", "4")
    assert cfg.disagg.fixed_costs and cfg.slo.ttft_ms == 800
    assert cfg.fairness.tenant_max_concurrent == 4 and not parse().disagg.fixed_costs
    m = LatencyModel(cfg.disagg)
    before = m.prefill_s(W("d"), 300)
    m.observe_prefill("d", "decode", False, 300, 30.0)
    assert m.prefill_s(W("d"), 300) == before


def test_a_path_measured_slower_than_predicted_is_calibrated_then_tried_again():
    """The fits say the pair is faster; the pair's requests keep taking 3x their prediction
    (its node slows under load, which no fit of one request sees), so its predictions are scaled
    up until the decode node wins. Decisions that do not take the pair let its correction fade,
    so it is tried again."""
    d = Disaggregation(DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=2))
    p, dec, body = W("p", role="prefill"), W("d", in_flight=2), {"input_ids": list(range(300))}
    first = d.decide(body, "k", p, dec)
    assert first.path == "disaggregated"
    actual = 3 * first.predicted_ttft_s
    for _ in range(60):  # each attempt predicted with the calibration so far
        d.model.record_error("disaggregated", d.model.pd_ttft(p, dec, 300, 300), actual, 300)
    calibration = d.model.describe()["calibration"]["disaggregated"]
    assert calibration == {"256-511": pytest.approx(3.0, rel=0.1)}
    assert d.decide(body, "k", p, dec).path == "decode_only"
    for _ in range(200):
        if d.decide(body, "k", p, dec).path == "disaggregated":
            break
    else:
        raise AssertionError("the pair was never tried again")


def test_short_prompts_are_calibrated_apart_from_long_ones():
    """Measured: the pair gives a 179-token prompt its first token 1.4x later than predicted
    (its bootstrap and hand-off wait a forward each on the loaded nodes, a fixed cost the fits,
    learnt mostly from 1,100-token prompts, miss), and 1,100-token prompts as predicted. Each
    size is calibrated by its own errors: the short prompts' pair predictions go up 1.4x, the
    long prompts' stay, and the decode node alone, predicted a little slower than the pair for a
    short prompt before, now takes it; long prompts still go to the pair."""
    d = Disaggregation(DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=2))
    p, dec = W("p", role="prefill"), W("d", in_flight=2)
    short, long_ = {"input_ids": list(range(179))}, {"input_ids": list(range(1100))}
    pd_short, local_short = d.model.pd_ttft(p, dec, 179, 179), d.model.local_ttft(dec, 179)
    pd_long = d.model.pd_ttft(p, dec, 1100, 1100)
    assert pd_short < local_short < 1.4 * pd_short  # the priors
    assert d.decide(short, "k", p, dec).path == "disaggregated"
    for _ in range(60):
        d.model.record_error(
            "disaggregated", d.model.pd_ttft(p, dec, 179, 179), pd_short * 1.4, 179
        )
        d.model.record_error("disaggregated", d.model.pd_ttft(p, dec, 1100, 1100), pd_long, 1100)
    assert d.model.pd_ttft(p, dec, 179, 179) == pytest.approx(1.4 * pd_short, rel=0.05)
    assert d.model.pd_ttft(p, dec, 1100, 1100) == pytest.approx(pd_long, rel=0.01)
    assert d.model.local_ttft(dec, 179) == local_short
    calibration = d.model.describe()["calibration"]["disaggregated"]
    assert set(calibration) == {"128-255", "1024-2047"}
    assert d.decide(short, "k", p, dec).path == "decode_only"
    assert d.decide(long_, "k", p, dec).path == "disaggregated"


def test_work_queued_in_the_router_does_not_change_a_prompts_size_class():
    """SLO admission adds its share of the router's queue as work ahead (router/slo.py): the
    prompt is still calibrated at its own size, where its errors are recorded."""
    m = LatencyModel(DisaggConfig())
    dec = W("d", in_flight=2)
    measured = 2 * m.local_ttft(dec, 179)
    for _ in range(60):
        m.record_error("decode_only", m.local_ttft(dec, 179), measured, 179)
    ahead = m.fit_prefill_s(dec, 179, None, 5000)  # the fit's time, no calibration
    assert m.local_ttft(dec, 179, None, 5000) == pytest.approx(2 * ahead, rel=0.05)


def test_a_node_behind_its_fit_says_so_while_its_prefills_wait():
    """In a burst nothing has ended yet, so the fits still hold their priors; a prefill open on
    the prefill node for 5x its predicted time scales that node's predictions 5x or more, and the
    next request goes to the decode node. Once the prefill ends, the correction goes."""
    d = Disaggregation(DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=2))
    p, dec, body = W("p", role="prefill"), W("d", in_flight=2), {"input_ids": list(range(300))}
    assert d.decide(body, "k", p, dec).path == "disaggregated"
    d.model.opened("p", 1, 0.01)
    time.sleep(0.05)
    assert d.model.overdue("p", time.monotonic()) >= 5
    assert d.decide(body, "k", p, dec).path == "decode_only"
    d.model.closed("p", 1)
    assert d.model.overdue("p", time.monotonic()) == 1.0
    assert d.decide(body, "k", p, dec).path == "disaggregated"


def test_a_tenant_is_not_held_late_by_another_tenants_prefills():
    """Another tenant's prefill runs late where the node's fair order put this tenant's prompts
    first: it says nothing of how long this tenant's prompt will take there."""
    d = Disaggregation(DisaggConfig(min_prompt_tokens=0, decode_prefix_fraction=2))
    p, dec, body = W("p", role="prefill"), W("d", in_flight=2), {"input_ids": list(range(300))}
    d.model.opened("p", 1, 0.01, "A")
    time.sleep(0.05)
    now = time.monotonic()
    assert d.model.overdue("p", now, "A") >= 5 and d.model.overdue("p", now) >= 5
    assert d.model.overdue("p", now, "B") == 1.0
    assert d.decide(body, "k", p, dec, tenant="A").path == "decode_only"
    assert d.decide(body, "k", p, dec, tenant="B").path == "disaggregated"


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_count_as_goodput_by_their_slowest_choice(stream):
    """With n > 1, one request is one unit of goodput: counted when choice 0's first token and
    every choice's gaps (streamed), or the whole answer by its longest choice, met the SLO."""
    import openai

    node_kw = {"token_delay_s": 0.05, "natural_tokens": 6}
    for slo_ms, counted in ((5000, 1), (10, 0)):  # each token takes 50 ms
        slo = SloConfig(ttft_ms=slo_ms, itl_ms=slo_ms)
        with Cluster(prefill=0, decode=0, colocated=1, node_kw=node_kw, slo=slo) as c:
            client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", timeout=10, max_retries=0)
            chat = {"model": "stub-model", "messages": [{"role": "user", "content": "a b c d"}]}
            out = client.chat.completions.create(**chat, max_tokens=5, n=3, stream=stream)
            texts = ["", "", ""]
            for chunk in out if stream else ():
                for ch in chunk.choices:
                    texts[ch.index] += ch.delta.content or ""
            if not stream:
                texts = [ch.message.content for ch in out.choices]
            assert all(texts), texts
            assert slo_rejections(c)["pdserve_router_goodput_requests_total"] == counted, slo_ms


def test_the_decode_step_fit_learns_only_streams_the_node_prefilled_nothing_beside():
    """Measured (bench/results/elastic_phases.md, 2026-12-07): under a routing that prefills on
    decode nodes, their streams' steps carried those prefills (ITL p50 97-136 ms against a 17 ms
    step alone), and the elastic controller, reading them as decode load, moved the last prefill
    node to decode. The felt step keeps every stream (the ITL SLO admits by it); the decode-only
    fit keeps a stream only if the node had no prompt of its own queued at its first token, its
    own aside, and none joined before its end."""
    from types import SimpleNamespace

    from pdserve.router.routing.attempt import Route
    from pdserve.router.routing.timing import Timing

    model = LatencyModel(DisaggConfig())
    d = SimpleNamespace(disagg=SimpleNamespace(model=model))
    decode = Worker(url="http://d", role="decode", breaker=CircuitBreaker(BreakerConfig()))
    prefill = Worker(url="http://p", role="prefill", breaker=CircuitBreaker(BreakerConfig()))

    def stream(route: Route, gap: float, local_prefill_meanwhile: bool) -> None:
        t = Timing()
        charged = route.prefill or route.decode
        charged.queue("", route.prompt_tokens, 1)  # as Attempt.start charges it
        t.sent(route, "")
        t.first_token(d, route)
        charged.queue("", -route.prompt_tokens, -1)  # its prefill ended
        if local_prefill_meanwhile:
            decode.queue("", 200, 1)  # another request prefills on the decode node
            decode.queue("", -200, -1)
        t.t_first -= 10 * gap  # ten tokens, `gap` apart
        for _ in range(10):
            t.token()
        t.ended(d, route)

    local = Route(None, decode, prompt_tokens=50, path="decode_only")
    pair = Route(prefill, decode, prompt_tokens=400, path="disaggregated")
    for _ in range(20):
        stream(pair, 0.02, local_prefill_meanwhile=False)
        stream(local, 0.02, local_prefill_meanwhile=False)  # its own prefill: before its tokens
        stream(pair, 0.12, local_prefill_meanwhile=True)
    assert model.decode_step_fit("http://d").predict(0) == pytest.approx(0.02, rel=0.1)
    assert model.step_fit("http://d").predict(0) > 0.04  # the felt step: the slow ones too
    decode.queue("", 300, 1)  # a prompt queued on the node at the next stream's first token
    stream(pair, 0.5, local_prefill_meanwhile=False)
    assert model.decode_step_fit("http://d").predict(0) == pytest.approx(0.02, rel=0.1)
    decode.queue("", -300, -1)
    # a stream prefilled on the decode node itself: its own prompt, still charged at its first
    # token, is no prefill beside it (the fit leaves its 20 ms prior for the measured 60 ms)
    model = LatencyModel(DisaggConfig())
    d.disagg.model = model
    for _ in range(20):
        stream(local, 0.06, local_prefill_meanwhile=False)
    assert model.decode_step_fit("http://d").predict(0) == pytest.approx(0.06, rel=0.1)
