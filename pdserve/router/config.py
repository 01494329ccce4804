"""Router configuration: frozen dataclasses, one per concern, joined in `RouterConfig`.

Each `setting` is also a flag of `pdserve router`, with its help, and its default read from
PDSERVE_ROUTER_<FLAG> first (infra/config_flags.py, router/cli.py): the numbers live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.infra.config_flags import nested, parse_bool, setting
from pdserve.router.worker_spec import WorkerSpec

# router/routing/policies.py POLICIES, which imports this module (tests/test_router_cli.py)
POLICY_NAMES = ("round_robin", "random", "power_of_two", "least_load", "cache_aware")


def _text_or_none(raw: str) -> str | None:
    """An empty value (`--api-key ""`, PDSERVE_API_KEY=) is none."""
    return raw or None


def _priority_scheduling(raw: str) -> bool:
    """true/false, or vLLM's --scheduling-policy words: priority (true), fcfs (false)."""
    word = raw.strip().lower()
    return word == "priority" if word in ("priority", "fcfs") else parse_bool(raw)


@dataclass(frozen=True)
class HealthConfig:
    """Background `GET /health` probes. A worker turns unhealthy after `failure_threshold`
    consecutive failed probes and healthy again after `success_threshold` consecutive good ones
    (its very first good probe makes a new worker healthy at once)."""

    interval_s: float = setting(
        10.0, flag="--health-interval", help="seconds between health probes"
    )
    timeout_s: float = setting(5.0, flag="--health-timeout", help="health probe timeout, seconds")
    failure_threshold: int = setting(3, help="failed probes => unhealthy")
    success_threshold: int = setting(2, help="good probes => healthy")


@dataclass(frozen=True)
class BreakerConfig:
    """Per-worker circuit breaker fed by request outcomes: `failure_threshold` consecutive node
    failures open it for `open_s`; then it is half-open and lets one request at a time through;
    `success_threshold` successes close it, any failure opens it again."""

    failure_threshold: int = setting(10, help="failures that open a breaker")
    success_threshold: int = setting(3, help="half-open successes that close a breaker")
    open_s: float = setting(60.0, flag="--cb-open-seconds", help="seconds a breaker stays open")


@dataclass(frozen=True)
class PairBreakerConfig(BreakerConfig):
    """A (prefill, decode) pair's link (router/routing/pair_health.py): fails fast, probed soon,
    closed by one success."""

    failure_threshold: int = setting(
        2,
        help="failed disaggregated attempts on a (prefill, decode) pair before the router stops "
        "pairing the two nodes",
    )
    success_threshold: int = 1
    open_s: float = setting(
        5.0,
        flag="--pair-open-seconds",
        help="seconds before an unpaired (prefill, decode) pair gets one request to try it again",
    )


@dataclass(frozen=True)
class RetryConfig:
    """Retries happen only before the client got its first byte; each uses a new pair and room.
    Backoff before retry k (0-based) is min(max_backoff, initial * multiplier**k) * (1 ± jitter)."""

    max_retries: int = setting(5, flag="--max-retries", help="retries before the first byte")
    initial_backoff_s: float = setting(
        0.05, flag="--retry-initial-backoff", help="first backoff, seconds"
    )
    max_backoff_s: float = setting(
        30.0, flag="--retry-max-backoff", help="largest backoff, seconds"
    )
    multiplier: float = 1.5
    jitter: float = 0.2


@dataclass(frozen=True)
class CacheAwareConfig:
    """cache_aware policy: route to the worker holding the longest prefix of the prompt when at
    least `cache_threshold` of it matches; if the load is imbalanced (max - min > balance_abs and
    max > min * balance_rel) pick the least loaded worker instead."""

    cache_threshold: float = setting(0.3, help="cache_aware: prefix match ratio")
    balance_abs: int = setting(
        64, flag="--balance-abs-threshold", help="cache_aware: load gap (requests)"
    )
    balance_rel: float = setting(
        1.5, flag="--balance-rel-threshold", help="cache_aware: load ratio"
    )
    max_tree_chars: int = 4_000_000


