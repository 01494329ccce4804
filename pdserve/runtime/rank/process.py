"""One PP rank of a node: `main(["--spec", JSON])`, in a process forked by a rank zygote
(infra/zygote.py); `python -m pdserve.runtime.rank.process --spec JSON` runs one too.

Loads its layer slice, joins the node's PP group, agrees on capacities, and runs the slot loop
until told to stop. PP0 talks to the front over ZMQ; every rank pushes its stats (queues, pool) to
the front twice a second, which is also the front's liveness signal. A watchdog ends the rank when
it makes no progress for `watchdog_s` seconds; any communication error (a dead peer) ends it too,
with one clear log line and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import zmq

from pdserve.consensus import rank_checker
from pdserve.engine.config import EngineConfig, apply_threads
from pdserve.engine.grammar import GrammarSampler
from pdserve.engine.kernels import cpu_kernels, spare_core, switches
from pdserve.engine.model.config import split_layers
from pdserve.engine.model.detokenizer import StopDetokenizer
from pdserve.engine.model.loader import load_model_config, load_slice, resolve_model
from pdserve.engine.model.tensor_parallel import TPShard
from pdserve.engine.model.tokenizer import load_tokenizer
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.window_pages import windowed_pool_pages
from pdserve.infra.logs import setup_logging
from pdserve.infra.procs import die_with_parent, exit_on_stop_signals, set_process_name
from pdserve.runtime.placement import bind_cores
from pdserve.runtime.rank.front_link import StatsReporter, ZmqFrontIO
from pdserve.runtime.rank.pp_comm import PPComm
from pdserve.runtime.rank.rank_loop import RankLoop
from pdserve.runtime.rank.slot_loop import LoopConfig, SlotLoop
from pdserve.runtime.rank.tp_group import FollowerFront, TPFollowLink, TPGroup, TPLeadLink
from pdserve.runtime.rank_spec import RankSpec

# What a rank imports lazily and a rank zygote (infra/zygote.py) imports once for all its children:
# the last stage's grammar warm-up (engine/grammar.py) imports xgrammar, about 1.8 s of CPU here.
ZYGOTE_PRELOAD = ("xgrammar",)

log = logging.getLogger("pdserve.rank")


def start_watchdog(loop: RankLoop, timeout_s: float) -> None:
    loop.stats.last_progress = time.monotonic()  # counted from here, not from the loop's build

    def watch():
        while True:
            time.sleep(min(1.0, timeout_s / 4))
            stalled = time.monotonic() - loop.stats.last_progress
            if stalled > timeout_s:
                s = loop.sched
                log.error(
                    "watchdog: no progress for %.0f s on pp_rank %d; waiting=%s running=%s "
                    "free_pages=%d/%d; exiting",
                    stalled,
                    loop.rank,
                    [r.rid for r in s.waiting][:20],
                    [[r.rid for r in slot] for slot in s.slots],
                    s.allocator.num_free,
                    s.allocator.num_pages,
                )
                logging.shutdown()
                os._exit(3)

    threading.Thread(target=watch, name="watchdog", daemon=True).start()


@dataclass
class RankParts:
    """What a rank is made of; a PD loop builds its own pieces (KV manager, votes) on top."""

    spec: RankSpec
    cfg: EngineConfig
    mcfg: Any
    comm: PPComm | None
    runner: ModelRunner
    sched: Scheduler
    loop_cfg: LoopConfig
    front: ZmqFrontIO | FollowerFront | None = None
    about: str = ""  # for the ready line: layers, threads, cores, dtype


def join_pp_group(spec: RankSpec) -> PPComm:
    return PPComm(
        spec.pp_rank,
        spec.pp_size,
        init_method=spec.dist_init,
        backend=spec.backend,
        timeout_s=spec.pp_timeout_s,
        device=spec.device,
        comm_stream=spec.comm_stream,
        host=spec.host,
    )


def join_tp_group(spec: RankSpec) -> TPGroup:
    return TPGroup(
        spec.tp_rank,
        spec.tp_size,
        stage=spec.pp_rank,
        init_method=spec.tp_init,
        world=spec.pp_size * spec.tp_size,
        hosts_store=spec.pp_rank == 0 and spec.tp_rank == 0,
        timeout_s=spec.pp_timeout_s,
        host=spec.host,
    )


def stage_link(spec: RankSpec, comm: Any) -> Any:
    """The rank's link to the rest of its node: its PP link (None for a lone rank), or in a TP
    group its lead's view of it (runtime/rank/tp_group.py)."""
    tp = join_tp_group(spec) if spec.tp_size > 1 else None
    if spec.pp_size > 1 and comm is None and (tp is None or tp.is_lead):
        comm = join_pp_group(spec)
    if tp is None:
        return comm
    if tp.is_lead:
        return TPLeadLink(comm, tp, spec.pp_rank, spec.pp_size)
    return TPFollowLink(tp, spec.pp_rank, spec.pp_size)


