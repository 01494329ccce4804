"""`pdserve decode`: the decode node (front + one process per PP rank)."""

from __future__ import annotations

import argparse
import sys

from pdserve.pd_common.node_defaults import add_elastic_args, set_pd_defaults
from pdserve.runtime.node_args import add_node_args
from pdserve.runtime.serve import advertise_host, make_front, run_node, run_remote_ranks


def add_decode_args(ap: argparse.ArgumentParser) -> None:
    add_node_args(ap, default_port=30001)
    set_pd_defaults(ap)
    add_elastic_args(ap, bootstrap_port=True)


def decode_main(args) -> int:
    from pdserve.decode_node.front import DecodeFront
    from pdserve.pd_common.messages import PDRankSpec

    if args.bootstrap_port is not None:  # only an elastic decode node serves a bootstrap server
        print("pdserve decode: --bootstrap-port needs --elastic", file=sys.stderr)
        return 2
    transfer = {"transfer_host": advertise_host(args)}
    if args.node_rank > 0:
        return run_remote_ranks(args, "decode", "pdserve.decode_node.rank", PDRankSpec, transfer)
    front, app = make_front(args, "decode", DecodeFront)
    return run_node(args, front, app, "decode", transfer, module="pdserve.decode_node.rank")
