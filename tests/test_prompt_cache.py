"""A running request's prompt enters the prefix cache when its prefill completes (issue #19, `n`
> 1): a sibling with the same prompt admitted after that shares the prompt's whole pages instead of
computing them again, while the first one is still decoding.

The runner below keeps a model of the KV pool (page -> the token each slot holds) and checks
before every computed token that the request's page table holds exactly its own history, so a
shared page with the wrong KV, or a page freed while a sibling still reads it, fails the test.
"""

import random

from test_scheduler import VOCAB, expected, make, oracle

from pdserve.engine.batch import SampleOut
from pdserve.engine.core import Req, SamplingParams
from pdserve.engine.scheduler import Scheduler


def step(s: Scheduler, pool: dict[int, list], done: dict[str, Req]) -> None:
    """One schedule + harvest of every slot, writing and checking the modelled KV pool."""
    P = s.cfg.page_size
    for slot in range(s.cfg.num_slots):
        b = s.schedule(slot)
        toks = []
        for e in b.entries:
            ids = e.req.all_ids
            for pos in range(e.start):  # what the attention reads must be the request's history
                assert pool[e.pages[pos // P]][pos % P] == ids[pos], (e.req.rid, pos)
            for pos in range(e.start, e.start + e.num_new):
                pool.setdefault(e.pages[pos // P], [None] * P)[pos % P] = ids[pos]
            if e.need_logits:
                toks.append(oracle(ids[: e.start + e.num_new]))
        s.harvest(b, SampleOut(toks) if toks else None)
        for r in s.drain_finished():
            done[r.rid] = r


def test_a_sibling_admitted_after_the_prefill_shares_the_prompt_while_the_first_decodes():
    prompt = list(range(1, 31))  # 30 tokens: 7 whole pages of 4
    s, pool, done = make(), {}, {}
    s.add(Req("c0", prompt, SamplingParams(max_tokens=20, ignore_eos=True)))
    while not s.reqs["c0"].output_ids:  # the prefill (in chunks of 8) and its first token
        step(s, pool, done)
    assert s.cache.num_cached_pages == 7, "the prompt's whole pages are in the tree, c0 runs on"
    for i in (1, 2):
        s.add(Req(f"c{i}", prompt, SamplingParams(max_tokens=20, ignore_eos=True)))
    step(s, pool, done)
    assert [s.reqs[f"c{i}"].cached_len for i in (1, 2)] == [28, 28]
    assert s.cache.hit_tokens_total == 56
    while s.has_work:
        step(s, pool, done)
    for i in range(3):
        assert done[f"c{i}"].output_ids == expected(prompt, 20)
    assert s.held_pages() == 0 and s.used_tokens == 0
    s.cache.check_integrity()
    assert s.cache.num_cached_pages + s.allocator.num_free == s.allocator.num_pages


def test_twins_prefilled_together_and_later_siblings_keep_every_page_right():
    """Requests with the same prompts arrive at random times, in several slots, with a pool small
    enough to evict and retract: every output is right and every page comes back."""
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(9, 40))] for _ in range(4)]
    s, pool, done = make(num_pages=40, slots=3, max_running=6), {}, {}
    want = {}
    for i in range(30):
        if rng.random() < 0.5 or not s.has_work:
            p, n = rng.choice(prompts), rng.randint(1, 12)
            want[f"r{i}"] = (p, n)
            s.add(Req(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)))
        step(s, pool, done)
    while s.has_work:
        step(s, pool, done)
    for rid, (p, n) in want.items():
        assert done[rid].output_ids == expected(p, n), rid
    assert s.cache.hit_tokens_total > 0
    assert s.held_pages() == 0 and s.used_tokens == 0
    s.cache.check_integrity()
    assert s.cache.num_cached_pages + s.allocator.num_free == s.allocator.num_pages
