"""What the node front starts a rank process with (sent as JSON on its command line). Kept apart
from runtime/rank_process.py so the front can build it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankSpec:
    model: str | None
    engine: dict[str, Any]
    pp_size: int
    pp_rank: int
    dist_init: str  # tcp://host:port of the PP group's rendezvous
    req_addr: str = ""  # front -> PP0 (PP0 only)
    evt_addr: str = ""  # PP0 -> front (PP0 only)
    stats_addr: str = ""  # every rank -> front
    async_depth: int = 0
    skip_pure_chunk_comm: bool = True
    watchdog_s: float = 120.0
    pp_timeout_s: float = 60.0
    backend: str = "gloo"
    device: str = "cpu"
    role: str = "colocated"
    cpus: list[int] = field(default_factory=list)  # cores this rank's threads own; [] = unbound
    extra: dict[str, Any] = field(default_factory=dict)
