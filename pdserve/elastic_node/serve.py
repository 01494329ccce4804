"""`pdserve prefill --elastic` / `pdserve decode --elastic`: an elastic node (front + bootstrap
server + one process per PP rank), started in that role; a decode node too hosts the bootstrap
server, where its ranks register from the moment they become prefill ranks."""

from __future__ import annotations

import sys

from pdserve.prefill_node.serve import serve_with_bootstrap

RANK_MODULE = "pdserve.elastic_node.rank"


def elastic_main(args, start_role: str) -> int:
    from pdserve.elastic_node.front import ElasticFront

    if args.bootstrap_port is None:
        print("pdserve: an elastic node needs --bootstrap-port", file=sys.stderr)
        return 2
    return serve_with_bootstrap(args, start_role, RANK_MODULE, ElasticFront, start_role=start_role)
