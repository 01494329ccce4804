"""The KV transfer's configuration: a PD node's settings (`--transfer-protocol`, `--kv-*` flags,
generated from the fields below: infra/config_flags.py), and what a rank adds (its address, the
cluster secret). Light on purpose: the node's command line (runtime/node_config.py) imports it,
so nothing here imports zmq, Mooncake or torch.

The environment variables that set these before they were flags (PDSERVE_TRANSFER_PROTOCOL,
PDSERVE_KV_TRANSFER_TIMEOUT_S, ...) still set their defaults; they are read once, where the node
parses its command line, never on a rank."""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, fields
from typing import Any

from pdserve.infra.config_flags import SETTING, config_from_dict, setting

AUX_HEADER = struct.Struct("<QII")  # room, payload length, crc32 of the payload
# "tcp": pdserve's authenticated transport (kv_transfer/tcp_transport.py); "mooncake-tcp":
# Mooncake's own TCP transport, which listens on every interface without authentication
# (docs/SECURITY.md), for comparison runs only.
PROTOCOLS = ("auto", "tcp", "rdma", "mooncake-tcp")
RANK_FIELDS = ("host", "auth_token")  # a rank's own: never in a spec (the secret stays off argv)


@dataclass(frozen=True)
class TransferConfig:
    host: str = "127.0.0.1"  # address this rank's engine and control socket use
    protocol: str = setting(
        "auto",
        flag="--transfer-protocol",
        env="PDSERVE_TRANSFER_PROTOCOL",
        choices=PROTOCOLS,
        help="how KV moves between nodes: tcp (pdserve's authenticated transport), rdma "
        "(Mooncake), auto (RDMA when a device is found, else tcp); mooncake-tcp: Mooncake's "
        "unauthenticated TCP transport, for comparisons only (docs/SECURITY.md)",
    )
    device: str | None = setting(
        None,
        flag="--transfer-device",
        env="PDSERVE_TRANSFER_DEVICE",
        help="RDMA device(s) for Mooncake, e.g. mlx5_0 or mlx5_0,mlx5_1; none: all found",
    )
    ctrl_port: int = 0  # 0: a free port
    bootstrap_timeout_s: float = setting(
        30.0,
        flag="--kv-bootstrap-timeout",
        env="PDSERVE_KV_BOOTSTRAP_TIMEOUT_S",
        help="seconds a room's prefill and decode ranks may take to find each other (route "
        "look-up and registration through the bootstrap server)",
    )
    # registered, no KV yet: a room queued behind a burst at a busy prefill node waits here (a
    # burst of 32 prompts on one shared core took over 60 s, and the retry prefilled them again);
    # a dead prefill is found by the heartbeat, a failed one says so, so this is the last resort
    waiting_timeout_s: float = setting(
        300.0,
        flag="--kv-waiting-timeout",
        env="PDSERVE_KV_WAITING_TIMEOUT_S",
        help="seconds a decode room may wait for its KV once it registered its pages (a room "
        "queued behind others at a busy prefill node waits here); a prefill room, for its next "
        "chunk",
    )
    transfer_timeout_s: float = setting(
        30.0,
        flag="--kv-transfer-timeout",
        env="PDSERVE_KV_TRANSFER_TIMEOUT_S",
        help="seconds one KV write of a prefill rank to its decode ranks may take",
    )
    heartbeat_interval_s: float = setting(
        1.0,
        flag="--kv-heartbeat-interval",
        env="PDSERVE_KV_HEARTBEAT_INTERVAL_S",
        help="seconds between a rank's liveness beats to the bootstrap servers of its peers",
    )
    heartbeat_misses: int = (
        3  # bootstrap server unreachable this many beats in a row => its ranks are dead
    )
    max_inflight_descriptors: int = (
        64  # outstanding Mooncake writes per peer write; far under its queue
    )
    transfer_threads: int = 2  # per rank; more threads thrash a small CPU over TCP (see bench)
    aux_slot_bytes: int = 4096
    checksum: bool = setting(
        False,
        flag="--kv-checksum",
        env="PDSERVE_KV_CHECKSUM",
        help="debug: decode verifies a crc32 of the KV it received",
    )
    auth_token: str | None = None  # bearer token of the bootstrap server
    terminal_ttl_s: float = 60.0  # finished rooms are kept this long to answer late messages
    quarantine_s: float = setting(
        45.0,
        flag="--kv-quarantine",
        env="PDSERVE_KV_QUARANTINE_S",
        help="decode: seconds the pages of a failed room without every peer's final word wait "
        "(beyond the engine's write timeout) before reuse",
    )
    tick_s: float = 0.05

    def __post_init__(self):
        for f in (
            "bootstrap_timeout_s",
            "waiting_timeout_s",
            "transfer_timeout_s",
            "heartbeat_interval_s",
            "tick_s",
        ):
            if not getattr(self, f) > 0:
                raise ValueError(f"{_named(f)} must be > 0, got {getattr(self, f)}")
        for f in ("quarantine_s", "terminal_ttl_s"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"{_named(f)} must be >= 0, got {getattr(self, f)}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"{_named('protocol')} must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        if (
            self.max_inflight_descriptors < 1
            or self.transfer_threads < 1
            or self.heartbeat_misses < 1
        ):
            raise ValueError(
                "max_inflight_descriptors, transfer_threads and heartbeat_misses must be >= 1"
            )
        if self.aux_slot_bytes <= AUX_HEADER.size:
            raise ValueError(f"aux_slot_bytes must exceed the {AUX_HEADER.size}-byte header")

    def to_spec(self) -> dict[str, Any]:
        """What a node sends each of its ranks (PDRankSpec.transfer, JSON): every field but the
        rank's own address and the cluster secret."""
        out = dataclasses.asdict(self)
        for name in RANK_FIELDS:
            del out[name]
        return out

    @classmethod
    def from_spec(cls, spec: dict[str, Any], host: str, auth_token: str | None) -> TransferConfig:
        """A rank's, from its spec's `transfer` (to_spec) and its own address and secret;
        ValueError names a field that is wrong or unknown."""
        if set(spec) & set(RANK_FIELDS):
            raise ValueError(f"a spec's transfer settings hold no {', '.join(RANK_FIELDS)}")
        return config_from_dict(cls, {**spec, "host": host, "auth_token": auth_token})


def _named(name: str) -> str:
    """A field's name, with its flag where it is a setting: what an operator reads in an error."""
    f = next(f for f in fields(TransferConfig) if f.name == name)
    spec = f.metadata.get(SETTING)
    return f"{name} ({spec.flag})" if spec is not None and spec.flag else name
