"""A windowed KV pool (`--windowed-kv`, engine/window_pages.py): a sliding-window model's sliding
layers keep their KV in pages of their own and give back the pages behind the window, so a long
request holds its window there, not its context. The outputs must not move by a bit, on every
PP layout, in fp32 (against transformers) and in bf16 (through the extend and decode kernels)."""

from __future__ import annotations

import contextlib
import random
import re

import httpx
import pytest
import torch
from cluster import NODE_ARGS, held_port, start
from inproc import ColocatedCluster, PDCluster, running, settled
from one_thread import hf_greedy_one_thread
from pd_cluster import decode_node, pd_generate_all, prefill_node, wait_pages_free
from reference import hf_greedy, load_hf

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import ParamError, Req, SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.kernels import paged_attention
from pdserve.engine.kv_cache import PageAllocator, pages_needed
from pdserve.engine.model.config import split_layers
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.window_pages import WindowPages, full_pool_pages, pages_per_request
from pdserve.pd_common.node_config import PDNodeConfig
from pdserve.prefill_node.serve import prefill_main
from tests.tiny_model import build_tiny_model

WINDOWED = {"windowed_kv": True, "enable_prefix_cache": False}
# prompts sent at once queue behind each other on a loaded machine (tests/test_pd_nodes.py)
QUEUE_TIMEOUTS = {"PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "60", "PDSERVE_KV_WAITING_TIMEOUT_S": "60"}


def make(model, **kw) -> Engine:
    base = dict(
        model=str(model),
        page_size=4,
        chunk_size=16,
        max_batch_tokens=64,
        max_total_tokens=4096,
        max_running=16,
        threads=1,
        dtype="float32",
        enable_prefix_cache=False,
    )
    return Engine(EngineConfig(**{**base, **kw}))


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def evicted(monkeypatch) -> list[int]:
    """The count of sliding pages each `PrefixCache.evict_sliding` call (any tree's) gave up."""
    counts: list[int] = []
    real = PrefixCache.evict_sliding
    monkeypatch.setattr(
        PrefixCache, "evict_sliding", lambda *a: counts.append(real(*a)) or counts[-1]
    )
    return counts


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("pp,depth", [(1, 0), (2, 1), (3, 0)])
def test_every_colocated_layout_matches_transformers(
    pp, depth, cache, gemma6, gemma6_greedy, evicted
):
    """A colocated node with the windowed pool, its ranks as threads: token-identical to
    transformers on prompts of up to 70 tokens (windows of 7, pages of 4), chunked and batched,
    twice, the second time each prompt twice at once (with the prefix cache, they continue from
    the tree's pages and its windows, and twins meet in the tree). 4 running requests: the
    sliding pool (28 pages) runs short while other slots' batches are in flight, and the tree
    gives up pages. Afterwards no request holds a page of either pool on any rank."""
    prompts, reference = gemma6_greedy
    engine = {**WINDOWED, "enable_prefix_cache": cache, "max_running": 4}
    with running(lambda: ColocatedCluster(gemma6, pp, engine=engine, async_depth=depth)) as c:
        for loop in c.node_.loops:
            assert loop.runner.pool.sliding_kv is not None, "the pool is not windowed"
        for twice in (1, 2):
            got = c.generate_all(prompts * twice, len(reference[0]))
            for i, (g, w) in enumerate(zip(got, reference * twice, strict=True)):
                n = len(prompts[i % len(prompts)])
                assert g == w, f"prompt {i} (len {n}) differs from transformers"
        assert (sum(evicted) > 0) == cache
        for loop in _only_the_tree_holds(c, c.node_.loops):
            assert cache == bool(loop.sched.cache and loop.sched.cache.hit_tokens_total > 0)


def test_a_long_request_holds_its_window(gemma6):
    """A 300-token prompt and 40 tokens of output: at every step the request holds at most a
    window and a chunk of sliding pages (7 of the 85 its context takes), while its
    full-attention pages grow with it; the tokens are transformers' own."""
    eng = make(gemma6, **WINDOWED)
    window = eng.model_config.sliding_window
    rng = random.Random(5)
    prompt = [rng.randrange(3, eng.model_config.vocab_size) for _ in range(300)]
    rid = eng.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    req: Req = eng.scheduler.reqs[rid]
    most, pages_seen = 0, []
    while eng.scheduler.has_work:
        eng.step()
        if not req.finished:
            most = max(most, len(req.sliding_pages))
            pages_seen.append((len(req.pages), req.sliding_first))
    bound = pages_per_request(window, 16, 4)
    assert most <= bound, f"held {most} sliding pages, at most {bound} are due"
    full_pages = pages_needed(339, 4)  # the last token's KV is never written
    assert pages_seen[-1][0] == full_pages
    assert pages_seen[-1][1] >= full_pages - bound  # the pages behind the window went back
    hf = hf_greedy(load_hf(gemma6), [prompt], 40)[0]
    assert eng._done[rid].output_ids == hf
    pool = eng.runner.pool
    assert pool.allocator.num_used == pool.sliding_allocator.num_used == 0


def test_bf16_is_bit_identical_through_the_kernels(tmp_path, monkeypatch):
    """In bf16, with head size 64 (the extend kernel's), the windowed pool changes where the
    sliding layers' keys lie, not what attention computes: every chosen token's logprob is the
    same bits as without it. The extend kernel serves the sliding layers' prefill chunks (its calls
    are counted), reading past the freed pages."""
    path = build_tiny_model(tmp_path / "g", arch="gemma3", tie=True, head_dim=64, seed=2)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 33, 90, 61, 140)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True)
    calls = []
    real = paged_attention.extend_attention_

    def counted(*a):
        calls.append(a[8] if len(a) > 8 else 0)
        return real(*a)

    monkeypatch.setattr(paged_attention, "extend_attention_", counted)
    out = {}
    for windowed in (False, True):
        eng = make(path, dtype="bfloat16", windowed_kv=windowed, page_size=16)
        assert (eng.runner.pool.sliding_kv is not None) == windowed
        eng.runner.model._extend_in_place = True  # the kernel on any CPU (AMX: not the default)
        res = eng.generate(prompts, params)
        out[windowed] = [(r.token_ids, r.logprobs) for r in res]
        assert eng.runner.pool.allocator.num_used == 0
    assert calls.count(7) > 0, "no sliding layer's chunk went through the extend kernel"
    assert out[True] == out[False]


