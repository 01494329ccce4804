"""`pdserve prefill`: the prefill node (front + bootstrap server + one process per PP rank)."""

from __future__ import annotations

import argparse

from pdserve.pd_common.node_config import PDNodeConfig, add_pd_node_flags
from pdserve.runtime.serve import advertise_host, make_front, run_node, run_remote_ranks

BOOTSTRAP_PORT = 8998


def add_prefill_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return add_pd_node_flags(ap, port=30000, bootstrap_port=BOOTSTRAP_PORT)


def prefill_main(cfg: PDNodeConfig) -> int:
    from pdserve.prefill_node.front import PrefillFront

    if cfg.engine.windowed_kv:  # it keeps a prompt's whole pages until they are sent
        raise SystemExit("pdserve prefill: --windowed-kv is for colocated and decode nodes")

    return serve_with_bootstrap(cfg, "prefill", "pdserve.prefill_node.rank", PrefillFront)


def serve_with_bootstrap(cfg: PDNodeConfig, role: str, module: str, front_cls, **front_kw) -> int:
    """A node whose front hosts the KV bootstrap server on cfg.bootstrap_port (a prefill node; an
    elastic node in either role): its front, server and ranks (`module`), until stopped; on a
    node-rank > 0 host, its ranks only."""
    from pdserve.infra.cluster_secret import cluster_secret
    from pdserve.kv_transfer.bootstrap import BootstrapServer
    from pdserve.pd_common.messages import PDRankSpec

    port = cfg.bootstrap_port
    if port is None:
        raise SystemExit(f"pdserve {role}: no --bootstrap-port")
    transfer = {"transfer_host": advertise_host(cfg), "transfer": cfg.transfer.to_spec()}
    if cfg.node_rank > 0:
        fields = {**transfer, "bootstrap_addr": f"{cfg.rendezvous_host()}:{port}"}
        return run_remote_ranks(cfg, role, module, PDRankSpec, fields)
    front, app = make_front(cfg, role, front_cls, bootstrap_port=port, **front_kw)
    server = BootstrapServer(host=cfg.host, port=port, token=cluster_secret()).start()
    try:
        return run_node(
            cfg,
            front,
            app,
            role,
            {**transfer, "bootstrap_addr": f"{advertise_host(cfg)}:{port}"},
            module=module,
        )
    finally:
        server.stop()
