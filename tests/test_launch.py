"""`pdserve launch` (pdserve/launch.py): command lines from a deployment's values, and a clear
error naming the key when the values cannot make one. The commands it makes for the chart and
compose are checked in tests/test_deploy.py; the multi-host tests start their clusters with it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve import launch
from pdserve.launch import ValuesError

NODE = {"replicas": 1, "pp": 4, "ranksPerPod": 2, "port": 30001, "distPort": 29500}
VALUES = {
    "leaders": {"prefill": ["p0"], "decode": ["d0", "d1"]},
    "prefill": {**NODE, "replicas": 1, "port": 30000, "bootstrapPort": 8998},
    "decode": {**NODE, "replicas": 2, "extraArgs": ["--max-running", 8]},
    "router": {"port": 8000, "extraArgs": ["--health-interval", "1"]},
}


def test_a_node_over_hosts_meets_at_its_leader():
    argv = launch.argv_for(VALUES, "decode", 1, 1, "10.0.0.5")
    assert argv == [
        "decode", "--pp", "4", "--host", "10.0.0.5", "--port", "30001",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "d1:29500",
        "--device", "cpu", "--drain-grace", "30", "--max-running", "8",
    ]  # fmt: skip


def test_the_router_lists_every_node():
    argv = launch.argv_for(VALUES, "router", 0, 0, "0.0.0.0")
    assert argv == [
        "router", "--host", "0.0.0.0", "--port", "8000",
        "--prefill", "http://p0:30000", "8998",
        "--decode", "http://d0:30001", "--decode", "http://d1:30001",
        "--health-interval", "1",
    ]  # fmt: skip


def test_later_values_override_key_by_key(tmp_path):
    base, top = tmp_path / "a.yaml", tmp_path / "b.json"
    base.write_text("prefill: {pp: 2, port: 1}\nrouter: {port: 9}\n")
    top.write_text(json.dumps({"prefill": {"pp": 4}}))
    assert launch.load_values([base, top]) == {
        "prefill": {"pp": 4, "port": 1},
        "router": {"port": 9},
    }


@pytest.mark.parametrize(
    ("change", "role", "index", "rank", "message"),
    [
        ({"decode": {**NODE, "replicas": 2, "pp": "4"}}, "decode", 0, 0, "`decode.pp` must be"),
        ({"decode": {**NODE, "replicas": 2, "pp": 3}}, "decode", 0, 0, "multiple of"),
        ({"leaders": {"prefill": ["p0"]}}, "decode", 0, 1, "`leaders.decode` has no host"),
        ({"leaders": {"prefill": ["p0"], "decode": ["d0"]}}, "router", 0, 0, "no host for node 1"),
        ({}, "decode", 2, 0, "--node-index 2: the values have 2 decode"),
        ({}, "decode", 0, 2, "node-rank 2 is not one of the node's 2 hosts"),
        ({"router": {}}, "router", 0, 0, "`router.port` is missing"),
        ({"lws": {"enabled": True}}, "decode", 0, 1, "LWS_LEADER_ADDRESS"),
    ],
)
def test_bad_values_name_what_is_wrong(change, role, index, rank, message, monkeypatch):
    monkeypatch.delenv("LWS_LEADER_ADDRESS", raising=False)
    with pytest.raises(ValuesError, match=message):
        launch.argv_for(VALUES | change, role, index, rank, "h")


def test_the_command_takes_node_rank_from_the_environment(tmp_path):
    values = tmp_path / "v.json"
    values.write_text(json.dumps(VALUES))
    cmd = [sys.executable, "-m", "pdserve.cli", "launch", "decode", "--values", str(values)]
    cmd += ["--host", "h", "--print"]
    env = {"NODE_RANK": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "--node-rank 1 --dist-init-addr d0:29500" in out.stderr
    values.write_text("prefill: [1, 2")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert (
        out.returncode == 2 and "pdserve launch: error:" in out.stderr and "not YAML" in out.stderr
    )


AUTO = {**VALUES, "decode": {**NODE, "replicas": 0, "pp": 2, "ranksPerPod": 2}, "leaders": {}}
AUTO["autoscaling"] = {"enabled": True, "router": "r-peers", "intervalSeconds": 7}


def test_autoscaled_nodes_are_not_on_the_routers_command_line():
    """They register themselves: the router starts with none, and its elastic controller on (it
    exports the gauge the autoscaler follows); a node's index is not checked against replicas."""
    router = launch.argv_for(AUTO, "router", 0, 0, "0.0.0.0")
    assert router == [
        "router", "--host", "0.0.0.0", "--port", "8000", "--elastic", "true",
        "--health-interval", "1",
    ]  # fmt: skip
    assert launch.argv_for(AUTO, "decode", 0, 0, "h")[:2] == ["decode", "--pp"]
    assert launch.register_argv(AUTO, "decode", "join", 0, "127.0.0.1") == [
        "register", "join", "--router", "http://r-peers:8000", "--node", "http://127.0.0.1:30001",
        "--role", "decode", "--wait", "600", "--every", "7",
    ]  # fmt: skip
    assert launch.register_argv(AUTO, "prefill", "leave", 0, "127.0.0.1")[-2:] == [
        "--deadline",
        str(30 + launch.LEAVE_MARGIN_S),
    ]
    with pytest.raises(ValuesError, match="prefill and decode nodes"):
        launch.register_argv(AUTO, "router", "join", 0, "127.0.0.1")
    with pytest.raises(ValuesError, match="needs `lws.enabled`"):
        launch.argv_for(AUTO, "prefill", 0, 0, "h")  # pp 4 over 2 pods, no LWS
