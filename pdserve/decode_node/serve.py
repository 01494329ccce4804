"""`pdserve decode`: the decode node (front + one process per PP rank)."""

from __future__ import annotations

import argparse
import sys

from pdserve.pd_common.node_config import PDNodeConfig, add_pd_node_flags
from pdserve.runtime.serve import advertise_host, make_front, run_node, run_remote_ranks


def add_decode_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    # no bootstrap server unless elastic: then it serves one in either role
    return add_pd_node_flags(ap, port=30001, bootstrap_port=None)


def decode_main(cfg: PDNodeConfig) -> int:
    from pdserve.decode_node.front import DecodeFront
    from pdserve.pd_common.messages import PDRankSpec

    if cfg.bootstrap_port is not None:  # only an elastic decode node serves a bootstrap server
        print("pdserve decode: --bootstrap-port needs --elastic", file=sys.stderr)
        return 2
    transfer = {"transfer_host": advertise_host(cfg), "transfer": cfg.transfer.to_spec()}
    if cfg.node_rank > 0:
        return run_remote_ranks(cfg, "decode", "pdserve.decode_node.rank", PDRankSpec, transfer)
    front, app = make_front(cfg, "decode", DecodeFront)
    return run_node(cfg, front, app, "decode", transfer, module="pdserve.decode_node.rank")
