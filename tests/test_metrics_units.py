"""Node and router metrics without a cluster (docs/METRICS.md): every known label set exists at 0
before the first event, inter-token latency is one sample per token gap, aborts and failures are
counted by a code from a fixed set, and the circuit breaker is one 0/1 series per state."""

from __future__ import annotations

import asyncio
import re
import types
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.decode_node.front import DecodeFront
from pdserve.kv_transfer.stats import (
    DROP_REASONS,
    FAILURE_REASONS,
    RECEIVER_FAILURES,
    SENDER_FAILURES,
)
from pdserve.pd_common.messages import KVRankStats
from pdserve.prefill_node.front import PrefillFront
from pdserve.router.metrics import CIRCUIT_STATES, GENERATION_ROUTES, RouterMetrics
from pdserve.runtime.front.answer import Pending
from pdserve.runtime.front.metrics import MetricsExtension, NodeMetrics
from pdserve.runtime.front.process import NodeFront
from pdserve.runtime.messages import ErrorEvent, FinishEvent, RankStats, TokenEvent
from pdserve.runtime.reasons import ABORT_REASONS, AbortReason

ROOT = Path(__file__).resolve().parents[1]


def samples(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(got: dict, name: str, **labels) -> float | None:
    """The sample `name` whose labels include `labels` (None: there is none)."""
    want = set(labels.items())
    hits = [v for (n, lab), v in got.items() if n == name and want <= lab]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def rank_stats(rank: int, samples_: dict, kv: KVRankStats | None = None) -> RankStats:
    return RankStats(
        rank, 100 + rank, 5, 3, 0, 0, 64, 64, 4, 0, 0, 0, 0, {"running": 0}, samples_, {}, kv, "f32"
    )


def kv_stats(**kw) -> KVRankStats:
    return KVRankStats(kw.get("bytes", 0), kw.get("failures", {}), [], {}, 5555)


def test_a_fresh_decode_node_shows_every_known_label_at_zero():
    m = NodeMetrics("n:1", "decode", DecodeFront.finish_reasons, DecodeFront.metrics_extension)
    front = types.SimpleNamespace(
        pp_size=2, dropped={}, model_name="tiny", rank_stats={}, follower_stats={}
    )
    names = {"queue:prealloc": [], "kv_alloc_wait": [], "consensus:decode_votes": []}
    for r in (0, 1):
        front.rank_stats[r] = rank_stats(r, names, kv_stats(failures={"peer_dead": 2}))
        m.ingest(front.rank_stats[r])
    got = samples(m.render(front)[0])
    for finish in ("stop", "length", "abort"):
        assert value(got, "pdserve_requests_total", finish_reason=finish) == 0
    for reason in ABORT_REASONS:
        assert value(got, "pdserve_requests_aborted_total", reason=reason) == 0, reason
    for r in ("0", "1"):
        for reason in RECEIVER_FAILURES:
            want = 2 if reason == "peer_dead" else 0
            assert (
                value(got, "pdserve_kv_transfer_failures_total", pp_rank=r, reason=reason) == want
            )
        for reason in DROP_REASONS:
            assert (
                value(
                    got,
                    "pdserve_control_messages_dropped_total",
                    pp_rank=r,
                    channel="kv-control",
                    reason=reason,
                )
                == 0
            ), reason
    drops = "pdserve_control_messages_dropped_total"
    assert value(got, drops, pp_rank="", channel="front-evt", reason="bad_event") == 0
    assert value(got, drops, pp_rank="", channel="front-stats", reason="replayed") == 0
    assert value(got, drops, pp_rank="0", channel="front-req", reason="unauthenticated") == 0
    assert value(got, drops, pp_rank="1", channel="front-req", reason="unauthenticated") is None
    for hist, labels in [
        ("pdserve_time_to_first_token_seconds", {}),
        ("pdserve_inter_token_latency_seconds", {}),
        ("pdserve_request_time_per_output_token_seconds", {}),
        ("pdserve_e2e_request_latency_seconds", {}),
        ("pdserve_queue_time_seconds", {"queue": "prealloc"}),
        ("pdserve_kv_alloc_wait_seconds", {}),
        ("pdserve_consensus_round_seconds", {"kind": "decode_votes"}),
        ("pdserve_kv_transfer_seconds", {"pp_rank": "1"}),
        ("pdserve_kv_transfer_request_bytes", {"pp_rank": "0"}),
    ]:
        assert value(got, hist + "_count", node="n:1", role="decode", **labels) == 0, hist
    assert value(got, "pdserve_model_info", model="tiny", dtype="f32", role="decode") == 1
    assert value(got, "pdserve_build_info") == 1


def test_pd_fronts_name_their_own_label_sets():
    assert PrefillFront.finish_reasons == ("prefill_done", "abort")
    assert DecodeFront.finish_reasons == NodeFront.finish_reasons == ("stop", "length", "abort")
    assert PrefillFront.metrics_extension.failure_reasons == SENDER_FAILURES
    assert DecodeFront.metrics_extension.failure_reasons == RECEIVER_FAILURES
    assert NodeFront.metrics_extension is MetricsExtension  # a colocated node adds nothing


def test_inter_token_latency_is_one_sample_per_token_gap():
    """Tokens 1 | 2 3 4 | 5 leave in three chunks at t = 10.0, 10.5, 10.6: the gaps are 0.5, 0, 0
    and 0.1 (four samples for five tokens) and add up to last - first token, so the histogram's
    mean is the per-request mean (TPOT)."""
    m = NodeMetrics("n:1", "decode")
    p = types.SimpleNamespace(
        t_start=9.0, t_first=10.0, t_last=None, prompt_tokens=3, token_ids=[], resumed=0
    )
    for t, n in ((10.0, 1), (10.5, 3), (10.6, 1)):
        prev, p.t_last = p.t_last, t
        p.token_ids += [7] * n
        m.observe_chunk(p, prev, n)
    got = samples(m.render(None)[0])
    itl = "pdserve_inter_token_latency_seconds"
    assert value(got, itl + "_count") == 4
    assert abs(value(got, itl + "_sum") - 0.6) < 1e-9
    assert value(got, itl + "_bucket", le="0.001") == 2  # the two zero gaps
    m.observe_request(p, "length")
    got = samples(m.render(None)[0])
    tpot = "pdserve_request_time_per_output_token_seconds"
    assert value(got, tpot + "_count") == 1
    assert abs(value(got, tpot + "_sum") - 0.6 / 4) < 1e-9


class _Detok:
    def add(self, toks):
        return "x" * len(toks)

    def finish(self, matched=None):
        return ""


def test_the_front_counts_aborts_by_the_events_reason_and_a_disconnect_as_its_own():
    async def main():
        front = NodeFront(
            None, model_name="m", role="decode", pp_size=1, max_context=64, vocab_size=8
        )
        front.metrics = NodeMetrics("n:1", "decode", front.finish_reasons)
        sent = []
        front.send = sent.append
        try:

            def pending(rid: str) -> Pending:
                from pdserve.engine.core import SamplingParams

                p = Pending(rid, 3, SamplingParams(), _Detok())
                front.pending[rid] = p
                return p

            p = pending("a")  # failed on the ranks: the event's code is the label
            p.events.put_nowait(TokenEvent("a", 5, None, None))
            p.events.put_nowait(
                ErrorEvent("a", "KV transfer failed: x", None, "kv_transfer_failed")
            )
            chunks = [c async for c in front.events(p)]
            assert chunks[-1]["error"]["message"] == "KV transfer failed: x"
            p = pending("b")  # aborted through /abort, then finished by the ranks
            assert front.abort("b")
            p.events.put_nowait(
                FinishEvent(
                    "b", "abort", "aborted by the client", None, 3, 0, 0, AbortReason.CLIENT_ABORT
                )
            )
            [c async for c in front.events(p)]
            p = pending("c")  # the reader goes away after one chunk
            p.events.put_nowait(TokenEvent("c", 5, None, None))
            gen = front.events(p)
            await gen.__anext__()
            await gen.aclose()
        finally:
            await front.close()
        return sent, samples(front.metrics.render(None)[0])

    sent, got = asyncio.run(main())
    assert [(m.rid, m.reason) for m in sent] == [("b", "client_abort"), ("c", "client_disconnect")]
    aborted = "pdserve_requests_aborted_total"
    assert value(got, aborted, reason="kv_transfer_failed") == 1
    assert value(got, aborted, reason="client_abort") == 1
    assert value(got, aborted, reason="client_disconnect") == 1
    assert value(got, "pdserve_requests_total", finish_reason="abort") == 3


def test_router_circuit_state_is_one_series_per_state_and_routes_exist_at_zero():
    m = RouterMetrics()
    got = samples(m.render())
    for route in GENERATION_ROUTES:
        assert value(got, "pdserve_router_requests_total", route=route, status="200") == 0
        assert value(got, "pdserve_router_request_duration_seconds_count", route=route) == 0
    assert value(got, "pdserve_time_to_first_token_seconds_count", role="router") == 0
    assert value(got, "pdserve_build_info") == 1
    m.set_worker("http://d", "decode", True, "half_open")
    got = samples(m.render())
    states = {
        s: value(got, "pdserve_router_circuit_state", worker="http://d", state=s)
        for s in CIRCUIT_STATES
    }
    assert states == {"closed": 0, "open": 0, "half_open": 1}
    m.forget_worker("http://d", "decode")
    assert "pdserve_router_circuit_state{" not in m.render().decode()


def test_reason_codes_come_from_fixed_snake_case_sets():
    """Every failure and drop reason kv_transfer/ counts is in its declared set, and every set is
    snake_case: a label value is a code, never free text."""
    for code in (*ABORT_REASONS, *FAILURE_REASONS, *DROP_REASONS):
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", code), code
    calls = re.compile(r"\b(_fail|add_failure|add_dropped|_drop)\(\s*f?\"([^\"]+)\"")
    found: dict[str, set[str]] = {"failure": set(), "drop": set()}
    for path in (ROOT / "pdserve" / "kv_transfer").glob("*.py"):
        for fn, text in calls.findall(path.read_text()):
            kind = "failure" if fn in ("_fail", "add_failure") else "drop"
            found[kind].add(text.partition(":")[0])
    assert found["failure"] and found["failure"] <= set(FAILURE_REASONS), found["failure"]
    assert found["drop"] and found["drop"] <= set(DROP_REASONS), found["drop"]
    for reason in ("foreign_peer", "bad_pages", "bad_aux", "pool_changed"):  # _check_register's
        assert reason in DROP_REASONS


def test_an_elastic_nodes_series_follow_the_role_it_serves():
    """An elastic node's `role` label is the role it serves when a sample is taken (its front's
    `metrics_role`): a request finished as a prefill node counts under prefill, one after the flip
    under decode, and both roles' series exist from the first scrape. Before, every series kept
    the start role's label for the node's life."""
    from pdserve.elastic_node.front import ElasticFront

    serving = ["prefill"]
    m = NodeMetrics(
        "n:1",
        "prefill",
        ElasticFront.finish_reasons,
        ElasticFront.metrics_extension,
        role_now=lambda: serving[0],
        roles=ElasticFront.metrics_roles,
    )
    got = samples(m.render(None)[0])
    for role in ("prefill", "decode"):
        assert value(got, "pdserve_requests_total", role=role, finish_reason="length") == 0
        assert value(got, "pdserve_decode_local_prompt_tokens_total", role=role) is not None
    p = types.SimpleNamespace(
        t_start=9.0, t_first=10.0, t_last=10.0, prompt_tokens=5, token_ids=[7], resumed=0
    )
    m.observe_request(p, "prefill_done")
    serving[0] = "decode"
    m.observe_request(p, "length")
    m.ext.count_local_prompt(5)
    got = samples(m.render(None)[0])
    assert value(got, "pdserve_requests_total", role="prefill", finish_reason="prefill_done") == 1
    assert value(got, "pdserve_requests_total", role="decode", finish_reason="length") == 1
    assert value(got, "pdserve_requests_total", role="prefill", finish_reason="length") == 0
    assert value(got, "pdserve_decode_local_prompt_tokens_total", role="decode") == 5


def test_a_tp_followers_kv_counters_join_its_stage_and_must_be_sealed_as_it():
    """A TP follower's stats (tp_rank > 0) are kept apart from the leads' (health, /server_info
    and the traces read the leads) and only their KV counters count: a stage's bytes are the sum
    over its ranks, its tokens the lead's, its failures per reason the most of any rank's. Stats
    sealed by another sender than the rank they name are refused, a follower's as a lead's and
    the other way round."""
    from dataclasses import replace

    from pdserve.infra.channel_auth import Opener, Sealer
    from pdserve.runtime.front.process import STATS_CHANNEL
    from pdserve.runtime.front.rank_reports import RankReports
    from pdserve.runtime.messages import pack

    front = types.SimpleNamespace(
        pp_size=1, rank_stats={}, follower_stats={}, rank_seen={}, metrics=None,
        tracing=types.SimpleNamespace(ending=False), dropped={}, model_name="tiny",
        _stats_opener=Opener(STATS_CHANNEL, secret="s"),
    )  # fmt: skip

    def push(st: RankStats, sender: str) -> None:
        RankReports._on_stats(front, Sealer(STATS_CHANNEL, sender, secret="s").seal(pack([st])))

    kv = replace(kv_stats(bytes=100, failures={"peer_dead": 1}), tokens=10)
    lead = rank_stats(0, {}, kv)
    theirs = {"peer_dead": 1, "waiting_timeout": 1}  # one room failed at both, one at its end
    follower = replace(lead, tp_rank=1, ext=replace(kv, bytes=60, tokens=10, failures=theirs))
    push(lead, "pp0")
    push(follower, "pp0.tp1")
    assert front.rank_stats == {0: lead} and front.follower_stats == {(0, 1): follower}
    assert list(front.rank_seen) == [0]
    for st, sender in ((follower, "pp0"), (lead, "pp0.tp1"), (replace(follower, tp_rank=2), "x")):
        with pytest.raises(ValueError):
            push(st, sender)
    with pytest.raises(ValueError):  # past MAX_TP: not a RankStats at all
        push(replace(follower, tp_rank=64), "pp0.tp64")

    m = NodeMetrics("n:1", "decode", DecodeFront.finish_reasons, DecodeFront.metrics_extension)
    got = samples(m.render(front)[0])
    assert value(got, "pdserve_kv_transfer_bytes_total", pp_rank="0") == 160
    assert value(got, "pdserve_kv_transfer_tokens_total", pp_rank="0") == 10
    for reason in ("peer_dead", "waiting_timeout"):
        failed = value(got, "pdserve_kv_transfer_failures_total", pp_rank="0", reason=reason)
        assert failed == 1, reason
