"""Router configuration: frozen dataclasses, one per concern, joined in `RouterConfig`.

CLI defaults are read from these classes (see `pdserve.router.cli`), so the numbers live in one
place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class WorkerSpec:
    """One node the router sends to. `bootstrap_port` is only meaningful for prefill nodes; when it
    is None the router learns it from the node's `GET /server_info`."""

    url: str
    role: str
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker role {self.role!r} is not one of {', '.join(ROLES)}")
        parsed = urlparse(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"worker URL {self.url!r} must look like http://HOST:PORT")
        if self.url.endswith("/"):
            raise ValueError(f"worker URL {self.url!r} must not end with '/'")
        if self.bootstrap_port is not None and not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap port {self.bootstrap_port} is not a TCP port")


@dataclass(frozen=True)
class HealthConfig:
    """Background `GET /health` probes. A worker turns unhealthy after `failure_threshold`
    consecutive failed probes and healthy again after `success_threshold` consecutive good ones
    (its very first good probe makes a new worker healthy at once)."""

    interval_s: float = 10.0
    timeout_s: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2


@dataclass(frozen=True)
class BreakerConfig:
    """Per-worker circuit breaker fed by request outcomes: `failure_threshold` consecutive node
    failures open it for `open_s`; then it is half-open and lets one request at a time through;
    `success_threshold` successes close it, any failure opens it again."""

    failure_threshold: int = 10
    success_threshold: int = 3
    open_s: float = 60.0


@dataclass(frozen=True)
class RetryConfig:
    """Retries happen only before the client got its first byte; each uses a new pair and room.
    Backoff before retry k (0-based) is min(max_backoff, initial * multiplier**k) * (1 ± jitter)."""

    max_retries: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 30.0
    multiplier: float = 1.5
    jitter: float = 0.2


@dataclass(frozen=True)
class CacheAwareConfig:
    """cache_aware policy: route to the worker holding the longest prefix of the prompt when at
    least `cache_threshold` of it matches; if the load is imbalanced (max - min > balance_abs and
    max > min * balance_rel) pick the least loaded worker instead."""

    cache_threshold: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5
    max_tree_chars: int = 4_000_000


@dataclass(frozen=True)
class DisaggConfig:
    """Conditional disaggregation (router/routing/disagg.py): when a request that could use a PD
    pair goes to the decode node alone. The defaults are measured on a 2-core CPU
    (docs/ROUTER.md)."""

    min_prompt_tokens: int = 64  # shorter prompts: decode-only (0: never for this reason)
    decode_prefix_fraction: float = 0.8  # held share of the prompt: decode-only (> 1: never)
    # a decode-side prefill token vs a prefill-side one (0: no queue rule); 1.5 measured against
    # other values on the side-by-side workload (docs/ROUTER.md)
    local_prefill_cost: float = 1.5
    # the same while the decode node has no request open (no stream to delay; capped by the local
    # cost; measured: bench/results/pd_router_caches.md); set it to the local cost for the rule
    # as it was
    idle_local_prefill_cost: float = 1.0
    transfer_overhead_tokens: int = 16  # bootstrap + KV transfer, in prefill-token equivalents
    max_tree_chars: int = 4_000_000  # the estimate of what decode nodes hold, bounded
    fixed_costs: bool = False  # route by the priors alone: the latency model does not learn

    def __post_init__(self) -> None:
        if self.min_prompt_tokens < 0 or self.transfer_overhead_tokens < 0:
            raise ValueError("disagg token thresholds must be >= 0")
        if self.decode_prefix_fraction <= 0 or self.local_prefill_cost < 0:
            raise ValueError("disagg decode prefix fraction must be > 0, local cost >= 0")
        if self.idle_local_prefill_cost < 0:
            raise ValueError("disagg idle local cost must be >= 0")


# Every request that can use a PD pair uses it (the tests of the transfer path pin this).
ALWAYS_DISAGGREGATE = DisaggConfig(
    min_prompt_tokens=0, decode_prefix_fraction=2.0, local_prefill_cost=0.0
)


