"""Connection limits of pdserve's HTTP servers (infra/http_server.py), on a real `pdserve router`
process in front of stub nodes: slow request headers are cut off at the header timeout, and a
streaming client that stops reading loses its connection at the write timeout, which frees its
admission slot. And the router's SSE keep-alive while a stream waits for its first token."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import httpx
import openai
import pytest
from cluster import free_port, start
from stub_node import Cluster, StubNode

from pdserve.router.config import RetryConfig

HEADER_TIMEOUT_S, WRITE_TIMEOUT_S = 3, 2
SLOW_CLIENTS = 500


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """`pdserve router` with one slot and no queue, over a stub prefill and a stub decode node whose
    streams are long (20 000 chunks of 1 KB) and as fast as it can send them."""
    prefill = StubNode(role="prefill", bootstrap_port=free_port(), max_context=10**7)
    decode = StubNode(role="decode", max_context=10**7, natural_tokens=20_000)
    port = free_port()
    cmd = [
        "router",
        "--port",
        str(port),
        "--prefill",
        prefill.url,
        str(prefill.behavior.bootstrap_port),
        "--decode",
        decode.url,
        "--max-concurrent",
        "1",
        "--max-queue",
        "0",
        "--health-interval",
        "0.5",
    ]
    env = {
        "PDSERVE_HTTP_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "PDSERVE_HTTP_WRITE_TIMEOUT_S": str(WRITE_TIMEOUT_S),
    }
    try:
        with start(cmd, port, tmp_path_factory.mktemp("limits") / "router.log", env=env) as (
            url,
            _,
        ):
            yield url
    finally:
        prefill.stop()
        decode.stop()


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except BlockingIOError:
        return False


def test_slow_headers_are_cut_off_and_others_are_served(router):
    port = int(router.rsplit(":", 1)[1])
    slow = []
    for _ in range(SLOW_CLIENTS):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        s.setblocking(False)
        slow.append(s)
    stop = threading.Event()

    def drip():  # one more header line to each open connection, every half second
        while not stop.wait(0.5):
            for s in slow:
                try:
                    s.send(b"X-Slow: 1\r\n")
                except OSError:
                    pass

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        assert httpx.get(f"{router}/health", timeout=30).status_code == 200  # served meanwhile
        sel = selectors.DefaultSelector()
        for s in slow:
            sel.register(s, selectors.EVENT_READ)
        open_ = set(slow)
        deadline = time.monotonic() + 120  # far past the 3 s header timeout, for a loaded machine
        while open_ and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=1):
                if closed_by_peer(key.fileobj):
                    open_.discard(key.fileobj)
                    sel.unregister(key.fileobj)
        assert not open_, f"{len(open_)} of {SLOW_CLIENTS} slow connections still open"
    finally:
        stop.set()
        dripper.join(5)
        for s in slow:
            s.close()
    assert httpx.get(f"{router}/health", timeout=30).status_code == 200


def generate(router: str) -> int:
    body = {"text": "x" * 1000, "stream": False, "sampling_params": {"max_tokens": 1}}
    return httpx.post(f"{router}/generate", json=body, timeout=30).status_code


def test_a_client_that_stops_reading_frees_its_slot(router):
    port = int(router.rsplit(":", 1)[1])
    body = json.dumps({"text": "x" * 1000, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that stopped: a full window
    s.connect(("127.0.0.1", port))
    try:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        assert s.recv(64).startswith(b"HTTP/1.1 200")  # streaming; never read again
        assert generate(router) == 429, "the stream holds the router's only slot"
        deadline = time.monotonic() + 120
        status = 429
        while status == 429 and time.monotonic() < deadline:
            time.sleep(0.5)
            status = generate(router)
        assert status == 200, "the slot of the client that stopped reading was never freed"
    finally:
        s.close()


# --- SSE keep-alive (router/openai_api/keepalive.py), on the router in a thread over stub nodes
# --------------


def wait_running_zero(cluster, timeout: float = 30.0) -> int:
    admission = cluster.app.state.router.admission
    deadline = time.monotonic() + timeout
    while admission.running and time.monotonic() < deadline:
        time.sleep(0.05)
    return admission.running


def test_sse_pings_while_the_first_token_is_slow():
    with Cluster(node_kw={"first_token_delay_s": 1.5}, sse_keepalive_s=0.2) as cluster:
        body = {
            "model": "stub-model",
            "messages": [{"role": "user", "content": "one two three"}],
            "max_tokens": 4,
            "stream": True,
        }
        with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        assert r.status_code == 200
        first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data: "))
        assert first_data >= 1 and all(ln == ": ping" for ln in lines[:first_data]), lines[
            : first_data + 1
        ]
        assert lines[-1] == "data: [DONE]"
        # SSE clients skip comments: the official SDK reads the same stream whole
        sdk = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=30, max_retries=0)
        chunks = sdk.chat.completions.create(
            model="stub-model", messages=body["messages"], max_tokens=4, stream=True
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == "one two three one"
        )
        assert wait_running_zero(cluster) == 0


def test_sse_failure_after_pings_is_an_error_event_and_frees_the_slot():
    with Cluster(
        node_kw={"fail": "hang"},
        sse_keepalive_s=0.2,
        request_timeout_s=1.0,
        retry=RetryConfig(max_retries=0),
    ) as cluster:
        body = {"text": "one two", "stream": True, "sampling_params": {"max_tokens": 2}}
        with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        assert r.status_code == 200 and lines[0] == ": ping"
        events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert len(events) == 1 and events[0]["error"]["message"], lines
        assert lines[-1] == "data: [DONE]"
        assert wait_running_zero(cluster) == 0
