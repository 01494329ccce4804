"""Prefill and decode nodes with their ranks as threads of the test process (tests/inproc.py): the
in-memory PP group and KV transfer instead of gloo and Mooncake, the real loops, schedulers, votes,
consensus store and rank consensus checker. Each test takes seconds; the behaviours that need real
processes (Mooncake, sockets, SIGKILL, the KV transfer timeouts) stay in tests/test_pd_nodes.py and
tests/test_chaos_faults.py."""

from __future__ import annotations

import pytest
from inproc import PDCluster, running, settled

from pdserve.consensus.kvpoll import KVPoll
from pdserve.pd_common.messages import PrefillDoneEvent
from pdserve.runtime.messages import ErrorEvent

MAX_NEW = 8


def _all_settled(stats) -> None:
    for node, ranks in stats.items():
        for s in ranks:
            assert settled(s), f"{node} pp{s.pp_rank}: {s}"


@pytest.mark.parametrize("ppp", [1, 2, 3])
@pytest.mark.parametrize("dpp", [1, 2, 3])
def test_every_layout_matches_transformers(ppp, dpp, tiny6, tiny6_greedy):
    """Token-identical to transformers; afterwards no page held, no prefix-cache page locked, and
    no byte of a decode pool changed outside the pages the requests had there."""
    prompts, reference = tiny6_greedy
    want = [r[:MAX_NEW] for r in reference]
    with running(lambda: PDCluster(tiny6, ppp, dpp)) as c:
        with c.paused():
            before = c.decode_pools()
        got = c.generate_all(prompts, MAX_NEW)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"prompt {i} (len {len(prompts[i])}) differs from transformers"
        _all_settled(c.wait_settled())
        with c.paused():
            after = c.decode_pools()
            for rank, (old, new) in enumerate(zip(before, after, strict=True)):
                changed = {int(p) for p in (old != new).flatten(1).any(1).nonzero().flatten()}
                touched = c.decode.ranks[rank].touched
                assert changed, f"decode pp{rank}: nothing written"
                assert changed <= touched, f"decode pp{rank}: pages {changed - touched} changed"
        assert c.fabric.descriptors > 0
        sent = sum(loop.kv_mgr.stats.bytes_sent for loop in c.prefill.loops)
        received = sum(loop.kv_mgr.stats.bytes_received for loop in c.decode.loops)
        assert sent == received > 0


@pytest.mark.parametrize("ppp,dpp", [(1, 1), (2, 3), (3, 2)])
def test_gemma3_layouts_match_transformers(ppp, dpp, gemma6, gemma6_greedy):
    """A Gemma 3 (sliding windows of 7 tokens, shorter than most prompts) is token-identical to
    transformers in the layouts of the issue, and leaves nothing held."""
    prompts, reference = gemma6_greedy
    with running(lambda: PDCluster(gemma6, ppp, dpp)) as c:
        got = c.generate_all(prompts, len(reference[0]))
        for i, (g, w) in enumerate(zip(got, reference, strict=True)):
            assert g == w, f"prompt {i} (len {len(prompts[i])}) differs from transformers"
        _all_settled(c.wait_settled())


@pytest.mark.parametrize("model", ["tiny6", "gemma6"])
def test_different_page_sizes_match_transformers(model, request):
    """Prefill pages of 4 tokens, decode pages of 8: the descriptors cut per layer and token run
    (for Gemma's sliding layers, from the window's start, a decode page boundary, on)."""
    path = request.getfixturevalue(model)
    prompts, reference = request.getfixturevalue(f"{model}_greedy")
    decode = {"page_size": 8}
    with running(lambda: PDCluster(path, 2, 3, decode_engine=decode)) as c:
        assert c.generate_all(prompts, MAX_NEW) == [r[:MAX_NEW] for r in reference]
        _all_settled(c.wait_settled())
        spared = sum(lp.kv_mgr.stats.snapshot()["window_skipped_bytes"] for lp in c.decode.loops)
        assert (spared > 0) == (model == "gemma6")


def _loops_all(node, pred) -> bool:
    """`pred` holds on every rank of `node` (paused: they all ended the same turn)."""
    return all(pred(loop) for loop in node.loops)


def _pd(loop, rid: str):
    return loop.by_rid.get(rid)


def _abort_in_prefill_bootstrap(c, prompt) -> None:
    """prefill bootstrap: the decode side never comes."""
    p = c.prefill
    with c.stepping():
        c.submit("boot", prompt, MAX_NEW, sides=("prefill",))
        c.step_until(lambda: _loops_all(p, lambda lp: _pd(lp, "boot") in lp.bootstrap))
        c.abort("boot", "prefill")
    r = c.result("boot", sides=("prefill",))
    assert isinstance(r.prefill, ErrorEvent) and "abort" in r.prefill.message


