"""A windowed KV pool (`--windowed-kv`, engine/window_pages.py): a sliding-window model's sliding
layers keep their KV in pages of their own and give back the pages behind the window, so a long
request holds its window there, not its context. The outputs must not move by a bit, on every
PP layout, in fp32 (against transformers) and in bf16 (through the extend and decode kernels)."""

from __future__ import annotations

import contextlib
import random

import httpx
import pytest
import torch
from cluster import NODE_ARGS, held_port, start
from inproc import ColocatedCluster, running, settled
from reference import hf_greedy, load_hf

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import ParamError, Req, SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.kernels import paged_attention
from pdserve.engine.kv_cache import PageAllocator, pages_needed
from pdserve.engine.window_pages import WindowPages, full_pool_pages, pages_per_request
from pdserve.pd_common.node_config import PDNodeConfig
from tests.tiny_model import build_tiny_model

WINDOWED = {"windowed_kv": True, "enable_prefix_cache": False}


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


@pytest.mark.parametrize("pp,depth", [(1, 0), (2, 1), (3, 0)])
def test_every_colocated_layout_matches_transformers(pp, depth, gemma6, gemma6_greedy):
    """A colocated node with the windowed pool, its ranks as threads: token-identical to
    transformers on prompts of up to 70 tokens (windows of 7, pages of 4), chunked and batched;
    afterwards no page of either pool is held on any rank."""
    prompts, reference = gemma6_greedy
    engine = {**WINDOWED}
    with running(lambda: ColocatedCluster(gemma6, pp, engine=engine, async_depth=depth)) as c:
        for loop in c.node_.loops:
            assert loop.runner.pool.sliding_kv is not None, "the pool is not windowed"
        got = c.generate_all(prompts, len(reference[0]))
        for i, (g, w) in enumerate(zip(got, reference, strict=True)):
            assert g == w, f"prompt {i} (len {len(prompts[i])}) differs from transformers"
        for s in c.wait_settled()["colocated"]:
            assert settled(s), s
        with c.paused():
            for loop in c.node_.loops:
                pool = loop.runner.pool
                assert pool.allocator.num_used == 0
                assert pool.sliding_allocator.num_used == 0


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
    """Named errors: with the prefix cache on (it keeps what the pool frees), on a PD node (its
    transfer moves one pool's pages), and for a model without sliding windows."""
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(windowed_kv=True)
    with pytest.raises(ValueError, match="colocated"):
        PDNodeConfig(engine=EngineConfig(**WINDOWED))
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
    """Gemma 3 270M's counts (18 layers, 15 sliding): a sliding pool of a quarter of the pages
    leaves the full pool 18 - 15/4 = 14.25 pages' worth of full layers per page of the budget,
    4.75x the pages; a sliding pool as large as the budget leaves it the same."""
    assert full_pool_pages(2048, 512, 18, 15) == (2048 * 18 - 512 * 15) // 3 == 9728
    assert full_pool_pages(2048, 2048, 18, 15) == 2048
    assert full_pool_pages(2048, 0, 18, 15) == 2048
    assert full_pool_pages(2048, 100, 6, 6) == 2048  # every layer slides: no full pool to grow


def test_a_real_pp2_node_serves_windowed(gemma6, gemma6_greedy, tmp_path):
    """`pdserve serve --pp 2 --windowed-kv --no-prefix-cache` as real processes: its ranks build
    the windowed pool (their ready line says so) and answer every prompt as transformers does."""
    prompts, reference = gemma6_greedy
    with contextlib.ExitStack() as holds:
        port = held_port(holds)
        cmd = ["serve", "--model", str(gemma6), "--pp", "2", "--port", str(port), *NODE_ARGS]
        cmd += ["--windowed-kv", "--no-prefix-cache"]
        log = tmp_path / "node.log"
        with start(cmd, port, log) as (url, _):
            for prompt, want in zip(prompts, reference, strict=True):
                body = {"input_ids": prompt, "sampling_params": {"max_tokens": len(want)}}
                body["sampling_params"]["ignore_eos"] = True
                r = httpx.post(f"{url}/generate", json=body, timeout=120)
                assert r.status_code == 200, r.text
                assert r.json()["token_ids"] == want
        assert log.read_text().count("windowed KV pool") == 2
