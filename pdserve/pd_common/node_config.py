"""A PD node's settings (`pdserve prefill`, `pdserve decode`): PDNodeConfig, a NodeConfig with
its KV bootstrap port, whether it is elastic, and its KV transfer's settings; and the engine
defaults that PD nodes set apart from the colocated node's, with the measurement behind each
(bench/results/HISTORY.md, bench/results/side_by_side_icelake.md runs 6 and 7)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.infra.config_flags import nested, setting
from pdserve.kv_transfer.config import TransferConfig
from pdserve.runtime.node_config import NodeConfig, add_node_flags

# New tokens per forward. 512, against the engine's 2048: a prefill iteration then holds one
# 512-token chunk, so a prompt's release vote (and its answer to the router) waits for at most
# that, and a decode step that also prefills a decode-only request carries at most 512 tokens. It
# served more tok/s than 2048 side by side, and matmuls of 512 rows run about as fast per row as
# 2048 (bench/results/side_by_side_icelake.md, bench/results/linear.md).
PD_MAX_BATCH_TOKENS = 512


@dataclass(frozen=True)
class PDNodeConfig(NodeConfig):
    """A prefill or decode node's: where its KV bootstrap server listens, and whether it may
    change role (docs/ARCHITECTURE.md section 14)."""

    bootstrap_port: int | None = setting(
        None,
        help="port of the KV bootstrap server (a prefill node's, or an elastic node's in either "
        "role)",
    )
    elastic: bool = setting(
        False,
        help="an elastic node: starts in this role and changes role on POST /role (needs "
        "--bootstrap-port)",
    )
    prefill_cpus: str = setting(
        "",
        help="an elastic node's rank cores while it is a prefill node, in --cpus form; its ranks' "
        "threads move there when it changes role (default: they stay on --cpus)",
    )
    decode_cpus: str = setting(
        "", help="the same while it is a decode node (`pdserve up --elastic` sets both)"
    )
    # --transfer-*, --kv-*: dests transfer_* (a node has its own `device`)
    transfer: TransferConfig = nested(TransferConfig, "KV transfer", prefix="transfer_")

    @property
    def role_cpus(self) -> dict[str, str]:
        cpus = {"prefill": self.prefill_cpus, "decode": self.decode_cpus}
        return {role: text for role, text in cpus.items() if text}

    def __post_init__(self):
        super().__post_init__()
        if self.engine.windowed_kv and self.elastic:  # a prefill node sends whole pages
            raise ValueError("windowed_kv is for colocated and decode nodes, not elastic ones")
        if self.elastic and self.bootstrap_port is None:
            raise ValueError("an elastic node needs bootstrap_port (--bootstrap-port)")


def add_pd_node_flags(ap: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """PDNodeConfig's flags with the PD defaults, then this role's `defaults` (port, bootstrap
    port)."""
    return add_node_flags(ap, PDNodeConfig, max_batch_tokens=PD_MAX_BATCH_TOKENS, **defaults)
