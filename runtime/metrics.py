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

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
FRONT_CHANNELS = {"events": "front-evt", "stats": "front-stats"}  # NodeFront.dropped's key prefixes
QUEUES = ("waiting", "running", "bootstrap", "inflight", "prealloc", "transfer", "retracted")


class _RankCollector:
    def __init__(self, node: str, role: str):
        self.node, self.role, self.front = node, role, None

    def collect(self):
        labels = ["node", "role", "pp_rank"]
        used = GaugeMetricFamily(
            "pdserve_kv_pool_used_tokens", "KV tokens held by live requests", labels=labels
        )
        cap = GaugeMetricFamily(
            "pdserve_kv_pool_capacity_tokens", "KV pool capacity in tokens", labels=labels
        )
        evict = GaugeMetricFamily(
            "pdserve_kv_cache_evictable_tokens",
            "prefix-cache tokens that can be evicted",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "pdserve_prefix_cache_hit_tokens",
            "prompt tokens served from the prefix cache",
            labels=labels,
        )
        queue = GaugeMetricFamily(
            "pdserve_queue_requests", "requests per queue", labels=labels + ["queue"]
        )
        up = GaugeMetricFamily("pdserve_rank_up", "1 while the rank reports stats", labels=labels)
        kv_bytes = CounterMetricFamily(
            "pdserve_kv_transfer_bytes",
            "KV bytes sent (prefill) or received (decode)",
            labels=labels,
        )
        kv_fail = CounterMetricFamily(
            "pdserve_kv_transfer_failures",
            "rooms whose KV transfer failed",
            labels=labels + ["reason"],
        )
        dropped = CounterMetricFamily(
            "pdserve_control_messages_dropped",
            "ZMQ control messages dropped (unauthenticated, replayed, malformed, ...)",
            labels=labels + ["channel", "reason"],
        )
        stats = self.front.rank_stats if self.front is not None else {}
        for key, n in sorted(getattr(self.front, "dropped", {}).items()):  # the front's readers
            channel, _, reason = key.partition(":")
            dropped.add_metric(
                [self.node, self.role, "", FRONT_CHANNELS.get(channel, channel), reason], n
            )
        for r in range(self.front.pp_size if self.front is not None else 0):
            st = stats.get(r)
            lv = [self.node, self.role, str(r)]
            up.add_metric(lv, 1.0 if st else 0.0)
            if not st:
                continue
            ps = st["page_size"]
            used.add_metric(lv, st["held_pages"] * ps)
            cap.add_metric(lv, st["num_pages"] * ps)
            evict.add_metric(lv, st["cached_pages"] * ps)
            hits.add_metric(lv, st["prefix_hit_tokens"])
            for q in QUEUES:
                queue.add_metric(lv + [q], st.get(q, 0))
            kv = st.get("kv")
            if kv is not None:
                kv_bytes.add_metric(lv, kv["bytes"])
                for reason, n in sorted(kv["failures"].items()):
                    kv_fail.add_metric(lv + [reason], n)
                for reason, n in sorted((kv.get("dropped") or {}).items()):
                    dropped.add_metric(lv + ["kv-control", reason], n)
            for reason, n in sorted((st.get("front_dropped") or {}).items()):
                dropped.add_metric(lv + ["front-req", reason], n)
        yield from (used, cap, evict, hits, queue, up, kv_bytes, kv_fail, dropped)


class NodeMetrics:
    def __init__(self, node: str, role: str):
        self.registry = CollectorRegistry()
        self.node, self.role = node, role
        lab = ["node", "role"]
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "time to first token",
            lab,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "mean time between output tokens",
            lab,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "request latency",
            lab,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "pdserve_requests", "finished requests", lab + ["finish_reason"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "prompt tokens", lab, registry=self.registry
        )
        self.gen_tokens = Counter(
            "pdserve_generation_tokens", "generated tokens", lab, registry=self.registry
        )
        self.aborted = Counter(
            "pdserve_requests_aborted", "aborted requests", lab + ["reason"], registry=self.registry
        )
        self.queue_time = Histogram(
            "pdserve_queue_time_seconds",
            "time a request spent in a queue",
            lab + ["queue"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.bootstrap = Histogram(
            "pdserve_bootstrap_seconds",
            "prefill: request arrival to bootstrap decision",
            lab,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.kv_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "per-room KV transfer latency",
            lab + ["pp_rank"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.consensus = Histogram(
            "pdserve_consensus_round_seconds",
            "vote cast to verdict applied (PP0)",
            lab + ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._ranks = _RankCollector(node, role)
        self.registry.register(self._ranks)

    def ingest(self, st: dict[str, Any]) -> None:
        """Latency samples a rank forwarded with its stats."""
        lv = (self.node, self.role)
        for name, values in (st.get("samples") or {}).items():
            kind, _, label = name.partition(":")
            for v in values:
                if kind == "queue":
                    self.queue_time.labels(*lv, label).observe(v)
                elif kind == "bootstrap":
                    self.bootstrap.labels(*lv).observe(v)
                elif kind == "consensus":
                    self.consensus.labels(*lv, label).observe(v)
        for v in (st.get("kv") or {}).get("latencies", []):
            self.kv_seconds.labels(*lv, str(st["pp_rank"])).observe(v)

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
