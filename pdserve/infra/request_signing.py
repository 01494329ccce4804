"""Signed internal HTTP requests: a caller proves that it holds the cluster secret without sending
it (docs/SECURITY.md, "Internal HTTP").

Each internal request carries

    Authorization: PDS1-HMAC-SHA256 t=<unix seconds>,n=<128-bit hex nonce>,s=<hex HMAC>

where the HMAC (SHA-256, under a key derived from the secret for this use alone) covers the method,
the path and query as sent, the Host header (so a request made for one node is refused by every
other), the time, the nonce and the SHA-256 of the body. The receiver refuses a signature older or
newer than SKEW_S, and a nonce it has seen within that window: a captured request replays nowhere,
and a changed byte of it fails the HMAC. Wall-clock time is used here only, never in scheduling.

Why HMAC signatures and not mutual TLS with a per-cluster CA: the secret every process already
holds (it keys the sealed ZMQ channels, infra/channel_auth.py) is then all a deployment needs; no
CA, certificates, expiry or rotation, and the nodes' plain-HTTP fast path stays as it is. What it
does not give is confidentiality of the bodies: prompts and tokens between the router and the
nodes travel in clear, as they did, on a network the operator keeps private.

`SignedAuth` signs an httpx client's requests; `SignatureCheck` is the ASGI middleware that
verifies them and marks the request's scope, which the routes' own checks (`is_signed`) read.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator

import httpx

from pdserve.infra.channel_auth import channel_key

SCHEME = "PDS1-HMAC-SHA256"
SKEW_S = 30.0  # how far a signature's time may be from the receiver's clock, either way
MAX_NONCES = 200_000  # replay window entries per receiving process (about 30 MB at most)
MAX_SIGNED_BODY = 64 << 20  # a signed body is read whole before the route sees it
BODY_TIMEOUT_S = 30.0  # to receive that body once the headers are in
SCOPE_KEY = "pdserve.signed"  # set in the ASGI scope of a request whose signature held
HTTP_CHANNEL = "internal-http"


def signing_key(secret: str) -> bytes:
    """The HMAC key for HTTP requests, derived from the cluster secret for this use alone (as
    each ZMQ channel's key is, infra/channel_auth.py)."""
    return channel_key(HTTP_CHANNEL, secret)


def _message(method: str, target: bytes, host: str, t: str, nonce: str, body: bytes) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return b"\n".join(
        [method.upper().encode(), target, host.lower().encode(), t.encode(), nonce.encode(),
         digest.encode()]
    )  # fmt: skip


def sign(key: bytes, method: str, target: bytes, host: str, body: bytes, now: float) -> str:
    """The Authorization value for one request; `target`: path and query as sent."""
    t, nonce = str(int(now)), secrets.token_hex(16)
    mac = hmac.new(key, _message(method, target, host, t, nonce, body), hashlib.sha256)
    return f"{SCHEME} t={t},n={nonce},s={mac.hexdigest()}"


class SignedAuth(httpx.Auth):
    """Signs every request of an httpx client (sync or async) with the cluster secret."""

    requires_request_body = True

    def __init__(self, secret: str, clock: Callable[[], float] = time.time):
        self._key, self._clock = signing_key(secret), clock

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = sign(
            self._key,
            request.method,
            request.url.raw_path,
            request.headers.get("host", ""),
            request.content,
            self._clock(),
        )
        yield request


def signed_auth(secret: str | None) -> SignedAuth | None:
    """The auth an internal client uses: None where no secret is configured."""
    return SignedAuth(secret) if secret else None


class Verifier:
    """Checks signatures and remembers the nonces of the last 2 * SKEW_S (thread-safe)."""

    def __init__(self, secret: str, clock: Callable[[], float] = time.time, max_nonces=MAX_NONCES):
        self._key, self._clock, self._max = signing_key(secret), clock, max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def check(self, header: str | None, method: str, target: bytes, host: str, body: bytes) -> str:
        """ "" when the request is signed, fresh and unseen; else why not (for the 401)."""
        fields = _parse(header)
        if fields is None:
            return f"missing or malformed signature (send 'Authorization: {SCHEME} ...')"
        t, nonce, mac = fields
        now = self._clock()
        if abs(now - int(t)) > SKEW_S:
            return f"signature time off by more than {SKEW_S:.0f} s (check the hosts' clocks)"
        expected = hmac.new(self._key, _message(method, target, host, t, nonce, body), "sha256")
        if not hmac.compare_digest(expected.hexdigest(), mac):
            return "bad signature"
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "replayed request"
            if len(self._seen) >= self._max:
                return "too many signed requests in the replay window"
            self._seen[nonce] = max(now, int(t)) + 2 * SKEW_S
        return ""


def _parse(header: str | None) -> tuple[str, str, str] | None:
    if not header or not header.startswith(SCHEME + " "):
        return None
    parts = dict(p.partition("=")[::2] for p in header[len(SCHEME) + 1 :].split(","))
    t, nonce, mac = parts.get("t", ""), parts.get("n", ""), parts.get("s", "")
    digits = t.isascii() and t.isdigit() and len(t) <= 12  # ascii: int() takes other digits
    if not (digits and _is_hex(nonce, 32) and _is_hex(mac, 64)):
        return None
    return t, nonce, mac


def _is_hex(s: str, n: int) -> bool:
    return len(s) == n and all(c in "0123456789abcdef" for c in s)


class SignatureCheck:
    """ASGI middleware: a request that carries a signature is read whole (up to MAX_SIGNED_BODY),
    verified, and passed on with its body replayed and `scope[SCOPE_KEY]` set; a bad signature is
    answered 401 here. A request without one passes untouched: the route decides (`is_signed`)."""

    def __init__(
        self,
        app,
        secret: str | None,
        max_body: int = MAX_SIGNED_BODY,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ):
        self.app, self.max_body, self.body_timeout_s = app, max_body, body_timeout_s
        self.verifier = Verifier(secret) if secret else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.verifier is None:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if not auth.startswith(SCHEME):
            return await self.app(scope, receive, send)
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return await _answer(send, 413, f"request body over {self.max_body} bytes")
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await _read_body(receive, self.max_body)
        except TimeoutError:
            return await _answer(send, 408, f"body not received within {self.body_timeout_s} s")
        if body is None:
            return  # the client went away before its body arrived
        if len(body) > self.max_body:
            return await _answer(send, 413, f"request body over {self.max_body} bytes")
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        host = headers.get(b"host", b"").decode("latin-1")
        why = self.verifier.check(auth, scope["method"], target, host, body)
        if not why and not _names_this_server(host, scope.get("server")):
            why = "signed for another server"  # a captured request replayed to another node
        if why:
            return await _answer(send, 401, why)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, whenever it comes

        await self.app({**scope, SCOPE_KEY: True}, replay, send)


def _names_this_server(host: str, server) -> bool:
    """Whether a Host header (signed) names the socket the request came in on: the same port, and
    the same address when it names one. A DNS name cannot be checked without a lookup, so it
    passes; nodes addressed by IP (as `pdserve up` and the tests do) refuse another node's
    requests."""
    if not server:
        return True
    if host.startswith("["):  # [v6 address]:port
        name, _, port = host[1:].partition("]")
        port = port.removeprefix(":")
    elif host.count(":") == 1:
        name, _, port = host.partition(":")
    else:  # a name or v4 address alone, or a bare v6 address
        name, port = host, ""
    if port and (not port.isdigit() or int(port) != int(server[1])):
        return False
    try:
        return ipaddress.ip_address(name) == ipaddress.ip_address(server[0])
    except ValueError:
        return True


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or its first `limit` + 1 bytes; None if the client disconnected."""
    body = bytearray()
    more = True
    while more and len(body) <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return bytes(body)


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def is_signed(scope_or_request, secret: str | None) -> bool:
    """True when no secret is configured, or the request's signature was verified."""
    if not secret:
        return True
    scope = getattr(scope_or_request, "scope", scope_or_request)
    return bool(scope.get(SCOPE_KEY))
