"""The internal plane needs the cluster secret: every node kind's internal endpoints, the prefill
node's bootstrap server, and a decode node contacts only bootstrap servers the router registered."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from cluster import NODE_ARGS, ROOT, free_port, start
from pd_cluster import FAST_TIMEOUTS, body
from reference import hf_greedy, load_hf

SECRET = "test-cluster-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}
WRONG = {"Authorization": f"Bearer {SECRET}x"}
ENV = {**FAST_TIMEOUTS, "PDSERVE_INTERNAL_TOKEN": SECRET}
SLOW_KV = {"PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "120", "PDSERVE_KV_WAITING_TIMEOUT_S": "120"}


@pytest.fixture(scope="module")
def nodes(tiny30, tmp_path_factory):
    """A colocated, a prefill and a decode node (PP 1, the decode node holding at most 2 requests),
    all holding the cluster secret."""
    tmp = tmp_path_factory.mktemp("auth")
    cport, pport, bport, dport = free_port(), free_port(), free_port(), free_port()
    common = ["--model", str(tiny30), "--pp", "1", *NODE_ARGS]
    with contextlib.ExitStack() as stack:
        colocated, _ = stack.enter_context(
            start(["serve", "--port", str(cport), *common], cport, tmp / "serve.log", env=ENV)
        )
        prefill, _ = stack.enter_context(
            start(
                ["prefill", "--port", str(pport), "--bootstrap-port", str(bport), *common],
                pport,
                tmp / "prefill.log",
                env=ENV,
            )
        )
        decode, _ = stack.enter_context(
            start(
                ["decode", "--port", str(dport), "--max-pending", "2", *common],
                dport,
                tmp / "decode.log",
                env={**ENV, **SLOW_KV},
            )
        )
        yield {"colocated": colocated, "prefill": prefill, "decode": decode, "bport": bport}


@pytest.mark.parametrize("kind", ["colocated", "prefill", "decode"])
def test_node_internal_endpoints_need_the_secret(nodes, kind):
    url = nodes[kind]
    gen = {
        "input_ids": [1, 2, 3],
        "bootstrap_room": 5,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": nodes["bport"],
        "sampling_params": {"max_tokens": 1},
    }
    for headers in ({}, WRONG, {"Authorization": SECRET}):
        r = httpx.post(f"{url}/generate", json=gen, headers=headers, timeout=10)
        assert r.status_code == 401, (kind, headers, r.text)
        assert (
            httpx.post(f"{url}/abort", json={"rid": "x"}, headers=headers, timeout=10).status_code
            == 401
        )
        assert httpx.get(f"{url}/server_info", headers=headers, timeout=10).status_code == 401
        assert httpx.get(f"{url}/debug/spans/x", headers=headers, timeout=10).status_code == 401
        for path, req in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert (
                httpx.post(f"{url}{path}", json=req, headers=headers, timeout=10).status_code == 401
            )
    assert httpx.get(f"{url}/server_info", headers=AUTH, timeout=10).json()["role"] == kind
    assert (
        httpx.post(f"{url}/tokenize", json={"prompt": "a"}, headers=AUTH, timeout=10).json()[
            "count"
        ]
        >= 1
    )
    assert (
        httpx.post(f"{url}/abort", json={"rid": "x"}, headers=AUTH, timeout=10).status_code == 200
    )
    # open on purpose: load balancer probes and Prometheus scrapers
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200


def test_bootstrap_server_needs_the_secret(nodes):
    base = f"http://127.0.0.1:{nodes['bport']}"
    fake = {
        "pp_rank": 0,
        "pp_size": 1,
        "layer_start": 0,
        "layer_end": 1,
        "host": "127.0.0.1",
        "ctrl_port": 9,
        "session_id": "evil:1",
        "page_size": 4,
        "token_bytes": 4,
        "dtype": "float32",
        "layout": "x",
    }
    for headers in ({}, WRONG):
        assert httpx.put(f"{base}/route", json=fake, headers=headers, timeout=10).status_code == 401
        assert (
            httpx.get(
                f"{base}/route",
                params={"layer_start": 0, "layer_end": 1},
                headers=headers,
                timeout=10,
            ).status_code
            == 401
        )
        assert (
            httpx.post(
                f"{base}/heartbeat",
                json={"session": "evil:1", "peers": []},
                headers=headers,
                timeout=10,
            ).status_code
            == 401
        )
    r = httpx.get(
        f"{base}/route", params={"layer_start": 0, "layer_end": 1}, headers=AUTH, timeout=10
    )
    assert r.status_code == 200 and [x["session_id"] for x in r.json()["ranks"]] != ["evil:1"]
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_decode_allowlist_is_set_only_with_the_secret(nodes):
    url = nodes["decode"]
    for headers in ({}, WRONG):
        r = httpx.put(
            f"{url}/bootstrap_servers",
            json={"servers": ["10.0.0.1:1"]},
            headers=headers,
            timeout=10,
        )
        assert r.status_code == 401
    r = httpx.put(f"{url}/bootstrap_servers", json={"servers": "x"}, headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "servers"


def test_decode_contacts_no_foreign_bootstrap_address(nodes, tiny30):
    """Even with the secret, a /generate naming a bootstrap server the router did not register is
    refused, and nothing connects to that address; a registered one still works end to end."""
    prefill, decode, bport = nodes["prefill"], nodes["decode"], nodes["bport"]
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(16)
        trap.setblocking(False)
        r = httpx.put(
            f"{decode}/bootstrap_servers",
            json={"servers": [f"127.0.0.1:{bport}"]},
            headers=AUTH,
            timeout=10,
        )
        assert r.status_code == 200
        foreign = {**body([5, 6, 7, 8], 99, trap.getsockname()[1], 4), "rid": "foreign"}
        r = httpx.post(f"{decode}/generate", json=foreign, headers=AUTH, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "unknown_bootstrap_server", (
            r.text
        )
        # A real request after it: the ranks have handled everything sent before it by the time it
        # ends.
        ids = [5, 6, 7, 8, 9, 10]
        want = hf_greedy(load_hf(tiny30), [ids], 4)[0]
        b = body(ids, 1234, bport, 4)
        with httpx.Client(headers=AUTH, timeout=60) as c, ThreadPoolExecutor(2) as pool:
            fp = pool.submit(c.post, f"{prefill}/generate", json=b)
            fd = pool.submit(c.post, f"{decode}/generate", json=b)
            rp, rd = fp.result(), fd.result()
        assert rp.status_code == 200, rp.text
        assert rd.status_code == 200 and rd.json()["token_ids"] == want, rd.text
        with pytest.raises(BlockingIOError):
            trap.accept()


def test_oversized_body_is_refused_before_it_is_read(nodes):
    url = nodes["colocated"]
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + SECRET.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{"
        )
        answer = s.recv(4096)  # answered without the 100 MB ever being sent
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]

    def chunks():
        yield b'{"text": "'
        for _ in range(80):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(f"{url}/generate", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413, r.text


@pytest.mark.parametrize("cmd", [["decode", "--host", "0.0.0.0"], ["router", "--host", "0.0.0.0"]])
def test_refuses_a_network_bind_without_a_secret(cmd, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_INTERNAL_TOKEN")}
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *cmd, "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "without a cluster secret" in r.stderr, r.stderr[-2000:]


def test_pending_cap_answers_503_with_retry_after(nodes):
    """Two decode requests whose KV never comes stay pending; the third is refused at once."""
    url, bport = nodes["decode"], nodes["bport"]
    r = httpx.put(
        f"{url}/bootstrap_servers",
        json={"servers": [f"127.0.0.1:{bport}"]},
        headers=AUTH,
        timeout=10,
    )
    assert r.status_code == 200
    with ThreadPoolExecutor(2) as pool:
        held = [
            pool.submit(
                httpx.post,
                f"{url}/generate",
                json={**body([5, 6, 7], 500 + i, bport, 4), "rid": f"hold{i}"},
                headers=AUTH,
                timeout=120,
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ranks = httpx.get(f"{url}/server_info", headers=AUTH, timeout=10).json()["ranks"]
            if (
                ranks[0]
                and sum(ranks[0].get(q, 0) for q in ("prealloc", "transfer", "waiting")) == 2
            ):
                break
            time.sleep(0.2)
        r = httpx.post(
            f"{url}/generate", json=body([5, 6, 7], 502, bport, 4), headers=AUTH, timeout=30
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "node_overloaded", r.text
        assert r.headers["retry-after"] == "1"
        for i in range(2):
            assert httpx.post(
                f"{url}/abort", json={"rid": f"hold{i}"}, headers=AUTH, timeout=10
            ).json()["aborted"]
        assert all(f.result().status_code >= 400 for f in held)
