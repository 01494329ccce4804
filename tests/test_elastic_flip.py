"""An elastic node (elastic_node/) changes role under load, its ranks as threads of the test process
(tests/inproc.py): the real loops, votes, consensus store and rank consensus checker, the in-memory
PP group and KV transfer.

Three nodes: E, elastic at PP 2, starts as prefill for D (a decode node at PP 2); P, a prefill
node at PP 1, prefills for E once E is a decode node. Every request of every phase is
token-identical to transformers, none fails, and nothing is left held."""

from __future__ import annotations

import time

from inproc import (
    WAIT_S,
    Cluster,
    _ids,
    _spec,
    result_of,
    running,
    settled,
)

from pdserve.decode_node import rank as decode_rank
from pdserve.elastic_node import rank as elastic_rank
from pdserve.elastic_node.loop import ElasticLoop
from pdserve.kv_transfer.in_memory import InMemoryFabric
from pdserve.kv_transfer.manager import TransferConfig
from pdserve.pd_common.messages import PDAddRequest, PrefillDoneEvent, SetRole
from pdserve.pd_common.rank_setup import pool_desc
from pdserve.prefill_node import rank as prefill_rank
from pdserve.runtime.messages import ErrorEvent
from pdserve.runtime.rank.process import build_rank
from pdserve.runtime.reasons import AbortReason

MAX_NEW = 12
EPP, DPP, PPP = 2, 2, 1


class ElasticCluster(Cluster):
    def __init__(self, model):
        super().__init__()
        transfer = TransferConfig(quarantine_s=5.0)
        self.e_fabric = InMemoryFabric(EPP, address="inproc-elastic:0")  # E's bootstrap server
        self.p_fabric = InMemoryFabric(PPP, address="inproc-prefill:0")  # P's
        self.elastic = self.node("elastic", EPP)
        self.decode = self.node("decode", DPP)
        self.prefill = self.node("prefill", PPP)

        def build_elastic(rank, comm, front):
            parts = build_rank(_spec(model, "prefill", EPP, rank, {}), comm=comm)
            parts.front = front

            def make_kv(role, parts):
                if role == "prefill":
                    return self.e_fabric.prefill_manager(pool_desc(parts), rank, transfer)
                return self.p_fabric.decode_manager(
                    pool_desc(parts),
                    rank,
                    decode_rank.dst_slices(parts),
                    decode_rank.AUX_SLOTS,
                    transfer,
                )

            return ElasticLoop(parts, "prefill", elastic_rank.TransferEnds(make_kv))

        def build_decode(rank, comm, front):
            parts = build_rank(_spec(model, "decode", DPP, rank, {}), comm=comm)
            parts.front = front
            kv = self.e_fabric.decode_manager(
                pool_desc(parts),
                rank,
                decode_rank.dst_slices(parts),
                decode_rank.AUX_SLOTS,
                transfer,
            )
            return decode_rank.make_loop(parts, kv)

        def build_prefill(rank, comm, front):
            spec = _spec(model, "prefill", PPP, rank, {})
            parts = build_rank(spec, comm=comm, **prefill_rank.BUILD_KWARGS)
            parts.front = front
            kv = self.p_fabric.prefill_manager(pool_desc(parts), rank, transfer)
            return prefill_rank.make_loop(parts, kv)

        self.elastic.start(build_elastic)
        self.decode.start(build_decode)
        self.prefill.start(build_prefill)
        self.wait_ready()

    def roles(self) -> list[str]:
        return [t.loop.role for t in self.elastic.ranks]

    def wait_role(self, role: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.roles() != [role] * EPP:
            self.check()
            assert time.monotonic() < deadline, f"E did not become {role}: {self.roles()}"
            time.sleep(0.02)

    def submit_pair(self, prefill, decode, fabric, prompt: list[int]) -> str:
        """What the router does: one rid and room to a prefill and a decode node."""
        rid, room = f"r{next(_ids)}", next(_ids) + 1000
        p = {"max_tokens": MAX_NEW, "ignore_eos": True}
        prefill.front.submit(PDAddRequest(rid, list(prompt), p, room, ""))
        decode.front.submit(PDAddRequest(rid, list(prompt), p, room, fabric.address))
        return rid

    def check_answers(self, rids, prefill, decode, want) -> None:
        for i, rid in enumerate(rids):
            first = prefill.front.wait_terminal(rid)[-1]
            assert isinstance(first, PrefillDoneEvent), (rid, first)
            r = result_of(decode.front.wait_terminal(rid))
            assert r.ok, (rid, r.error)
            assert r.tokens == want[i], f"prompt {i} differs from transformers"


def test_elastic_node_flips_both_ways_under_load_at_pp2(tiny6, tiny6_greedy):
    prompts, reference = tiny6_greedy
    want = [r[:MAX_NEW] for r in reference]
    with running(lambda: ElasticCluster(tiny6)) as c:
        e, d, p = c.elastic, c.decode, c.prefill
        # E prefills for D; it is told to become a decode node while those requests run
        rids = [c.submit_pair(e, d, c.e_fabric, prompt) for prompt in prompts]
        e.front.submit(SetRole("decode"))
        late = f"r{next(_ids)}"  # arrives after the SetRole: refused, to be sent elsewhere
        e.front.submit(PDAddRequest(late, prompts[0], {"max_tokens": 2}, 999, ""))
        c.check_answers(rids, e, d, want)
        refusal = e.front.wait_terminal(late)[-1]
        assert isinstance(refusal, ErrorEvent) and refusal.reason == AbortReason.ROLE_CHANGE
        c.wait_role("decode")

        # P prefills for E, now a decode node; E is told to go back while it decodes them
        rids = [c.submit_pair(p, e, c.p_fabric, prompt) for prompt in prompts]
        c.check_answers(rids[:1], p, e, want[:1])
        e.front.submit(SetRole("prefill"))
        c.check_answers(rids, p, e, want)
        c.wait_role("prefill")

        # and E prefills for D again
        rids = [c.submit_pair(e, d, c.e_fabric, prompt) for prompt in prompts]
        c.check_answers(rids, e, d, want)

        stats = c.wait_settled()
        for node, ranks in stats.items():
            for s in ranks:
                assert settled(s), f"{node} pp{s.pp_rank}: {s}"
        assert [t.loop.flips for t in e.ranks] == [2] * EPP
        for t in e.ranks:  # one manager per role, kept across the flips; one set of counters
            ends = t.loop.ends
            assert sorted(ends.kv) == ["decode", "prefill"]
            assert ends.kv["prefill"].stats is ends.kv["decode"].stats
            kv = ends.kv["prefill"].stats.snapshot()
            assert kv["bytes_sent"] > 0 and kv["bytes_received"] > 0
