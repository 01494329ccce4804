"""The decode prefix cache with partial KV transfer (decode_node/prefix.py), in-process
(tests/inproc.py: ranks as threads, the in-memory transfer, the rank consensus checker on).

A conversation's next turn repeats the previous prompt and answer: the decode ranks hold those pages
in their prefix cache, register only the pages after them, and the prefill ranks send only those.
"""

from __future__ import annotations

import random

import pytest
import torch
from inproc import PDCluster, running, settled
from reference import hf_greedy, load_hf

MAX_NEW = 8
PS = 4  # tests/inproc.py ENGINE page_size, both nodes


@pytest.fixture(scope="module")
def hf6(tiny6):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_hf(tiny6)
    finally:
        torch.set_num_threads(threads)


def _conversation(hf, seed: int, turns: int = 3) -> list[tuple[list[int], list[int]]]:
    """(prompt, transformers' greedy answer) per turn: each prompt is the previous prompt, its
    answer and a new user message."""
    rng = random.Random(seed)
    prompt, out = [rng.randrange(3, 380) for _ in range(29)], []
    for _ in range(turns):
        answer = hf_greedy(hf, [prompt], MAX_NEW)[0]
        out.append((prompt, answer))
        prompt = prompt + answer + [rng.randrange(3, 380) for _ in range(rng.randrange(5, 14))]
    return out


def _kv(loops) -> list[dict]:
    return [loop.kv_mgr.stats.snapshot() for loop in loops]


