"""Engine defaults that PD nodes set apart from the colocated node's, with the measurement behind
each (bench/results/HISTORY.md, bench/results/side_by_side_icelake.md runs 6 and 7)."""

from __future__ import annotations

import argparse

# New tokens per forward. 512, against the engine's 2048: a prefill iteration then holds one
# 512-token chunk, so a prompt's release vote (and its answer to the router) waits for at most
# that, and a decode step that also prefills a decode-only request carries at most 512 tokens. It
# served more tok/s than 2048 side by side, and matmuls of 512 rows run about as fast per row as
# 2048 (bench/results/side_by_side_icelake.md, bench/results/linear.md).
PD_MAX_BATCH_TOKENS = 512


def set_pd_defaults(ap: argparse.ArgumentParser) -> None:
    ap.set_defaults(max_batch_tokens=PD_MAX_BATCH_TOKENS)


def add_elastic_args(ap: argparse.ArgumentParser, bootstrap_port: bool) -> None:
    """`--elastic`: the node may change role at runtime (POST /role, docs/ARCHITECTURE.md
    section 14); it then hosts a bootstrap server in either role (`bootstrap_port`: add the flag,
    which a prefill node has already)."""
    ap.add_argument(
        "--elastic",
        action="store_true",
        help="an elastic node: starts in this role and changes role on POST /role "
        "(needs --bootstrap-port)",
    )
    if bootstrap_port:
        ap.add_argument(
            "--bootstrap-port",
            type=int,
            default=None,
            help="with --elastic: port of the KV bootstrap server it serves as a prefill node",
        )
