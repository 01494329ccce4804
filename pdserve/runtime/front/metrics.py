"""Prometheus metrics of a node front: request latencies observed here, pool and queues per rank.

Every rank pushes its stats to the front (runtime/rank/front_link.py StatsReporter), so one scrape
of the front covers every rank of the node. Each app gets its own CollectorRegistry.

Every series a dashboard reads exists from the first scrape after the ranks reported (docs/
METRICS.md): labelled counters are created at 0 for every label value known in advance (finish
and abort reasons, the control channels' drop reasons, and those an extension names), and the
histograms for every sample name a rank declares (`SlotLoop.sample_names`).

A kind of node adds its own metrics through one `MetricsExtension` that its front class names
(the PD nodes: pd_common/metrics.py); this module knows no node kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.infra.build import build_info
from pdserve.runtime.messages import RankStats
from pdserve.runtime.reasons import ABORT_REASONS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# one gap between two tokens: finer at the low end (a zero gap lands in the first bucket)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
FRONT_CHANNELS = {"events": "front-evt", "stats": "front-stats"}  # NodeFront.dropped's key prefixes
SEAL_DROPS = ("unauthenticated", "replayed", "malformed")  # any sealed channel (infra/channel_auth)
FRONT_DROPS = {"front-evt": SEAL_DROPS + ("bad_event",), "front-stats": SEAL_DROPS}


class _RankCollector:
    def __init__(self, metrics: NodeMetrics):
        self.metrics, self.front, self.ext = metrics, None, metrics.ext

    @property
    def node(self) -> str:
        return self.metrics.node

    @property
    def role(self) -> str:
        return self.metrics.role

    def collect(self):
        fam = _families() | self.ext.families()
        front = self.front
        stats = front.rank_stats if front is not None else {}
        follower_stats = front.follower_stats if front is not None else {}
        dropped = {(ch, r): 0 for ch, reasons in FRONT_DROPS.items() for r in reasons}
        for key, n in getattr(front, "dropped", {}).items():  # the front's readers
            channel, _, reason = key.partition(":")
            dropped[FRONT_CHANNELS.get(channel, channel), reason] = n
        for (channel, reason), n in sorted(dropped.items()):
            fam["dropped"].add_metric([self.node, self.role, "", channel, reason], n)
        for r in range(front.pp_size if front is not None else 0):
            st = stats.get(r)
            lv = [self.node, self.role, str(r)]
            fam["up"].add_metric(lv, 1.0 if st else 0.0)
            if st:
                _add_rank(fam, lv, st)
                followers = [f for (pp, _), f in sorted(follower_stats.items()) if pp == r]
                self.ext.add_rank(fam, lv, st, followers)
        if front is not None:
            dtype = next((st.dtype for st in stats.values() if st.dtype), "")
            fam["model"].add_metric([self.node, self.role, front.model_name, dtype], 1.0)
        yield from fam.values()


RANK_LABELS = ["node", "role", "pp_rank"]


def rank_gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
    """A per-rank family, built anew at each scrape from the ranks' last stats."""
    return GaugeMetricFamily(name, doc, labels=RANK_LABELS + list(extra))


def rank_counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=RANK_LABELS + list(extra))


def _families() -> dict[str, Any]:
    return {
        "used": rank_gauge("pdserve_kv_pool_used_tokens", "KV tokens held by live requests"),
        "cap": rank_gauge("pdserve_kv_pool_capacity_tokens", "KV pool capacity in tokens"),
        "s_used": rank_gauge(
            "pdserve_kv_sliding_pool_used_tokens",
            "a windowed pool's sliding-layer tokens in use (requests' windows, the prefix cache)",
        ),
        "s_cap": rank_gauge(
            "pdserve_kv_sliding_pool_capacity_tokens", "a windowed pool's sliding-layer capacity"
        ),
        "evict": rank_gauge(
            "pdserve_kv_cache_evictable_tokens", "prefix-cache tokens that can be evicted"
        ),
        "hits": rank_counter(
            "pdserve_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache"
        ),
        "queue": rank_gauge("pdserve_queue_requests", "requests per queue", ("queue",)),
        "up": rank_gauge("pdserve_rank_up", "1 while the rank reports stats"),
        "dropped": rank_counter(
            "pdserve_control_messages_dropped",
            "ZMQ control messages dropped (unauthenticated, replayed, malformed, ...)",
            ("channel", "reason"),
        ),
        "model": GaugeMetricFamily(
            "pdserve_model_info",
            "1; the model this node serves and the dtype its ranks compute in",
            labels=["node", "role", "model", "dtype"],
        ),
    }


