"""`pdserve router` command line: RouterConfig's settings as flags (router/config.py, through
infra/config_flags.py), parsed once, here, into a RouterConfig.

Workers:
  --prefill URL [BOOTSTRAP_PORT]   a prefill node; the bootstrap port is learnt from the node's
                                   GET /server_info when not given
  --decode URL                     a decode node
  --worker URL                     a colocated node (no PD split)
Every flag but the worker lists and --insecure also reads PDSERVE_ROUTER_<FLAG> (e.g.
PDSERVE_ROUTER_PORT); the API key reads PDSERVE_API_KEY. The cluster secret, sent to the nodes and
required on /workers, comes only from PDSERVE_INTERNAL_TOKEN or a 0600 file named by
PDSERVE_INTERNAL_TOKEN_FILE (never a flag: a command line is visible to every local user in `ps`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

from pdserve.infra.cluster_secret import cluster_secret
from pdserve.infra.config_flags import add_flags, config_from_args, setting
from pdserve.infra.internal_auth import INSECURE_HELP, refuse_unprotected_bind
from pdserve.router.config import POLICY_NAMES, RouterConfig
from pdserve.router.worker_spec import WorkerSpec

ENV_PREFIX = "PDSERVE_ROUTER_"


@dataclass(frozen=True)
class _BothPolicies:
    """A flag that sets two RouterConfig fields."""

    policy: str | None = setting(
        None,
        choices=POLICY_NAMES,
        help="policy for both prefill and decode (over --prefill-policy and --decode-policy)",
    )


def add_router_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--insecure",
        action="store_true",
        help=INSECURE_HELP.replace(
            "generate, abort and read the topology", "add, remove and list workers"
        ),
    )
    add_flags(parser, _BothPolicies, env_prefix=ENV_PREFIX)
    add_flags(parser, RouterConfig, env_prefix=ENV_PREFIX)
    return parser


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


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The edge: the parsed flags as a RouterConfig. Raises ValueError with a message for the
    operator on inconsistent flags."""
    workers = _worker_specs(args)
    secret = cluster_secret()
    try:
        refuse_unprotected_bind(args.host, secret, args.insecure, "pdserve router")
    except SystemExit as exc:
        raise ValueError(str(exc)) from None
    return config_from_args(
        RouterConfig,
        args,
        workers=workers,
        internal_token=secret,
        prefill_policy=args.policy or args.prefill_policy,
        decode_policy=args.policy or args.decode_policy,
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
