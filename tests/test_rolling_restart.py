"""A rolling restart (SIGHUP to `pdserve up`, pdserve/rolling_restart.py) of a 2 prefill + 2 decode
cluster under a constant load of greedy streams: every node is drained and started again, one at a
time, and no request fails and no stream differs from transformers' tokens (fp32)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import pytest
from cluster import free_port, launched, node_args, secret_auth
from one_thread import one_torch_thread
from reference import hf_greedy, load_hf
from tiny_model import build_tiny_model

pytestmark = pytest.mark.failover

PROMPTS = [[4 + i, 9, 16 + 3 * i, 25, 36, 49 - i] for i in range(6)]
MAX_NEW = 48
CLIENTS = 4
ROUTER_ARGS = (
    "--health-interval 0.5 --health-failure-threshold 2 --health-success-threshold 1 "
    "--decode-policy round_robin --cb-failure-threshold 100000 --pair-failure-threshold 100000"
)


async def _one(c: httpx.AsyncClient, url: str, i: int) -> tuple[int, list[int], str | None]:
    body = {"input_ids": PROMPTS[i], "stream": True,
            "sampling_params": {"max_tokens": MAX_NEW, "ignore_eos": True}}  # fmt: skip
    toks, error = [], None
    try:
        async with c.stream("POST", f"{url}/generate", json=body) as r:
            if r.status_code != 200:
                return i, toks, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = str(event["error"])
                    toks.extend(event.get("token_ids") or [])
    except httpx.HTTPError as e:
        error = repr(e)
    return i, toks, error


def test_a_rolling_restart_under_load_fails_nothing(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", num_layers=2, seed=7)
    with one_torch_thread():
        want = hf_greedy(load_hf(model), PROMPTS, MAX_NEW)
    port, log = free_port(), tmp_path / "up.log"
    args = ["--model", str(model), "--port", str(port), "--prefill-nodes", "2"]
    args += ["--decode-nodes", "2", "--node-args", " ".join([*node_args(), "--drain-grace", "1"])]
    args += ["--router-args", ROUTER_ARGS]
    url = f"http://127.0.0.1:{port}"
    with launched(args, log) as launch:
        proc = launch.ready(timeout=300)
        auth = secret_auth(log)
        nodes = [w["url"] for w in httpx.get(f"{url}/workers", auth=auth).json()["workers"]]
        pids = {n: httpx.get(f"{n}/server_info", auth=auth).json()["pid"] for n in nodes}

        async def load() -> list[tuple[int, list[int], str | None]]:
            done, outs = asyncio.Event(), []
            async with httpx.AsyncClient(timeout=120) as c:

                async def client(k: int) -> None:
                    while not done.is_set():
                        outs.append(await _one(c, url, k % len(PROMPTS)))
                        k += CLIENTS

                tasks = [asyncio.create_task(client(k)) for k in range(CLIENTS)]
                await asyncio.sleep(1.0)
                proc.send_signal(signal.SIGHUP)
                deadline = time.monotonic() + 240
                while "rolling restart done" not in log.read_text():
                    assert "rolling restart stopped" not in log.read_text(), log.read_text()[-3000:]
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    await asyncio.sleep(0.5)
                await asyncio.sleep(1.0)
                done.set()
                await asyncio.gather(*tasks)
            return outs

        outs = asyncio.run(load())
        text = log.read_text()
        assert len(re.findall(r"rolling restart: \S+ back", text)) == 4, text[-3000:]
        after = {n: httpx.get(f"{n}/server_info", auth=auth).json()["pid"] for n in nodes}
        assert all(after[n] != pids[n] for n in nodes), "a node was not restarted"
    failed = [(i, e) for i, _, e in outs if e is not None]
    assert not failed, failed
    assert all(toks == want[i] for i, toks, _ in outs), "a stream differs from transformers"
    assert len(outs) > 20, len(outs)
