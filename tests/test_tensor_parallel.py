"""Tensor parallelism inside a PP stage (docs/ARCHITECTURE.md section 15).

- The cut: two TP ranks' slices, run as threads that sum their partial outputs, give the logits
  of the whole slice, for Llama and Gemma 3 layers (engine/model/tensor_parallel.py).
- A colocated node of real processes at PP x TP 1x2 and 2x2 over gloo, with the rank consensus
  checker on: greedy output token-identical to transformers in fp32, guided output the offline
  engine's, sampled output the same for the same seed (the lead samples and compiles, its
  follower takes its tokens and its report), and nothing held after.
- A divergence planted on a TP follower is caught by the checker over the TP group.
- A TP follower killed mid-stream stops its node, and no rank outlives it.
- An abort storm on 2x2 with small pools leaves nothing held and every full answer exact.
- A TP size that does not divide the heads is refused before any rank starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from cluster import NODE_ARGS, free_port, group_alive, node_args, start
from one_thread import hf_greedy_one_thread
from test_engine import make
from test_pp_node import _alive, divergence_stops_the_node, generate_all, rank_stats
from test_structured_output import PROMPTS, SCHEMAS

from pdserve.engine.core import SamplingParams
from pdserve.engine.forward_batch import BatchItem, build_forward_batch
from pdserve.engine.kv_cache import KVLayout, KVPool
from pdserve.engine.model.config import tp_refusal
from pdserve.engine.model.loader import load_model_config, load_slice
from pdserve.engine.model.tensor_parallel import TPShard

MAX_NEW = 12


class ThreadSum:
    """An all-reduce of `size` threads: each adds its partial into the sum, in rank order."""

    def __init__(self, size: int):
        self.size = size
        self.parts: dict[int, list[torch.Tensor]] = {}
        self.barrier = threading.Barrier(size, timeout=30)

    def reducer(self, rank: int):
        def reduce(t: torch.Tensor) -> None:
            self.parts.setdefault(rank, []).append(t)
            self.barrier.wait()
            n = len(self.parts[rank]) - 1
            total = sum(self.parts[r][n].clone() for r in range(self.size))
            self.barrier.wait()
            t.copy_(total)

        return reduce


def _logits(model, prompt: list[int]) -> torch.Tensor:
    lay = KVLayout(
        num_pages=8,
        page_size=16,
        layer_start=model.layer_start,
        layer_end=model.layer_end,
        num_kv_heads=model.layer_cfg.num_kv_heads,
        head_dim=model.layer_cfg.head_dim,
        dtype=torch.float32,
    )
    pool = KVPool(lay)
    pages = list(range((len(prompt) + 15) // 16))
    fb = build_forward_batch([BatchItem(pages, 0, len(prompt), True)], 16, window=model.window)
    return model(torch.tensor(prompt), fb, pool)


@pytest.mark.parametrize("which", ["tiny6", "gemma6"])
def test_two_shards_sum_to_the_whole_slice(which, request, mixed_prompts):
    path = request.getfixturevalue(which)
    prompt = mixed_prompts[7]  # 40 tokens
    cfg = load_model_config(path)
    whole = _logits(load_slice(path, 0, cfg.num_layers), prompt)
    sums = ThreadSum(2)
    got: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        model = load_slice(path, 0, cfg.num_layers, None, TPShard(rank, 2, sums.reducer(rank)))
        assert model.layer_cfg.num_heads == cfg.num_heads // 2
        assert model.layer_cfg.num_kv_heads == cfg.num_kv_heads // 2
        got[rank] = _logits(model, prompt)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(got[0], got[1])  # every rank of the group holds the same logits
    assert torch.allclose(got[0], whole, atol=1e-5, rtol=1e-5), (got[0] - whole).abs().max()
    assert torch.equal(got[0][-1].argmax(), whole[-1].argmax())


def test_a_tp_size_that_does_not_divide_is_refused(tiny6):
    cfg = load_model_config(tiny6)  # 4 query heads, 2 KV heads, MLP 128
    assert tp_refusal(cfg, 2) == ""
    assert "KV heads" in tp_refusal(cfg, 4)
    assert "query heads" in tp_refusal(cfg, 3)
    with pytest.raises(ValueError, match="does not divide"):
        load_slice(tiny6, 0, 2, None, TPShard(0, 3))


def test_a_node_refuses_a_tp_the_model_cannot_take(tiny6):
    """The front says why and exits before it starts a rank."""
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny6), "--tp", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "tp 4 does not divide the model's 2 KV heads" in r.stderr, r.stderr[-2000:]


@pytest.fixture(scope="module")
def reference(tiny6, mixed_prompts):
    return hf_greedy_one_thread(tiny6, mixed_prompts, MAX_NEW)


@pytest.mark.parametrize("pp,tp", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_tp_node_matches_transformers(pp, tp, tiny6, mixed_prompts, reference, tmp_path):
    port = free_port()
    cmd = ["serve", "--model", str(tiny6), "--pp", str(pp), "--tp", str(tp), "--port", str(port)]
    env = {"PDSERVE_RANK_CONSENSUS_CHECK": "1"}
    log_path = tmp_path / "node.log"
    with start([*cmd, *NODE_ARGS], port, log_path, env=env) as (url, _):
        got = generate_all(url, mixed_prompts)
        for i, (g, want) in enumerate(zip(got, reference, strict=True)):
            assert g == want, f"prompt {i} (len {len(mixed_prompts[i])}) differs from transformers"
        _check_guided(url, tiny6)
        _check_sampled(url, mixed_prompts)
        stats = rank_stats(url)
        assert [s["pp_rank"] for s in stats] == list(range(pp))  # the leads report
        assert [s["held_pages"] for s in stats] == [0] * pp
        assert httpx.get(f"{url}/health").status_code == 200, "the checker or a rank failed"
    log = log_path.read_text()
    for r in range(pp):
        for t in range(tp):
            assert f"pp_rank {r}/{pp} ready: " in log
            assert f"TP rank {t} of {tp}" in log
    assert "consensus check FAILED" not in log


def _check_guided(url: str, model) -> None:
    eng = make(model)
    for name, schema in SCHEMAS.items():
        params = {"max_tokens": 48, "guide": ["json_schema", json.dumps(schema)]}
        want = eng.generate([PROMPTS[1]], SamplingParams.from_dict(params))[0].token_ids
        r = httpx.post(
            f"{url}/generate",
            json={"input_ids": PROMPTS[1], "sampling_params": params},
            timeout=120,
        )
        r.raise_for_status()
        assert r.json()["token_ids"] == want, name


def _check_sampled(url: str, prompts: list[list[int]]) -> None:
    """Sampled requests (top-p, top-k) on every rank of the group: the lead samples, its followers
    take its tokens, so the checker (on) finds nothing; the same seed gives the same tokens."""

    def one(ids: list[int], seed: int) -> list[int]:
        params = {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": seed}
        r = httpx.post(
            f"{url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=120
        )
        r.raise_for_status()
        return r.json()["token_ids"]

    first = [one(ids, i) for i, ids in enumerate(prompts[:4])]
    assert [one(ids, i) for i, ids in enumerate(prompts[:4])] == first


def test_a_divergence_on_a_tp_follower_is_caught(tiny6, mixed_prompts, tmp_path):
    """The test-only hook plants a rank-local allocation on PP0's TP rank 1: its lead and the
    other stages never see its page ids, only the checker's comparison over the TP group can."""
    port = free_port()
    cmd = ["serve", "--model", str(tiny6), "--tp", "2", "--port", str(port), *NODE_ARGS]
    env = {"PDSERVE_RANK_CONSENSUS_CHECK": "1", "PDSERVE_TEST_PLANT_DIVERGENCE": "0.1"}
    log = divergence_stops_the_node(cmd, port, tmp_path / "node.log", env, mixed_prompts[:2])
    assert "planting a divergence on colocated-pp0-tp1" in log