def _abort_in_prefill_waiting(c, first, first_ref, prompt) -> None:
    """prefill waiting: behind a request (`first`) that holds the one running place."""
    p = c.prefill
    with c.stepping():
        c.submit("first", first, MAX_NEW)
        c.submit("wait", prompt, MAX_NEW)
        c.step_until(
            lambda: _loops_all(p, lambda lp: any(q.rid == "wait" for q in lp.sched.waiting))
        )
        c.abort("wait", "prefill")
    r = c.result("wait")
    assert isinstance(r.prefill, ErrorEvent) and "abort" in r.prefill.message
    assert r.error is not None and "aborted_by_prefill" in r.error.message, r
    assert c.result("first").tokens == first_ref[:MAX_NEW]


def _abort_between_prefill_chunks(c, fresh_prompt) -> None:
    """prefill running, between chunks: some of the KV is on the decode side already."""
    p = c.prefill

    def mid_prefill(lp):
        pd = _pd(lp, "chunked")
        return pd is not None and 0 < pd.sent_upto < len(fresh_prompt)

    with c.stepping():
        c.submit("chunked", fresh_prompt, MAX_NEW)
        c.step_until(lambda: _loops_all(p, mid_prefill))
        c.abort("chunked", "prefill")
    r = c.result("chunked")
    assert isinstance(r.prefill, ErrorEvent) and "abort" in r.prefill.message
    assert r.error is not None and "aborted_by_prefill" in r.error.message, r


def _abort_in_prefill_inflight(c, prompt, ref) -> None:
    """prefill inflight: the KV landed, the release vote has not run yet. The decode side has
    its KV and decodes (the router aborts both sides when it gives up)."""
    p = c.prefill
    with c.stepping():
        room = c.submit("inflight", prompt, MAX_NEW)
        c.step_until(lambda: _loops_all(p, lambda lp: room in lp.inflight))
        c.abort("inflight", "prefill")
    r = c.result("inflight")
    assert isinstance(r.prefill, ErrorEvent) and "abort" in r.prefill.message
    assert r.ok and r.tokens == ref[:MAX_NEW], r


def _abort_in_decode_prealloc(c, prompt) -> None:
    """decode prealloc: registered, before the PREALLOC verdict. The prefill side comes later
    and finds the room given up."""
    d = c.decode

    def registered(lp):
        pd = _pd(lp, "prealloc")
        return pd is not None and pd in lp.prealloc and bool(pd.pages)

    with c.stepping():
        room = c.submit("prealloc", prompt, MAX_NEW, sides=("decode",))
        c.step_until(lambda: _loops_all(d, registered))
        c.abort("prealloc", "decode")
    c.check_late_prefill_after_decode_abort("prealloc", prompt, MAX_NEW, room)


def _abort_in_decode_transfer(c, prompt) -> None:
    """decode transfer, the prefill side not there yet."""
    d = c.decode
    with c.stepping():
        c.submit("transfer", prompt, MAX_NEW, sides=("decode",))
        c.step_until(lambda: _loops_all(d, lambda lp: _pd(lp, "transfer") in lp.transfer.values()))
        c.abort("transfer", "decode")
    r = c.result("transfer", sides=("decode",))
    assert r.error is not None and "abort" in r.error.message, r


def _abort_in_decode_transfer_mid_prefill(c, fresh_prompt) -> None:
    """decode transfer while the prefill node is between chunks: its senders stop."""
    p, d = c.prefill, c.decode

    def sending(lp):
        pd = _pd(lp, "transfer2")
        return pd is not None and 0 < pd.sent_upto < len(fresh_prompt)

    def waiting_for_kv(lp):
        return _pd(lp, "transfer2") in lp.transfer.values()

    with c.stepping():
        c.submit("transfer2", fresh_prompt, MAX_NEW)
        c.step_until(lambda: _loops_all(p, sending) and _loops_all(d, waiting_for_kv))
        c.abort("transfer2", "decode")
    r = c.result("transfer2")
    assert r.error is not None and "abort" in r.error.message, r
    assert isinstance(r.prefill, ErrorEvent) and "aborted_by_decode" in r.prefill.message


def _abort_while_decoding(c, prompt, ref) -> None:
    """decode running: a few tokens out."""
    d = c.decode

    def decoding(lp):
        req = lp.sched.reqs.get("running")
        return req is not None and len(req.output_ids) >= 3

    with c.stepping():
        c.submit("running", prompt, 40)
        c.step_until(lambda: _loops_all(d, decoding))
        c.abort("running", "decode")
    r = c.result("running")
    assert isinstance(r.prefill, PrefillDoneEvent)
    assert r.finish is not None and r.finish.kind == "abort", r
    assert 3 <= len(r.tokens) < 40 and r.tokens == ref[: len(r.tokens)]