def rank_name(spec: RankSpec, short: bool = False) -> str:
    """How logs name the rank: decode-pp1, or colocated-pp0-tp1 in a TP group; `short`: as `ps`
    shows it, in the 15 bytes a process name keeps (coloc-pp0-tp1)."""
    if spec.tp_size == 1:
        return f"{spec.role}-pp{spec.pp_rank}"
    role = spec.role[:5] if short else spec.role
    return f"{role}-pp{spec.pp_rank}-tp{spec.tp_rank}"


def agree_capacities(comm: PPComm, cfg: EngineConfig) -> EngineConfig:
    """Capacities every decision reads are agreed once: the minimum over ranks."""
    lo, _ = comm.all_min_max(
        [
            cfg.num_pages,
            cfg.max_running,
            cfg.chunk_size,
            cfg.max_batch_tokens,
            cfg.mixed_prefill_tokens,
            cfg.fair_prefill_tokens,
        ]
    )
    return replace(
        cfg,
        max_total_tokens=lo[0] * cfg.page_size,
        max_running=lo[1],
        chunk_size=lo[2],
        max_batch_tokens=lo[3],
        mixed_prefill_tokens=lo[4],
        fair_prefill_tokens=lo[5],
    )


def plant_divergence_if_asked(spec: RankSpec, runner: ModelRunner) -> None:
    """Test-only: a rank-local allocation the other ranks do not make, the kind of bug the
    consensus checker exists for; this rank then hands out different page ids. Only the
    environment the rank was started with can ask for it (no request or message can), and only
    with the checker on, which stops the node at the first diverging call: never wrong output."""
    me = str(spec.pp_rank) if spec.tp_size == 1 else f"{spec.pp_rank}.{spec.tp_rank}"
    if os.environ.get("PDSERVE_TEST_PLANT_DIVERGENCE") != me:
        return
    if rank_checker.ENABLED:
        log.warning(
            "PDSERVE_TEST_PLANT_DIVERGENCE: planting a divergence on %s (test only)",
            rank_name(spec),
        )
        runner.pool.allocator.alloc(1)


def build_rank(
    spec: RankSpec,
    *,
    hold_kv_on_finish: bool = False,
    prefix_cache: bool | None = None,
    comm: Any = None,
) -> RankParts:
    """Loads the rank's slice and builds its runner and scheduler. `comm`: a PP group end to use
    instead of joining `spec.dist_init` (the in-memory one of runtime/rank/pp_comm_memory.py, when
    the tests run a node's ranks as threads); None: a PP>1 rank joins the torch.distributed
    group."""
    cfg = EngineConfig.from_kwargs(model=spec.model, **spec.engine)
    switches.use(cfg.kernels)  # before any kernel decision (engine/kernels/switches.py)
    threads = apply_threads(cfg.threads)  # 0: every core this rank is bound to
    path = resolve_model(cfg.model)
    mcfg = load_model_config(path)
    asked = cfg.dtype
    cfg = cfg.for_model(mcfg.dtype, "cuda" if spec.device.startswith("cuda") else "cpu")
    start, end = split_layers(mcfg.num_layers, spec.pp_size)[spec.pp_rank]
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    why = f"asked: {asked}" if asked != "auto" else f"auto; the model's weights are {mcfg.dtype}"
    about = (
        f"layers [{start}, {end}) of {mcfg.num_layers}, {threads} torch threads on cores {cores}, "
        f"dtype {cfg.dtype} ({why})"
    )
    log.debug("pp_rank %d/%d: %s", spec.pp_rank, spec.pp_size, about)
    comm = stage_link(spec, comm)
    if comm is not None:
        cfg = agree_capacities(comm, cfg)
    tp = comm.tp if comm is not None else None
    runner, loaded = _load_runner(spec, cfg, mcfg, path, (start, end), threads, tp)
    about += loaded
    plant_divergence_if_asked(spec, runner)
    loop_cfg = LoopConfig(
        pp_size=spec.pp_size,
        async_depth=spec.async_depth,
        skip_pure_chunk_comm=spec.skip_pure_chunk_comm,
        waiting_timeout_s=spec.waiting_timeout_s,
        running_timeout_s=spec.running_timeout_s,
    )
    sched = _scheduler(cfg, mcfg, path, runner, loop_cfg, prefix_cache, hold_kv_on_finish)
    if comm is not None:
        if spec.device == "cpu":
            cpu_kernels.load()  # a first build (minutes on a slow machine) belongs to the load too
        # No rank sends a PP message before every slice is loaded: a receive waits --pp-timeout
        # for one message, and a peer dequantising a big file can take longer than that.
        comm.wait_for_peers("loaded", spec.load_timeout_s)
    return RankParts(spec, cfg, mcfg, comm, runner, sched, loop_cfg, about=about)


