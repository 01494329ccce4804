"""What the node front starts a rank process with (JSON in its argv, checked strictly on
arrival). Kept apart from runtime/rank/process.py so the front can build it without importing
torch. A kind of node with more to say subclasses it (pd_common/messages.PDRankSpec), and names
that class in its front (NodeFront.rank_spec) and its rank entry point (run_rank's spec_cls)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.runtime.messages import from_mapping


@dataclass(frozen=True)
class RankSpec:
    model: str | None
    engine: dict[str, Any]  # EngineConfig fields (EngineConfig.from_kwargs checks them)
    pp_size: int
    pp_rank: int
    dist_init: str  # tcp://host:port of the PP group's rendezvous
    host: str = "127.0.0.1"  # this rank's own address: its PP group (gloo) listens there only
    req_addr: str = ""  # front -> PP0 (PP0 only)
    evt_addr: str = ""  # PP0 -> front (PP0 only)
    stats_addr: str = ""  # every rank -> front
    async_depth: int = 0
    skip_pure_chunk_comm: bool = True
    watchdog_s: float = 120.0
    pp_timeout_s: float = 60.0
    load_timeout_s: float = 600.0  # how long a rank waits for its peers to load their slices
    backend: str = "gloo"
    device: str = "cpu"
    role: str = "colocated"
    cpus: list[int] = field(default_factory=list)  # cores this rank's threads own; [] = unbound
    waiting_timeout_s: float = 0.0  # PP0 aborts a request queued longer (0 = off)
    running_timeout_s: float = 0.0  # PP0 aborts a request alive longer (0 = off)
    comm_stream: bool = False  # PP sends on their own CUDA stream
    # tensor parallelism inside the stage (runtime/rank/tp_group.py): this rank's place in its
    # stage's group, and the node's TP rendezvous (tcp://host:port, served by PP0's TP rank 0)
    tp_size: int = 1
    tp_rank: int = 0
    tp_init: str = ""
    # an elastic node's: this rank's cores in each role it may take, where its threads move when
    # the node changes role ({}: they stay on `cpus`)
    role_cpus: dict[str, list[int]] = field(default_factory=dict)
    # whether the ranks bind sockets beyond the front link that other hosts reach (a PD node's KV
    # control): runtime/serve.refuse_unprotected checks the host they advertise
    ranks_listen: ClassVar[bool] = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        """Raises ValueError (MessageError) naming what is wrong."""
        return from_mapping(cls, json.loads(text))
