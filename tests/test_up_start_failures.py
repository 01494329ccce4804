"""`pdserve up` stops at once, with the reason and nothing left running, when a node cannot start:
engine flags a rank would refuse (checked by the node before any rank starts), and a rank that
dies while it loads (a truncated weights file). Before, the second waited out the whole start-up
timeout (600 s) with the node's front alive and unhealthy."""

from __future__ import annotations

import os
import subprocess

from cluster import free_port, group_alive, launched
from tiny_model import build_tiny_model

BOUND_S = 180  # a bound on the wait, not a speed check: the failure comes in seconds


def _failed_start(args: list[str], log) -> str:
    with launched(["--port", str(free_port()), *args], log) as launch:
        try:
            rc = launch.proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            tail = log.read_text()[-3000:]
            raise AssertionError(f"`pdserve up` still waiting:\n{tail}") from None
        text = log.read_text()
        assert rc != 0, text[-3000:]
        assert group_alive(launch.proc.pid) == [], text[-3000:]
        return text


def test_bad_engine_flags_stop_it_before_any_rank(tiny6, tmp_path):
    text = _failed_start(
        ["--model", str(tiny6), "--node-args", "--chunk-size 1024 --max-batch-tokens 512"],
        tmp_path / "up.log",
    )
    assert "error: chunk_size (1024) must be <= max_batch_tokens (512)" in text
    assert "exited with code" in text and "during start-up" in text
    assert "pp_rank 0/1 ready" not in text  # refused by the node, not by its ranks


def test_a_rank_that_dies_loading_stops_it(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", num_layers=2, seed=3)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a download cut short
    text = _failed_start(["--model", str(model)], tmp_path / "up.log")
    assert "failed during start-up" in text and "exited with code" in text