@pytest.mark.parametrize("ppp,dpp", [(1, 1), (2, 3), (3, 2)])
def test_a_resumed_request_continues_exactly_through_a_prefill_node(ppp, dpp, tiny6, tiny6_greedy):
    """A migrated stream replayed through a prefill node (router/routing/migration.py): the prefill
    node prefills prompt + the tokens sent and samples the next, the decode node receives the KV of
    both and goes on; the client gets exactly the rest of transformers' tokens."""
    prompts, reference = tiny6_greedy
    with running(lambda: PDCluster(tiny6, ppp, dpp)) as c:
        cases = [(i, k) for i in (0, 3, 4) for k in (1, MAX_NEW // 2, MAX_NEW - 1)]
        rids = {f"resume{i}-{k}": (i, k) for i, k in cases}
        for rid, (i, k) in rids.items():
            c.submit(rid, prompts[i], MAX_NEW, resume=reference[i][:k])
        for rid, (i, k) in rids.items():
            r = c.result(rid)
            assert r.ok and isinstance(r.prefill, PrefillDoneEvent), (rid, r)
            assert r.tokens == reference[i][k:MAX_NEW], rid
            assert r.finish.kind == "length", rid
        _all_settled(c.wait_settled())


def test_aborts_at_every_stage(tiny6, tiny6_greedy):
    """An abort in each queue a request passes through, caught there by running the nodes turn by
    turn: every one ends with an answer on both sides, and nothing stays held."""
    prompts, reference = tiny6_greedy
    long, long_ref = prompts[4], reference[4]  # 70 tokens: five prefill chunks
    # Prompts not seen before, for the aborts between chunks: the prefix cache would serve a known
    # prompt in one chunk.
    fresh = [list(reversed(long)), list(reversed(prompts[3]))]
    # One prefill request at a time, so a second one waits in the scheduler's waiting queue.
    with running(lambda: PDCluster(tiny6, 2, 2, prefill_engine={"max_running": 1})) as c:
        _abort_in_prefill_bootstrap(c, long)
        _abort_in_prefill_waiting(c, long, long_ref, prompts[3])
        _abort_between_prefill_chunks(c, fresh[0])
        _abort_in_prefill_inflight(c, prompts[2], reference[2])
        _abort_in_decode_prealloc(c, prompts[1])
        _abort_in_decode_transfer(c, prompts[1])
        _abort_in_decode_transfer_mid_prefill(c, fresh[1])
        _abort_while_decoding(c, long, long_ref)

        _all_settled(c.wait_settled())
        assert c.generate_all(prompts[:3], MAX_NEW) == [x[:MAX_NEW] for x in reference[:3]]


def _in_quarantine(room: int):
    return lambda loop: room in loop.quarantine


def test_failed_transfers_go_to_quarantine_and_come_back(tiny6, tiny6_greedy):
    """The three decode votes: PREALLOC and TRANSFERRED good for the requests that complete; the
    TRANSFERRED vote bad for a room whose writes failed (on every prefill rank, or on one), which
    waits in quarantine until the RELEASE vote finds it quiesced on every decode rank."""
    prompts, reference = tiny6_greedy
    with running(lambda: PDCluster(tiny6, 2, 3)) as c:
        d = c.decode
        for room, rid, prefill_rank in ((5000, "all", None), (5001, "one", 1)):
            c.fabric.fail_writes(room=room, prefill_rank=prefill_rank)
            quarantined = _in_quarantine(room)
            with c.stepping():
                c.submit(rid, prompts[3], MAX_NEW, room=room)
                c.step_until(lambda q=quarantined: _loops_all(d, q))
                ends = [loop.quarantine[room].transfer for loop in d.loops]
                assert any(end.poll() == KVPoll.Failed for end in ends)
                c.step_until(lambda q=quarantined: not any(q(loop) for loop in d.loops))
            r = c.result(rid)
            assert r.error is not None and "KV transfer failed" in r.error.message, r
            assert isinstance(r.prefill, ErrorEvent) and "KV transfer failed" in r.prefill.message
            _all_settled(c.wait_settled())
        assert c.generate_all(prompts, MAX_NEW) == [x[:MAX_NEW] for x in reference]
        failures = [loop.kv_mgr.stats.snapshot()["failures"] for loop in c.prefill.loops]
        assert sum(f.get("transfer_error", 0) for f in failures) >= 2, failures


def test_retraction_under_decode_kv_pressure(tiny6, tiny6_greedy):
    """A decode pool far smaller than the requests need: decodes are retracted and re-prefilled on
    the decode node, rooms wait in prealloc without pages (one is aborted there), and every answer
    is still token-identical to transformers."""
    prompts, reference = tiny6_greedy
    max_new = len(reference[0])
    small = {"max_total_tokens": 160}  # 40 pages of 4 tokens; the 70-token prompt alone takes 24

    def waiting_for_pages(lp):
        pd = _pd(lp, "nopages")
        return pd is not None and pd in lp.prealloc and not pd.pages

    with running(lambda: PDCluster(tiny6, 2, 2, decode_engine=small)) as c:
        rids = [f"k{i}" for i in range(len(prompts))]
        with c.stepping():
            for rid, ids in zip(rids, prompts, strict=True):
                c.submit(rid, ids, max_new)
            c.submit("nopages", prompts[4], max_new, sides=("decode",))
            c.step_until(lambda: _loops_all(c.decode, waiting_for_pages))
            c.abort("nopages", "decode")
        r = c.result("nopages", sides=("decode",))
        assert r.error is not None and "abort" in r.error.message, r
        for rid, want in zip(rids, reference, strict=True):
            r = c.result(rid)
            assert r.ok and r.tokens == want, (rid, r)
        stats = c.wait_settled()
        _all_settled(stats)
        assert all(s.retractions > 0 for s in stats["decode"]), stats["decode"]


def test_decode_local_requests_among_pd_requests_match_transformers(tiny6, tiny6_greedy):
    """Requests with no bootstrap fields are prefilled on the decode node itself (chunked, by the
    same scheduler on every decode rank), at the same time as PD requests whose KV comes from the
    prefill node; both kinds are token-identical to transformers."""
    prompts, reference = tiny6_greedy
    want = [r[:MAX_NEW] for r in reference]
    with running(lambda: PDCluster(tiny6, 2, 3)) as c:
        local = [f"local{i}" for i in range(len(prompts))]
        pd = [f"pd{i}" for i in range(len(prompts))]
        for i, ids in enumerate(prompts):
            c.submit_local(local[i], ids, MAX_NEW)
            c.submit(pd[i], ids, MAX_NEW)
        for i in range(len(prompts)):
            r = c.result(local[i], sides=("decode",))
            assert r.ok and r.tokens == want[i], f"decode-local prompt {i}: {r}"
            r = c.result(pd[i])
            assert r.ok and r.tokens == want[i], f"PD prompt {i}: {r}"
        _all_settled(c.wait_settled())


def test_waiting_timeout_covers_the_pd_queues(tiny6, tiny6_greedy):
    """`--waiting-timeout` also ends requests stuck in the PD queues (the prefill node's bootstrap
    queue, the decode node's prealloc/transfer queues) with its own reason, long before the KV
    bootstrap and waiting timeouts would; a request that is not stuck is not touched."""
    prompts, reference = tiny6_greedy
    # 3 s, as in a node's test: the requests that are not stuck count as waiting on the decode
    # node until their KV lands, which a loaded machine can stretch past a shorter timeout.
    with running(lambda: PDCluster(tiny6, 2, 2, spec={"waiting_timeout_s": 3.0})) as c:
        c.submit("stuck-d", prompts[3], MAX_NEW, sides=("decode",))  # the prefill side never comes
        c.submit("stuck-p", prompts[3], MAX_NEW, sides=("prefill",))  # nor the decode side
        r = c.result("stuck-d", sides=("decode",))
        assert r.error is not None and r.error.reason == "waiting_timeout", r
        r = c.result("stuck-p", sides=("prefill",))
        assert isinstance(r.prefill, ErrorEvent), r
        assert r.prefill.reason == "waiting_timeout", r.prefill
        assert c.generate_all(prompts[:2], MAX_NEW) == [x[:MAX_NEW] for x in reference[:2]]
        _all_settled(c.wait_settled())


def test_outstanding_moves_with_a_rooms_transfer_status(tiny6, tiny6_greedy):
    """PP0's idle wait backs off while `outstanding()` stays the same (runtime/rank/idle_wait.py): a
    room waiting in the decode node's transfer queue changes it as soon as its transfer end's status
    does, before the room changes queue, so the votes on a landed transfer run at the short wait."""
    prompts, reference = tiny6_greedy
    with running(lambda: PDCluster(tiny6, 2, 2)) as c:
        d0 = c.decode.loops[0]
        assert d0.outstanding() is None
        with c.stepping():
            room = c.submit("moves", prompts[3], MAX_NEW, sides=("decode",))
            c.step_until(lambda: room in d0.transfer)
            waiting = d0.outstanding()
            for node in c.nodes:
                node.step()
            assert d0.outstanding() == waiting  # nothing moved: the same value, so PP0 backs off
            c.submit("moves", prompts[3], MAX_NEW, sides=("prefill",), room=room)
            c.step_until(lambda: d0.outstanding() != waiting)
            assert room in d0.transfer, "the value changed only when the room left the queue"
        assert c.result("moves").tokens == reference[3][:MAX_NEW]