def _add_rank(fam: dict[str, Any], lv: list[str], st: RankStats) -> None:
    ps = st.page_size
    fam["used"].add_metric(lv, st.held_pages * ps)
    fam["cap"].add_metric(lv, st.num_pages * ps)
    # --windowed-kv's sliding pool; 0 without it (every series exists from the start)
    fam["s_used"].add_metric(lv, (st.sliding_pages - st.sliding_free_pages) * ps)
    fam["s_cap"].add_metric(lv, st.sliding_pages * ps)
    fam["evict"].add_metric(lv, st.cached_pages * ps)
    fam["hits"].add_metric(lv, st.prefix_hit_tokens)
    for q, n in sorted(st.queues.items()):  # the loop's queues: a PD loop adds its own
        fam["queue"].add_metric(lv + [q], n)
    if st.pp_rank == 0:  # only PP0 reads the front's requests
        for reason, n in sorted((dict.fromkeys(SEAL_DROPS, 0) | st.front_dropped).items()):
            fam["dropped"].add_metric(lv + ["front-req", reason], n)


class MetricsExtension:
    """What a kind of node adds to the metrics of its front (`NodeFront.metrics_extension`): this
    base adds nothing. A subclass registers its own metrics in `metrics.registry` when built (the
    series known in advance at 0), adds per-rank families to each scrape (`families`, filled by
    `add_rank` from each rank's stats), and observes what the ranks forward (`ingest`)."""

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def families(self) -> dict[str, Any]:
        return {}

    def add_rank(
        self, fam: dict[str, Any], lv: list[str], st: RankStats, followers: list[RankStats]
    ) -> None:
        """`st` a stage's lead's stats, `followers` its TP followers' (their `ext` only)."""

    def ingest(self, st: RankStats) -> None:
        pass


