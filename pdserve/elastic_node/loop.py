"""The rank loop of an elastic node: a prefill or a decode loop, replaced by the other at a flip
that every rank of the node makes at the end of the same iteration (docs/ARCHITECTURE.md
section 14).

    SetRole(role)   arrives in the meta stream, so every rank applies it in the same iteration
                    and at the same place among the requests (`PDLoop._set_role`): from there the
                    loop admits no request (each is refused with `role_change`, PP0 answers)
    drain           the requests it holds finish as usual: prefill rooms through their release
                    vote, decode streams to their end, failed rooms through quarantine
    flip            at the end of an iteration where the loop is drained (`PDLoop.drained`, a pure
                    function of replicated state) for the L-th iteration in a row, every rank
                    builds the new role's loop over the same model, pool, scheduler and PP link,
                    and that role's transfer end (`RoleEnds`). The weights are not reloaded.

Why L quiet iterations (L = pp_size + async_depth, the slots): a batch scheduled in iteration t
is harvested in t + L - 1, and a vote cast in t is applied then. After L iterations with nothing
held and every batch empty, no output, hidden state or verdict that names a request is on any
link. What is still in flight is the vote ring's metronome: the empty verdicts of the last L - 1
slots. Both roles' loops therefore share one `RingVote` over the kinds of both, so the new loop
takes those verdicts exactly where the old one left them.

A rank keeps each role's transfer end for its life once made (`RoleEnds`): its KV manager (control
port, aux buffer, Mooncake session, bootstrap registration: what peers have cached about it) and
the prefill consensus store stay open, idle while the other role serves, and one set of transfer
counters covers both, so the node's counters never go back at a flip.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from pdserve.consensus.rank_checker import rank_consensus
from pdserve.consensus.vote import KINDS, RingVote
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.infra.affinity import move_threads
from pdserve.pd_common.loop_base import PDLoop, vote_transport
from pdserve.pd_common.messages import KVRankStats
from pdserve.runtime.rank.process import RankParts
from pdserve.runtime.rank.slot_loop import FrontIO, LoopStats
from pdserve.runtime.rank.spans import RankSpans

log = logging.getLogger("pdserve.elastic")


class RoleEnds(Protocol):
    """Each role's transfer end, made at the role's first use and kept for the rank's life."""

    def loop(self, role: str, parts: RankParts, vote: RingVote) -> PDLoop:
        """`role`'s loop over the rank's parts, the shared vote and the role's transfer end (a
        loop that does not own it: `PDLoop.owns_transfer` False)."""
        ...

    def close(self) -> None:
        """Closes every transfer end made."""
        ...


class ElasticLoop:
    """One rank of an elastic node: runs its current role's loop, and flips it (see above). It
    offers what the rank's process, its stats reporter and its watchdog use of a loop."""

    def __init__(self, parts: RankParts, role: str, ends: RoleEnds):
        self.parts, self.ends = parts, ends
        slots = parts.loop_cfg.num_slots
        self.vote = RingVote(vote_transport(parts.comm, slots), slots, kinds=KINDS)
        self.loop = self._build(role)
        self.quiet = 0  # iterations in a row the loop was drained while leaving its role
        self.flips = 0

    def _build(self, role: str) -> PDLoop:
        # a prefill rank keeps a finished prompt's pages until its transfer was released
        self.parts.sched.hold_kv_on_finish = role == "prefill"
        return self.ends.loop(role, self.parts, self.vote)

    @property
    def role(self) -> str:
        return self.loop.role

    def iteration(self, t: int) -> None:
        self.loop.iteration(t)
        target = self.loop.leaving_for
        if target is None:
            self.quiet = 0
            return
        self.quiet = self.quiet + 1 if self.loop.drained() else 0
        if self.quiet >= self.parts.loop_cfg.num_slots:
            self._flip(target, t)

    @rank_consensus("pd_role_flip", args=lambda self, role, t: [self.loop.role, role, t])
    def _flip(self, role: str, t: int) -> None:
        old = self.loop
        new = self._build(role)
        # what the rank's process and its stats push read across the flip
        new.stats, new.samples, new.spans = old.stats, old.samples, old.spans
        new.spans.role = role
        new._kv_latencies_seen = old._kv_latencies_seen  # the counters are the rank's
        self.loop, self.quiet = new, 0
        self.flips += 1
        log.info("pp_rank %d: %s -> %s after iteration %d", new.rank, old.role, role, t)
        self._move_cores(old.role, role)

    def _move_cores(self, old: str, new: str) -> None:
        """The rank's threads onto the new role's cores, where the node names them
        (RankSpec.role_cpus; `pdserve up --elastic` plans them so that two decode ranks do not share
        a core). A local choice, no decision of the loop's: the peers need not agree on it."""
        cores = self.parts.spec.role_cpus
        if new not in cores:
            return
        was = cores.get(old) or self.parts.spec.cpus or sorted(os.sched_getaffinity(0))
        n = move_threads(was, cores[new])
        log.info("pp_rank %d: %d thread(s) moved to cores %s", self.loop.rank, n, cores[new])

    # --- what the rank's process, stats reporter and watchdog read --------------------------------
    @property
    def stats(self) -> LoopStats:
        return self.loop.stats

    @property
    def sched(self) -> Scheduler:
        return self.loop.sched

    @property
    def runner(self) -> ModelRunner:
        return self.loop.runner

    @property
    def rank(self) -> int:
        return self.loop.rank

    @property
    def front(self) -> FrontIO | None:
        return self.loop.front

    @property
    def spans(self) -> RankSpans:
        return self.loop.spans

    def queue_sizes(self) -> dict[str, int]:
        return self.loop.queue_sizes()

    def drain_samples(self) -> dict[str, list[float]]:
        return self.loop.drain_samples()

    def stats_extension(self) -> KVRankStats:
        return self.loop.stats_extension()

    def describe(self) -> str:
        return f"elastic, now {self.role}: {self.loop.describe()}"

    def close(self) -> None:
        self.loop.close()
        self.ends.close()