@dataclass(frozen=True)
class DisaggConfig:
    """Conditional disaggregation (router/routing/disagg.py): when a request that could use a PD
    pair goes to the decode node alone. The defaults are measured on a 2-core CPU
    (docs/ROUTER.md)."""

    min_prompt_tokens: int = setting(
        64,
        help="PD: shorter prompts (estimated tokens) are prefilled on the decode node (0: never "
        "for this reason)",
    )
    decode_prefix_fraction: float = setting(
        0.8,
        help="PD: decode-only when the decode node holds this share of the prompt (> 1: never)",
    )
    # 1.5 measured against other values on the side-by-side workload (docs/ROUTER.md)
    local_prefill_cost: float = setting(
        1.5,
        help="PD: cost of a decode-side prefill token vs a prefill-side one, for the queue rule "
        "(0: no queue rule; while the decode node has no request open, "
        "--disagg-idle-local-prefill-cost at most; the default was measured on 2 cores where the "
        "prefill rank shares a core: where prefill nodes have cores of their own, a higher cost "
        "keeps more prefills out of the decode batch)",
    )
    # measured: bench/results/pd_router_caches.md
    idle_local_prefill_cost: float = setting(
        1.0,
        help="PD: the queue rule's cost while the decode node has no request open (no stream to "
        "delay; at most --disagg-local-prefill-cost, which restores the rule as it was)",
    )
    stream_delay_weight: float = setting(
        0.0,
        help="PD: what a second of delay to each stream open on the decode node weighs against a "
        "second of the request's own TTFT, when choosing between the pair and the decode node "
        "alone: a prefill there delays every stream's next tokens by its compute time (0: the "
        "fastest first token wins, as before; docs/ROUTER.md)",
    )
    transfer_overhead_tokens: int = setting(
        16,
        help="PD: bootstrap + KV transfer cost in prefill-token equivalents, for the queue rule",
    )
    max_tree_chars: int = 4_000_000  # the estimate of what decode nodes hold, bounded
    fixed_costs: bool = setting(
        False,
        parse=parse_bool,
        help="PD: route by the cost flags above alone, as before the latency model (which does not "
        "learn then); it still measures its errors (true/false)",
    )

    def __post_init__(self) -> None:
        if self.min_prompt_tokens < 0 or self.transfer_overhead_tokens < 0:
            raise ValueError("disagg token thresholds must be >= 0")
        if self.decode_prefix_fraction <= 0 or self.local_prefill_cost < 0:
            raise ValueError("disagg decode prefix fraction must be > 0, local cost >= 0")
        if self.idle_local_prefill_cost < 0:
            raise ValueError("disagg idle local cost must be >= 0")
        if self.stream_delay_weight < 0:
            raise ValueError("disagg stream delay weight must be >= 0")


# Every request that can use a PD pair uses it (the tests of the transfer path pin this).
ALWAYS_DISAGGREGATE = DisaggConfig(
    min_prompt_tokens=0, decode_prefix_fraction=2.0, local_prefill_cost=0.0
)


@dataclass(frozen=True)
class SloConfig:
    """Opt-in latency targets (router/slo.py): a request predicted to miss one is refused at once
    with 429 `slo_unattainable`, and a request answered within them counts as goodput. 0: none."""

    ttft_ms: float = setting(
        0.0,
        flag="--ttft-slo-ms",
        help="time to first token (from arrival at the router) a request must be predicted to "
        "meet, else 429 slo_unattainable at once (0: none; docs/ROUTER.md)",
    )
    itl_ms: float = setting(
        0.0, flag="--itl-slo-ms", help="the same for the mean time between two tokens of a stream"
    )

    def __post_init__(self) -> None:
        if self.ttft_ms < 0 or self.itl_ms < 0:
            raise ValueError("SLOs must be >= 0 ms (0: none)")


@dataclass(frozen=True)
class FairnessConfig:
    """Sharing the cluster between tenants (router/admission.py, router/tenants.py)."""

    tenant_max_concurrent: int = setting(
        0,
        help="requests one tenant (API key) may have dispatched at once; more wait (0: no limit)",
    )
    max_queued_prompt_tokens: int = setting(
        0,
        help="hold requests in the router's fair queue while the nodes' queued prompt tokens "
        "reach this (0: never)",
    )
    tenant_keys_file: str | None = setting(
        None,
        flag="--tenant-keys",
        help="file of lines 'NAME KEY [WEIGHT]': the API keys accepted and the tenant each is",
    )
    priority_scheduling: bool = setting(
        False,
        aliases=("--scheduling-policy",),
        parse=_priority_scheduling,
        help="order the admission queue by requests' `priority` (lower first); off: a priority "
        "other than 0 is a 400 (true/false; or as vLLM's --scheduling-policy: priority/fcfs)",
    )

    def __post_init__(self) -> None:
        if self.tenant_max_concurrent < 0 or self.max_queued_prompt_tokens < 0:
            raise ValueError("tenant and queue limits must be >= 0 (0: none)")


@dataclass(frozen=True)
class ElasticConfig:
    """The elastic controller (router/routing/elastic.py): off unless `enabled`."""

    enabled: bool = setting(
        False,
        flag="--elastic",
        parse=parse_bool,
        help="move elastic nodes between prefill and decode as the load shifts "
        "(router/routing/elastic.py, docs/ROUTER.md 'Elastic nodes'; true/false)",
    )
    interval_s: float = 1.0
    ttft_target_ms: float = setting(  # else DEFAULT_TTFT_TARGET_MS
        0.0, help="the prefill wait the controller keeps under (0: --ttft-slo-ms, else 2000)"
    )
    itl_target_ms: float = setting(  # else DEFAULT_ITL_TARGET_MS
        0.0, help="the decode step it keeps under (0: --itl-slo-ms, else 100)"
    )
    high: float = 0.8  # a role is short past high x its target (it may take the other's last)
    busy: float = 0.3  # under busy x its target no role asks for a node
    gain: float = 0.8  # a move must bring the cluster's pressure under gain x what it is now
    spare_gain: float = 0.95  # ... or under this, where the giving role stays idle after it
    sustain_s: float = setting(
        3.0, flag="--elastic-sustain", help="seconds a shortage lasts before a move"
    )
    dwell_s: float = setting(
        20.0, flag="--elastic-dwell", help="seconds between two moves, at least"
    )
    flip_timeout_s: float = 600.0
    flip_grace_s: float = setting(
        2.0,
        flag="--elastic-flip-grace",
        help="seconds a moving node's requests may take to finish; then its streams continue on "
        "another node of its role (mid-stream migration) and the rest are retried",
    )

    def __post_init__(self) -> None:
        if not 0 < self.busy < self.high or not 0 < self.gain <= self.spare_gain < 1:
            raise ValueError("elastic thresholds need 0 < busy < high, 0 < gain <= spare_gain < 1")
        if min(self.interval_s, self.sustain_s, self.dwell_s, self.flip_timeout_s) <= 0:
            raise ValueError("elastic intervals must be > 0 s")
        if not 0 <= self.flip_grace_s <= 3600:
            raise ValueError("--elastic-flip-grace must be seconds in [0, 3600]")
        if self.ttft_target_ms < 0 or self.itl_target_ms < 0:
            raise ValueError("elastic targets must be >= 0 ms (0: the SLO or the default)")


