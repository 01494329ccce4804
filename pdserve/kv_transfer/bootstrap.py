"""The bootstrap server of a prefill node (hosted by the prefill front, or standalone in a thread).

Prefill ranks register where they are (PUT /route); a decode rank asks which prefill ranks hold its
layers and KV heads (GET /route?layer_start=a&layer_end=b&head_start=h&head_end=k, the heads
optional; 503 until every rank of the node registered, PP size x TP size of them); every
rank heartbeats (POST /heartbeat) and learns which of its peers went silent, which is how peer death
is detected; GET /health. The cluster secret (a bearer token, compared in constant time) guards
everything but /health; bodies over MAX_BODY bytes are refused while they stream in.

`build_app(state, token)` is a Starlette app the front can mount; `BootstrapServer` runs one with
uvicorn in a background thread.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import asdict, dataclass

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdserve.infra.request_signing import SignatureCheck, is_signed
from pdserve.kv_transfer.layout import LAYOUT_NAME, intersect

# How long a rank may be silent before its peers hear it is dead. A rank beats every
# TransferConfig.heartbeat_interval_s (1 s), and one beat may take up to the client's request
# timeout (2 s), so one beat that timed out leaves a 4 s gap. The ranks give their bootstrap server
# heartbeat_misses (3) failed beats; the server gives a rank as many intervals plus one request:
# 3 x 1 s + 2 s. (At 3 s, a single timed-out beat was enough to fail the rank's rooms.)
HEARTBEAT_TIMEOUT_S = 5.0

logger = logging.getLogger(__name__)

MAX_BODY = 64 * 1024  # a registration or a heartbeat is well under 1 KiB (plus the peer list)


@dataclass(frozen=True)
class PrefillRankInfo:
    """What a prefill rank registers: layer slice, KV heads, control endpoint, Mooncake session,
    KV format. Under TP (docs/ARCHITECTURE.md section 15) a stage is `tp_size` ranks, each
    holding KV heads [head_start, head_end); without it, `head_end` - `head_start` are all the
    model's KV heads."""

    pp_rank: int
    pp_size: int
    layer_start: int
    layer_end: int
    host: str
    ctrl_port: int
    session_id: str
    page_size: int
    token_bytes: int
    dtype: str
    layout: str = LAYOUT_NAME
    tp_rank: int = 0
    tp_size: int = 1
    head_start: int = 0
    head_end: int = 1

    @property
    def rank(self) -> int:
        """The rank's place in its node, as its control messages name it (KVManagerBase.rank)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def heads(self) -> tuple[int, int]:
        return (self.head_start, self.head_end)

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d) -> PrefillRankInfo:
        if not isinstance(d, dict) or set(d) != set(cls.__dataclass_fields__):
            raise ValueError(f"expected keys {sorted(cls.__dataclass_fields__)}")
        for name, f in cls.__dataclass_fields__.items():
            want = int if f.type in ("int", int) else str
            if type(d[name]) is not want:
                raise ValueError(f"{name} must be {want.__name__}")
        info = cls(**d)
        if not (
            0 <= info.pp_rank < info.pp_size
            and 0 <= info.tp_rank < info.tp_size
            and 0 <= info.layer_start < info.layer_end
            and 0 <= info.head_start < info.head_end
            and 0 < info.ctrl_port < 65536
            and info.page_size > 0
            and info.token_bytes > 0
            and info.token_bytes % (info.head_end - info.head_start) == 0
        ):
            raise ValueError(f"inconsistent registration {info}")
        if info.layout != LAYOUT_NAME:
            raise ValueError(
                f"unsupported KV layout {info.layout!r}; this build moves {LAYOUT_NAME!r}"
            )
        return info


class BootstrapState:
    """Registrations and liveness of one prefill node (thread-safe, no I/O)."""

    def __init__(self, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, clock=time.monotonic):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[int, PrefillRankInfo] = {}  # by PrefillRankInfo.rank
        self._shape: tuple[int, int] | None = None  # (pp_size, tp_size) of the node
        self._last_seen: dict[str, float] = {}

    def register(self, info: PrefillRankInfo) -> None:
        shape = (info.pp_size, info.tp_size)
        with self._lock:
            if self._shape is not None and shape != self._shape:
                # a node restarted with another PP or TP size: start over
                logger.warning(
                    "prefill (pp, tp) changed %s -> %s; dropping old registrations",
                    self._shape,
                    shape,
                )
                self._ranks.clear()
            self._shape = shape
            self._ranks[info.rank] = info
            self._last_seen[info.session_id] = self._clock()

    def _complete(self) -> bool:
        return self._shape is not None and len(self._ranks) == self._shape[0] * self._shape[1]

    def ready(self) -> bool:
        with self._lock:
            return self._complete()

    def route(
        self,
        layer_start: int,
        layer_end: int,
        session: str | None = None,
        heads: tuple[int, int] | None = None,
    ) -> list[PrefillRankInfo] | None:
        """Prefill ranks whose layers meet [layer_start, layer_end) and, if given, whose KV heads
        meet `heads`, by rank; None until all registered."""
        with self._lock:
            if session:
                self._last_seen[session] = self._clock()
            if not self._complete():
                return None
            return [
                r
                for _, r in sorted(self._ranks.items())
                if intersect((r.layer_start, r.layer_end), (layer_start, layer_end))
                and (heads is None or intersect(r.heads, heads))
            ]

    def heartbeat(self, session: str, peers: list[str]) -> list[str]:
        """Records `session` as alive; returns the peers that were seen once and are silent now."""
        now = self._clock()
        with self._lock:
            self._last_seen[session] = now
            return [
                p
                for p in peers
                if p in self._last_seen and now - self._last_seen[p] > self.heartbeat_timeout_s
            ]

    def sessions(self) -> list[str]:
        """The sessions of the prefill ranks registered now (a restarted node brings new ones)."""
        with self._lock:
            return sorted(r.session_id for r in self._ranks.values())

    def health(self) -> dict:
        with self._lock:
            pp, tp = self._shape or (None, None)
            return {"status": "ok", "registered": len(self._ranks), "pp_size": pp, "tp_size": tp}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


class BodyTooLarge(ValueError):
    pass


async def read_json(request: Request):
    """The JSON body, refused as soon as its declared or received size passes MAX_BODY."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise BodyTooLarge
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise BodyTooLarge
    return json.loads(raw)


