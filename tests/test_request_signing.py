"""Signed internal requests (infra/request_signing.py): what a signature covers, replays, the
time window, the bounded nonce memory, and the ASGI check in front of a real app. The same checks
on real nodes, with requests captured off the wire: tests/test_secret_on_the_wire.py."""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from pdserve.infra.request_signing import (
    SCHEME,
    SKEW_S,
    SignatureCheck,
    SignedAuth,
    Verifier,
    is_signed,
    sign,
    signing_key,
)

SECRET = "unit-secret"
REQ = ("POST", b"/generate?x=1", "10.9.8.7:8001", b'{"input_ids": [1, 2, 3]}')


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _signed(clock: Clock, req=REQ, secret=SECRET) -> str:
    method, target, host, body = req
    return sign(signing_key(secret), method, target, host, body, clock())


def test_a_signed_request_is_accepted_once():
    clock = Clock()
    v = Verifier(SECRET, clock)
    header = _signed(clock)
    assert SECRET not in header and signing_key(SECRET).hex() not in header
    assert v.check(header, *REQ) == ""
    assert v.check(header, *REQ) == "replayed request"
    assert v.check(_signed(clock), *REQ) == ""  # a new nonce: a new request


@pytest.mark.parametrize("field", range(4))
def test_every_signed_part_of_the_request_counts(field):
    clock = Clock()
    v = Verifier(SECRET, clock)
    header = _signed(clock)
    changed = list(REQ)
    changed[field] = {
        0: "GET",
        1: b"/generate?x=2",
        2: "10.9.8.6:8001",
        3: b'{"input_ids": [1, 2, 4]}',
    }[field]
    assert v.check(header, *changed) == "bad signature"
    assert v.check(header, *REQ) == ""  # the refusal spent nothing of the original


def test_a_changed_byte_of_the_header_is_refused():
    clock = Clock()
    v = Verifier(SECRET, clock)
    header = _signed(clock)
    t = header.split("t=")[1].split(",")[0]
    nonce = header.split("n=")[1].split(",")[0]
    flipped_nonce = nonce[:-1] + ("0" if nonce[-1] != "0" else "1")
    sig = header.rsplit("s=", 1)[1]
    flipped_sig = ("0" if sig[0] != "0" else "1") + sig[1:]
    for bad in (
        header.replace(f"t={t}", f"t={int(t) - 1}"),
        header.replace(f"n={nonce}", f"n={flipped_nonce}"),
        header.replace(f"s={sig}", f"s={flipped_sig}"),
        _signed(clock, secret=SECRET + "x"),
    ):
        assert v.check(bad, *REQ) == "bad signature", bad
    assert v.check(header, *REQ) == ""


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        f"Bearer {SECRET}",
        SECRET,
        f"{SCHEME}",
        f"{SCHEME} t=1,n=2,s=3",
        f"{SCHEME} t=abc,n={'a' * 32},s={'b' * 64}",
        f"{SCHEME} t=1,n={'A' * 32},s={'b' * 64}",  # hex is lower case
        f"{SCHEME} t={'9' * 40},n={'a' * 32},s={'b' * 64}",
        f"{SCHEME} n={'a' * 32},s={'b' * 64}",
        f"{SCHEME} t=1,,,=,n={'a' * 32}",
        f"{SCHEME} t=\u00b2,n={'a' * 32},s={'b' * 64}",  # a digit to str.isdigit, not to int()
    ],
)
def test_malformed_or_clear_credentials_are_refused(header):
    why = Verifier(SECRET, Clock()).check(header, *REQ)
    assert why.startswith("missing or malformed signature"), why


def test_a_signature_outside_the_time_window_is_refused_either_way():
    clock = Clock()
    v = Verifier(SECRET, clock)
    header = _signed(clock)
    clock.t += SKEW_S + 1
    assert "time off" in v.check(header, *REQ)
    early = Clock(clock.t + SKEW_S + 1)
    assert "time off" in v.check(_signed(early), *REQ)  # a sender's clock far ahead


