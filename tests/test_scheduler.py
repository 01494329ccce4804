"""Scheduler, allocator and prefix cache, driven by a deterministic token oracle instead of a model.

The oracle makes the next token a function of the whole sequence, so a request's output is only
right if the scheduler fed it its real history (including after retraction and prefix sharing).
"""

import random

import pytest

from pdserve.engine.batch import SampleOut
from pdserve.engine.core import ParamError, Req, SamplingParams
from pdserve.engine.kv_cache import PageAllocator
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.scheduler import Scheduler, SchedulerConfig

VOCAB = 97


def oracle(ids: list[int]) -> int:
    h = 0
    for t in ids:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(oracle(seq))
    return seq[len(prompt) :]


def run_to_end(s: Scheduler, max_steps: int = 10_000) -> dict[str, Req]:
    done, kv_written = {}, {}
    for _ in range(max_steps):
        if not s.has_work:
            break
        for slot in range(s.cfg.num_slots):
            b = s.schedule(slot)
            toks = []
            for e in b.entries:
                # The KV a batch "writes" must be exactly the request's real tokens at those
                # positions.
                kv_written[e.req.rid] = e.start + e.num_new
                if e.need_logits:
                    toks.append(oracle(e.req.all_ids[: e.start + e.num_new]))
            s.harvest(b, SampleOut(toks) if toks else None)
            for r in s.drain_finished():
                done[r.rid] = r
    assert not s.has_work, "scheduler did not finish in time"
    return done


def make(num_pages=256, page=4, slots=1, cache=True, **kw) -> Scheduler:
    cfg = SchedulerConfig(
        page_size=page,
        chunk_size=kw.pop("chunk", 8),
        max_batch_tokens=kw.pop("mbt", 32),
        max_running=kw.pop("max_running", 16),
        mixed_prefill_tokens=kw.pop("mixed", 0),
        max_context=512,
        num_slots=slots,
        enable_prefix_cache=cache,
    )
    return Scheduler(cfg, PageAllocator(num_pages))


def test_allocator_never_hands_out_a_page_twice():
    a = PageAllocator(10)
    got = a.alloc(4) + a.alloc(3)
    assert len(set(got)) == 7 and a.num_free == 3
    a.free(got[:2])
    again = a.alloc(2)
    assert set(again) == set(got[:2]) and a.num_free == 3
    with pytest.raises(MemoryError):
        a.alloc(4)
    with pytest.raises(AssertionError):
        a.free([got[0], got[0]])


@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("cache", [True, False])
def test_all_requests_complete_correctly_and_pages_return(slots, cache):
    rng = random.Random(slots)
    s = make(slots=slots, cache=cache)
    reqs = {}
    for i in range(24):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        n = rng.randint(1, 12)
        reqs[f"r{i}"] = (prompt, n)
        s.add(Req(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    done = run_to_end(s)
    for rid, (prompt, n) in reqs.items():
        assert done[rid].output_ids == expected(prompt, n), rid
        assert done[rid].finish.kind == "length"
    assert s.held_pages() == 0 and s.used_tokens == 0


def test_prefix_cache_shares_pages_and_output_is_unchanged():
    shared = list(range(1, 33))
    s = make()
    s.add(Req("a", shared + [50, 51], SamplingParams(max_tokens=4, ignore_eos=True)))
    run_to_end(s)
    s.add(Req("b", shared + [60], SamplingParams(max_tokens=4, ignore_eos=True)))
    done = run_to_end(s)
    assert done["b"].cached_len == 32, (
        "the 32-token shared prefix (8 pages of 4) should come from the cache"
    )
    assert s.cache.hit_tokens_total == 32
    assert done["b"].output_ids == expected(shared + [60], 4)
    assert s.held_pages() == 0


def test_retraction_completes_everything_with_a_tiny_pool():
    rng = random.Random(5)
    s = make(num_pages=24, page=4, max_running=8, chunk=16, mbt=32)
    reqs = {}
    for i in range(12):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(8, 30))]
        reqs[f"r{i}"] = (prompt, 40)
        s.add(Req(f"r{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True)))
    done = run_to_end(s)
    assert s.num_retractions > 0, "the pool was meant to be too small for the batch"
    for rid, (prompt, n) in reqs.items():
        assert done[rid].output_ids == expected(prompt, n), rid
    assert s.held_pages() == 0


def test_two_schedulers_with_the_same_inputs_decide_the_same():
    def trace(seed):
        rng = random.Random(seed)
        s = make(num_pages=40, slots=2)
        log = []
        for i in range(10):
            s.add(
                Req(
                    f"r{i}",
                    [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))],
                    SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True),
                )
            )
        for _ in range(400):
            if not s.has_work:
                break
            for slot in range(2):
                b = s.schedule(slot)
                log.append([(e.req.rid, e.start, e.num_new, tuple(e.pages)) for e in b.entries])
                toks = [
                    oracle(e.req.all_ids[: e.start + e.num_new]) for e in b.entries if e.need_logits
                ]
                s.harvest(b, SampleOut(toks) if toks else None)
        return log

    assert trace(1) == trace(1)


