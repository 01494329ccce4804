"""A node's settings (`pdserve serve`, `prefill`, `decode`): the engine's (EngineConfig), then the
node's own (PP size, address, timeouts, multi-host, cores, logging, tracing). Each is a flag,
generated from its field (infra/config_flags.py); the command line is parsed into a NodeConfig at
the edge (pdserve/cli.py), and the node is started from that config alone."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.infra.config_flags import add_flags, config_from_args, nested, setting
from pdserve.infra.internal_auth import INSECURE_HELP
from pdserve.infra.logs import FORMAT_ENV, FORMATS, LEVEL_ENV
from pdserve.runtime.messages import MAX_TP


@dataclass(frozen=True)
class NodeConfig:
    engine: EngineConfig = nested(EngineConfig, "engine")
    pp: int = setting(
        1, aliases=("--pipeline-parallel-size",), help="pipeline-parallel size of this node"
    )
    tp: int = setting(
        1,
        aliases=("--tensor-parallel-size",),
        help="tensor-parallel size of each PP stage: processes per stage, each with its share of "
        "the heads and the MLP (a colocated, prefill or decode node, on one host)",
    )
    host: str = setting("127.0.0.1", help="HTTP bind address")
    port: int = setting(30000, help="HTTP port")
    insecure: bool = setting(False, help=INSECURE_HELP)
    advertise_host: str | None = setting(
        None,
        env="PDSERVE_ADVERTISE_HOST",
        help="the address other hosts reach this one at (KV transfer, control sockets, stats); "
        "none: --host",
    )
    async_depth: int = setting(0, help="forwards a rank may run ahead of their results")
    skip_pure_chunk_comm: bool = setting(
        True, help="send no ring message for pure intermediate prefill chunks"
    )
    watchdog: float = setting(120.0, help="seconds without progress before a rank exits")
    pp_timeout: float = setting(60.0, help="PP receive timeout (seconds)")
    load_timeout: float = setting(
        600.0,
        help="how long a rank that loaded its slice waits for the other ranks of its node to load "
        "theirs before any PP message (seconds)",
    )
    waiting_timeout: float = setting(0.0, help="abort requests queued longer (seconds; 0: off)")
    running_timeout: float = setting(0.0, help="abort requests alive longer (seconds; 0: off)")
    drain_grace: float = setting(
        30.0,
        help="on SIGTERM or POST /drain: seconds the requests in flight get to finish before they "
        "move to another node (docs/RELIABILITY.md)",
    )
    nnodes: int = setting(1, help="hosts this node's PP ranks are spread over")
    node_rank: int = setting(0, help="this host's place among --nnodes (0 runs the front)")
    dist_init_addr: str | None = setting(None, help="host:port of the PP rendezvous (multi-host)")
    cpus: str = setting(
        "",
        help="cores of each local rank, e.g. '0;1' or '0,1;2,3' (ranks by ';'); default: planned "
        "over this process's cores (runtime/placement.py); `pdserve up` sets it",
    )
    io_cpus: str | None = setting(
        None, help="cores for the front process (e.g. '2'); default: the plan's I/O core, if any"
    )
    front_cpus: str | None = setting(
        None,
        help="cores for the front process when they are not I/O cores (no prefill helper runs "
        "there): `pdserve up` on a host with no core left over binds the fronts to a prefill "
        "rank's core; default: --io-cpus",
    )
    max_pending: int = setting(
        4096,
        help="requests the node holds at once (queued or running); beyond: 503 with Retry-After",
    )
    grammar_compile_timeout: float = setting(
        10.0,
        help="CPU seconds a structured-output guide may take to compile on the front; past them "
        "the request gets a 400 (queued behind other guides, or waiting for the CPU, past them "
        "in wall time: a retryable 503); engine/grammar.py",
    )
    device: str = setting("cpu", help="cpu or cuda (NCCL between ranks)")
    pp_comm_stream: bool = setting(
        False, help="CUDA: PP sends/receives on their own stream, overlapping forwards"
    )
    log_level: str = setting(
        "INFO",
        env=LEVEL_ENV,
        help="INFO: a start-up line per node and rank, then warnings and errors; DEBUG adds HTTP "
        "client and access lines and Mooncake's own log",
    )
    log_format: str = setting(
        "text",
        env=FORMAT_ENV,
        choices=FORMATS,
        help="json: one JSON object per line, with rid and trace_id (this process and the ones it "
        "starts)",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        help="export OpenTelemetry traces over OTLP/HTTP to this collector (e.g. "
        "http://127.0.0.1:4318); off by default (docs/TRACING.md)",
    )

    def __post_init__(self):
        for name in ("pp", "tp", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pp % self.nnodes:
            raise ValueError(f"pp ({self.pp}) must be a multiple of nnodes ({self.nnodes})")
        if self.tp > 1 and self.nnodes > 1:
            raise ValueError("tp > 1 runs each node on one host (nnodes 1)")
        if self.tp > MAX_TP:  # the front takes the stats of no rank past it
            raise ValueError(f"tp must be at most {MAX_TP}, got {self.tp}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr HOST:PORT (the host of node-rank 0)")

    @property
    def role_cpus(self) -> dict[str, str]:
        """Each role's `--cpus` for a node that may change role (PDNodeConfig); none here."""
        return {}

    def rendezvous_host(self) -> str:
        """The host of node-rank 0 (multi-host), from --dist-init-addr."""
        if not self.dist_init_addr:
            raise ValueError("a multi-host node needs dist_init_addr HOST:PORT")
        return self.dist_init_addr.rsplit(":", 1)[0]


def add_node_flags(
    ap: argparse.ArgumentParser, cls: type[NodeConfig], **defaults: Any
) -> argparse.ArgumentParser:
    """`cls`'s flags on `ap`, with this command's own `defaults` by field name."""
    add_flags(ap, cls, defaults=defaults)
    return ap


def node_config(cls: type[NodeConfig], args: argparse.Namespace) -> Any:
    """The edge: the parsed flags as `cls`. ValueError names the setting that is wrong."""
    return config_from_args(cls, args)
