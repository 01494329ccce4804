"""`pdserve prefill`: the prefill node (front + bootstrap server + one process per PP rank)."""

from __future__ import annotations

import argparse

from pdserve.pd_common.node_defaults import add_elastic_args, set_pd_defaults
from pdserve.runtime.node_args import add_node_args
from pdserve.runtime.serve import advertise_host, make_front, run_node, run_remote_ranks


def add_prefill_args(ap: argparse.ArgumentParser) -> None:
    add_node_args(ap, default_port=30000)
    set_pd_defaults(ap)
    ap.add_argument(
        "--bootstrap-port", type=int, default=8998, help="port of the KV bootstrap server"
    )
    add_elastic_args(ap, bootstrap_port=False)


def prefill_main(args) -> int:
    from pdserve.prefill_node.front import PrefillFront

    return serve_with_bootstrap(args, "prefill", "pdserve.prefill_node.rank", PrefillFront)


def serve_with_bootstrap(args, role: str, module: str, front_cls, **front_kw) -> int:
    """A node whose front hosts the KV bootstrap server on --bootstrap-port (a prefill node; an
    elastic node in either role): its front, server and ranks (`module`), until stopped; on a
    node-rank > 0 host, its ranks only."""
    from pdserve.infra.cluster_secret import cluster_secret
    from pdserve.kv_transfer.bootstrap import BootstrapServer
    from pdserve.pd_common.messages import PDRankSpec

    transfer = {"transfer_host": advertise_host(args)}
    if args.node_rank > 0:
        host0 = args.dist_init_addr.rsplit(":", 1)[0]
        fields = {**transfer, "bootstrap_addr": f"{host0}:{args.bootstrap_port}"}
        return run_remote_ranks(args, role, module, PDRankSpec, fields)
    front, app = make_front(args, role, front_cls, bootstrap_port=args.bootstrap_port, **front_kw)
    server = BootstrapServer(
        host=args.host, port=args.bootstrap_port, token=cluster_secret()
    ).start()
    try:
        return run_node(
            args,
            front,
            app,
            role,
            {**transfer, "bootstrap_addr": f"{advertise_host(args)}:{args.bootstrap_port}"},
            module=module,
        )
    finally:
        server.stop()