def _heartbeat(body) -> tuple[str, list[str]]:
    """A heartbeat's {session: str, peers: [str]}; ValueError, KeyError or TypeError if not."""
    session, peers = body["session"], body["peers"]
    names = peers if type(peers) is list else [None]
    if type(session) is not str or any(type(p) is not str for p in names):
        raise ValueError("bad heartbeat")
    return session, peers


ROUTE_QUERY = "layer_start and layer_end (ints) are required; head_start and head_end go together"


def _route_query(q) -> tuple[int, int, tuple[int, int] | None]:
    """A route lookup's layers and, if given, KV heads; KeyError or ValueError if not ints."""
    heads = None
    if "head_start" in q or "head_end" in q:
        heads = (int(q["head_start"]), int(q["head_end"]))
    return int(q["layer_start"]), int(q["layer_end"]), heads


def build_app(state: BootstrapState, token: str | None = None) -> Starlette:
    def authorized(request: Request) -> bool:
        return is_signed(request, token)

    async def put_route(request: Request):
        if not authorized(request):
            return _error(401, "the request must be signed with the cluster secret")
        try:
            state.register(PrefillRankInfo.from_wire(await read_json(request)))
        except BodyTooLarge:
            return _error(413, f"body over {MAX_BODY} bytes")
        except ValueError as e:
            return _error(400, str(e))
        return JSONResponse({"ok": True})

    async def get_route(request: Request):
        if not authorized(request):
            return _error(401, "the request must be signed with the cluster secret")
        q = request.query_params
        try:
            a, b, heads = _route_query(q)
        except (KeyError, ValueError):
            return _error(400, ROUTE_QUERY)
        ranks = state.route(a, b, q.get("session"), heads)
        if ranks is None:
            return _error(503, "not every prefill rank has registered yet")
        return JSONResponse({"ranks": [r.to_wire() for r in ranks]})

    async def post_heartbeat(request: Request):
        if not authorized(request):
            return _error(401, "the request must be signed with the cluster secret")
        try:
            session, peers = _heartbeat(await read_json(request))
        except BodyTooLarge:
            return _error(413, f"body over {MAX_BODY} bytes")
        except (ValueError, KeyError, TypeError):
            return _error(400, "body must be {session: str, peers: [str]}")
        return JSONResponse(
            {
                "dead": state.heartbeat(session, peers),
                "ranks": state.sessions(),
                "timeout_s": state.heartbeat_timeout_s,
            }
        )

    async def health(request: Request):
        return JSONResponse(state.health())

    return Starlette(
        routes=[
            Route("/route", put_route, methods=["PUT"]),
            Route("/route", get_route, methods=["GET"]),
            Route("/heartbeat", post_heartbeat, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=[Middleware(SignatureCheck, secret=token, max_body=MAX_BODY)],
    )


class BootstrapServer:
    """A bootstrap app served by uvicorn in a daemon thread; port 0 picks a free port."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ):
        import uvicorn

        from pdserve.infra.http_server import server_config

        self.state = BootstrapState(heartbeat_timeout_s)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config = server_config(build_app(self.state, token), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name="kv-bootstrap",
            daemon=True,
        )

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> BootstrapServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"bootstrap server on {self.addr} did not start")
            time.sleep(0.01)
        logger.debug("KV bootstrap server on %s", self.addr)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()
