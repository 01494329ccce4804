"""Prometheus metrics of a node front: request latencies observed here, pool and queues per rank.

Every rank pushes its stats to the front (runtime.rank_process.StatsReporter), so one scrape of the
front covers every rank of the node. Each app gets its own CollectorRegistry.

Every series a dashboard reads exists from the first scrape after the ranks reported (docs/
METRICS.md): labelled counters are created at 0 for every label value known in advance (finish
and abort reasons, the KV transfer's failure and drop reasons the front names, the control channels'
drop reasons), and the histograms for every sample name a rank declares (`SlotLoop.sample_names`).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from infra.build import build_info
from runtime.messages import RankStats
from runtime.reasons import ABORT_REASONS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# one gap between two tokens: finer at the low end (a zero gap lands in the first bucket)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(12, 36, 2))  # 4 KiB .. 16 GiB, x4
FRONT_CHANNELS = {"events": "front-evt", "stats": "front-stats"}  # NodeFront.dropped's key prefixes
SEAL_DROPS = ("unauthenticated", "replayed", "malformed")  # any sealed channel (infra/channel_auth)
FRONT_DROPS = {"front-evt": SEAL_DROPS + ("bad_event",), "front-stats": SEAL_DROPS}


class _RankCollector:
    def __init__(self, node: str, role: str):
        self.node, self.role, self.front = node, role, None

    def collect(self):
        fam = _families()
        front = self.front
        stats = front.rank_stats if front is not None else {}
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
                _add_rank(fam, lv, st, front)
        if front is not None:
            dtype = next((st.dtype for st in stats.values() if st.dtype), "")
            fam["model"].add_metric([self.node, self.role, front.model_name, dtype], 1.0)
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
        "kv_tokens": counter(
            "pdserve_kv_transfer_tokens",
            "prompt tokens whose KV was sent (prefill) or received (decode)",
        ),
        "kv_skip_tokens": counter(
            "pdserve_kv_transfer_skipped_tokens",
            "prompt tokens not transferred: the decode rank held them in its prefix cache",
        ),
        "kv_skip_bytes": counter(
            "pdserve_kv_transfer_skipped_bytes", "KV bytes of the skipped tokens (not transferred)"
        ),
        "kv_fail": counter(
            "pdserve_kv_transfer_failures", "rooms whose KV transfer failed", ("reason",)
        ),
        "dropped": counter(
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


def _add_rank(fam: dict[str, Any], lv: list[str], st: RankStats, front: Any) -> None:
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
        fam["kv_tokens"].add_metric(lv, kv.tokens)
        fam["kv_skip_tokens"].add_metric(lv, kv.skipped_tokens)
        fam["kv_skip_bytes"].add_metric(lv, kv.skipped_bytes)
        failures = dict.fromkeys(getattr(front, "kv_failure_reasons", ()), 0) | kv.failures
        for reason, n in sorted(failures.items()):
            fam["kv_fail"].add_metric(lv + [reason], n)
        dropped = dict.fromkeys(getattr(front, "kv_drop_reasons", ()), 0) | kv.dropped
        for reason, n in sorted(dropped.items()):
            fam["dropped"].add_metric(lv + ["kv-control", reason], n)
    if st.pp_rank == 0:  # only PP0 reads the front's requests
        for reason, n in sorted((dict.fromkeys(SEAL_DROPS, 0) | st.front_dropped).items()):
            fam["dropped"].add_metric(lv + ["front-req", reason], n)


class NodeMetrics:
    def __init__(self, node: str, role: str, finish_reasons: tuple[str, ...] = ()):
        self.registry = CollectorRegistry()
        self.node, self.role = node, role
        lab = ["node", "role"]
        info = build_info()
        Gauge(
            "pdserve_build_info", "1; the pdserve build", list(info), registry=self.registry
        ).labels(**info).set(1)
        self._request_latencies(lab)
        self._request_counters(lab)
        self._stage_latencies(lab)
        self._create_series(finish_reasons)
        self._ranks = _RankCollector(node, role)
        self.registry.register(self._ranks)

    def _hist(self, name: str, doc: str, labels: list[str], buckets=LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: list[str]) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _request_latencies(self, lab: list[str]) -> None:
        """Per request, seen by the front: TTFT, ITL, TPOT, end to end."""
        self.ttft = self._hist("pdserve_time_to_first_token_seconds", "time to first token", lab)
        self.itl = self._hist(
            "pdserve_inter_token_latency_seconds",
            "time between two consecutive output tokens (one sample per token after the first)",
            lab,
            ITL_BUCKETS,
        )
        self.tpot = self._hist(
            "pdserve_request_time_per_output_token_seconds",
            "per request: (last token - first token) / (output tokens - 1)",
            lab,
            ITL_BUCKETS,
        )
        self.e2e = self._hist("pdserve_e2e_request_latency_seconds", "request latency", lab)

    def _request_counters(self, lab: list[str]) -> None:
        """Finished and aborted requests, prompt and generated tokens."""
        self.requests = self._counter(
            "pdserve_requests", "finished requests", lab + ["finish_reason"]
        )
        self.prompt_tokens = self._counter("pdserve_prompt_tokens", "prompt tokens", lab)
        self.gen_tokens = self._counter("pdserve_generation_tokens", "generated tokens", lab)
        # decode nodes: prompts they prefill themselves (conditional disaggregation, fallback)
        self.local_prompt_tokens = self._counter(
            "pdserve_decode_local_prompt_tokens",
            "decode node: prompt tokens of requests it prefills itself (no prefill node)",
            lab,
        )
        self.aborted = self._counter(
            "pdserve_requests_aborted", "aborted requests", lab + ["reason"]
        )

    def _stage_latencies(self, lab: list[str]) -> None:
        """Samples the ranks forward (`ingest`): queues, bootstrap, KV pages and transfer, votes."""
        self.queue_time = self._hist(
            "pdserve_queue_time_seconds", "time a request spent in a queue", lab + ["queue"]
        )
        self.bootstrap = self._hist(
            "pdserve_bootstrap_seconds", "prefill: request arrival to bootstrap decision", lab
        )
        self.alloc_wait = self._hist(
            "pdserve_kv_alloc_wait_seconds", "decode: request arrival to its KV pages", lab
        )
        self.kv_seconds = self._hist(
            "pdserve_kv_transfer_seconds", "per-room KV transfer latency", lab + ["pp_rank"]
        )
        self.kv_room_bytes = self._hist(
            "pdserve_kv_transfer_request_bytes",
            "KV bytes one request moved on one rank",
            lab + ["pp_rank"],
            BYTES_BUCKETS,
        )
        self.consensus = self._hist(
            "pdserve_consensus_round_seconds", "vote cast to verdict applied (PP0)", lab + ["kind"]
        )

    def _create_series(self, finish_reasons: tuple[str, ...]) -> None:
        """The series known in advance, at 0 from the first scrape."""
        lv = (self.node, self.role)
        for m in (self.ttft, self.itl, self.tpot, self.e2e, self.prompt_tokens, self.gen_tokens):
            m.labels(*lv)
        if self.role == "decode":
            self.local_prompt_tokens.labels(*lv)
        for finish in finish_reasons:
            self.requests.labels(*lv, finish)
        for reason in sorted(ABORT_REASONS):
            self.aborted.labels(*lv, reason)

    def ingest(self, st: RankStats) -> None:
        """Latency samples a rank forwarded with its stats; a name with no sample still makes
        its series (at 0)."""
        lv = (self.node, self.role)
        for name, values in st.samples.items():
            kind, _, label = name.partition(":")
            if kind == "queue":
                h = self.queue_time.labels(*lv, label)
            elif kind == "bootstrap":
                h = self.bootstrap.labels(*lv)
            elif kind == "kv_alloc_wait":
                h = self.alloc_wait.labels(*lv)
            elif kind == "consensus":
                h = self.consensus.labels(*lv, label)
            else:
                continue
            for v in values:
                h.observe(v)
        if st.kv is not None:
            rank = str(st.pp_rank)
            seconds, nbytes = (
                self.kv_seconds.labels(*lv, rank),
                self.kv_room_bytes.labels(*lv, rank),
            )
            for v in st.kv.latencies:
                seconds.observe(v)
            for b in st.kv.room_bytes:
                nbytes.observe(b)

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
        self.gen_tokens.labels(*lv).inc(len(p.token_ids))
        self.e2e.labels(*lv).observe(now - p.t_start)
        if p.t_first is not None:
            self.ttft.labels(*lv).observe(p.t_first - p.t_start)
            if len(p.token_ids) > 1 and p.t_last is not None:
                self.tpot.labels(*lv).observe((p.t_last - p.t_first) / (len(p.token_ids) - 1))
        if finish == "abort":
            self.aborted.labels(*lv, reason if reason in ABORT_REASONS else "client_abort").inc()

    def render(self, front) -> tuple[bytes, str]:
        self._ranks.front = front
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
