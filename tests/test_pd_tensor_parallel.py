"""Tensor parallelism on prefill and decode nodes, KV moved between different (PP, TP) layouts
(docs/ARCHITECTURE.md sections 6 and 15), with real processes, gloo and the TCP transfer.

Four prefill nodes (PP x TP 1x1, 1x2, 2x1, 2x2) and three decode nodes (1x1, 1x2, 2x1) of tiny6
(2 KV heads: TP 2 holds one each) start together; a request goes to one prefill and one decode
node, so the pairs below are the layouts #49 names. With the rank consensus checker on:
- greedy output is token-identical to transformers in fp32 on every pair, with the KV checksum
  on (each decode rank checks the heads and layers it got from each prefill rank);
- nothing is held after, and no rank diverged.
tests/test_kv_transfer_tp.py counts the bytes of each (layer, head) overlap.
"""

from __future__ import annotations

import contextlib

import pytest
from cluster import wait_healthy
from one_thread import hf_greedy_one_thread
from pd_cluster import decode_node, pd_generate_all, prefill_node, wait_pages_free

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