def _cached_pages(loop, ids: list[int]) -> list[int]:
    """The prefix-cache pages of the longest cached page-aligned prefix of `ids`, read without
    touching the cache (no clock tick)."""
    node, pages = loop.sched.cache.root, []
    for i in range(len(ids) // PS):
        node = node.children.get(tuple(ids[i * PS : (i + 1) * PS]))
        if node is None:
            break
        pages.append(node.page)
    return pages


def _delta(after: list[dict], before: list[dict], key: str) -> int:
    """How much counter `key` grew, summed over the ranks."""
    return sum(a[key] - b[key] for a, b in zip(after, before, strict=True))


def _token_bytes(loop) -> int:
    """KV bytes of one token on this rank (all its layers, K and V)."""
    pool = loop.kv_mgr.pool
    return pool.num_layers * 2 * pool.token_bytes


@pytest.mark.parametrize("ppp,dpp", [(1, 1), (2, 3), (3, 2)])
def test_conversation_transfers_only_new_pages(ppp, dpp, tiny6, hf6):
    """Three turns: turn 1 moves the whole prompt; turns 2 and 3 move only the pages after what the
    decode ranks cached from the turn before (bytes from the transfer counters, both sides), the
    cached pages stay unchanged, the answers are transformers' (fp32, greedy), and afterwards no
    page is held or locked."""
    turns = _conversation(hf6, seed=ppp * 10 + dpp)
    with running(lambda: PDCluster(tiny6, ppp, dpp)) as c:
        kept = 0  # tokens the decode ranks cached from the turn before (prompt + answer but last)
        hits = 0
        for n, (prompt, want) in enumerate(turns):
            with c.paused():
                before_p, before_d = _kv(c.prefill.loops), _kv(c.decode.loops)
                prefix = [_cached_pages(loop, prompt[: len(prompt) - 1]) for loop in c.decode.loops]
                pools = [loop.runner.pool.kv.clone() for loop in c.decode.loops]
            held = (kept // PS) * PS
            assert all(len(p) * PS == held for p in prefix), (n, prefix, held)
            assert c.generate_all([prompt], MAX_NEW) == [want], f"turn {n + 1}"
            c.wait_settled()
            with c.paused():
                after_p, after_d = _kv(c.prefill.loops), _kv(c.decode.loops)
                for d, loop in enumerate(c.decode.loops):
                    kv = loop.runner.pool.kv
                    for page in prefix[d]:  # the cached prefix: never written
                        assert torch.equal(kv[page], pools[d][page]), (n, d, page)
            sent_pages = -(-len(prompt) // PS) - held // PS
            for d, loop in enumerate(c.decode.loops):
                tb = _token_bytes(loop)
                got = {k: after_d[d][k] - before_d[d][k] for k in after_d[d] if k in COUNTERS}
                assert got == {
                    "bytes_received": sent_pages * PS * tb,
                    "tokens": len(prompt) - held,
                    "skipped_tokens": held,
                    "skipped_bytes": held * tb,
                }, (n, d)
            sent = _delta(after_p, before_p, "bytes_sent")
            assert sent == _delta(after_d, before_d, "bytes_received"), n
            assert _delta(after_p, before_p, "skipped_bytes") == held * sum(
                _token_bytes(loop) for loop in c.decode.loops
            ), n
            for a, b in zip(after_p, before_p, strict=True):  # each prefill rank: every token
                assert a["skipped_tokens"] - b["skipped_tokens"] == held, n
                assert a["tokens"] - b["tokens"] == len(prompt) - held, n
            hits += held
            kept = len(prompt) + MAX_NEW - 1
        stats = c.wait_settled()
        for node, ranks in stats.items():
            for s in ranks:
                assert settled(s), f"{node} pp{s.pp_rank}: {s}"
        assert [s.prefix_hit_tokens for s in stats["decode"]] == [hits] * dpp
        assert hits > 0 and all(s.cached_pages > 0 for s in stats["decode"])


COUNTERS = ("bytes_received", "tokens", "skipped_tokens", "skipped_bytes")


def _loops_all(node, pred) -> bool:
    return all(pred(loop) for loop in node.loops)


def _held(rid: str, queue: str):
    """On a decode rank: `rid` registered with a cached prefix and waits in `queue`."""

    def pred(loop) -> bool:
        pd = loop.by_rid.get(rid)
        if pd is None or pd.held is None or pd.held.tokens == 0 or not pd.pages:
            return False
        return pd in loop.prealloc if queue == "prealloc" else pd in loop.transfer.values()

    return pred


def test_abort_after_partial_prefix_bootstrap(tiny6, hf6):
    """A turn aborted on the decode node right after it registered with a cached prefix (before the
    prefill node came; then with the KV on its way): the client hears, the prefix is unlocked, the
    new pages come back through quarantine, nothing stays held or locked, and the cached prefix
    still serves the turn when it comes again."""
    (p1, a1), (p2, a2) = _conversation(hf6, seed=5, turns=2)
    with running(lambda: PDCluster(tiny6, 2, 3)) as c:
        d = c.decode
        assert c.generate_all([p1], MAX_NEW) == [a1]

        with c.stepping():
            room = c.submit("early", p2, MAX_NEW, sides=("decode",))
            c.step_until(lambda: _loops_all(d, _held("early", "prealloc")))
            locked = [
                loop.sched.cache.num_cached_pages - loop.sched.cache.evictable_pages
                for loop in d.loops
            ]
            assert all(n > 0 for n in locked), locked
            c.abort("early", "decode")
        c.check_late_prefill_after_decode_abort("early", p2, MAX_NEW, room)

        with c.stepping():
            c.submit("late", p2, MAX_NEW)
            c.step_until(lambda: _loops_all(d, _held("late", "transfer")))
            c.abort("late", "decode")
        r = c.result("late")
        assert r.error is not None and "abort" in r.error.message, r

        stats = c.wait_settled()
        for node, ranks in stats.items():
            for s in ranks:
                assert settled(s), f"{node} pp{s.pp_rank}: {s}"
                assert s.locked_cached_pages == 0 and s.held_pages == 0

        before = _kv(d.loops)
        assert c.generate_all([p2], MAX_NEW) == [a2]
        held = ((len(p1) + MAX_NEW - 1) // PS) * PS
        for a, b in zip(_kv(d.loops), before, strict=True):
            assert a["skipped_tokens"] - b["skipped_tokens"] == held
        stats = c.wait_settled()
        assert all(settled(s) for ranks in stats.values() for s in ranks), stats


def _retracted(rid: str):
    return lambda loop: any(
        r.rid == rid and r.status.value == "retracted" for r in loop.sched.waiting
    )


def test_retraction_of_a_request_with_a_cached_prefix(tiny6, hf6):
    """A conversation's turn 2 holds a cached prefix, then is retracted under decode KV pressure
    (decode PP 1: one slot, and turn 2 is its youngest request): it gives its pages to the cache,
    unlocks the prefix, re-prefills on the decode node from the cache, and its answer is still
    transformers'."""
    (p1, a1), (p2, _) = _conversation(hf6, seed=9, turns=2)
    long_new = 40
    a2 = hf_greedy(hf6, [p2], long_new)[0]
    rng = random.Random(4)
    others = [[rng.randrange(3, 380) for _ in range(30)] for _ in range(2)]
    want = hf_greedy(hf6, others, long_new)
    small = {"max_total_tokens": 160}  # 40 pages of 4 tokens
    with running(lambda: PDCluster(tiny6, 2, 1, decode_engine=small)) as c:
        assert c.generate_all([p1], MAX_NEW) == [a1]
        with c.stepping():
            for i, ids in enumerate(others):
                c.submit(f"other{i}", ids, long_new)
            c.step_until(lambda: _loops_all(c.decode, lambda lp: len(lp.sched.reqs) == 2))
            c.submit("turn2", p2, long_new)
            c.step_until(lambda: _loops_all(c.decode, _held("turn2", "transfer")))
            c.step_until(lambda: _loops_all(c.decode, _retracted("turn2")))
        r = c.result("turn2")
        assert r.ok and r.tokens == a2, r
        for i, w in enumerate(want):
            r = c.result(f"other{i}")
            assert r.ok and r.tokens == w, (i, r)
        stats = c.wait_settled()
        for node, ranks in stats.items():
            for s in ranks:
                assert settled(s), f"{node} pp{s.pp_rank}: {s}"
        assert all(s.retractions > 0 for s in stats["decode"])


def _window_bytes(loop, held: int, num_tokens: int) -> int:
    """KV bytes a decode rank's sliding layers skip for a room of `num_tokens` after `held`
    cached ones: their tokens before the window's start, which is rounded down to a page."""
    pool = loop.kv_mgr.pool
    start = max(0, num_tokens - pool.window) // PS * PS
    return len(pool.sliding) * 2 * pool.token_bytes * max(0, start - held)


@pytest.mark.parametrize("ppp,dpp", [(1, 1), (2, 3)])
def test_gemma_moves_only_the_window_and_the_cache_reuses_only_whole_windows(
    ppp, dpp, gemma6, gemma6_greedy
):
    """A Gemma 3 (a window of 7 tokens on 4 of its 6 layers, pages of 4):
    - A, through PD, 41 prompt tokens: its sliding layers move only tokens 32.. (the window of its
      end, rounded down to a page); both sides count the bytes spared alike, and the answer is
      transformers'.
    - B, computed on the decode node itself, shares A's first 24 tokens: the decode cache holds
      them, but without their sliding layers' KV, which B's first new tokens read; so B matches
      nothing and computes them again. Its answer is transformers'. (With the match not cut
      short, B read A's missing sliding KV and its answer differed.)
    - C, through PD, continues A's conversation: the cached window of A's end is whole, so C
      holds all 48 cached tokens and moves only what follows."""
    from one_thread import hf_greedy_one_thread

    rng = random.Random(5)
    a = [rng.randrange(3, 380) for _ in range(41)]
    (want_a,) = hf_greedy_one_thread(gemma6, [a], MAX_NEW)
    b = a[:24] + [rng.randrange(3, 380) for _ in range(10)]
    c_prompt = a + want_a + [rng.randrange(3, 380) for _ in range(6)]
    want_b, want_c = hf_greedy_one_thread(gemma6, [b, c_prompt], MAX_NEW)
    with running(lambda: PDCluster(gemma6, ppp, dpp)) as c:
        before_p, before_d = _kv(c.prefill.loops), _kv(c.decode.loops)
        assert c.generate_all([a], MAX_NEW) == [want_a]
        c.wait_settled()
        with c.paused():
            after_p, after_d = _kv(c.prefill.loops), _kv(c.decode.loops)
            hits_a = [loop.sched.cache.hit_tokens_total for loop in c.decode.loops]
        spared = [_window_bytes(loop, 0, len(a)) for loop in c.decode.loops]
        assert sum(spared) > 0
        for d in range(dpp):
            assert (
                after_d[d]["window_skipped_bytes"] - before_d[d]["window_skipped_bytes"]
                == (spared[d])
            )
        assert _delta(after_p, before_p, "window_skipped_bytes") == sum(spared)
        assert _delta(after_p, before_p, "bytes_sent") == _delta(
            after_d, before_d, "bytes_received"
        )

        c.submit_local("b", b, MAX_NEW)
        assert c.result("b", sides=("decode",)).tokens == want_b
        c.wait_settled()
        with c.paused():
            hits_b = [loop.sched.cache.hit_tokens_total for loop in c.decode.loops]
        assert hits_b == hits_a, "B reused pages without their sliding layers' KV"

        assert c.generate_all([c_prompt], MAX_NEW) == [want_c]
        stats = c.wait_settled()
        kept = (len(a) + MAX_NEW - 1) // PS * PS
        hits_c = [s.prefix_hit_tokens - h for s, h in zip(stats["decode"], hits_b, strict=True)]
        assert hits_c == [kept] * dpp
        for node, ranks in stats.items():
            for s in ranks:
                assert settled(s), f"{node} pp{s.pp_rank}: {s}"
