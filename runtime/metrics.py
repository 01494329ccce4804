"""Prometheus metrics of a node front: request latencies observed here, pool and queues per rank.

Every rank pushes its stats to the front (runtime.rank_process.StatsReporter), so one scrape of the
front covers every rank of the node. Each app gets its own CollectorRegistry.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from runtime.messages import RankStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
FRONT_CHANNELS = {"events": "front-evt", "stats": "front-stats"}  # NodeFront.dropped's key prefixes


class _RankCollector:
    def __init__(self, node: str, role: str):
        self.node, self.role, self.front = node, role, None

    def collect(self):
        fam = _families()
        stats = self.front.rank_stats if self.front is not None else {}
        for key, n in sorted(getattr(self.front, "dropped", {}).items()):  # the front's readers
            channel, _, reason = key.partition(":")
            fam["dropped"].add_metric(
                [self.node, self.role, "", FRONT_CHANNELS.get(channel, channel), reason], n
            )
        for r in range(self.front.pp_size if self.front is not None else 0):
            st = stats.get(r)
            lv = [self.node, self.role, str(r)]
            fam["up"].add_metric(lv, 1.0 if st else 0.0)
            if st:
                _add_rank(fam, lv, st)
        yield from fam.values()


def _families() -> dict[str, Any]:
    labels = ["node", "role", "pp_rank"]

    def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=labels + list(extra))

    def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=labels + list(extra))

    return {
        "used": gauge("pdserve_kv_pool_used_tokens", "KV tokens held by live requests"),
        "cap": gauge("pdserve_kv_pool_capacity_tokens", "KV pool capacity in tokens"),
        "evict": gauge(
            "pdserve_kv_cache_evictable_tokens", "prefix-cache tokens that can be evicted"
        ),
        "hits": counter(
            "pdserve_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache"
        ),
        "queue": gauge("pdserve_queue_requests", "requests per queue", ("queue",)),
        "up": gauge("pdserve_rank_up", "1 while the rank reports stats"),
        "kv_bytes": counter(
            "pdserve_kv_transfer_bytes", "KV bytes sent (prefill) or received (decode)"
        ),
        "kv_fail": counter(
            "pdserve_kv_transfer_failures", "rooms whose KV transfer failed", ("reason",)
        ),
        "dropped": counter(
            "pdserve_control_messages_dropped",
            "ZMQ control messages dropped (unauthenticated, replayed, malformed, ...)",
            ("channel", "reason"),
        ),
    }


def _add_rank(fam: dict[str, Any], lv: list[str], st: RankStats) -> None:
    ps = st.page_size
    fam["used"].add_metric(lv, st.held_pages * ps)
    fam["cap"].add_metric(lv, st.num_pages * ps)
    fam["evict"].add_metric(lv, st.cached_pages * ps)
    fam["hits"].add_metric(lv, st.prefix_hit_tokens)
    for q, n in sorted(st.queues.items()):  # the loop's queues: a PD loop adds its own
        fam["queue"].add_metric(lv + [q], n)
    kv = st.kv
    if kv is not None:
        fam["kv_bytes"].add_metric(lv, kv.bytes)
        for reason, n in sorted(kv.failures.items()):
            fam["kv_fail"].add_metric(lv + [reason], n)
        for reason, n in sorted(kv.dropped.items()):
            fam["dropped"].add_metric(lv + ["kv-control", reason], n)
    for reason, n in sorted(st.front_dropped.items()):
        fam["dropped"].add_metric(lv + ["front-req", reason], n)


class NodeMetrics:
    def __init__(self, node: str, role: str):
        self.registry = CollectorRegistry()
        self.node, self.role = node, role
        lab = ["node", "role"]

        def hist(name: str, doc: str, labels: list[str]) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        self.ttft = hist("pdserve_time_to_first_token_seconds", "time to first token", lab)
        self.itl = hist(
            "pdserve_inter_token_latency_seconds", "mean time between output tokens", lab
        )
        self.e2e = hist("pdserve_e2e_request_latency_seconds", "request latency", lab)
        self.requests = counter("pdserve_requests", "finished requests", lab + ["finish_reason"])
        self.prompt_tokens = counter("pdserve_prompt_tokens", "prompt tokens", lab)
        self.gen_tokens = counter("pdserve_generation_tokens", "generated tokens", lab)
        self.aborted = counter("pdserve_requests_aborted", "aborted requests", lab + ["reason"])
        self.queue_time = hist(
            "pdserve_queue_time_seconds", "time a request spent in a queue", lab + ["queue"]
        )
        self.bootstrap = hist(
            "pdserve_bootstrap_seconds", "prefill: request arrival to bootstrap decision", lab
        )
        self.kv_seconds = hist(
            "pdserve_kv_transfer_seconds", "per-room KV transfer latency", lab + ["pp_rank"]
        )
        self.consensus = hist(
            "pdserve_consensus_round_seconds", "vote cast to verdict applied (PP0)", lab + ["kind"]
        )
        self._ranks = _RankCollector(node, role)
        self.registry.register(self._ranks)

    def ingest(self, st: RankStats) -> None:
        """Latency samples a rank forwarded with its stats."""
        lv = (self.node, self.role)
        for name, values in st.samples.items():
            kind, _, label = name.partition(":")
            for v in values:
                if kind == "queue":
                    self.queue_time.labels(*lv, label).observe(v)
                elif kind == "bootstrap":
                    self.bootstrap.labels(*lv).observe(v)
                elif kind == "consensus":
                    self.consensus.labels(*lv, label).observe(v)
        for v in st.kv.latencies if st.kv else []:
            self.kv_seconds.labels(*lv, str(st.pp_rank)).observe(v)

    def observe_request(self, p: Any, finish: str) -> None:
        lv = (self.node, self.role)
        now = time.monotonic()
        self.requests.labels(*lv, finish).inc()
        self.prompt_tokens.labels(*lv).inc(p.prompt_tokens)
        self.gen_tokens.labels(*lv).inc(len(p.token_ids))
        self.e2e.labels(*lv).observe(now - p.t_start)
        if p.t_first is not None:
            self.ttft.labels(*lv).observe(p.t_first - p.t_start)
            if len(p.token_ids) > 1:
                self.itl.labels(*lv).observe((now - p.t_first) / (len(p.token_ids) - 1))
        if finish == "abort":
            self.aborted.labels(*lv, "abort").inc()

    def render(self, front) -> tuple[bytes, str]:
        self._ranks.front = front
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
