"""Prefill and decode nodes as real processes with real Mooncake transfers over TCP on loopback.

The model is tiny6 (6 layers): the PP splits cut across each other as the real ones do (prefill
PP 2: 3/3 layers, decode PP 3: 2/2/2) with a fifth of tiny30's layers to run. The two nodes
of a test start at once (pd_cluster.pd_pair)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest
from cluster import group_alive, wait_healthy
from one_thread import hf_greedy_one_thread
from pd_cluster import (
    allow_bootstrap,
    body,
    decode_node,
    pd_generate,
    pd_generate_all,
    pd_pair,
    prefill_node,
    sse_tokens,
    wait_pages_free,
)

MAX_NEW = 10


@pytest.fixture(scope="module")
def reference(tiny6, mixed_prompts):
    return hf_greedy_one_thread(tiny6, mixed_prompts, MAX_NEW)


# All prompts are sent at once and queue behind each other on a loaded machine: the fast 8 s KV
# timeouts (meant for the failure tests) would fail a room that merely waited its turn to prefill.
QUEUE_TIMEOUTS = {"PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "60", "PDSERVE_KV_WAITING_TIMEOUT_S": "60"}


# Every layout from (1,1) to (3,3), and decode-local requests among PD ones, run in seconds
# in-process (tests/test_inproc_pd.py, ranks as threads, the in-memory transfer); here, one layout
# with real processes, gloo and Mooncake: the decode ranks' layers cut across the prefill ranks'
# (2 against 3: decode PP1's layers [2, 4) come from both prefill ranks).
# The prompts come from three tenants (one weighted, one of lower priority): the ranks order their
# waiting queues and cap each tenant's prefill per forward by them (engine/fair_queue.py), with the
# consensus checker on, and the answers stay exact. The cap is set below the longer prompts, so
# that it binds.
TENANTS = ({"tenant": "a"}, {"tenant": "b", "tenant_weight": 3.0}, {"tenant": "c", "priority": 1})


@pytest.mark.parametrize("ppp,dpp", [(2, 3)])
def test_pd_greedy_matches_transformers(ppp, dpp, tiny6, mixed_prompts, reference, tmp_path):
    cap = ["--fair-prefill-tokens", "24"]
    with pd_pair(tiny6, ppp, dpp, tmp_path, cap, QUEUE_TIMEOUTS) as ((purl, bport, _), (durl, _)):
        got = pd_generate_all(purl, durl, bport, mixed_prompts, MAX_NEW, TENANTS)
        for i, (g, want) in enumerate(zip(got, reference, strict=True)):
            assert g == want, f"prompt {i} (len {len(mixed_prompts[i])}) differs from transformers"
        left = wait_pages_free(purl, durl)
        assert not any(left[purl]) and not any(left[durl]), left
        for url in (purl, durl):
            assert httpx.get(f"{url}/health").status_code == 200
    for name in ("prefill", "decode"):
        assert "diverged" not in (tmp_path / f"{name}.log").read_text()


async def _abort_one_sided(c, url, rid, room, bport, prompts):
    """A request sent to one node only, whose partner never comes, aborted there after 0.5 s
    (prefill: in bootstrap; decode: in prealloc or transfer); returns its answer."""
    t = asyncio.create_task(
        c.post(f"{url}/generate", json={**body(prompts[3], room, bport, 5), "rid": rid})
    )
    await asyncio.sleep(0.5)
    assert (await c.post(f"{url}/abort", json={"rid": rid})).json()["aborted"]
    r = await t
    assert r.status_code >= 400
    return r


async def _abort_that_overtakes_its_request(c, purl, durl, bport, prompts) -> None:
    """An abort that overtakes its request (it came first, on another connection): the request is
    refused when it arrives, on either node, instead of waiting for a partner that already gave
    up until its bootstrap timeout. Malformed rids are refused by name."""
    for url, rid in ((purl, "e1"), (durl, "e2")):
        assert (await c.post(f"{url}/abort", json={"rid": rid})).json()["aborted"] is False
        r = await c.post(f"{url}/generate", json={**body(prompts[3], 13, bport, 5), "rid": rid})
        assert r.status_code == 409 and r.json()["error"]["code"] == "aborted", r.text
        for bad in (
            {"rid": 5},
            {"rid": ""},
            {"rid": "x" * 257},
            {},
        ):  # named, not remembered
            r = await c.post(f"{url}/abort", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text


RANDOM_ABORTS = 24  # requests with random fates; a quarter of them are never aborted


async def _random_aborts(c, purl, durl, bport, prompts, reference) -> None:
    """Random aborts: waiting, mid-chunk, inflight on prefill; transfer, running on decode. The
    requests that finish are right, and enough of them finish."""
    rng = random.Random(5)

    async def one(i):
        k = i % len(prompts)
        room, rid = rng.getrandbits(63), f"r{i}"
        b = {**body(prompts[k], room, bport, MAX_NEW), "rid": rid}
        mode = rng.choice(["none", "prefill", "decode", "both"])
        delay = rng.uniform(0.0, 1.5)
        tp = asyncio.create_task(c.post(f"{purl}/generate", json=b))
        td = asyncio.create_task(c.post(f"{durl}/generate", json=b))
        if mode != "none":
            await asyncio.sleep(delay)
            if mode in ("prefill", "both"):
                await c.post(f"{purl}/abort", json={"rid": rid})
            if mode in ("decode", "both"):
                await c.post(f"{durl}/abort", json={"rid": rid})
        rp, rd = await tp, await td
        return k, mode, rp, rd

    results = await asyncio.gather(*(one(i) for i in range(RANDOM_ABORTS)))
    ok = 0
    for k, mode, rp, rd in results:
        if rd.status_code == 200 and rd.json()["meta_info"]["finish_reason"]["type"] == "length":
            assert rd.json()["token_ids"] == reference[k], (k, mode)
            ok += 1
        else:
            assert mode != "none", (k, rp.text, rd.text)
    assert ok >= RANDOM_ABORTS // 8


async def _streaming_client_goes_away(c, purl, durl, bport, prompts) -> None:
    """Streaming client that goes away while decoding."""
    async with c.stream(
        "POST", f"{durl}/generate", json=body(prompts[5], 77, bport, 40, True)
    ) as s:
        pre = asyncio.create_task(c.post(f"{purl}/generate", json=body(prompts[5], 77, bport, 40)))
        lines = []
        async for line in s.aiter_lines():
            lines.append(line)
            if len(sse_tokens(lines)) >= 3:
                break
    await pre


def test_aborts_at_every_stage(tiny6, mixed_prompts, reference, tmp_path):
    """Deterministic cases for the stages only one side reaches,
    then random aborts on both sides. Aborts end their rooms through KVAbort, not timeouts, so the
    transfer wait is long: the requests queue on a loaded machine, and at 8 s an unaborted room's
    transfer timed out in a loaded full run."""
    env = {"PDSERVE_KV_WAITING_TIMEOUT_S": "30"}
    with pd_pair(tiny6, 2, 2, tmp_path, env=env) as ((purl, bport, _), (durl, _)):
        allow_bootstrap(durl, bport)

        async def run():
            # keep-alive below uvicorn's 5 s: on a loaded machine a connection idle while the
            # results are checked was reused as the node closed it (httpx.ReadError)
            limits = httpx.Limits(keepalive_expiry=4.0)
            async with httpx.AsyncClient(timeout=60, limits=limits) as c:
                r = await _abort_one_sided(c, purl, "b1", 11, bport, mixed_prompts)
                assert "abort" in r.json()["error"]["message"]
                await _abort_that_overtakes_its_request(c, purl, durl, bport, mixed_prompts)
                await _abort_one_sided(c, durl, "d1", 12, bport, mixed_prompts)
                await _random_aborts(c, purl, durl, bport, mixed_prompts, reference)
                await _streaming_client_goes_away(c, purl, durl, bport, mixed_prompts)

        asyncio.run(asyncio.wait_for(run(), 180))
        left = wait_pages_free(purl, durl, timeout=40)
        assert not any(left[purl]) and not any(left[durl]), f"pages still held: {left}"
        # Still serving, still right.
        assert pd_generate_all(purl, durl, bport, mixed_prompts[:3], MAX_NEW) == reference[:3]


def _kill_group(proc):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


async def _kill_decode_node_while_decoding(purl, durl, bport, dproc, prompts):
    """Eight PD requests of 400 tokens; the decode node is SIGKILLed while it decodes. Returns the
    requests' results (exceptions included) and how long they took after the kill."""
    async with httpx.AsyncClient(timeout=60) as c:
        tasks = [
            asyncio.create_task(pd_generate(c, purl, durl, bport, prompts[i], 400))
            for i in range(8)
        ]
        # Killed while it decodes (its ranks report their queues twice a second; 400
        # tokens take longer than that even on tiny6).
        deadline = time.monotonic() + 60
        while (await c.get(f"{durl}/server_info")).json()["load"]["running"] == 0:
            assert time.monotonic() < deadline, "the decode node never started decoding"
            await asyncio.sleep(0.1)
        _kill_group(dproc)
        t0 = time.monotonic()
        res = await asyncio.gather(*tasks, return_exceptions=True)
        return res, time.monotonic() - t0