def test_abort_everywhere_frees_everything():
    s = make(slots=2)
    for i in range(6):
        s.add(Req(f"r{i}", list(range(1, 20 + i)), SamplingParams(max_tokens=30, ignore_eos=True)))
    b0 = s.schedule(0)  # some requests in flight in slot 0
    assert s.abort("r5") is not None  # still waiting => removed at once
    inflight = b0.entries[0].req.rid
    s.abort(inflight)  # in flight => ends at harvest
    assert s.reqs[inflight].to_finish is not None
    s.harvest(b0, SampleOut([0] * len(b0.sampling_entries)) if b0.sampling_entries else None)
    assert inflight not in s.reqs
    for rid in list(s.reqs):
        s.abort(rid)
    run_to_end(s)
    assert s.held_pages() == 0 and s.used_tokens == 0
    kinds = {r.finish.kind for r in s.drain_finished()}
    assert kinds <= {"abort"}


def test_prefix_cache_evicts_lru_deterministically():
    a = PageAllocator(8)
    c = PrefixCache(a, 2)
    for toks in [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]]:
        pages, h = c.match(toks, len(toks))
        c.lock(h)
        own = a.alloc(2 - len(pages) if len(toks) == 4 else 1)
        free = c.insert(toks, pages + own, len(toks), len(pages))
        a.free(free)
        c.unlock(h)
    c.check_integrity()
    assert c.num_cached_pages == 4  # [1,2] shared, [3,4], [5,6], [7,8]
    c.match([7, 8], 2)  # touch [7,8]: now [3,4] is the least recently used leaf
    assert c.evict(1) == 1
    assert c.match([1, 2, 3, 4], 4)[0].__len__() == 1 and len(c.match([7, 8], 2)[0]) == 1


def test_prefix_cache_matches_only_up_to_a_whole_window():
    """Pages without their sliding layers' KV (a PD transfer's, before the window) are cached,
    but a match ends where such a page lies within the window before its end: pages of 2 tokens,
    a window of 3 (engine/prefix_cache.py)."""
    a = PageAllocator(16)
    c = PrefixCache(a, 2, window=3)
    toks = list(range(1, 13))  # 6 pages; the first 3 partial
    pages = a.alloc(6)
    assert c.insert(toks, pages, 12, 0, partial_pages=3) == []
    c.check_integrity()
    # a match of k pages reads sliding keys from token 2k - 3 on: whole from page 3 on, so k >= 5
    for k, want in [(6, 6), (5, 5), (4, 0), (3, 0), (1, 0)]:
        got, handle = c.match(toks[: 2 * k] + [99], 2 * k)
        assert len(got) == want and got == pages[:want], (k, got)
        assert want or handle is c.root
    # a twin's whole copy does not replace a partial node: its page goes back to the pool
    twin = a.alloc(6)
    assert c.insert(toks, twin, 12, 0) == twin
    assert len(c.match(toks[:8] + [99], 8)[0]) == 0
    # without a window every cached page is whole to the model: the flags do not cut a match
    plain = PrefixCache(PageAllocator(8), 2)
    plain_pages = plain.allocator.alloc(3)
    plain.insert(toks[:6], plain_pages, 6, 0, partial_pages=3)
    assert plain.match(toks[:6], 6)[0] == plain_pages


