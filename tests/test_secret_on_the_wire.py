"""The cluster secret never crosses the network (infra/request_signing.py, docs/SECURITY.md): every
frame on the loopback interface is captured for a whole `pdserve up` run (start-up, routing,
prefill and decode, shutdown), and none holds the secret in any usual encoding. A request the
router signed, taken off the wire, is refused when replayed and when one byte of it is changed.
Capturing needs root (AF_PACKET)."""

from __future__ import annotations

import os
import secrets

import httpx
import pytest
from cluster import ClusterAuth, free_port, node_args, pdserve_up
from packet_capture import Capture, can_capture, encodings, first_request, send_raw

from pdserve.infra.request_signing import SCHEME

pytestmark = pytest.mark.skipif(not can_capture(), reason="capturing frames needs root (AF_PACKET)")

PROMPTS = ["hello", "the prefill node computes the prompt's KV " * 12, "a b c d e f g h"]


def _send(port: int, raw: bytes) -> tuple[int, bytes]:
    """One raw HTTP/1.1 request on a fresh connection: (status, body)."""
    answer = send_raw("127.0.0.1", port, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1:2]
    return (int(status[0]) if status and status[0].isdigit() else 0), body or answer


@pytest.fixture(scope="module")
def run(tiny6, tmp_path_factory):
    """A whole cluster run under capture; yields (capture, decode port, secret)."""
    secret = secrets.token_urlsafe(32)
    port = free_port()
    log = tmp_path_factory.mktemp("wire") / "up.log"
    env = {**os.environ, "PDSERVE_INTERNAL_TOKEN": secret, "PDSERVE_LOG_LEVEL": "WARNING"}
    args = ["--model", str(tiny6), "--port", str(port), "--node-args", " ".join(node_args())]
    auth = ClusterAuth(secret)
    with Capture("lo", encodings(secret)) as cap:
        with pdserve_up(args, log, timeout=300, env=env):
            url = f"http://127.0.0.1:{port}"
            workers = httpx.get(f"{url}/workers", auth=auth, timeout=10).json()["workers"]
            decode = next(w["url"] for w in workers if w["role"] == "decode")
            dport = int(decode.rsplit(":", 1)[1])
            cap.keep_ports.add(dport)
            for prompt in PROMPTS:
                r = httpx.post(
                    f"{url}/v1/completions",
                    json={"model": tiny6.name, "prompt": prompt, "max_tokens": 4},
                    timeout=120,
                )
                assert r.status_code == 200, r.text
            replays = _replays(cap, dport)
            fresh = httpx.get(f"{decode}/server_info", auth=auth, timeout=10).status_code
        yield cap, replays, fresh


def _replays(cap: Capture, dport: int) -> dict[str, tuple[int, bytes]]:
    """A /generate the router sent the decode node, sent again as captured and with one byte of
    its body changed, while the cluster still runs."""
    captured = next(
        (r for s in cap.streams_to(dport) if (r := first_request(s, b"POST /generate"))), None
    )
    assert captured is not None, "no /generate to the decode node was captured"
    assert SCHEME.encode() in captured
    head, body = captured.split(b"\r\n\r\n", 1)
    # one letter of the first string value, in another case: still JSON, still the same length
    start = min(k for k in (body.find(b'":"'), body.find(b'": "')) if k >= 0) + 3
    i = next(j for j in range(start, len(body)) if chr(body[j]).isalpha())
    changed = body[:i] + bytes([body[i] ^ 0x20]) + body[i + 1 :]
    return {
        "replayed": _send(dport, captured),
        "changed": _send(dport, head + b"\r\n\r\n" + changed),
    }


def test_no_frame_holds_the_secret(run):
    cap, _, _ = run
    assert cap.tcp_bytes > 0 and cap.frames > 0, "the capture saw no traffic"
    assert cap.found == [], f"the secret crossed the wire: {cap.found[:5]}"


def test_a_captured_request_replays_nowhere(run):
    _, replays, fresh = run
    status, body = replays["replayed"]
    assert status == 401, body
    # refused for its nonce (seen) or, on a slow machine, its age: never served again
    assert b"replayed request" in body or b"signature time off" in body, body
    assert fresh == 200  # the node itself serves a freshly signed request


def test_a_changed_byte_is_refused(run):
    _, replays, _ = run
    status, body = replays["changed"]
    assert (status, b"bad signature" in body) == (401, True), body