async def _kill_prefill_node_under_rooms(durl, bport, pproc, prompts):
    """Six rooms registered by the decode node; the prefill node is SIGKILLed under them. Returns
    the decode node's answers and how long they took after the kill."""
    async with httpx.AsyncClient(timeout=60) as c:
        tasks = [
            asyncio.create_task(
                c.post(f"{durl}/generate", json=body(prompts[i], 1000 + i, bport, 40))
            )
            for i in range(4, 10)
        ]
        await asyncio.sleep(0.2)
        _kill_group(pproc)
        t0 = time.monotonic()
        res = await asyncio.gather(*tasks)
        return res, time.monotonic() - t0


def test_decode_then_prefill_node_killed_and_the_survivor_recovers(
    tiny6, mixed_prompts, reference, tmp_path
):
    """SIGKILL of a whole node, the decode node first, then the prefill node. The prefill node that
    survived the first kill (with the replacement decode node) is the one killed second, so four
    nodes start instead of six; the prompts of the second kill are not in the decode node's prefix
    cache, so its rooms wait for every page from the prefill node as on a fresh node."""
    names = ("prefill-a", "decode-a")
    with (
        # The replacement decode node starts with the pair; the prefill node never hears of it
        # before the first kill is over (pd_generate_all below).
        decode_node(tiny6, 2, tmp_path, name="decode-b", wait=False) as (durl2, dproc2),
        pd_pair(tiny6, 2, 2, tmp_path, names=names) as ((purl, bport, pproc), (durl, dproc)),
    ):
        # 1. The decode node dies; the prefill node recovers.
        res, took = asyncio.run(
            _kill_decode_node_while_decoding(purl, durl, bport, dproc, mixed_prompts)
        )
        assert took < 40, f"prefill answers took {took:.0f} s after the decode node died"
        assert any(isinstance(r, Exception) for r in res), "no request was cut by the kill"
        assert group_alive(dproc.pid) == []
        left = wait_pages_free(purl, timeout=40)
        assert not any(left[purl]), f"prefill still holds pages after the decode node died: {left}"
        wait_healthy(durl2, dproc2, 240, tmp_path / "decode-b.log")
        assert pd_generate_all(purl, durl2, bport, mixed_prompts[:4], MAX_NEW) == reference[:4]

        # 2. The prefill node dies under rooms the decode node registered with it; the decode
        # node recovers.
        allow_bootstrap(durl2, bport)
        res, took = asyncio.run(_kill_prefill_node_under_rooms(durl2, bport, pproc, mixed_prompts))
        assert took < 40
        for r in res:
            if r.status_code == 200:
                # Never a 200 with wrong text: an unfinished transfer must end in an error.
                assert (
                    "error" in r.json() or r.json()["meta_info"]["finish_reason"]["type"] == "abort"
                )
        # The replacement starts while the decode node's quarantine runs out (they do not
        # interact).
        with prefill_node(tiny6, 2, tmp_path, name="prefill-b") as (purl2, bport2, _):
            left = wait_pages_free(durl2, timeout=40)
            assert not any(left[durl2]), (
                f"decode still holds pages after the prefill node died: {left}"
            )
            got = pd_generate_all(purl2, durl2, bport2, mixed_prompts[10:14], MAX_NEW)
            assert got == reference[10:14]