def test_a_replay_stays_refused_after_its_nonce_is_forgotten():
    clock = Clock()
    v = Verifier(SECRET, clock)
    header = _signed(clock)
    assert v.check(header, *REQ) == ""
    clock.t += 2 * SKEW_S + 1  # the nonce has expired from memory; the time window refuses it
    assert "time off" in v.check(header, *REQ)
    assert len(v._seen) == 1  # and the check above purged nothing it still needed


def test_the_nonce_memory_is_bounded():
    clock = Clock()
    v = Verifier(SECRET, clock, max_nonces=3)
    for _ in range(3):
        assert v.check(_signed(clock), *REQ) == ""
    assert v.check(_signed(clock), *REQ) == "too many signed requests in the replay window"
    clock.t += 2 * SKEW_S + 1
    assert v.check(_signed(clock), *REQ) == ""  # the expired ones made room
    assert len(v._seen) == 1


def _app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(SignatureCheck, secret=SECRET, max_body=1000)

    @app.post("/echo")
    async def echo(request: Request):
        return {"signed": is_signed(request, SECRET), "body": (await request.body()).decode()}

    return app


def _auth(secret: str):
    """SignedAuth's signing as a function: starlette's TestClient runs on httpx2, which takes
    one (a real httpx client takes SignedAuth itself, as the cluster's processes do)."""
    auth = SignedAuth(secret)

    def flow(request):
        request.read()
        return next(auth.auth_flow(request))

    return flow


def test_the_middleware_passes_a_signed_body_on_unchanged():
    client = TestClient(_app())
    body = '{"a": "' + "x" * 900 + '"}'
    r = client.post("/echo?q=1", content=body, auth=_auth(SECRET))
    assert r.json() == {"signed": True, "body": body}
    r = client.post("/echo", content=body)  # unsigned: the route decides
    assert r.json() == {"signed": False, "body": body}
    r = client.post("/echo", content=body, auth=_auth(SECRET + "x"))
    assert r.status_code == 401 and r.json()["error"]["message"] == "bad signature"
    r = client.post("/echo", content="y" * 1001, auth=_auth(SECRET))
    assert r.status_code == 413


def test_an_httpx_client_signs_every_request():
    """SignedAuth on a real httpx client: the header it sends verifies for that request only."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    clock = Clock()
    with httpx.Client(auth=SignedAuth(SECRET, clock), transport=httpx.MockTransport(handler)) as c:
        c.post("http://node:8001/generate?x=1", json={"input_ids": [1]})
        c.get("http://node:8001/server_info")
    v = Verifier(SECRET, clock)
    for r in seen:
        header = r.headers["authorization"]
        assert header.startswith(SCHEME) and SECRET not in header
        assert v.check(header, r.method, r.url.raw_path, r.headers["host"], r.content) == ""
    assert seen[0].url.raw_path == b"/generate?x=1" and seen[0].headers["host"] == "node:8001"


def _asgi_call(app, scope: dict, body: bytes) -> tuple[int, bytes]:
    """One request straight through an ASGI app: (status, body)."""
    import asyncio

    sent, given = [], False

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_request_signed_for_one_server_is_refused_by_another():
    """The signed Host must name the socket the request came in on: a request captured on its
    way to 10.9.8.7:8001 and replayed to 10.9.8.6:8001 is refused there (its nonce is new there)."""
    method, target, host, body = REQ
    header = sign(signing_key(SECRET), method, target, host, body, time.time())
    scope = {
        "type": "http",
        "method": method,
        "path": "/generate",
        "raw_path": b"/generate",
        "query_string": b"x=1",
        "headers": [(b"host", host.encode()), (b"authorization", header.encode())],
        "server": ("10.9.8.6", 8001),
    }
    app = SignatureCheck(_app(), secret=SECRET)
    status, answer = _asgi_call(app, scope, body)
    assert (status, b"signed for another server" in answer) == (401, True), answer
    scope = {**scope, "server": ("10.9.8.7", 8001)}  # the server it was signed for takes it
    assert _asgi_call(SignatureCheck(_app(), secret=SECRET), scope, body)[0] != 401
