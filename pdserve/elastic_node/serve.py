"""`pdserve prefill --elastic` / `pdserve decode --elastic`: an elastic node (front + bootstrap
server + one process per PP rank), started in that role."""

from __future__ import annotations

import sys

from pdserve.runtime.serve import advertise_host, make_front, run_node, run_remote_ranks

RANK_MODULE = "pdserve.elastic_node.rank"


def elastic_main(args, start_role: str) -> int:
    from pdserve.elastic_node.front import ElasticFront
    from pdserve.infra.cluster_secret import cluster_secret
    from pdserve.kv_transfer.bootstrap import BootstrapServer
    from pdserve.pd_common.messages import PDRankSpec

    if args.bootstrap_port is None:
        print("pdserve: an elastic node needs --bootstrap-port", file=sys.stderr)
        return 2
    transfer = {"transfer_host": advertise_host(args)}
    if args.node_rank > 0:
        host0 = args.dist_init_addr.rsplit(":", 1)[0]
        fields = {**transfer, "bootstrap_addr": f"{host0}:{args.bootstrap_port}"}
        return run_remote_ranks(args, start_role, RANK_MODULE, PDRankSpec, fields)
    front, app = make_front(
        args, start_role, ElasticFront, bootstrap_port=args.bootstrap_port, start_role=start_role
    )
    # a decode node too: its ranks register here from the moment they become prefill ranks
    server = BootstrapServer(
        host=args.host, port=args.bootstrap_port, token=cluster_secret()
    ).start()
    try:
        return run_node(
            args,
            front,
            app,
            start_role,
            {**transfer, "bootstrap_addr": f"{advertise_host(args)}:{args.bootstrap_port}"},
            module=RANK_MODULE,
        )
    finally:
        server.stop()
