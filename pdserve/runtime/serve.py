"""`pdserve serve`: a colocated PP node (front + one process per PP rank); the PD nodes build on it.

The launcher starts the front's sockets, starts the local rank processes, watches them, and serves
HTTP. A rank that exits marks the node unhealthy (the front answers 503 and fails what is pending)
and the launcher stops the other ranks: nothing is left half-alive. Ctrl-C or SIGTERM stops all.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Any

import uvicorn

from pdserve.infra.http_server import run_server, server_config
from pdserve.infra.internal_auth import refuse_unprotected_bind
from pdserve.infra.logs import setup_logging, uvicorn_level
from pdserve.infra.procs import reserve_port, stop_processes
from pdserve.infra.tracing import make_exporter
from pdserve.infra.zygote_client import Zygote, ZygoteChild
from pdserve.runtime.front.drain import Drain
from pdserve.runtime.front.tokenizer_loading import TokenizerLoading
from pdserve.runtime.node_config import NodeConfig
from pdserve.runtime.node_ranks import advertise_host, make_specs
from pdserve.runtime.rank_spec import RankSpec

log = logging.getLogger("pdserve.serve")


class DrainingServer(uvicorn.Server):
    """The node's HTTP server: its first SIGTERM drains the node (runtime/front/drain.py), which
    stops the server once the node has handed its work on; a second SIGTERM, or SIGINT, stops it
    at once."""

    drain: Drain | None = None
    loops: dict[str, asyncio.AbstractEventLoop] = {}

    def handle_exit(self, sig: int, frame) -> None:
        loop = self.loops.get("loop")
        if sig == signal.SIGTERM and self.drain is not None and self.drain.task is None and loop:
            log.warning("SIGTERM: draining (a second SIGTERM stops the node at once)")
            loop.call_soon_threadsafe(self.drain.start)
            return
        super().handle_exit(sig, frame)


class RankSet:
    """The local rank processes of a node, forked by a rank zygote (infra/zygote.py: the shared
    one PDSERVE_RANK_ZYGOTE names, or the node's own), and a thread that notices when one of them
    exits."""

    def __init__(
        self, specs: list[RankSpec], on_exit, module: str = "pdserve.runtime.rank.process"
    ):
        self.on_exit = on_exit
        self._stopping = False
        self.zygote = Zygote.shared_or_start([module])
        self.procs: list[ZygoteChild] = [
            self.zygote.fork(module, ["--spec", spec.to_json()]) for spec in specs
        ]
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping:
            for i, p in enumerate(self.procs):
                rc = p.poll()
                if rc is not None and not self._stopping:
                    self.on_exit(f"rank process {p.pid} (local #{i}) exited with code {rc}")
                    self.stop()
                    return
            time.sleep(0.2)

    def stop(self) -> None:
        self._stopping = True
        stop_processes(self.procs)
        self.zygote.close()


def refuse_unprotected(cfg: NodeConfig, role: str, ranks_listen: bool) -> str | None:
    """The cluster secret; stops the process when this host's part of the node would listen beyond
    loopback without one (and no --insecure): its HTTP front (--host) and, when its ranks listen
    (RankSpec.ranks_listen: the PD nodes' KV control sockets), the host they advertise
    (--advertise-host)."""
    from pdserve.infra.cluster_secret import cluster_secret

    secret = cluster_secret()
    hosts = [cfg.host] + ([advertise_host(cfg)] if ranks_listen else [])
    for host in dict.fromkeys(hosts):
        refuse_unprotected_bind(host, secret, cfg.insecure, f"pdserve {role}")
    return secret


def front_host(cfg: NodeConfig) -> str:
    return cfg.host if cfg.nnodes > 1 else "127.0.0.1"


def stats_port(cfg: NodeConfig) -> int:
    """Multi-host: the front takes its ranks' stats on the rendezvous port + 1."""
    if cfg.nnodes > 1 and cfg.dist_init_addr:
        return int(cfg.dist_init_addr.rsplit(":", 1)[1]) + 1
    return 0


def _draining_server(cfg: NodeConfig, front, app) -> DrainingServer:
    """The node's HTTP server, which a drain (SIGTERM, POST /drain) ends once it is over."""
    server = DrainingServer(
        server_config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level=uvicorn_level(),
            timeout_graceful_shutdown=3,
        )
    )
    server.drain = app.state.drain = Drain(
        front, cfg.drain_grace, lambda: setattr(server, "should_exit", True)
    )
    server.loops = {}
    return server


def run_node(
    cfg: NodeConfig,
    front,
    app,
    role: str,
    spec_fields: dict[str, Any] | None = None,
    module: str = "pdserve.runtime.rank.process",
) -> int:
    """Starts the ranks (each with its front's kind of spec, NodeFront.rank_spec), serves HTTP
    until stopped, then stops every rank."""
    # held for the node's life, so no other process's free_port picks the rendezvous port before
    # pp_rank 0 binds it (its TCPStore binds with SO_REUSEADDR, through the hold)
    holds = [reserve_port() for _ in range(2 if cfg.tp > 1 else 1)]  # + the TP groups' rendezvous
    ports = [h.getsockname()[1] for h in holds]
    ranks = None
    try:
        specs = make_specs(
            cfg,
            role,
            {"req": front.req_addr, "evt": front.evt_addr, "stats": front.stats_addr},
            front.rank_spec,
            spec_fields,
            dist_port=ports[0],
            tp_port=ports[-1] if cfg.tp > 1 else None,
        )
        server = _draining_server(cfg, front, app)
        loop_holder: dict[str, asyncio.AbstractEventLoop] = server.loops

        def on_rank_exit(why: str) -> None:
            loop = loop_holder.get("loop")
            if loop is not None:
                loop.call_soon_threadsafe(front.mark_dead, why)
            else:
                front.dead = why

        ranks = RankSet(specs, on_rank_exit, module)
        ready = getattr(front.tok, "ready", None)

        @app.on_event("startup")
        async def _grab_loop():
            loop_holder["loop"] = asyncio.get_running_loop()
            more = front.describe()
            tp = f", tp={cfg.tp}" if cfg.tp > 1 else ""
            where = f"http://{cfg.host}:{cfg.port} (pp={cfg.pp}{tp})"
            log.info("%s node front on %s%s", role, where, f", {more}" if more else "")

        if ready is not None:
            ready()  # a tokenizer that cannot load stops the node now, with its error
        run_server(server)
    finally:
        if ranks is not None:
            ranks.stop()
        for h in holds:
            h.close()
    return 0


def make_front(cfg: NodeConfig, role: str, cls=None, **kw):
    """The front of a node of `role`: tokenizer, sockets, metrics, and its FastAPI app."""
    from pdserve.engine.model.config import tp_refusal
    from pdserve.engine.model.loader import load_model_config, load_sampling_defaults, resolve_model
    from pdserve.runtime.front.http_app import build_app
    from pdserve.runtime.front.metrics import NodeMetrics
    from pdserve.runtime.front.process import NodeFront

    setup_logging(f"[{role} front]", cfg.log_level, cfg.log_format)
    cls = cls or NodeFront
    # the ranks read the secret too: children inherit the environment
    secret = refuse_unprotected(cfg, role, cls.rank_spec.ranks_listen)
    if not secret:
        log.warning(
            "no cluster secret (PDSERVE_INTERNAL_TOKEN): internal endpoints are open to local users"
        )
    path = resolve_model(cfg.engine.model)
    mcfg = load_model_config(path)
    if tp_refusal(mcfg, cfg.tp):
        raise SystemExit(f"--tp: {tp_refusal(mcfg, cfg.tp)}")
    name = path.name.split(".")[0] if path.suffix == ".gguf" else path.name  # SmolLM2-135M-Instruct
    front = cls(
        TokenizerLoading(path),
        model_name=name,
        role=role,
        pp_size=cfg.pp,
        max_context=min(cfg.engine.max_context, mcfg.max_position_embeddings),
        vocab_size=mcfg.vocab_size,
        host=front_host(cfg),
        stats_port=stats_port(cfg),
        **kw,
    )
    front.metrics = NodeMetrics(
        f"{cfg.host}:{cfg.port}",
        role,
        front.finish_reasons,
        cls.metrics_extension,
        role_now=front.metrics_role,
        roles=front.metrics_roles,
    )
    front.tracing.exporter = make_exporter(cfg.otlp_traces_endpoint, role)
    front.max_pending = cfg.max_pending
    front.guide_gate.timeout_s = cfg.grammar_compile_timeout
    front.prefix_cache = cfg.engine.enable_prefix_cache
    front.sampling_defaults = load_sampling_defaults(path)
    if front.sampling_defaults.get("unapplied"):
        log.warning(
            "generation_config defaults pdserve does not apply: %s",
            front.sampling_defaults["unapplied"],
        )
    return front, build_app(front, secret)


def run_remote_ranks(
    cfg: NodeConfig,
    role: str,
    module: str,
    spec_cls: type[RankSpec] = RankSpec,
    spec_fields: dict[str, Any] | None = None,
) -> int:
    """--node-rank > 0: this host runs its share of the node's ranks; the front is on rank 0."""
    setup_logging(f"[{role} node-rank {cfg.node_rank}]", cfg.log_level, cfg.log_format)
    # these ranks' sockets are as reachable as node-rank 0's
    refuse_unprotected(cfg, role, spec_cls.ranks_listen)
    port = stats_port(cfg)
    host0 = cfg.rendezvous_host()
    specs = make_specs(cfg, role, {"stats": f"tcp://{host0}:{port}"}, spec_cls, spec_fields)
    stopped = threading.Event()

    def on_exit(why: str) -> None:
        log.error("%s; stopping", why)
        stopped.set()

    ranks = RankSet(specs, on_exit, module)
    try:
        while not stopped.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        ranks.stop()
    return 1 if stopped.is_set() else 0


def serve_main(cfg: NodeConfig) -> int:
    if cfg.node_rank > 0:
        return run_remote_ranks(cfg, "colocated", "pdserve.runtime.rank.process")
    front, app = make_front(cfg, "colocated")
    return run_node(cfg, front, app, "colocated")
