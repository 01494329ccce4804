"""Gemma 3 270M (the real file, `--model gemma3-270m`) against transformers on the same GGUF, in
fp32: the slices of the engine, and a whole `pdserve up` at PP (2, 3) with every request
disaggregated. One prompt is longer than the 512-token window, so the sliding layers' masks cut
keys. Minutes of model loads: a CI step of its own (`make test-models`)."""

from __future__ import annotations

import httpx
import pytest
import torch
from cluster import up
from metrics_scrape import counter
from one_thread import one_torch_thread
from reference import hf_greedy

from pdserve.engine.forward_batch import BatchItem, build_forward_batch
from pdserve.engine.kv_cache import KVLayout, KVPool, pages_needed
from pdserve.engine.model.loader import load_model_config, load_slice, resolve_model
from pdserve.engine.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.models

MAX_NEW = 16
PAGE = 16
LONG = " ".join(
    f"Item {i}: the {('red', 'blue', 'green')[i % 3]} box holds {i * 7 % 13} stones."
    for i in range(60)
)
TEXTS = ["The capital of France is", LONG + " Item 60: the"]


@pytest.fixture(scope="module")
def gemma3():
    """(path, config, prompts, transformers' greedy answers in fp32)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model("gemma3-270m")
    cfg = load_model_config(path)
    tok = load_tokenizer(path)
    prompts = [tok(t).input_ids for t in TEXTS]
    assert len(prompts[1]) > cfg.sliding_window  # the window cuts keys of the long prompt
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        answers = hf_greedy(ref, prompts, MAX_NEW)
    del ref
    return path, cfg, prompts, answers


def greedy(slices, cfg, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens through the chained slices: the prompt in one forward, then decode
    steps."""
    table = list(range(pages_needed(len(prompt) + n, PAGE)))
    pools = [
        KVPool(
            KVLayout(
                len(table),
                PAGE,
                s.layer_start,
                s.layer_end,
                cfg.num_kv_heads,
                cfg.head_dim,
                torch.float32,
            )
        )
        for s in slices
    ]
    out, start, x = [], 0, prompt
    window = max(s.window for s in slices)
    for _ in range(n):
        fb = build_forward_batch([BatchItem(table, start, len(x), True)], PAGE, window=window)
        h = torch.tensor(x)
        for s, pool in zip(slices, pools, strict=True):
            h = s(h, fb, pool)
        start += len(x)
        out.append(int(h[-1].argmax()))
        x = [out[-1]]
    return out


def test_the_config_is_gemma3_270m(gemma3):
    _, cfg, _, _ = gemma3
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert shape == (18, 640, 4, 1, 256) and cfg.vocab_size == 262144
    assert cfg.sliding_window == 512 and cfg.tie_word_embeddings
    assert [i for i in range(18) if not cfg.is_sliding(i)] == [5, 11, 17]


@pytest.mark.parametrize("cuts", [[(0, 18)], [(0, 7), (7, 18)]], ids=["one_slice", "two"])
def test_slices_match_transformers(gemma3, cuts):
    path, cfg, prompts, answers = gemma3
    slices = [load_slice(path, a, b) for a, b in cuts]
    with one_torch_thread():
        got = [greedy(slices, cfg, p, MAX_NEW) for p in prompts]
    assert got == answers


def test_pdserve_up_serves_it_exactly(gemma3, tmp_path):
    """`pdserve up --model gemma3-270m` in fp32, prefill PP 2 and decode PP 3, every prompt
    prefilled on the prefill node and its KV moved, the sliding layers' only from the window of
    the prompt's end on: token-identical to transformers. (Five ranks load fp32 slices of a
    262k-entry embedding on two cores at their own pace; each waits for the others before its
    first PP message, or a fast one's first receive timed out: once in four runs.)"""
    _, _, prompts, answers = gemma3
    args = ["--prefill-pp", "2", "--decode-pp", "3"]
    args += ["--node-args", "--dtype float32"]
    args += ["--router-args", "--disagg-local-prefill-cost 0 --disagg-min-prompt-tokens 1"]
    with up("gemma3-270m", tmp_path / "up.log", args, timeout=420) as (url, _, auth):
        # its ready line shows a completion, not a chat request this model would refuse
        ready = (tmp_path / "up.log").read_text().split("ready: ", 1)[1]
        assert "/v1/completions" in ready and "/v1/chat" not in ready
        for prompt, want in zip(prompts, answers, strict=True):
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
            }
            r = httpx.post(f"{url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["token_ids"] == want
        # the 790-token prompt's sliding layers moved from its window on, and both sides agree
        spared = {"prefill": 0.0, "decode": 0.0}
        for w in httpx.get(f"{url}/workers", auth=auth, timeout=10).json()["workers"]:
            spared[w["role"]] += counter(w["url"], "pdserve_kv_transfer_window_skipped_bytes_total")
        assert spared["prefill"] == spared["decode"] > 0, spared
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "gemma-3-270m-q4_k_m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