def test_freeing_keeps_every_key_a_query_reads():
    """WindowPages.place over random chunk plans: before each forward, every key that one of its
    queries reads through the window (from start - window + 1 on) is on a page still held, no
    page is held twice, and a request never holds more than `pages_per_request`."""
    rng = random.Random(11)
    for _ in range(200):
        ps, window, chunk = rng.choice([1, 4, 16]), rng.randrange(1, 40), rng.randrange(1, 40)
        alloc = PageAllocator(10_000)
        wp = WindowPages(alloc, ps, window)
        req = Req("r", [1], SamplingParams())
        start = 0
        for _ in range(rng.randrange(1, 30)):
            n = rng.randrange(1, chunk + 1)
            wp.place(req, start, n)
            first_key = max(0, start - window + 1)
            assert req.sliding_first <= first_key // ps
            assert req.sliding_first + len(req.sliding_pages) == pages_needed(start + n, ps)
            assert len(req.sliding_pages) <= pages_per_request(window, chunk, ps)
            assert len(set(req.sliding_pages)) == len(req.sliding_pages)
            assert alloc.num_used == len(req.sliding_pages)
            start += n
        wp.release(req)
        assert alloc.num_used == 0


def test_the_windowed_pool_is_refused_where_it_cannot_serve(tiny6):
    """Named errors: on a prefill node and an elastic node (a prefill node keeps and sends a
    prompt's whole pages), and for a model without sliding windows. A decode node takes it."""
    PDNodeConfig(engine=EngineConfig(**WINDOWED))
    with pytest.raises(ValueError, match="not elastic"):
        PDNodeConfig(engine=EngineConfig(**WINDOWED), elastic=True, bootstrap_port=9)
    with pytest.raises(SystemExit, match="colocated and decode nodes"):
        prefill_main(PDNodeConfig(engine=EngineConfig(**WINDOWED), bootstrap_port=9))
    with pytest.raises(ValueError, match="no sliding-window layers"):
        make(tiny6, **WINDOWED)


