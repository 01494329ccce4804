"""Tensor parallelism on prefill and decode nodes, KV moved between different (PP, TP) layouts
(docs/ARCHITECTURE.md sections 6 and 15), with real processes, gloo and the TCP transfer.

Four prefill nodes (PP x TP 1x1, 1x2, 2x1, 2x2) and three decode nodes (1x1, 1x2, 2x1) of tiny6
(2 KV heads: TP 2 holds one each) start together; a request goes to one prefill and one decode
node, so the pairs below are the layouts #49 names. With the rank consensus checker on:
- greedy output is token-identical to transformers in fp32 on every pair, with the KV checksum
  on (each decode rank checks the heads and layers it got from each prefill rank);
- nothing is held after, and no rank diverged.
And an abort storm through `pdserve up` with TP 2 on both sides (prefill 2x2, decode 2x2), every
request disaggregated, small pools: every answer that ran to its end is transformers', nothing is
held after, and the cluster still answers.
tests/test_kv_transfer_tp.py counts the bytes of each (layer, head) overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time

import httpx
import pytest
import torch
from cluster import ClusterAuth, free_port, node_args, pdserve_up, wait_healthy
from metrics_scrape import scrape, total
from one_thread import hf_greedy_one_thread
from pd_cluster import FAST_TIMEOUTS, decode_node, pd_generate_all, prefill_node, wait_pages_free
from test_smollm2_tp import ALWAYS_PD
from test_tensor_parallel import STORM, STORM_NEW, _storm

pytestmark = pytest.mark.tp  # `make test-tp`, a CI step of its own

MAX_NEW = 8
PREFILL = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1), "2x2": (2, 2)}
DECODE = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1)}
# (prefill PP x TP, decode PP x TP): the layouts of #49
PAIRS = [("1x2", "1x1"), ("1x1", "1x2"), ("2x2", "1x2"), ("1x2", "2x1"), ("2x1", "1x2")]
# the prompts queue behind each other on a loaded machine: no room fails for waiting its turn
QUEUE_TIMEOUTS = {"PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "60", "PDSERVE_KV_WAITING_TIMEOUT_S": "60"}


@pytest.fixture(scope="module")
def nodes(tiny6, tmp_path_factory):
    """{("prefill", "1x2"): (url, bootstrap port), ("decode", "1x1"): (url,), ...}, all started at
    once and stopped after the module."""
    tmp = tmp_path_factory.mktemp("pd_tp")
    with contextlib.ExitStack() as stack:
        started = {}
        for name, (pp, tp) in PREFILL.items():
            extra = ["--tp", str(tp), "--kv-checksum"]
            url, bport, proc = stack.enter_context(
                prefill_node(tiny6, pp, tmp, extra, QUEUE_TIMEOUTS, f"prefill-{name}", wait=False)
            )
            started["prefill", name] = (url, proc, (url, bport))
        for name, (pp, tp) in DECODE.items():
            extra = ["--tp", str(tp), "--kv-checksum"]
            url, proc = stack.enter_context(
                decode_node(tiny6, pp, tmp, extra, QUEUE_TIMEOUTS, f"decode-{name}", wait=False)
            )
            started["decode", name] = (url, proc, (url,))
        for (role, name), (url, proc, _) in started.items():
            wait_healthy(url, proc, 300, tmp / f"{role}-{name}.log")
        yield {key: value for key, (_, _, value) in started.items()}, tmp


@pytest.fixture(scope="module")
def reference(tiny6, mixed_prompts):
    return hf_greedy_one_thread(tiny6, mixed_prompts[:8], MAX_NEW)


@pytest.mark.parametrize("pname,dname", PAIRS)
def test_pd_tp_layout_matches_transformers(pname, dname, nodes, tiny6, mixed_prompts, reference):
    found, tmp = nodes
    purl, bport = found["prefill", pname]
    (durl,) = found["decode", dname]
    prompts = mixed_prompts[:8]
    got = pd_generate_all(purl, durl, bport, prompts, MAX_NEW)
    for i, (g, want) in enumerate(zip(got, reference, strict=True)):
        assert g == want, f"{pname}->{dname}: prompt {i} differs from transformers"
    left = wait_pages_free(purl, durl)
    assert not any(left[purl]) and not any(left[durl]), left
    for role, name in (("prefill", pname), ("decode", dname)):
        log = (tmp / f"{role}-{name}.log").read_text()
        assert "diverged" not in log and "checksum_mismatch" not in log, f"{role}-{name}"


def test_kv_counters_sum_every_tp_rank(nodes, tiny6, mixed_prompts):
    """A stage's KV transfer counters sum its TP ranks' own transfers (each moves the heads it
    holds): after rooms through every pair, on every node of the pairs each stage's bytes per
    token (moved and skipped together) are its layers' KV of every head, so over the stages the
    whole model's, whatever the node's TP: exactly on a decode node, which counts by token; at
    least that on a prefill node, which counts the bytes it wrote (whole pages from a page-aligned
    cached prefix on). When followers pushed no counters, a TP 2 node's were about half of that.
    A follower pushes every 0.5 s, so the counters are read until they agree, for up to 30 s."""
    found, _ = nodes
    for pname, dname in PAIRS:
        purl, bport = found["prefill", pname]
        (durl,) = found["decode", dname]
        pd_generate_all(purl, durl, bport, mixed_prompts[8:10], 2)
    cfg = json.loads((tiny6 / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_elem = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim
    in_pairs = {("prefill", p) for p, _ in PAIRS} | {("decode", d) for _, d in PAIRS}
    for role, name in sorted(in_pairs):
        (url, *_) = found[role, name]
        deadline = time.monotonic() + 30
        while True:
            why = _kv_counters_disagree(url, (PREFILL if role == "prefill" else DECODE)[name][0],
                                        per_elem, exact=role == "decode")  # fmt: skip
            if not why or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not why, (role, name, why)


def _kv_counters_disagree(url: str, pp: int, per_elem: int, exact: bool) -> str:
    """Why a node's per-stage KV bytes per token are not the model's KV per token, or ""."""
    got = scrape(url)
    (dtype,) = {lab["dtype"] for lab, _ in got["pdserve_model_info"]}
    per_token = per_elem * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    stage = {}
    for r in map(str, range(pp)):
        moved, tokens = (
            sum(total(got, f"pdserve_kv_transfer_{kind}_total", pp_rank=r) for kind in kinds)
            for kinds in (("bytes", "skipped_bytes"), ("tokens", "skipped_tokens"))
        )
        if not tokens:
            return f"stage {r} moved no rooms"
        stage[r] = (moved, tokens)
    per = sum(m / t for m, t in stage.values())
    ok = per == pytest.approx(per_token) if exact else per_token * (1 - 1e-9) <= per < 2 * per_token
    return "" if ok else f"{per:.1f} bytes a token, not {per_token}: {stage}"


SECRET = "tp-storm-secret"  # `pdserve up` takes the cluster secret from its environment


@pytest.fixture(scope="module")
def storm_reference(tiny6, mixed_prompts):
    return hf_greedy_one_thread(tiny6, mixed_prompts, STORM_NEW)


def test_an_abort_storm_with_tp2_on_both_sides_leaves_nothing_held(
    tiny6, mixed_prompts, storm_reference, tmp_path
):
    """160 streams through the router to a prefill node and a decode node of PP 2 x TP 2 each,
    every one disaggregated, with small pools (64 pages of 4 tokens: requests queue on both nodes
    and decodes are retracted), the consensus checker on, and a seeded mix of fates: run to the
    end, dropped before the first byte (the router aborts both legs), after the first token (the
    transfer's end), after a few."""
    port = free_port()
    small = " ".join(node_args(max_total_tokens=256, max_running=None))
    args = ["--model", str(tiny6), "--port", str(port), "--node-args", small]
    args += ["--prefill-pp", "2", "--prefill-tp", "2", "--decode-pp", "2", "--decode-tp", "2"]
    args += ["--router-args", f"{ALWAYS_PD} --health-interval 1"]
    timeouts = {"PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "90", "PDSERVE_KV_WAITING_TIMEOUT_S": "90"}
    env = {**os.environ, **FAST_TIMEOUTS, **timeouts, "PDSERVE_INTERNAL_TOKEN": SECRET}
    rng = random.Random(12)
    fates = ["end", "end", "before", "first", "some"]
    plans = [(i % len(mixed_prompts), rng.choice(fates)) for i in range(STORM)]
    auth = ClusterAuth(SECRET)
    with pdserve_up(args, tmp_path / "up.log", 480, env):
        url = f"http://127.0.0.1:{port}"
        outs = asyncio.run(_storm(url, mixed_prompts, plans))
        assert not [o for o in outs if o[0] == "hang"], "a stream hung"
        for (i, fate), (end, toks) in zip(plans, outs, strict=True):
            if fate == "end":
                assert end == "done" and toks == storm_reference[i], (i, end, toks)
        workers = httpx.get(f"{url}/workers", auth=auth, timeout=10).json()["workers"]
        nodes = {w["role"]: w["url"] for w in workers}
        deadline = time.monotonic() + 60
        while True:
            ranks = {
                role: httpx.get(f"{u}/server_info", auth=auth, timeout=10).json()["ranks"]
                for role, u in nodes.items()
            }
            held = {role: [r["held_pages"] for r in rs] for role, rs in ranks.items()}
            if not any(sum(h) for h in held.values()) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not any(sum(h) for h in held.values()), held
        assert any(r["retractions"] > 0 for r in ranks["decode"]), "the decode pool was never short"
        for u in nodes.values():
            assert httpx.get(f"{u}/health", auth=auth, timeout=10).status_code == 200
        again = asyncio.run(_storm(url, mixed_prompts, [(i, "end") for i in range(4)]))
        assert [t for _, t in again] == storm_reference[:4]
    log = (tmp_path / "up.log").read_text()
    assert "consensus check FAILED" not in log and "diverged" not in log


@pytest.mark.parametrize("dname", ["1x2", "2x1"])
def test_a_tp_decode_node_prefills_alone_exactly(dname, nodes, mixed_prompts, reference):
    """A request the router sends to the decode node alone (no bootstrap room) is prefilled there,
    by its TP ranks, among none of the PD rooms' transfers."""
    from test_pp_node import generate_all

    found, _ = nodes
    (durl,) = found["decode", dname]
    assert generate_all(durl, mixed_prompts[:8], MAX_NEW) == reference