def test_sigkill_of_a_tp_follower_stops_the_node(tiny6, tmp_path):
    """Followers push no stats: the node watches their processes, as every rank's. A follower
    killed while its group serves a stream ends that stream with an error, the node turns
    unhealthy, and every rank exits."""
    port = free_port()
    cmd = ["serve", "--model", str(tiny6), "--tp", "2", "--port", str(port), *NODE_ARGS]
    log_path = tmp_path / "node.log"
    with start(cmd, port, log_path) as (url, proc):
        found = re.search(r"\[colocated pp0-tp1\] pid=(\d+)", log_path.read_text())
        assert found, "the follower's ready line"
        follower = int(found.group(1))
        lead = httpx.get(f"{url}/server_info").json()["ranks"][0]["pid"]
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1500, "ignore_eos": True}}
        with httpx.stream(
            "POST", f"{url}/generate", json={**body, "stream": True}, timeout=60
        ) as r:
            lines = r.iter_lines()
            first = next(lines)  # the stream has started
            assert "token" in first, first
            os.kill(follower, signal.SIGKILL)
            rest = "".join(lines)
        assert "node failure" in rest, rest[-500:]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and httpx.get(f"{url}/health").status_code != 503:
            time.sleep(0.2)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["dead"] is True, health.text
        while time.monotonic() - t0 < 30 and _alive(lead):
            time.sleep(0.2)
        assert not _alive(lead) and not _alive(follower), "a rank outlived its group"
    assert group_alive(proc.pid) == []