def test_the_same_memory_holds_a_longer_context(gemma6):
    """The pool's memory stays what `max_total_tokens` of every layer takes; the sliding pool
    needs less than its share (4 running requests of a window and a chunk), and the rest goes to
    the full pool. So a context of 1,000 tokens, refused by a pool of 512 tokens, runs in the same
    memory windowed, token for token as transformers."""
    small = dict(max_total_tokens=512, max_running=4, max_context=1100)
    rng = random.Random(9)
    prompt = [rng.randrange(3, 200) for _ in range(960)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = make(gemma6, **small)
    with pytest.raises(ParamError, match="can never fit in the KV pool"):
        plain.add_request(prompt, params)
    eng = make(gemma6, **small, **WINDOWED)
    pool, before = eng.runner.pool, plain.runner.pool
    assert pool.nbytes + pool.sliding_kv.numel() * pool.sliding_kv.element_size() <= before.nbytes
    assert pool.allocator.num_pages * 4 > 1000
    [done] = eng.generate([prompt], params)
    assert done.token_ids == hf_greedy(load_hf(gemma6), [prompt], 40)[0]


def test_full_pool_pages_spend_what_the_sliding_pool_leaves():
    """Gemma 3 270M's layout (18 layers, every sixth full: 5, 11, 17). At PP 1 a sliding pool of a
    quarter of the pages (and its zero page) leaves the full pool about (18 - 15/4) / 3 = 4.75x
    the pages. At PP 2 the second slice holds two full layers of nine and bounds it: about
    (9 - 7/4) / 2 = 3.625x; no rank takes more memory than without the window (checked on every
    slice at PP 1 to 6)."""
    sliding = lambda x: x % 6 != 5  # noqa: E731
    assert full_pool_pages(2048, 512, split_layers(18, 1), sliding) == (2048 * 18 - 513 * 15) // 3
    assert full_pool_pages(2048, 512, split_layers(18, 2), sliding) == (2048 * 9 - 513 * 7) // 2
    assert full_pool_pages(2048, 2047, split_layers(18, 1), sliding) == 2048
    assert full_pool_pages(2048, 0, split_layers(18, 1), sliding) == 2048
    assert full_pool_pages(2048, 100, [(0, 6)], lambda x: True) == 2048  # no full layer to grow
    for pp in range(1, 7):
        for s_pages in (1, 260, 1024, 2047):
            f = full_pool_pages(2048, s_pages, split_layers(18, pp), sliding)
            for a, b in split_layers(18, pp):
                n_sliding = sum(1 for x in range(a, b) if sliding(x))
                windowed = f * (b - a - n_sliding) + (s_pages + 1) * n_sliding
                assert windowed <= 2048 * (b - a), (pp, s_pages, a, b)


def test_a_real_pp2_node_serves_windowed(gemma6, gemma6_greedy, tmp_path):
    """`pdserve serve --pp 2 --windowed-kv` (prefix cache on, the default) as real processes: its
    ranks build the windowed pool (their ready line says so) and answer every prompt as
    transformers does, twice: the second time from the tree's pages."""
    prompts, reference = gemma6_greedy
    with contextlib.ExitStack() as holds:
        port = held_port(holds)
        cmd = ["serve", "--model", str(gemma6), "--pp", "2", "--port", str(port), *NODE_ARGS]
        cmd += ["--windowed-kv"]
        log = tmp_path / "node.log"
        with start(cmd, port, log) as (url, _):
            for prompt, want in [*zip(prompts, reference, strict=True)] * 2:
                params = {"max_tokens": len(want), "ignore_eos": True}
                body = {"input_ids": prompt, "sampling_params": params}
                r = httpx.post(f"{url}/generate", json=body, timeout=120)
                assert r.status_code == 200, r.text
                assert r.json()["token_ids"] == want
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert log.read_text().count("windowed KV pool") == 2
        # each rank's sliding pool: a chunk (16) and a window (7) in pages of 4, 32 running, and
        # in use now only what the prefix cache keeps of its prompts' windows
        caps = re.findall(r"pdserve_kv_sliding_pool_capacity_tokens\{[^}]*\} (\S+)", metrics)
        used = re.findall(r"pdserve_kv_sliding_pool_used_tokens\{[^}]*\} (\S+)", metrics)
        assert [float(c) for c in caps] == [4 * 32 * pages_per_request(7, 16, 4)] * 2
        assert len(used) == 2 and all(0 < float(u) < float(caps[0]) for u in used)


def test_prefix_hits_read_their_window_from_the_tree(gemma6):
    """With the prefix cache, a prompt's pages go to the tree with the sliding pages of the window
    at its end (and none behind it). A prompt that extends it continues from the tree, reading
    that window; one that shares only its beginning finds no sliding pages there and is cut back.
    A small sliding pool (2 running requests) makes the tree give up sliding pages no window
    reads. Every answer is transformers' own; afterwards only the tree holds pages."""
    eng = make(gemma6, windowed_kv=True, enable_prefix_cache=True, max_running=2)
    tree, pool = eng.scheduler.cache, eng.runner.pool
    assert pool.sliding_allocator.num_pages == 2 * pages_per_request(7, 16, 4)
    rng = random.Random(4)
    base = [rng.randrange(3, 200) for _ in range(61)]
    prompts = [base, base + [rng.randrange(3, 200) for _ in range(23)], base[:30] + [5, 6, 7]]
    prompts += [[rng.randrange(3, 200) for _ in range(40 + 9 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    hf = load_hf(gemma6)
    hits, evicted = [], []
    real = tree.evict_sliding
    tree.evict_sliding = lambda n, in_use: evicted.append(real(n, in_use)) or evicted[-1]
    for prompt in prompts:
        before = tree.hit_tokens_total
        [done] = eng.generate([prompt], params)
        assert done.token_ids == hf_greedy(hf, [prompt], 12)[0], f"prompt of {len(prompt)}"
        hits.append(tree.hit_tokens_total - before)
    # the extension shares base's 15 whole pages; it reads pages 13 and 14 through its window,
    # which base's last chunk held when its prompt went to the tree
    assert hits[0] == 0 and hits[1] == 60
    # base's first pages lost their sliding pages behind its window: the match is cut back
    assert hits[2] == 0
    assert pool.allocator.num_used == tree.num_cached_pages
    assert pool.sliding_allocator.num_used == len(tree._sliding_of) <= 14
    assert sum(1 for n in tree._iter_nodes() if n.partial) > 0
    assert sum(evicted) > 0, "the sliding pool never ran short"


def test_the_tree_keeps_the_sliding_pages_a_window_reads():
    """PrefixCache with a sliding pool: a finished request's own sliding pages go to its new
    nodes; a twin's copy of a chunk whose node has one goes back (no page lost); a match reads
    the window before its end from the nodes; under pressure the tree gives up only pages no
    live window reads, and their nodes turn partial, so later matches are cut back before them."""
    full, sliding = PageAllocator(64), PageAllocator(64)
    tree = PrefixCache(full, 4, window=7, sliding_allocator=sliding)
    tokens = list(range(100, 124))  # 6 pages
    pages = full.alloc(6)
    own = dict(zip(range(3, 6), sliding.alloc(3), strict=True))  # pages 0-2: behind the window
    assert tree.insert(tokens, pages, 24, 0, 0, own) == []
    assert sliding.num_used == 3 and all(tree.owns_sliding(p) for p in own.values())
    twin_pages = full.alloc(6)
    twin_own = dict(zip(range(2, 6), sliding.alloc(4), strict=True))
    freed = tree.insert(tokens, twin_pages, 24, 0, 0, twin_own)
    assert freed == twin_pages  # every chunk was there first
    full.free(freed)
    assert sliding.num_used == 4 and tree.owns_sliding(twin_own[2])  # page 2 had none: taken
    got, handle = tree.match(tokens + [1], 25)
    assert got == pages
    assert tree.window_of(handle, 6) == (4, [own[4], own[5]])  # tokens 17-23 of the window
    tree.lock(handle)
    assert tree.evict_sliding(10, in_use={own[4], own[5]}) == 2  # pages 2 and 3: no window reads
    assert sliding.num_used == 2 and not tree.owns_sliding(own[3])
    tree.unlock(handle)
    assert tree.match(tokens[:16] + [1], 17)[0] == []  # page 3 (in 16's window) turned partial
    tree.evict(6)
    assert full.num_used == 0 and sliding.num_used == 0


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
def test_a_sliding_pool_of_every_page_never_runs_short(gemma6, cache):
    """Where max_running requests at their most need more sliding pages than the budget (here
    64 x 7 against 16 pages, as 64 x 65 against 2,048 at the defaults), the sliding pool gets the
    budget (less its zero page) and the full pool no more: short requests, whose window covers
    their whole context, hold as many sliding pages as full ones. Many at once fill both pools
    and answer as transformers does. (With 16 full pages beside 15 sliding ones, the sixteenth
    full page's request found no sliding page: MemoryError.)"""
    eng = make(
        gemma6, windowed_kv=True, enable_prefix_cache=cache, max_total_tokens=64, max_running=64
    )
    pool, sched = eng.runner.pool, eng.scheduler
    assert pool.sliding_allocator.num_pages == pool.allocator.num_pages == 15
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 200) for _ in range(4)] for _ in range(12)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in prompts]
    most = 0
    while sched.has_work:
        eng.step()
        most = max(most, pool.sliding_allocator.num_used)
    assert most >= 14  # the pools fill: the decodes take the pages admission kept back
    got = [eng._done[r].output_ids for r in rids]
    assert got == hf_greedy(load_hf(gemma6), prompts, 4)


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
# (2, 6): decode ranks 1 and 5 hold a full-attention layer only, and register no sliding buffer
@pytest.mark.parametrize("ppp,dpp", [(1, 1), (2, 3), (3, 2), (2, 6)])
def test_a_windowed_decode_node_matches_transformers(
    ppp, dpp, cache, gemma6, gemma6_greedy, gemma6_continued, evicted
):
    """A PD decode node with the windowed pool (its ranks as threads, the in-memory transfer):
    its sliding layers' KV lands in pages of their own, the window of each prompt's end only,
    and every answer is transformers'. Then each conversation continues, twice at once: with the
    decode prefix cache, those rooms hold the first answers' pages and read the window before
    their end from the tree, and twins meet in it. 2 running requests on a sliding pool of
    2 x 7 pages: the tree gives pages up. Afterwards no request holds a page of either pool on
    any decode rank."""
    prompts, reference = gemma6_greedy
    continued, more = gemma6_continued
    engine = {**WINDOWED, "enable_prefix_cache": cache, "max_running": 2}
    with running(lambda: PDCluster(gemma6, ppp, dpp, decode_engine=engine)) as c:
        for loop in c.decode.loops:
            assert loop.runner.pool.sliding_kv is not None, "the decode pool is not windowed"
            layers = range(*loop.kv_mgr.pool.layers)
            has_sliding = any(layer in loop.kv_mgr.pool.sliding for layer in layers)
            assert (loop.kv_mgr.sliding_pool is not None) == has_sliding
        for asked, want in [(prompts, reference), (continued * 2, more * 2)]:
            got = c.generate_all(asked, len(want[0]))
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g == w, f"prompt {i} (len {len(asked[i])}) differs from transformers"
        for loop in _only_the_tree_holds(c, c.decode.loops):
            assert cache == bool(loop.sched.cache and loop.sched.cache.hit_tokens_total > 0)
            spared = loop.kv_mgr.stats.snapshot()["window_skipped_bytes"]
            assert (spared > 0) == (loop.kv_mgr.sliding_pool is not None)
        assert (sum(evicted) > 0) == cache


@pytest.fixture(scope="module")
def gemma6_continued(gemma6, gemma6_greedy):
    """Each conversation of gemma6_greedy continued: prompt and answer, then transformers' next
    4 tokens."""
    prompts, reference = gemma6_greedy
    continued = [p + r for p, r in zip(prompts, reference, strict=True)]
    return continued, hf_greedy_one_thread(gemma6, continued, 4)


def test_a_real_windowed_decode_node_matches_transformers(
    gemma6, gemma6_greedy, gemma6_continued, tmp_path
):
    """`pdserve prefill --pp 2` and `pdserve decode --pp 3 --windowed-kv` as real processes, the
    KV over the TCP data plane into both of each decode rank's buffers (its last rank holds
    sliding layers only: its full buffer has no bytes), with the debug checksum on both sides:
    every answer is transformers', then every conversation continued (from the decode prefix
    cache). Afterwards no rank holds a page, and each decode rank's sliding pool shows."""
    prompts, reference = gemma6_greedy
    continued, more = gemma6_continued
    env = {**QUEUE_TIMEOUTS, "PDSERVE_KV_CHECKSUM": "1"}
    with contextlib.ExitStack() as stack:
        purl, bport, _ = stack.enter_context(prefill_node(gemma6, 2, tmp_path, env=env))
        durl, _ = stack.enter_context(decode_node(gemma6, 3, tmp_path, ["--windowed-kv"], env))
        for asked, want in [(prompts, reference), (continued, more)]:
            got = pd_generate_all(purl, durl, bport, asked, len(want[0]))
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g == w, f"prompt {i} (len {len(asked[i])}) differs from transformers"
        left = wait_pages_free(purl, durl)
        assert not any(left[purl]) and not any(left[durl]), left
        metrics = httpx.get(f"{durl}/metrics", timeout=30).text
    caps = re.findall(r"pdserve_kv_sliding_pool_capacity_tokens\{[^}]*\} (\S+)", metrics)
    assert len(caps) == 3 and all(float(c) > 0 for c in caps), caps
    hits = re.findall(r"pdserve_prefix_cache_hit_tokens_total\{[^}]*\} (\S+)", metrics)
    assert hits and float(hits[0]) > 0, hits
    assert "windowed KV pool" in (tmp_path / "decode.log").read_text()


def test_an_admission_on_a_decode_node_spares_the_window_it_matched():
    """A decode node's admission may make the tree give sliding pages up (WindowPages.admits):
    never the ones of the window its own match reads, which the lock does not keep. (Before, it
    gave up the least recently used pages, here one the match reads, and `adopt` found the
    match's window with a page missing.)"""
    full, sliding = PageAllocator(64), PageAllocator(10)
    tree = PrefixCache(full, 4, window=7, sliding_allocator=sliding)
    window, behind = sliding.alloc(2), sliding.alloc(2)  # the window's pages have the lowest ids
    tokens = list(range(100, 124))
    own = {4: window[0], 5: window[1], 2: behind[0], 3: behind[1]}
    assert tree.insert(tokens, full.alloc(6), 24, 0, 0, own) == []
    wp = WindowPages(sliding, 4, 7, tree, chunk_size=16)
    wp.watch(tuple)  # a decode node's: every admission keeps room for what holders may take
    assert sliding.num_free == 6 and wp.chunk_pages == 7
    pages, handle = tree.match(tokens + [1], 24)
    tree.lock(handle)
    assert wp.admits(handle, len(pages))
    req = Req("r", tokens + [1], SamplingParams(max_tokens=4))
    wp.adopt(req, handle, len(pages))
    assert (req.sliding_first, req.sliding_pages) == (4, window)


def test_rooms_that_share_a_cached_window_never_run_the_sliding_pool_short():
    """Decode rooms of one cached prompt read the same 4 window pages from the tree. Admitting a
    room counts those once, and each room at its bound (a window and a page), so the rooms
    admitted then decode 32 tokens without the pool running short. (Before, each room counted the
    shared pages as its own: 5 rooms were admitted into 14 pages, and `place` raised MemoryError
    at token 177.)"""
    full, sliding = PageAllocator(64), PageAllocator(14)
    tree = PrefixCache(full, 16, window=64, sliding_allocator=sliding)
    prompt = list(range(1000, 1160))  # 10 pages; the window before its end: pages 6 to 9
    own = dict(zip(range(6, 10), sliding.alloc(4), strict=True))
    assert tree.insert(prompt, full.alloc(10), 160, 0, 0, own) == []
    rooms: list[Req] = []
    wp = WindowPages(sliding, 16, 64, tree, chunk_size=16)
    wp.watch(lambda: [(r, True) for r in rooms])
    while True:
        req = Req(f"r{len(rooms)}", prompt + [7], SamplingParams(max_tokens=32))
        pages, handle = tree.match(req.input_ids, 160)
        tree.lock(handle)
        got = wp.for_transfer(req, 161, (161 - 64) // 16, handle, len(pages))
        if got is None:
            break
        assert got[0] == 10 and len(got[1]) == 1  # the tree's 4 pages, then one of its own
        rooms.append(req)
    assert len(rooms) == 2
    for t in range(161, 193):
        for req in rooms:
            wp.place(req, t, 1)
            assert len(req.sliding_pages) <= pages_per_request(64, 1, 16)


def test_decode_local_requests_among_pd_rooms_on_a_windowed_decode_node(gemma6, gemma6_greedy):
    """Prompts prefilled on the windowed decode node itself (no bootstrap fields: the scheduler
    admits them, a window and a chunk each at most) among PD rooms of the same prompts (a window
    and a page), 2 running on a sliding pool of 2 x 7 pages, with the prefix cache: every answer
    is transformers', nothing runs the pool short, and afterwards only the tree holds pages."""
    prompts, reference = gemma6_greedy
    engine = {**WINDOWED, "enable_prefix_cache": True, "max_running": 2}
    with running(lambda: PDCluster(gemma6, 2, 3, decode_engine=engine)) as c:
        for i, ids in enumerate(prompts):
            c.submit_local(f"local{i}", ids, len(reference[i]))
            c.submit(f"pd{i}", ids, len(reference[i]))
        for i in range(len(prompts)):
            r = c.result(f"local{i}", sides=("decode",))
            assert r.ok and r.tokens == reference[i], f"decode-local prompt {i}: {r}"
            r = c.result(f"pd{i}")
            assert r.ok and r.tokens == reference[i], f"PD prompt {i}: {r}"
        _only_the_tree_holds(c, c.decode.loops)


def _only_the_tree_holds(cluster, loops) -> list:
    """Waits until every rank of `cluster` settled; then, paused, on each of `loops` only the
    prefix cache (if any) holds pages of either pool. Returns `loops`."""
    for node in cluster.wait_settled().values():
        for s in node:
            assert settled(s), s
    with cluster.paused():
        for loop in loops:
            pool, tree = loop.runner.pool, loop.sched.cache
            assert pool.allocator.num_used == (tree.num_cached_pages if tree else 0)
            assert pool.sliding_allocator.num_used == (len(tree._sliding_of) if tree else 0)
    return loops