@dataclass(frozen=True)
class SloConfig:
    """Opt-in latency targets (router/slo.py): a request predicted to miss one is refused at once
    with 429 `slo_unattainable`, and a request answered within them counts as goodput. 0: none."""

    ttft_ms: float = 0.0  # from arrival at the router to the first token
    itl_ms: float = 0.0  # mean time between two tokens of a stream

    def __post_init__(self) -> None:
        if self.ttft_ms < 0 or self.itl_ms < 0:
            raise ValueError("SLOs must be >= 0 ms (0: none)")


@dataclass(frozen=True)
class FairnessConfig:
    """Sharing the cluster between tenants (router/admission.py, router/tenants.py)."""

    tenant_max_concurrent: int = 0  # units one tenant may hold (0: no limit)
    max_queued_prompt_tokens: int = 0  # nodes' queued prompt tokens that hold requests here (0: no)
    tenant_keys_file: str | None = None  # lines "NAME KEY [WEIGHT]": API keys and their tenants
    priority_scheduling: bool = False  # honour requests' `priority` (else non-zero is a 400)

    def __post_init__(self) -> None:
        if self.tenant_max_concurrent < 0 or self.max_queued_prompt_tokens < 0:
            raise ValueError("tenant and queue limits must be >= 0 (0: none)")


@dataclass(frozen=True)
class ElasticConfig:
    """The elastic controller (router/routing/elastic.py): off unless `enabled`."""

    enabled: bool = False
    interval_s: float = 1.0
    ttft_target_ms: float = 0.0  # 0: the router's TTFT SLO, else DEFAULT_TTFT_TARGET_MS
    itl_target_ms: float = 0.0  # 0: the router's ITL SLO, else DEFAULT_ITL_TARGET_MS
    high: float = 0.8  # a role is short past high x its target
    low: float = 0.5  # a role can spare a node if it stays under low x its target without it
    idle: float = 0.1  # a role under idle x its target, beside one over busy x its own, gives a
    busy: float = 0.3  # node to it (kept: at least one node of each role)
    sustain_s: float = 3.0
    dwell_s: float = 20.0
    flip_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high or not 0 < self.idle < self.busy:
            raise ValueError("elastic thresholds need 0 < low < high and 0 < idle < busy")
        if min(self.interval_s, self.sustain_s, self.dwell_s, self.flip_timeout_s) <= 0:
            raise ValueError("elastic intervals must be > 0 s")
        if self.ttft_target_ms < 0 or self.itl_target_ms < 0:
            raise ValueError("elastic targets must be >= 0 ms (0: the SLO or the default)")


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[WorkerSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_policy: str = "cache_aware"
    decode_policy: str = "power_of_two"
    api_key: str | None = None
    internal_token: str | None = None
    served_model_name: str | None = None
    max_concurrent: int = 256
    max_queue: int = 1024
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1
    connect_timeout_s: float = 3.0
    request_timeout_s: float = 600.0  # non-streaming: whole answer; streaming: first event
    stream_idle_timeout_s: float = 300.0  # streaming: longest gap between two events
    max_migrations: int = 3  # streaming: moves to another decode node (router/routing/migration.py)
    sse_keepalive_s: float = 5.0  # streaming: ': ping' this often until the first event
    max_body_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"
    log_format: str = "text"  # or json (infra/logs.py)
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for traces (docs/TRACING.md)
    debug_requests: int = 1000  # requests the /debug/requests timeline keeps (0: off)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    # a (prefill, decode) pair's link (router/routing/pair_health.py): fails fast, probed soon
    pair_breaker: BreakerConfig = field(default_factory=lambda: BreakerConfig(2, 1, 5.0))
    retry: RetryConfig = field(default_factory=RetryConfig)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.debug_requests < 0:
            raise ValueError("debug_requests must be >= 0")
        urls = [w.url for w in self.workers]
        if len(urls) != len(set(urls)):
            raise ValueError("the same worker URL is listed twice")
        if self.retry.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        if (
            min(
                self.health.failure_threshold,
                self.health.success_threshold,
                self.breaker.failure_threshold,
                self.breaker.success_threshold,
                self.pair_breaker.failure_threshold,
                self.pair_breaker.success_threshold,
            )
            < 1
        ):
            raise ValueError("health and breaker thresholds must be >= 1")