def _load_runner(
    spec: RankSpec,
    cfg: EngineConfig,
    mcfg: Any,
    path: Path,
    layers: tuple[int, int],
    threads: int,
    tp: TPGroup | None = None,
) -> tuple[ModelRunner, str]:
    """Loads layers [start, end) and builds their runner, after the capacities were agreed; and
    what the ready line adds about them (small-batch weights, the spare-core helper)."""
    start, end = layers
    about = ""
    shard = TPShard()
    if tp is not None:  # this rank's share of each layer; the group sums the partial outputs
        shard = TPShard(tp.rank, tp.size, tp.reduce_)
        about += f", TP rank {tp.rank} of {tp.size}"
    model = load_slice(path, start, end, cfg.torch_dtype, shard)
    model.logits = tp is None or tp.is_lead  # a follower takes its lead's tokens (slot_loop.py)
    if cfg.small_batch_weights:
        about += ", " + model.add_small_batch_weights(
            lambda: load_slice(path, start, end, None, shard),  # fp32
            batch_invariant=cfg.batch_invariant,
        )
    helper = (
        spare_core.start(cfg.spare_cores, threads, cfg.torch_dtype, blocked=model.blocked_matmuls())
        if spec.device == "cpu"
        else ""
    )
    about += f", {helper}" if helper else ""
    max_ctx = min(cfg.max_context, mcfg.max_position_embeddings)
    pages, sliding = windowed_pool_pages(cfg, mcfg, max_ctx, spec.pp_size)
    runner = ModelRunner(model, pages, cfg.page_size, cfg.torch_dtype, cfg.seed, sliding)
    if sliding:
        about += f", windowed KV pool: {pages} full and {sliding} sliding pages"
    # only the sampling rank holds grammar state (engine/grammar.py): a TP group's lead
    if model.is_last and (tp is None or tp.is_lead):
        tok = lambda: load_tokenizer(path)  # noqa: E731  (loaded at the first guided request)
        runner.grammar = GrammarSampler(tok, mcfg.vocab_size, mcfg.eos_token_ids)
        runner.grammar.warm_up_in_background()
    return runner, about


def _scheduler(cfg, mcfg, path, runner, loop_cfg, prefix_cache, hold_kv_on_finish) -> Scheduler:
    sched_cfg = replace(
        cfg.scheduler_config(num_slots=loop_cfg.num_slots, enable_prefix_cache=prefix_cache),
        max_context=min(cfg.max_context, mcfg.max_position_embeddings),
        window=mcfg.sliding_window,
    )
    return Scheduler(
        sched_cfg,
        runner.pool.allocator,
        mcfg.eos_token_ids,
        detokenize=StopDetokenizer(path),
        hold_kv_on_finish=hold_kv_on_finish,
        sliding_allocator=runner.pool.sliding_allocator,
    )


def colocated_loop(parts: RankParts) -> SlotLoop:
    return SlotLoop(parts.loop_cfg, parts.comm, parts.runner, parts.sched, parts.front)


def _become_rank(spec: RankSpec) -> None:
    """The process settings of a rank, before it builds anything."""
    setup_logging(f"[{rank_name(spec).replace('-', ' ', 1)}]")
    set_process_name(rank_name(spec, short=True))  # e.g. decode-pp1
    rank_checker.configure_from_env()  # forked from a zygote: imported under its environment
    bind_cores(spec.cpus)  # before any thread starts: OpenMP's and the transfer's inherit it
    die_with_parent()
    exit_on_stop_signals(log, f"pp_rank {spec.pp_rank}")  # logs who stopped it


def run_rank(
    argv: list[str] | None,
    make_loop: Callable[[RankParts], RankLoop] = colocated_loop,
    build_kwargs: dict[str, Any] | None = None,
    spec_cls: type[RankSpec] = RankSpec,
) -> int:
    """Parses the spec (a `spec_cls`), builds the rank and runs its loop until SIGTERM or a fatal
    error."""
    ap = argparse.ArgumentParser(description="one PP rank (started by a node launcher)")
    ap.add_argument("--spec", required=True, help="RankSpec as JSON")
    try:
        spec = spec_cls.from_json(ap.parse_args(argv).spec)
    except ValueError as e:  # a MessageError, or JSONDecodeError
        ap.error(f"--spec: {e}")
    _become_rank(spec)
    ctx = zmq.Context()
    loop = None
    try:
        parts = build_rank(spec, **(build_kwargs or {}))
        if spec.pp_rank == 0:  # only PP0's TP lead talks to the front
            lead = spec.tp_rank == 0
            parts.front = ZmqFrontIO(ctx, spec.req_addr, spec.evt_addr) if lead else FollowerFront()
        loop = make_loop(parts)
        stats = StatsReporter(ctx, spec.stats_addr, spec, loop, dtype=parts.cfg.dtype)
        start_watchdog(loop, spec.watchdog_s)
        more = loop.describe()
        log.info(
            "pp_rank %d/%d ready: %s, %d KV pages of %d tokens%s",
            spec.pp_rank,
            spec.pp_size,
            parts.about,
            parts.sched.allocator.num_pages,
            parts.cfg.page_size,
            f", {more}" if more else "",
        )
        stats.maybe_send(force=True)
        t = 0
        while True:
            loop.iteration(t)
            stats.maybe_send()
            t += 1
    except (SystemExit, KeyboardInterrupt):
        return 0
    except Exception as e:
        log.error(
            "pp_rank %d stops: %s: %s",
            spec.pp_rank,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
        logging.shutdown()
        os._exit(1)
    finally:
        if loop is not None:
            loop.close()
        ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    return run_rank(argv)


if __name__ == "__main__":
    sys.exit(main())