@dataclass(frozen=True)
class RouterConfig:
    """Every `setting` below, and in the nested configs, is a flag of `pdserve router`."""

    workers: tuple[WorkerSpec, ...] = ()  # --prefill, --decode, --worker (router/cli.py)
    host: str = setting("127.0.0.1", help="address to bind")
    port: int = setting(8000, help="port to bind")
    prefill_policy: str = setting("cache_aware", choices=POLICY_NAMES, help="prefill policy")
    decode_policy: str = setting(
        "power_of_two", choices=POLICY_NAMES, help="decode (and colocated) policy"
    )
    api_key: str | None = setting(
        None,
        env="PDSERVE_API_KEY",
        secret=True,
        parse=_text_or_none,
        help="clients must send 'Authorization: Bearer KEY'",
    )
    internal_token: str | None = None  # the cluster secret: never a flag (router/cli.py)
    served_model_name: str | None = setting(
        None, help="extra model name accepted besides the nodes' own"
    )
    max_concurrent: int = setting(256, help="requests dispatched at once")
    max_queue: int = setting(1024, help="requests waiting for a slot; beyond: 429")
    queue_timeout_s: float = setting(
        30.0, flag="--queue-timeout", help="seconds a request may wait queued"
    )
    retry_after_s: int = setting(1, flag="--retry-after", help="Retry-After seconds on 429")
    connect_timeout_s: float = setting(
        3.0, flag="--connect-timeout", help="seconds to connect to a node"
    )
    request_timeout_s: float = setting(
        600.0,
        flag="--request-timeout",
        help="seconds to the first stream event (streaming) or the whole answer",
    )
    stream_idle_timeout_s: float = setting(
        300.0,
        flag="--stream-idle-timeout",
        help="longest silence of a decode stream, seconds",
    )
    max_migrations: int = setting(  # router/routing/migration.py
        3, help="times a stream may move to another decode node when its own fails (0: never)"
    )
    sse_keepalive_s: float = setting(
        5.0,
        flag="--sse-keepalive",
        help="seconds between SSE ': ping' comments while a stream waits for its first token "
        "(0: none)",
    )
    max_body_bytes: int = setting(4 * 1024 * 1024, help="largest request body; beyond: 413")
    log_level: str = setting("info", help="info, or debug: adds access and health-probe lines")
    log_format: str = setting(  # infra/logs.py
        "text",
        choices=("text", "json"),
        help="text, or json: one JSON object per line, with rid and trace_id",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        parse=_text_or_none,
        help="export OpenTelemetry traces over OTLP/HTTP to this collector, e.g. "
        "http://127.0.0.1:4318 (docs/TRACING.md)",
    )
    debug_requests: int = setting(
        1000, help="finished requests whose stage times GET /debug/requests keeps (0: off)"
    )
    health: HealthConfig = nested(HealthConfig, "health probes", prefix="health_")
    breaker: BreakerConfig = nested(BreakerConfig, "circuit breaker of a node", prefix="cb_")
    pair_breaker: BreakerConfig = nested(
        PairBreakerConfig, "circuit breaker of a (prefill, decode) pair", prefix="pair_"
    )
    retry: RetryConfig = nested(RetryConfig, "retries", prefix="retry_")
    cache_aware: CacheAwareConfig = nested(CacheAwareConfig, "cache_aware policy")
    disagg: DisaggConfig = nested(DisaggConfig, "conditional disaggregation", prefix="disagg_")
    slo: SloConfig = nested(SloConfig, "latency SLOs")
    fairness: FairnessConfig = nested(FairnessConfig, "tenants and admission")
    elastic: ElasticConfig = nested(ElasticConfig, "elastic nodes", prefix="elastic_")

    def __post_init__(self) -> None:
        for policy in (self.prefill_policy, self.decode_policy):
            if policy not in POLICY_NAMES:
                raise ValueError(f"unknown policy {policy!r}; supported: {', '.join(POLICY_NAMES)}")
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
