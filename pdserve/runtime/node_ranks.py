"""What ranks a node starts on this host, and with what: the rank specs (runtime/rank_spec.py),
their cores (runtime/placement.py), PP stages and the TP ranks of each stage
(docs/ARCHITECTURE.md sections 1 and 15)."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, replace
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.runtime.node_config import NodeConfig
from pdserve.runtime.placement import (
    Placement,
    bind_cores,
    parse_cpus,
    parse_io_cpus,
    plan_placement,
)
from pdserve.runtime.rank_spec import RankSpec

log = logging.getLogger("pdserve.serve")


def local_ranks(cfg: NodeConfig) -> list[int]:
    per = cfg.pp // cfg.nnodes  # NodeConfig checked that it divides
    return list(range(cfg.node_rank * per, (cfg.node_rank + 1) * per))


def node_placement(cfg: NodeConfig, n_local: int) -> Placement:
    """This node's rank cores: `--cpus` as given (from `pdserve up`'s host-wide plan), else planned
    over the cores this process may use."""
    try:
        if cfg.cpus:
            io = parse_io_cpus(cfg.io_cpus) if cfg.io_cpus else ()
            return Placement(parse_cpus(cfg.cpus, n_local), io)
        plan = plan_placement(n_local, sorted(os.sched_getaffinity(0)), cfg.engine.threads)
        return (
            plan if cfg.io_cpus is None else Placement(plan.rank_cores, parse_io_cpus(cfg.io_cpus))
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None


def engine_dict(engine: EngineConfig, threads: int, io_cores=()) -> dict[str, Any]:
    """The engine settings every rank gets (EngineConfig.from_kwargs on the rank), with the
    threads and helper cores of this host's plan; the model travels in RankSpec.model."""
    out = asdict(
        replace(engine, threads=threads, spare_cores=tuple(spare_cores(io_cores, threads)))
    )
    del out["model"]
    return out


def advertise_host(cfg: NodeConfig) -> str:
    """The address other hosts reach this one at (Mooncake, control sockets, stats)."""
    host = cfg.advertise_host or cfg.host
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def spare_cores(io_cores, threads: int) -> list[int]:
    """Where a rank's prefill helper may run (engine/kernels/spare_core.py): the plan's I/O cores,
    for a rank with one compute thread. Never another rank's core: on a 2-core `pdserve up` host
    (no I/O core) a helper on the other node's core raised the decode rank's ITL tail
    (measured: bench/results/HISTORY.md)."""
    return sorted(io_cores) if threads == 1 else []


TP_ROLES = ("colocated", "prefill", "decode")  # the nodes that take --tp


def make_specs(
    cfg: NodeConfig,
    role: str,
    front_addrs: dict[str, str],
    spec_cls: type[RankSpec] = RankSpec,
    spec_fields: dict[str, Any] | None = None,
    dist_port: int | None = None,
    tp_port: int | None = None,
) -> list[RankSpec]:
    """The spec of each of this host's ranks, TP ranks of a stage next to each other; `spec_fields`:
    what a kind of node's `spec_cls` adds (PDRankSpec: where its transfer listens); `dist_port` and
    `tp_port`: where PP0 hosts the PP group's and the TP groups' rendezvous on a single host (ports
    the caller holds with reserve_port)."""
    ranks = local_ranks(cfg)
    if not cfg.dist_init_addr and dist_port is None:
        raise ValueError("make_specs: a single-host node needs dist_port (a reserve_port hold)")
    if cfg.tp > 1 and role not in TP_ROLES:
        raise SystemExit(f"--tp {cfg.tp}: a {role} node has no TP yet")
    if cfg.tp > 1 and tp_port is None:
        raise ValueError("make_specs: a TP node needs tp_port (a reserve_port hold)")
    if cfg.tp > 1 and cfg.device != "cpu":  # the group is gloo, and one GPU would hold every rank
        raise SystemExit(f"--tp {cfg.tp}: TP runs on the CPU only (--device cpu) for now")
    dist = f"tcp://{cfg.dist_init_addr}" if cfg.dist_init_addr else f"tcp://127.0.0.1:{dist_port}"
    plan = node_placement(cfg, len(ranks) * cfg.tp)
    try:
        moves = {role: parse_cpus(text, len(ranks)) for role, text in cfg.role_cpus.items()}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    names = [
        f"{role} pp{r}" + (f" tp{t}" if cfg.tp > 1 else "") for r in ranks for t in range(cfg.tp)
    ]
    log.debug("placement: %s", plan.describe(names))
    # the front; each rank binds itself to its own cores
    bind_cores(parse_io_cpus(cfg.front_cpus) if cfg.front_cpus else plan.io_cores)
    common = _stage_fields(cfg, role, dist, tp_port, spec_fields)
    specs = []
    for i, r in enumerate(ranks):
        for t in range(cfg.tp):
            cores = plan.rank_cores[i * cfg.tp + t]
            # a TP follower talks to no one outside its group but its stats push, and times nothing
            lead = t == 0
            specs.append(
                spec_cls(
                    engine=engine_dict(cfg.engine, cfg.engine.threads or len(cores), plan.io_cores),
                    pp_rank=r,
                    tp_rank=t,
                    cpus=list(cores),
                    req_addr=front_addrs.get("req", "") if lead else "",
                    evt_addr=front_addrs.get("evt", "") if lead else "",
                    stats_addr=front_addrs.get("stats", ""),  # a follower: its KV counters
                    waiting_timeout_s=cfg.waiting_timeout if lead else 0.0,
                    running_timeout_s=cfg.running_timeout if lead else 0.0,
                    role_cpus={role: list(cores[i]) for role, cores in moves.items()},
                    **common,
                )
            )
    return specs


def _stage_fields(
    cfg: NodeConfig, role: str, dist: str, tp_port: int | None, more: dict[str, Any] | None
) -> dict[str, Any]:
    """The spec fields every rank of the node shares."""
    return dict(
        model=cfg.engine.model,
        pp_size=cfg.pp,
        dist_init=dist,
        host=advertise_host(cfg) if cfg.nnodes > 1 else "127.0.0.1",
        async_depth=cfg.async_depth,
        skip_pure_chunk_comm=cfg.skip_pure_chunk_comm,
        watchdog_s=cfg.watchdog,
        pp_timeout_s=cfg.pp_timeout,
        load_timeout_s=cfg.load_timeout,
        role=role,
        device=cfg.device,
        backend="nccl" if cfg.device.startswith("cuda") else "gloo",
        comm_stream=cfg.pp_comm_stream,
        tp_size=cfg.tp,
        tp_init=f"tcp://127.0.0.1:{tp_port}" if cfg.tp > 1 else "",
        **(more or {}),
    )
