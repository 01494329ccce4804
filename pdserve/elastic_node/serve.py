"""`pdserve prefill --elastic` / `pdserve decode --elastic`: an elastic node (front + bootstrap
server + one process per PP rank), started in that role; a decode node too hosts the bootstrap
server, where its ranks register from the moment they become prefill ranks."""

from __future__ import annotations

from pdserve.pd_common.node_config import PDNodeConfig
from pdserve.prefill_node.serve import serve_with_bootstrap

RANK_MODULE = "pdserve.elastic_node.rank"


def elastic_main(cfg: PDNodeConfig, start_role: str) -> int:
    """`cfg.bootstrap_port` is set: PDNodeConfig refuses an elastic node without one."""
    from pdserve.elastic_node.front import ElasticFront

    return serve_with_bootstrap(cfg, start_role, RANK_MODULE, ElasticFront, start_role=start_role)