class NodeMetrics:
    """A node front's metrics. Every series carries the node's `role` label: the role it serves
    when a sample is taken. That is fixed, except on an elastic node, whose `role_now` follows its
    flips (a request's samples go to the role that served it); its series exist in every role of
    `roles` from the first scrape."""

    def __init__(
        self,
        node: str,
        role: str,
        finish_reasons: tuple[str, ...] = (),
        extension: type[MetricsExtension] = MetricsExtension,
        role_now: Callable[[], str] | None = None,
        roles: tuple[str, ...] = (),
    ):
        self.registry = CollectorRegistry()
        self.node, self._role, self._role_now = node, role, role_now
        lab = ["node", "role"]
        info = build_info()
        Gauge(
            "pdserve_build_info", "1; the pdserve build", list(info), registry=self.registry
        ).labels(**info).set(1)
        self._request_latencies(lab)
        self._request_counters(lab)
        self._stage_latencies(lab)
        self.series_roles = tuple(dict.fromkeys((role, *roles)))
        for r in self.series_roles:
            self._create_series(r, finish_reasons)
        self.ext = extension(self)
        self._ranks = _RankCollector(self)
        self.registry.register(self._ranks)

    @property
    def role(self) -> str:
        """The `role` label now (module docstring of the class)."""
        return self._role_now() if self._role_now is not None else self._role

    def hist(self, name: str, doc: str, labels: list[str], buckets=LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def counter(self, name: str, doc: str, labels: list[str]) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _request_latencies(self, lab: list[str]) -> None:
        """Per request, seen by the front: TTFT, ITL, TPOT, end to end."""
        self.ttft = self.hist("pdserve_time_to_first_token_seconds", "time to first token", lab)
        self.itl = self.hist(
            "pdserve_inter_token_latency_seconds",
            "time between two consecutive output tokens (one sample per token after the first)",
            lab,
            ITL_BUCKETS,
        )
        self.tpot = self.hist(
            "pdserve_request_time_per_output_token_seconds",
            "per request: (last token - first token) / (output tokens - 1)",
            lab,
            ITL_BUCKETS,
        )
        self.e2e = self.hist("pdserve_e2e_request_latency_seconds", "request latency", lab)

    def _request_counters(self, lab: list[str]) -> None:
        """Finished and aborted requests, prompt and generated tokens."""
        self.requests = self.counter(
            "pdserve_requests", "finished requests", lab + ["finish_reason"]
        )
        self.prompt_tokens = self.counter("pdserve_prompt_tokens", "prompt tokens", lab)
        self.gen_tokens = self.counter("pdserve_generation_tokens", "generated tokens", lab)
        self.aborted = self.counter(
            "pdserve_requests_aborted", "aborted requests", lab + ["reason"]
        )

    def _stage_latencies(self, lab: list[str]) -> None:
        """Samples the ranks forward (`ingest`): queues and votes."""
        self.queue_time = self.hist(
            "pdserve_queue_time_seconds", "time a request spent in a queue", lab + ["queue"]
        )
        self.consensus = self.hist(
            "pdserve_consensus_round_seconds", "vote cast to verdict applied (PP0)", lab + ["kind"]
        )

    def _create_series(self, role: str, finish_reasons: tuple[str, ...]) -> None:
        """The series known in advance, at 0 from the first scrape."""
        lv = (self.node, role)
        for m in (self.ttft, self.itl, self.tpot, self.e2e, self.prompt_tokens, self.gen_tokens):
            m.labels(*lv)
        for finish in finish_reasons:
            self.requests.labels(*lv, finish)
        for reason in sorted(ABORT_REASONS):
            self.aborted.labels(*lv, reason)

    def ingest(self, st: RankStats) -> None:
        """Latency samples a rank forwarded with its stats; a name with no sample still makes
        its series (at 0). The names this module does not know are the extension's."""
        lv = (self.node, self.role)
        for name, values in st.samples.items():
            kind, _, label = name.partition(":")
            if kind == "queue":
                h = self.queue_time.labels(*lv, label)
            elif kind == "consensus":
                h = self.consensus.labels(*lv, label)
            else:
                continue
            for v in values:
                h.observe(v)
        self.ext.ingest(st)

    def observe_chunk(self, p: Any, prev: float | None, n_tokens: int) -> None:
        """Inter-token latency of a chunk of `n_tokens` made at `p.t_last` (the previous one at
        `prev`; None: this is the first). Tokens that arrived together are coalesced into one chunk:
        its first token's gap is the time since the previous chunk, each further token's gap is 0,
        so every token after the first is one sample and the samples add up to the request's
        (last - first token) time: the histogram's mean is the token-weighted time per token."""
        h = self.itl.labels(self.node, self.role)
        if prev is not None:
            h.observe(p.t_last - prev)
        for _ in range(n_tokens - 1):
            h.observe(0.0)

    def observe_request(self, p: Any, finish: str, reason: str | None = None) -> None:
        lv = (self.node, self.role)
        now = time.monotonic()
        self.requests.labels(*lv, finish).inc()
        self.prompt_tokens.labels(*lv).inc(p.prompt_tokens)
        made = len(p.token_ids) - p.resumed  # a migrated stream's earlier tokens: another node's
        self.gen_tokens.labels(*lv).inc(made)
        self.e2e.labels(*lv).observe(now - p.t_start)
        if p.t_first is not None:
            self.ttft.labels(*lv).observe(p.t_first - p.t_start)
            if made > 1 and p.t_last is not None:
                self.tpot.labels(*lv).observe((p.t_last - p.t_first) / (made - 1))
        if finish == "abort":
            self.aborted.labels(*lv, reason if reason in ABORT_REASONS else "client_abort").inc()

    def render(self, front) -> tuple[bytes, str]:
        self._ranks.front = front
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