def test_unfit_requests_are_rejected_with_the_field_named():
    s = make(num_pages=4, page=4)
    with pytest.raises(ParamError) as e:
        s.add(Req("x", list(range(10)), SamplingParams(max_tokens=20)))
    assert e.value.field == "max_tokens"
    with pytest.raises(ParamError):
        SamplingParams.from_dict({"temperature": -1})
    with pytest.raises(ParamError) as e:
        SamplingParams.from_dict({"top_q": 0.5})
    assert e.value.field == "top_q"


def test_prefill_per_forward_is_capped_while_any_request_decodes():
    """A stream's next token waits for at most `mixed_prefill_tokens` of prefill; with no request
    decoding a prompt takes its full chunk; outputs are unchanged."""
    slots = 1
    s = make(slots=slots, chunk=32, mbt=64, mixed=8)
    s.add(Req("a", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
    b = s.schedule(0)
    s.harvest(b, SampleOut([oracle([1, 2, 3])]))
    long_prompt = [(7 * i) % VOCAB for i in range(60)]
    s.add(Req("b", long_prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    prefill_sizes = []
    while "b" in s.reqs and not s.reqs["b"].output_ids:
        for slot in range(slots):
            b = s.schedule(slot)
            toks = []
            for e in b.entries:
                if e.req.rid == "b":
                    prefill_sizes.append(e.num_new)
                if e.need_logits:
                    toks.append(oracle(e.req.all_ids[: e.start + e.num_new]))
            s.harvest(b, SampleOut(toks) if toks else None)
    assert prefill_sizes == [8] * 7 + [4], prefill_sizes
    done = run_to_end(s)
    assert done["b"].output_ids == expected(long_prompt, 3)
    assert done["a"].output_ids == expected([1, 2, 3], 30)
    # nothing decoding: a new prompt takes a whole chunk
    s.add(Req("c", [5] + long_prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    first = s.schedule(0).entries
    assert [e.num_new for e in first] == [32]


def test_the_prefill_cap_counts_the_decodes_of_other_slots():
    """In a pipeline the slots' forwards run in turn, so a prefill in slot 1 delays slot 0's
    decode too: it is capped while slot 0's request decodes, even with that decode in flight."""
    s = make(slots=2, chunk=32, mbt=64, mixed=8)
    s.add(Req("a", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
    s.harvest(s.schedule(0), SampleOut([oracle([1, 2, 3])]))  # "a" decodes, in slot 0
    in_flight = s.schedule(0)
    assert [(e.req.rid, e.num_new) for e in in_flight.entries] == [("a", 1)]
    s.add(Req("b", list(range(40)), SamplingParams(max_tokens=1, ignore_eos=True)))
    other = s.schedule(1)
    assert [(e.req.rid, e.num_new) for e in other.entries] == [("b", 8)]


def test_a_request_held_by_its_guide_computes_all_but_the_token_that_samples():
    """`guide_pending` (engine/grammar.py): its prompt is prefilled but for the last token, no
    batch samples it, `has_work` no longer counts it, and the others run; once its guide is
    reported compiled it samples, and its output is the one it would have had."""
    s = make(chunk=8, mbt=32)
    held = Req("g", list(range(1, 12)), SamplingParams(max_tokens=3, ignore_eos=True))
    held.guide_pending = True
    s.add(held)
    s.add(Req("p", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
    seen = []
    for _ in range(20):
        b = s.schedule(0)
        assert b.awaits_guides
        seen += [(e.req.rid, e.num_new, e.need_logits) for e in b.entries if e.req.rid == "g"]
        toks = [oracle(e.req.all_ids[: e.start + e.num_new]) for e in b.sampling_entries]
        s.harvest(b, SampleOut(toks) if toks else None)
    assert seen == [("g", 8, False), ("g", 2, False)]  # 10 of its 11 tokens, no sample
    assert [r.rid for r in s.drain_finished()] == ["p"]
    assert held.kv_len == 10 and not held.output_ids and not s.has_work
    s.guides_compiled([("gone", 10), ("g", 10)])  # a request that ended since is skipped
    assert s.has_work and not s.guides_pending
    done = run_to_end(s)
    assert done["g"].output_ids == expected(list(range(1, 12)), 3)


def test_a_held_request_decodes_after_its_report_and_aborts_cleanly():
    """A PD decode side's request (`add_prefilled`) held by its guide takes no decode step until
    `guides_compiled`; a held request that is aborted gives its pages back."""
    s = make()
    d = Req("d", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), output_ids=[9])
    d.guide_pending = True
    s.add_prefilled(d, s.allocator.alloc(1), slot=0)
    assert not s.schedule(0).entries and not s.has_work
    s.guides_compiled([("d", 10)])
    assert [(e.req.rid, e.num_new) for e in s.schedule(0).entries] == [("d", 1)]
    a = Req("a", list(range(1, 10)), SamplingParams(max_tokens=2, ignore_eos=True))
    a.guide_pending = True
    s2 = make()
    s2.add(a)
    s2.harvest(s2.schedule(0), None)  # 8 of its 9 tokens
    assert a.kv_len == 8 and s2.held_pages() > 0 and not s2.has_work
    s2.abort("a")
    assert [r.rid for r in s2.drain_finished()] == ["a"]
    assert s2.held_pages() == 0 and not s2.guides_pending


def test_guides_reported_compiled_are_known_on_every_rank_and_bounded(monkeypatch):
    """`guides_compiled` adds the reported requests' guides to `guides_known` (the last
    KNOWN_GUIDES); a request with a known guide is not held, one with a forgotten guide is."""
    from pdserve.engine import guide_hold

    monkeypatch.setattr(guide_hold, "KNOWN_GUIDES", 2)
    s = make()

    def applied(rid: str, spec: str) -> Req:
        r = Req(
            rid, [1, 2, 3], SamplingParams.from_dict({"max_tokens": 1, "guide": ["regex", spec]})
        )
        s.add(r)
        s.hold(r)  # as the loops do (engine/grammar.py hold_for_guide)
        return r

    held = [applied("a", "a+"), applied("b", "b+"), applied("c", "c+")]
    assert all(r.guide_pending for r in held)
    s.guides_compiled([("a", 10), ("b", 10), ("c", 10)])
    assert list(s.guides_known) == [("regex", "b+"), ("regex", "c+")]  # the oldest forgotten
    assert not applied("d", "c+").guide_pending
    assert applied("e", "a+").guide_pending


def test_the_known_guides_are_bounded_in_bytes(monkeypatch):
    """The report carries each compiled guide's bytes, so every rank bounds the known guides'
    (which the sampling rank never evicts) alike: the oldest go while they hold more than
    KNOWN_BYTES, and the newest stays whatever its size. Before the report carried them, 128
    known guides of a 42 KB schema each (6.6 MB compiled) pinned 845 MB on the sampling rank."""
    from pdserve.engine import guide_hold

    monkeypatch.setattr(guide_hold, "KNOWN_BYTES", 100)
    s = make()
    for rid, spec in (("a", "a+"), ("b", "b+"), ("c", "c+"), ("d", "d+")):
        r = Req(
            rid, [1, 2, 3], SamplingParams.from_dict({"max_tokens": 1, "guide": ["regex", spec]})
        )
        s.add(r)
        s.hold(r)
    s.guides_compiled([("a", 40), ("b", 40)])
    assert list(s.guides_known) == [("regex", "a+"), ("regex", "b+")] and s.known_bytes == 80
    s.guides_compiled([("c", 40)])  # 120 > 100: the oldest goes
    assert list(s.guides_known) == [("regex", "b+"), ("regex", "c+")] and s.known_bytes == 80
    s.guides_compiled([("d", 500)])  # bigger than the bound alone: it stays, the others go
    assert list(s.guides_known) == [("regex", "d+")] and s.known_bytes == 500
