"""`pdserve prefill`: the prefill node (front + bootstrap server + one process per PP rank)."""
from __future__ import annotations

import argparse

from engine.serve import add_node_args, make_front, run_node


def add_prefill_args(ap: argparse.ArgumentParser) -> None:
    add_node_args(ap, default_port=30000)
    ap.add_argument("--bootstrap-port", type=int, default=8998, help="port of the KV bootstrap server")


def prefill_main(args) -> int:
    from kv_transfer.bootstrap import BootstrapServer
    from prefill_node.front import PrefillFront

    front, app = make_front(args, "prefill", PrefillFront, bootstrap_port=args.bootstrap_port)
    server = BootstrapServer(host=args.host, port=args.bootstrap_port, token=args.internal_token).start()
    try:
        return run_node(args, front, app, "prefill", module="prefill_node.rank",
                        extra={"bootstrap_addr": f"{args.host}:{args.bootstrap_port}", "transfer_host": args.host})
    finally:
        server.stop()
