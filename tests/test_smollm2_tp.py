"""SmolLM2-135M (the default model's GGUF) at TP 3, in fp32, against transformers on the same
file: its 9 query heads, 3 KV heads and MLP of 1536 split three ways (docs/ARCHITECTURE.md
section 15), token-identical, with the rank consensus checker on: a colocated node, and `pdserve
up --prefill-tp 3 --decode-tp 3` with every request disaggregated (each decode rank's KV heads
from the prefill rank that holds them). Minutes of model loads on two cores: a CI step of its own
(`make test-models`)."""

from __future__ import annotations

import os
import re

import httpx
import pytest
import torch
from cluster import NODE_ARGS, free_port, pdserve_up, start
from one_thread import one_torch_thread
from reference import hf_greedy

from pdserve.engine.model.loader import load_model_config, resolve_model
from pdserve.engine.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.models

MAX_NEW = 16
TEXTS = [
    "The capital of France is",
    "Write a haiku about pipelines: tensors flow downstream, each stage holds a slice of heads,",
]


@pytest.fixture(scope="module")
def smollm2():
    """(prompts, transformers' greedy answers in fp32)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(None)
    cfg = load_model_config(path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (9, 3, 1536)
    tok = load_tokenizer(path)
    prompts = [tok(t).input_ids for t in TEXTS]
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad(), one_torch_thread():
        answers = hf_greedy(ref, prompts, MAX_NEW)
    del ref
    return prompts, answers


def assert_greedy(url: str, prompts, answers) -> None:
    """Each prompt's greedy answer through `url`'s /generate is transformers'."""
    for prompt, want in zip(prompts, answers, strict=True):
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
        }
        r = httpx.post(f"{url}/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == want


def test_tp3_serves_smollm2_exactly(smollm2, tmp_path):
    prompts, answers = smollm2
    port = free_port()
    cmd = ["serve", "--tp", "3", "--dtype", "float32", "--port", str(port), *NODE_ARGS]
    env = {"PDSERVE_RANK_CONSENSUS_CHECK": "1"}
    with start(cmd, port, tmp_path / "node.log", env=env, timeout=420) as (url, _):
        assert_greedy(url, prompts, answers)
        assert httpx.get(f"{url}/health").status_code == 200, "the checker or a rank failed"
    log = (tmp_path / "node.log").read_text()
    assert all(f"TP rank {t} of 3" in log for t in range(3))


# every request through the pair: no prompt is short enough, cached enough or queued enough for
# the decode node alone, and the latency model does not route
ALWAYS_PD = (
    "--disagg-min-prompt-tokens 0 --disagg-decode-prefix-fraction 2 "
    "--disagg-local-prefill-cost 0 --disagg-fixed-costs true"
)


def test_up_with_tp3_on_both_sides_serves_smollm2_exactly(smollm2, tmp_path):
    prompts, answers = smollm2
    port = free_port()
    node = " ".join([*NODE_ARGS, "--dtype", "float32"])
    args = ["--port", str(port), "--prefill-tp", "3", "--decode-tp", "3"]
    args += ["--node-args", node, "--router-args", ALWAYS_PD]
    env = {**os.environ, "PDSERVE_RANK_CONSENSUS_CHECK": "1"}
    log = tmp_path / "up.log"
    with pdserve_up(args, log, 600, env):
        url = f"http://127.0.0.1:{port}"
        assert_greedy(url, prompts, answers)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    text = log.read_text()
    assert "x TP 3" in text and "diverged" not in text
    taken = re.findall(r'pdserve_router_route_decisions_total\{path="(\w+)"[^}]*\} (\S+)', metrics)
    assert taken and {p for p, n in taken if float(n) > 0} == {"disaggregated"}, taken
