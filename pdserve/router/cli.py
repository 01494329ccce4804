"""`pdserve router` command line: flags (with PDSERVE_* environment defaults) -> RouterConfig.

Workers:
  --prefill URL [BOOTSTRAP_PORT]   a prefill node; the bootstrap port is learnt from the node's
                                   GET /server_info when not given
  --decode URL                     a decode node
  --worker URL                     a colocated node (no PD split)
Every flag but the worker lists also reads PDSERVE_ROUTER_<FLAG> (e.g. PDSERVE_ROUTER_PORT);
the API key reads PDSERVE_API_KEY. The cluster secret, sent to the nodes and required on /workers,
comes only from PDSERVE_INTERNAL_TOKEN or a 0600 file named by PDSERVE_INTERNAL_TOKEN_FILE (never a
flag: a command line is visible to every local user in `ps`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve.infra.cluster_secret import cluster_secret
from pdserve.infra.internal_auth import INSECURE_HELP, refuse_unprotected_bind
from pdserve.router.config import (
    BreakerConfig,
    CacheAwareConfig,
    DisaggConfig,
    ElasticConfig,
    FairnessConfig,
    HealthConfig,
    RetryConfig,
    RouterConfig,
    SloConfig,
    WorkerSpec,
)
from pdserve.router.routing.policies import POLICIES

_SECRET_ENV = {"api_key": "PDSERVE_API_KEY"}


def _env(dest: str, default, kind=str):
    name = _SECRET_ENV.get(dest, f"PDSERVE_ROUTER_{dest.upper()}")
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(
            f"environment variable {name}={raw!r} is not a valid {kind.__name__}"
        ) from None


def _opt_adder(parser: argparse.ArgumentParser):
    """`opt(flag, default, kind, help)`: a flag whose default reads PDSERVE_ROUTER_<FLAG> first."""

    def opt(flag: str, default, kind=str, help: str = "", **kw):
        dest = flag.lstrip("-").replace("-", "_")
        parser.add_argument(
            flag,
            dest=dest,
            type=kind,
            default=_env(dest, default, kind),
            help=f"{help} (default: %(default)s)",
            **kw,
        )

    return opt


def add_router_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_worker_args(parser)
    opt = _opt_adder(parser)
    _add_serving_args(parser, opt)
    _add_fault_args(opt)
    _add_routing_args(opt)
    _add_log_args(opt)
    return parser


def _add_worker_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workers")
    g.add_argument(
        "--prefill",
        action="append",
        nargs="+",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="prefill node URL, optionally followed by its bootstrap port; repeatable",
    )
    g.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="decode node URL; repeatable"
    )
    g.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="colocated node URL (no PD split); repeatable",
    )


def _add_serving_args(parser: argparse.ArgumentParser, opt) -> None:
    R = RouterConfig
    opt("--host", R.host, help="address to bind")
    opt("--port", R.port, int, help="port to bind")
    opt(
        "--api-key",
        None,
        help="clients must send 'Authorization: Bearer KEY' (env PDSERVE_API_KEY)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help=INSECURE_HELP.replace(
            "generate, abort and read the topology", "add, remove and list workers"
        ),
    )
    opt("--served-model-name", None, help="extra model name accepted besides the nodes' own")
    opt("--max-concurrent", R.max_concurrent, int, help="requests dispatched at once")
    opt("--max-queue", R.max_queue, int, help="requests waiting for a slot; beyond: 429")
    opt("--queue-timeout", R.queue_timeout_s, float, help="seconds a request may wait queued")
    opt("--retry-after", R.retry_after_s, int, help="Retry-After seconds on 429")
    _add_slo_args(opt)
    _add_elastic_args(opt)
    opt("--connect-timeout", R.connect_timeout_s, float, help="seconds to connect to a node")
    opt(
        "--request-timeout",
        R.request_timeout_s,
        float,
        help="seconds to the first stream event (streaming) or the whole answer",
    )
    opt(
        "--stream-idle-timeout",
        R.stream_idle_timeout_s,
        float,
        help="longest silence of a decode stream, seconds",
    )
    opt(
        "--sse-keepalive",
        R.sse_keepalive_s,
        float,
        help="seconds between SSE ': ping' comments while a stream waits for its first token "
        "(0: none)",
    )
    opt("--max-body-bytes", R.max_body_bytes, int, help="largest request body; beyond: 413")


def _add_log_args(opt) -> None:
    R = RouterConfig
    opt(
        "--otlp-traces-endpoint",
        R.otlp_traces_endpoint,
        help="export OpenTelemetry traces over OTLP/HTTP to this collector, e.g. "
        "http://127.0.0.1:4318 (docs/TRACING.md)",
    )
    opt(
        "--debug-requests",
        R.debug_requests,
        int,
        help="finished requests whose stage times GET /debug/requests keeps (0: off)",
    )
    opt("--log-level", R.log_level, help="info, or debug: adds access and health-probe lines")
    opt(
        "--log-format",
        R.log_format,
        help="text, or json: one JSON object per line, with rid and trace_id",
        choices=("text", "json"),
    )


def _add_fault_args(opt) -> None:
    H, B, T = HealthConfig, BreakerConfig, RetryConfig
    opt("--health-interval", H.interval_s, float, help="seconds between health probes")
    opt("--health-timeout", H.timeout_s, float, help="health probe timeout, seconds")
    opt("--health-failure-threshold", H.failure_threshold, int, help="failed probes => unhealthy")
    opt("--health-success-threshold", H.success_threshold, int, help="good probes => healthy")
    opt("--cb-failure-threshold", B.failure_threshold, int, help="failures that open a breaker")
    opt(
        "--cb-success-threshold",
        B.success_threshold,
        int,
        help="half-open successes that close a breaker",
    )
    opt("--cb-open-seconds", B.open_s, float, help="seconds a breaker stays open")
    P = RouterConfig().pair_breaker
    opt(
        "--pair-failure-threshold",
        P.failure_threshold,
        int,
        help="failed disaggregated attempts on a (prefill, decode) pair before the router stops "
        "pairing the two nodes",
    )
    opt(
        "--pair-open-seconds",
        P.open_s,
        float,
        help="seconds before an unpaired (prefill, decode) pair gets one request to try it again",
    )
    opt("--max-retries", T.max_retries, int, help="retries before the first byte")
    opt(
        "--max-migrations",
        RouterConfig.max_migrations,
        int,
        help="times a stream may move to another decode node when its own fails (0: never)",
    )
    opt("--retry-initial-backoff", T.initial_backoff_s, float, help="first backoff, seconds")
    opt("--retry-max-backoff", T.max_backoff_s, float, help="largest backoff, seconds")


def _add_routing_args(opt) -> None:
    R, C, D = RouterConfig, CacheAwareConfig, DisaggConfig
    opt("--policy", None, help="policy for both prefill and decode", choices=list(POLICIES))
    opt("--prefill-policy", R.prefill_policy, choices=list(POLICIES), help="prefill policy")
    opt(
        "--decode-policy",
        R.decode_policy,
        choices=list(POLICIES),
        help="decode (and colocated) policy",
    )
    opt("--cache-threshold", C.cache_threshold, float, help="cache_aware: prefix match ratio")
    opt("--balance-abs-threshold", C.balance_abs, int, help="cache_aware: load gap (requests)")
    opt("--balance-rel-threshold", C.balance_rel, float, help="cache_aware: load ratio")
    opt(
        "--disagg-min-prompt-tokens",
        D.min_prompt_tokens,
        int,
        help="PD: shorter prompts (estimated tokens) are prefilled on the decode node",
    )
    opt(
        "--disagg-decode-prefix-fraction",
        D.decode_prefix_fraction,
        float,
        help="PD: decode-only when the decode node holds this share of the prompt (> 1: never)",
    )
    opt(
        "--disagg-local-prefill-cost",
        D.local_prefill_cost,
        float,
        help="PD: cost of a decode-side prefill token vs a prefill-side one, for the queue rule "
        "(0: no queue rule; while the decode node has no request open, "
        "--disagg-idle-local-prefill-cost at most; the default was measured on 2 cores where the "
        "prefill rank shares a core: where prefill nodes have cores of their own, a higher cost "
        "keeps more prefills out of the decode batch)",
    )
    opt(
        "--disagg-idle-local-prefill-cost",
        D.idle_local_prefill_cost,
        float,
        help="PD: the queue rule's cost while the decode node has no request open (no stream to "
        "delay; at most --disagg-local-prefill-cost, which restores the rule as it was)",
    )
    opt(
        "--disagg-transfer-overhead-tokens",
        D.transfer_overhead_tokens,
        int,
        help="PD: bootstrap + KV transfer cost in prefill-token equivalents, for the queue rule",
    )
    opt(
        "--disagg-fixed-costs",
        False,
        _flag,
        help="PD: route by the cost flags above alone, as before the latency model; it still "
        "measures its errors (true/false)",
        nargs="?",
        const=True,
    )


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _prefill_spec(values: list[str]) -> WorkerSpec:
    if len(values) > 2:
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(values)}")
    port = None
    if len(values) == 2:
        if not values[1].isdigit():
            raise ValueError(f"--prefill bootstrap port {values[1]!r} is not a number")
        port = int(values[1])
    return WorkerSpec(url=values[0].rstrip("/"), role="prefill", bootstrap_port=port)


def _worker_specs(args: argparse.Namespace) -> tuple[WorkerSpec, ...]:
    workers = [_prefill_spec(v) for v in args.prefill]
    workers += [WorkerSpec(url=u.rstrip("/"), role="decode") for u in args.decode]
    workers += [WorkerSpec(url=u.rstrip("/"), role="colocated") for u in args.worker]
    if args.prefill and not args.decode:
        raise ValueError("--prefill needs at least one --decode")
    if args.decode and not args.prefill:
        raise ValueError("--decode needs at least one --prefill (use --worker for colocated nodes)")
    return tuple(workers)


def _routing_configs(args: argparse.Namespace) -> dict:
    """The routing parts of the config: health, breakers, retries, cache affinity, the
    disaggregation rules."""
    return dict(
        health=HealthConfig(
            args.health_interval,
            args.health_timeout,
            args.health_failure_threshold,
            args.health_success_threshold,
        ),
        breaker=BreakerConfig(
            args.cb_failure_threshold, args.cb_success_threshold, args.cb_open_seconds
        ),
        pair_breaker=BreakerConfig(args.pair_failure_threshold, 1, args.pair_open_seconds),
        retry=RetryConfig(
            max_retries=args.max_retries,
            initial_backoff_s=args.retry_initial_backoff,
            max_backoff_s=args.retry_max_backoff,
        ),
        cache_aware=CacheAwareConfig(
            args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold
        ),
        disagg=DisaggConfig(
            min_prompt_tokens=args.disagg_min_prompt_tokens,
            decode_prefix_fraction=args.disagg_decode_prefix_fraction,
            local_prefill_cost=args.disagg_local_prefill_cost,
            idle_local_prefill_cost=args.disagg_idle_local_prefill_cost,
            transfer_overhead_tokens=args.disagg_transfer_overhead_tokens,
            fixed_costs=args.disagg_fixed_costs,
        ),
    )


def _add_elastic_args(opt) -> None:
    E = ElasticConfig
    opt(
        "--elastic",
        False,
        _flag,
        help="move elastic nodes between prefill and decode as the load shifts "
        "(router/routing/elastic.py, docs/ROUTER.md 'Elastic nodes'; true/false)",
        nargs="?",
        const=True,
    )
    opt(
        "--elastic-ttft-target-ms",
        E.ttft_target_ms,
        float,
        help="the prefill wait the controller keeps under (0: --ttft-slo-ms, else 2000)",
    )
    opt(
        "--elastic-itl-target-ms",
        E.itl_target_ms,
        float,
        help="the decode step it keeps under (0: --itl-slo-ms, else 100)",
    )
    opt("--elastic-sustain", E.sustain_s, float, help="seconds a shortage lasts before a move")
    opt("--elastic-dwell", E.dwell_s, float, help="seconds between two moves, at least")


def _add_slo_args(opt) -> None:
    S, F = SloConfig, FairnessConfig
    opt(
        "--ttft-slo-ms",
        S.ttft_ms,
        float,
        help="time to first token a request must be predicted to meet, else 429 "
        "slo_unattainable at once (0: none; docs/ROUTER.md)",
    )
    opt("--itl-slo-ms", S.itl_ms, float, help="the same for the mean time between tokens")
    opt(
        "--tenant-max-concurrent",
        F.tenant_max_concurrent,
        int,
        help="requests one tenant (API key) may have dispatched at once; more wait (0: no limit)",
    )
    opt(
        "--max-queued-prompt-tokens",
        F.max_queued_prompt_tokens,
        int,
        help="hold requests in the router's fair queue while the nodes' queued prompt tokens "
        "reach this (0: never)",
    )
    opt(
        "--tenant-keys",
        F.tenant_keys_file,
        help="file of lines 'NAME KEY [WEIGHT]': the API keys accepted and the tenant each is",
    )
    opt(
        "--priority-scheduling",
        False,
        _flag,
        help="order the admission queue by requests' `priority` (lower first), as vLLM's "
        "--scheduling-policy priority; off: a priority other than 0 is a 400 (true/false)",
        nargs="?",
        const=True,
    )


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ValueError with a message for the operator on inconsistent flags."""
    workers = _worker_specs(args)
    secret = cluster_secret()
    try:
        refuse_unprotected_bind(args.host, secret, args.insecure, "pdserve router")
    except SystemExit as exc:
        raise ValueError(str(exc)) from None
    return RouterConfig(
        workers=workers,
        host=args.host,
        port=args.port,
        prefill_policy=args.policy or args.prefill_policy,
        decode_policy=args.policy or args.decode_policy,
        api_key=args.api_key or None,
        internal_token=secret,
        served_model_name=args.served_model_name,
        max_concurrent=args.max_concurrent,
        max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout,
        retry_after_s=args.retry_after,
        connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        max_migrations=args.max_migrations,
        sse_keepalive_s=args.sse_keepalive,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        log_format=args.log_format,
        otlp_traces_endpoint=args.otlp_traces_endpoint or None,
        debug_requests=args.debug_requests,
        slo=SloConfig(args.ttft_slo_ms, args.itl_slo_ms),
        elastic=ElasticConfig(
            enabled=args.elastic,
            ttft_target_ms=args.elastic_ttft_target_ms,
            itl_target_ms=args.elastic_itl_target_ms,
            sustain_s=args.elastic_sustain,
            dwell_s=args.elastic_dwell,
        ),
        fairness=FairnessConfig(
            args.tenant_max_concurrent,
            args.max_queued_prompt_tokens,
            args.tenant_keys,
            args.priority_scheduling,
        ),
        **_routing_configs(args),
    )


def serve(config: RouterConfig) -> None:
    import uvicorn

    from pdserve.infra.http_server import run_server, server_config
    from pdserve.infra.logs import setup_logging, uvicorn_level
    from pdserve.router.app import build_app

    setup_logging("[router]", config.log_level, config.log_format)
    run_server(
        uvicorn.Server(
            server_config(
                build_app(config),
                host=config.host,
                port=config.port,
                log_level=uvicorn_level(),
                timeout_graceful_shutdown=5,
            )
        )
    )


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_router_args(parser)
    args = parser.parse_args(argv)
    try:
        config = router_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not config.workers:
        logging.getLogger("pdserve.router").warning("no workers given; add them with POST /workers")
    if not config.internal_token:
        logging.getLogger("pdserve.router").warning(
            "no cluster secret (PDSERVE_INTERNAL_TOKEN): /workers is open to anyone who can reach "
            "the router"
        )
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(run())