STORM = 160  # streaming requests
GUIDE = ["json_schema", json.dumps(SCHEMAS["enum"])]
STORM_NEW = 40  # long enough for the decodes to outgrow the small pool


@pytest.fixture(scope="module")
def storm_reference(tiny6, mixed_prompts):
    return hf_greedy_one_thread(tiny6, mixed_prompts, STORM_NEW)


def test_an_abort_storm_on_pp2_tp2_leaves_nothing_held(
    tiny6, mixed_prompts, reference, storm_reference, tmp_path
):
    """160 streams through a 2x2 node with small pools (64 pages of 4 tokens: requests queue
    and decodes are retracted), the consensus checker on, a seeded mix of fates: run to the end,
    dropped before the first byte, after the first token, after a few; guided (JSON schema) to
    the end or dropped after two tokens. Every answer that ran to its end is transformers' (a
    guided one the offline engine's), no stream hangs, and afterwards no lead holds a page, every
    queue is empty and the node still answers (a follower whose pool or queues had parted from its
    lead's would have stopped the node through the checker)."""
    port = free_port()
    cmd = ["serve", "--model", str(tiny6), "--pp", "2", "--tp", "2", "--port", str(port)]
    cmd += node_args(max_total_tokens=256, max_running=None)  # 64 pages of 4 tokens
    env = {"PDSERVE_RANK_CONSENSUS_CHECK": "1"}
    rng = random.Random(11)
    fates = ["end", "end", "before", "first", "some", "guided", "guided-cut"]
    plans = [(i % len(mixed_prompts), rng.choice(fates)) for i in range(STORM)]
    eng = make(tiny6)
    guided = eng.generate(
        [p for p in mixed_prompts], SamplingParams.from_dict({"max_tokens": 24, "guide": GUIDE})
    )
    with start(cmd, port, tmp_path / "node.log", env=env) as (url, _):
        outs = asyncio.run(_storm(url, mixed_prompts, plans))
        assert not [o for o in outs if o[0] == "hang"], "a stream hung"
        for (i, fate), (end, toks) in zip(plans, outs, strict=True):
            if fate == "end":
                assert end == "done" and toks == storm_reference[i], (i, end, toks)
            if fate == "guided":
                assert end == "done" and toks == guided[i].token_ids, (i, end, toks)
        ended = sum(o[0] == "done" for o in outs)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = rank_stats(url, settle_s=1.0)
            queues = [s["waiting"] + s["running"] for s in stats]
            if [s["held_pages"] for s in stats] == [0, 0] and queues == [0, 0]:
                break
        assert [s["held_pages"] for s in stats] == [0, 0], stats
        assert queues == [0, 0], stats
        assert all(s["retractions"] > 0 for s in stats), "the pools were never short"
        assert httpx.get(f"{url}/health").status_code == 200, "the checker or a rank failed"
        assert generate_all(url, mixed_prompts[:4]) == reference[:4]
    assert ended >= sum(f in ("end", "guided") for _, f in plans)
    assert "consensus check FAILED" not in (tmp_path / "node.log").read_text()


async def _storm(url: str, prompts, plans) -> list[tuple[str, list[int]]]:
    sem = asyncio.Semaphore(24)

    async def one(c: httpx.AsyncClient, i: int, fate: str) -> tuple[str, list[int]]:
        params: dict = {"max_tokens": STORM_NEW, "ignore_eos": True}
        if fate.startswith("guided"):
            params = {"max_tokens": 24, "guide": GUIDE}
        body = {"input_ids": prompts[i], "stream": True, "sampling_params": params}
        cut = {"first": 1, "some": 8, "guided-cut": 2}.get(fate)
        toks: list[int] = []
        async with sem:
            try:
                async with asyncio.timeout(120):
                    async with c.stream("POST", f"{url}/generate", json=body) as r:
                        if fate == "before":
                            return "dropped", toks
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            toks += json.loads(line[6:]).get("token_ids") or []
                            if cut and len(toks) >= cut:
                                return "dropped", toks
            except TimeoutError:
                return "hang", toks
        return "done", toks

    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as c:
        return await asyncio.gather(*(one(c, i, f) for i, f in plans))
