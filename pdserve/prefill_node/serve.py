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
    from pdserve.kv_transfer.bootstrap import BootstrapServer
    from pdserve.pd_common.messages import PDRankSpec
    from pdserve.prefill_node.front import PrefillFront

    transfer = {"transfer_host": advertise_host(args)}
    if args.node_rank > 0:
        host0 = args.dist_init_addr.rsplit(":", 1)[0]
        return run_remote_ranks(
            args,
            "prefill",
            "pdserve.prefill_node.rank",
            PDRankSpec,
            {**transfer, "bootstrap_addr": f"{host0}:{args.bootstrap_port}"},
        )
    from pdserve.infra.cluster_secret import cluster_secret

    front, app = make_front(args, "prefill", PrefillFront, bootstrap_port=args.bootstrap_port)
    server = BootstrapServer(
        host=args.host, port=args.bootstrap_port, token=cluster_secret()
    ).start()
    try:
        return run_node(
            args,
            front,
            app,
            "prefill",
            {**transfer, "bootstrap_addr": f"{advertise_host(args)}:{args.bootstrap_port}"},
            module="pdserve.prefill_node.rank",
        )
    finally:
        server.stop()
