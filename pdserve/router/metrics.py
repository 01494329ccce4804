"""Router metrics, in a CollectorRegistry owned by one app (several apps may share a process).

The series a dashboard reads exist from the first scrape: the generation routes' request counters
(status 200) and durations, the router's TTFT, and every circuit state of each worker (1 for the
state it is in, 0 for the others).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pdserve.infra.build import build_info
from pdserve.router.routing.disagg import DECODE_ONLY_REASONS, DISAGGREGATED_REASONS

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


ROUTE_DECISIONS = tuple(("disaggregated", r) for r in DISAGGREGATED_REASONS) + tuple(
    ("decode_only", r) for r in DECODE_ONLY_REASONS
)
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
# why a stream moved, and how (router/routing/migration.py): every pair exists at 0 from the start
MIGRATION_CAUSES = (
    "connection",
    "stream_cut",
    "node_unhealthy",
    "idle_timeout",
    "node_failure",
    "node_draining",
    "kv_transfer_failed",
    "bootstrap_failed",
)
MIGRATION_OUTCOMES = ("resumed", "failed", "refused")
CIRCUIT_STATES = (
    "closed",
    "open",
    "half_open",
)  # router/routing/circuit.py CircuitState, lower case


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._request_metrics()
        self._worker_gauges()
        self._refusal_counters()
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time to the first streamed token",
            ["role"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        info = build_info()
        Gauge(
            "pdserve_build_info", "1; the pdserve build", list(info), registry=self.registry
        ).labels(**info).set(1)
        for route in GENERATION_ROUTES:
            self.requests.labels(route=route, status="200")
            self.duration.labels(route=route)
        self.ttft.labels(role="router")
        self._elastic_metrics()

    def _elastic_metrics(self) -> None:
        """The elastic controller's moves and its per-role node estimate (routing/elastic.py);
        every series exists from the start (0 while the controller is off)."""
        self.role_flips = Counter(
            "pdserve_router_role_flips",
            "Elastic nodes the controller moved to another role, by the role, the load that asked "
            "for it (prefill_short, decode_short, prefill_busy, decode_busy) and the outcome "
            "(done, failed)",
            ["to", "reason", "outcome"],
            registry=self.registry,
        )
        for to in ("prefill", "decode"):
            for why in ("short", "busy"):
                for outcome in ("done", "failed"):
                    self.role_flips.labels(to=to, reason=f"{to}_{why}", outcome=outcome)
        self.role_replicas_needed = Gauge(
            "pdserve_router_role_replicas_needed",
            "Nodes each role needs for the elastic targets (TTFT for prefill, ITL for decode): "
            "its node count scaled by its predicted latency over its target, counted by the "
            "role each node was started in (an elastic node serving the other role counts "
            "for its own), summed over the models; for autoscalers (0 while the controller "
            "is off)",
            ["role"],
            registry=self.registry,
        )
        for role in ("prefill", "decode"):
            self.role_replicas_needed.labels(role=role)

    def _request_metrics(self) -> None:
        """Requests answered, their duration, and the route each attempt took."""
        r = self.registry
        self.requests = Counter(
            "pdserve_router_requests_total",
            "Requests answered by the router",
            ["route", "status"],
            registry=r,
        )
        self.duration = Histogram(
            "pdserve_router_request_duration_seconds",
            "Time from request arrival to the last byte sent",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.route_decisions = Counter(
            "pdserve_router_route_decisions_total",
            "Routes chosen per attempt: disaggregated (a prefill and a decode node) or decode_only "
            "(the decode node prefills: no prefill node could serve, this request's prefill leg "
            "failed, or conditional disaggregation chose it: short_prompt, decode_prefix_hit, "
            "prefill_queue)",
            ["path", "reason"],
            registry=r,
        )
        for path, reason in ROUTE_DECISIONS:  # every label set exists at 0 from the start
            self.route_decisions.labels(path=path, reason=reason)

    def _worker_gauges(self) -> None:
        """Each worker's health and circuit breaker state."""
        self.worker_healthy = Gauge(
            "pdserve_router_worker_healthy",
            "1 when the worker passes its health checks",
            ["worker", "role"],
            registry=self.registry,
        )
        self.circuit_state = Gauge(
            "pdserve_router_circuit_state",
            "1 for the circuit breaker state the worker is in (closed, open, half_open), else 0",
            ["worker", "state"],
            registry=self.registry,
        )
        self.pair_state = Gauge(
            "pdserve_router_pair_circuit_state",
            "1 for the breaker state a (prefill, decode) pair is in (closed, open, half_open), "
            "else 0: open while the router does not pair the two nodes",
            ["prefill", "decode", "state"],
            registry=self.registry,
        )
        self.pair_failures = Counter(
            "pdserve_router_pair_failures_total",
            "Disaggregated attempts that failed on a (prefill, decode) pair",
            ["prefill", "decode"],
            registry=self.registry,
        )

    def _refusal_counters(self) -> None:
        """Attempts retried on a new pair, requests refused by admission control."""
        self.retries = Counter(
            "pdserve_router_retries_total",
            "Attempts retried on a new prefill/decode pair",
            registry=self.registry,
        )
        self.rejected = Counter(
            "pdserve_router_rejected_total",
            "Requests refused with 429 by admission control",
            registry=self.registry,
        )
        self._migration_metrics()
        self._slo_metrics()

    def _slo_metrics(self) -> None:
        """The latency model's errors, SLO refusals and goodput (router/slo.py)."""
        self.prediction_ratio = Histogram(
            "pdserve_router_ttft_prediction_ratio",
            "Predicted over measured time from dispatch to first token, per route path "
            "(router/routing/latency_model.py)",
            ["path"],
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
            registry=self.registry,
        )
        for path in ("disaggregated", "decode_only", "colocated"):
            self.prediction_ratio.labels(path=path)
        self.slo_rejections = Counter(
            "pdserve_router_slo_rejections_total",
            "Requests refused with 429 slo_unattainable: predicted to miss --ttft-slo-ms or "
            "--itl-slo-ms",
            ["slo"],
            registry=self.registry,
        )
        for slo in ("ttft", "itl"):
            self.slo_rejections.labels(slo=slo)
        self.goodput = Counter(
            "pdserve_router_goodput_requests_total",
            "Generation requests answered in full that met every SLO set (--ttft-slo-ms, "
            "--itl-slo-ms; with none set, every one answered in full)",
            registry=self.registry,
        )

    def _migration_metrics(self) -> None:
        """Streams moved to another decode node mid-stream (router/routing/migration.py)."""
        self.migrations = Counter(
            "pdserve_router_migrations_total",
            "Streams whose decode node failed mid-stream, by cause, and whether the stream went on "
            "(resumed), no decode node took it (failed) or it could not move (refused)",
            ["cause", "outcome"],
            registry=self.registry,
        )
        for cause in MIGRATION_CAUSES:
            for outcome in MIGRATION_OUTCOMES:
                self.migrations.labels(cause=cause, outcome=outcome)
        self.migrated_tokens = Counter(
            "pdserve_router_migrated_tokens_total",
            "Tokens a migrated stream's new decode node prefilled again after the prompt",
            registry=self.registry,
        )
        self.migration_stall = Histogram(
            "pdserve_router_migration_stall_seconds",
            "The gap a client saw in a migrated stream: its last event before the break to the "
            "new node's first",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def migration(self, cause: str, outcome: str, tokens: int = 0) -> None:
        self.migrations.labels(cause=cause, outcome=outcome).inc()
        self.migrated_tokens.inc(tokens)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.duration.labels(route=route).observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(role="router").observe(seconds)

    def route_decision(self, path: str, reason: str) -> None:
        self.route_decisions.labels(path=path, reason=reason).inc()

    def set_worker(self, url: str, role: str, healthy: bool, circuit: str) -> None:
        """`circuit`: the breaker's state, one of CIRCUIT_STATES."""
        self.worker_healthy.labels(worker=url, role=role).set(1 if healthy else 0)
        for state in CIRCUIT_STATES:
            self.circuit_state.labels(worker=url, state=state).set(1 if state == circuit else 0)

    def set_pair(self, prefill: str, decode: str, circuit: str) -> None:
        for state in CIRCUIT_STATES:
            self.pair_state.labels(prefill=prefill, decode=decode, state=state).set(
                1 if state == circuit else 0
            )

    def forget_pair(self, prefill: str, decode: str) -> None:
        for state in CIRCUIT_STATES:
            try:
                self.pair_state.remove(prefill, decode, state)
            except KeyError:
                pass
        try:
            self.pair_failures.remove(prefill, decode)
        except KeyError:
            pass

    def forget_worker(self, url: str, role: str) -> None:
        series = [(self.worker_healthy, (url, role))]
        series += [(self.circuit_state, (url, state)) for state in CIRCUIT_STATES]
        for gauge, labels in series:
            try:
                gauge.remove(*labels)
            except KeyError:
                pass  # never reported

    def render(self) -> bytes:
        return generate_latest(self.registry)
