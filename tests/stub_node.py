"""A stub pdserve node (docs/PROTOCOL.md) for router tests and the router benchmark.

Generation is fake and deterministic: the answer repeats the prompt's words, `natural_tokens` of
them (then finish "stop"), or `max_tokens` if fewer (finish "length"). Knobs (`Behavior`) can be
changed at run time with `POST /_control`; `GET /_stats` returns what the node saw (rids, rooms,
aborts). `StubNode` runs one in a thread on a loopback port; `python tests/stub_node.py --port 0`
runs one as a process and prints `READY <port>`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.infra.request_signing import SignatureCheck, is_signed

FAIL_MODES = (None, "500", "503", "429", "hang", "abort", "midstream")


@dataclass
class Behavior:
    role: str = "decode"  # prefill | decode | colocated
    model: str = "stub-model"
    max_context: int = 4096
    bootstrap_port: int | None = None
    natural_tokens: int = 8
    token_delay_s: float = 0.0  # between stream chunks
    first_token_delay_s: float = 0.0  # decode: as if waiting for the KV; prefill: the prefill
    fail: str | None = None  # one of FAIL_MODES, for /generate
    healthy: bool = True
    internal_token: str | None = None
    prefix_cache: bool = True  # what /server_info says (a node's --no-prefix-cache)


@dataclass
class Stats:
    generate: int = 0
    rids: list = field(default_factory=list)
    rooms: list = field(default_factory=list)
    bodies: list = field(default_factory=list)
    aborts: list = field(default_factory=list)
    disconnects: int = 0
    bootstrap_servers: list = field(default_factory=list)


def _error(status: int, message: str, code: str | None = None, param: str | None = None):
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error" if status < 500 else "server_error",
                "param": param,
                "code": code,
            }
        },
        status_code=status,
    )


def _words(body: dict) -> list[str]:
    if isinstance(body.get("text"), str):
        words = body["text"].split()
    elif isinstance(body.get("messages"), list):
        words = str(body["messages"][-1].get("content", "")).split()
    else:
        words = [f"t{i}" for i in body.get("input_ids", [])]
    return words or ["hello"]


def make_app(behavior: Behavior) -> FastAPI:
    node = _StubRoutes(behavior)
    app = FastAPI()
    app.state.behavior, app.state.stats = behavior, node.stats
    # a real node's check of the router's signed requests (infra/request_signing.py)
    app.add_middleware(SignatureCheck, secret=behavior.internal_token)
    app.add_api_route("/generate", node.generate, methods=["POST"])
    app.add_api_route("/abort", node.abort, methods=["POST"])
    app.add_api_route("/health", node.health, methods=["GET"])
    app.add_api_route("/server_info", node.server_info, methods=["GET"])
    app.add_api_route("/bootstrap_servers", node.bootstrap_servers, methods=["PUT"])
    app.add_api_route("/_control", node.control, methods=["POST"])
    app.add_api_route("/_stats", node.get_stats, methods=["GET"])
    return app


def _abort_chunk(rid: str, message: str, code: str) -> str:
    return _sse(
        {
            "rid": rid,
            "error": {"message": message, "type": "server_error", "code": code},
            "meta_info": {"finish_reason": {"type": "abort"}},
        }
    )


class _StubRoutes:
    """The stub node's endpoints, over its behavior (changed at run time by /_control)."""

    def __init__(self, behavior: Behavior):
        self.behavior = behavior
        self.stats = Stats()
        self.aborted: set[str] = set()

    def plan(self, body: dict):
        words = _words(body)
        params = body.get("sampling_params") or {}
        max_tokens = params.get("max_tokens")
        n = self.behavior.natural_tokens
        reason = "stop"
        if max_tokens is not None and max_tokens <= n:
            n, reason = max_tokens, "length"
        out = []
        for i in range(n):
            word = words[i % len(words)]
            if any(s and s in word for s in (params.get("stop") or [])):
                reason = "stop"
                break
            out.append(word)
        return len(words), out, reason, params

    @staticmethod
    def chunk(rid, prompt_tokens, done, text, i, reason, params):
        meta = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": done,
            "finish_reason": {"type": reason} if reason else None,
        }
        if params.get("logprobs") and text:
            top = params.get("top_logprobs") or 0
            meta["logprobs"] = [[1000 + i, -0.5, [[1000 + i + k, -0.5 - k] for k in range(top)]]]
        return {
            "rid": rid,
            "text": text,
            "token_ids": [1000 + i] if text else [],
            "meta_info": meta,
        }

    async def generate(self, request: Request):
        b, stats = self.behavior, self.stats
        body = await request.json()
        rid = body.get("rid") or uuid.uuid4().hex
        stats.generate += 1
        stats.rids.append(rid)
        stats.rooms.append(body.get("bootstrap_room"))
        stats.bodies.append(body)
        prompt_tokens, words, reason, params = self.plan(body)
        if prompt_tokens + (params.get("max_tokens") or 0) > b.max_context:
            return _error(
                400,
                "prompt plus max_tokens exceed the context",
                "context_length_exceeded",
                "max_tokens",
            )
        if b.fail in ("500", "503", "429"):
            return _error(int(b.fail), f"injected failure {b.fail}", "injected")
        if b.fail == "hang":
            while rid not in self.aborted:
                await asyncio.sleep(0.02)
            return JSONResponse({"rid": rid, "meta_info": {"finish_reason": {"type": "abort"}}})
        if b.role == "prefill":
            await _sleep_unless(b.first_token_delay_s, rid, self.aborted)
            kind = "abort" if b.fail == "abort" or rid in self.aborted else "length"
            return {
                "rid": rid,
                "meta_info": {"prompt_tokens": prompt_tokens, "finish_reason": {"type": kind}},
            }
        if not body.get("stream"):
            return await self.whole_answer(rid, prompt_tokens, words, reason, params)
        events = self.events(rid, prompt_tokens, words, reason, params)
        return StreamingResponse(events, media_type="text/event-stream")

    async def whole_answer(self, rid, prompt_tokens, words, reason, params):
        await _sleep_unless(self.behavior.first_token_delay_s, rid, self.aborted)
        if self.behavior.fail == "abort" or rid in self.aborted:
            reason = "abort"
        text = " ".join(words)
        out = self.chunk(rid, prompt_tokens, len(words), text, 0, reason, params)
        out["token_ids"] = [1000 + i for i in range(len(words))]
        if params.get("logprobs"):
            out["meta_info"]["logprobs"] = [
                self.chunk(rid, 0, 0, w, i, None, params)["meta_info"]["logprobs"][0]
                for i, w in enumerate(words)
            ]
        return out

    async def events(self, rid, prompt_tokens, words, reason, params):
        b = self.behavior
        try:
            await _sleep_unless(b.first_token_delay_s, rid, self.aborted)
            if b.fail == "abort":
                yield _abort_chunk(rid, "injected abort", "injected")
                yield "data: [DONE]\n\n"
                return
            for i, word in enumerate(words):
                if i and b.token_delay_s:
                    await _sleep_unless(b.token_delay_s, rid, self.aborted)
                if rid in self.aborted or (b.fail == "midstream" and i == 2):
                    yield _abort_chunk(rid, "aborted", "aborted")
                    break
                last = i == len(words) - 1
                text = (" " if i else "") + word
                yield _sse(
                    self.chunk(rid, prompt_tokens, i + 1, text, i, reason if last else None, params)
                )
            else:
                if not words:
                    yield _sse(self.chunk(rid, prompt_tokens, 0, "", 0, reason, params))
            yield "data: [DONE]\n\n"
        except BaseException:
            self.stats.disconnects += 1
            raise

    def _authorized(self, request: Request) -> bool:
        return is_signed(request, self.behavior.internal_token)

    async def abort(self, request: Request):
        if not self._authorized(request):
            return _error(401, "bad internal token")
        body = await request.json()
        self.stats.aborts.append(body.get("rid"))
        self.aborted.add(body.get("rid"))
        return {"aborted": True}

    async def health(self):
        if not self.behavior.healthy:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return {"status": "ok"}

    async def server_info(self):
        b = self.behavior
        return {
            "model": b.model,
            "role": b.role,
            "max_context": b.max_context,
            "pp_size": 1,
            "bootstrap_port": b.bootstrap_port,
            "prefix_cache": b.prefix_cache,
            "load": {"running": 0, "waiting": 0},
        }

    async def bootstrap_servers(self, request: Request):
        if not self._authorized(request):
            return _error(401, "bad internal token")
        self.stats.bootstrap_servers = (await request.json())["servers"]
        return {"servers": self.stats.bootstrap_servers}

    async def control(self, request: Request):
        for key, value in (await request.json()).items():
            setattr(self.behavior, key, value)
        return dataclasses.asdict(self.behavior)

    async def get_stats(self):
        return dataclasses.asdict(self.stats)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _sleep_unless(seconds: float, rid: str, aborted: set[str]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and rid not in aborted:
        await asyncio.sleep(min(0.02, max(0.0, end - time.monotonic())))


def bind_loopback(port: int = 0) -> socket.socket:
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only when proto says TCP;
    # without it every reused connection waits ~40 ms (Nagle against delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


class ThreadServer:
    """Runs an ASGI app with uvicorn in a daemon thread on a loopback socket."""

    def __init__(self, app, port: int = 0, lifespan: str = "on"):
        self.app = app
        self.sock = bind_loopback(port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=1,
            access_log=False,
            lifespan=lifespan,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, timeout: float = 10.0) -> ThreadServer:
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 5.0, force: bool = False) -> None:
        """Graceful (lifespan shutdown runs) unless `force`: then open requests are dropped."""
        self.server.should_exit = True
        self.server.force_exit = force
        self.thread.join(timeout)
        self.sock.close()


class StubNode:
    """A stub node in a thread. `kill()` stops it; `revive()` starts it again on the same port."""

    def __init__(self, **behavior):
        self.behavior = Behavior(**behavior)
        self.app = make_app(self.behavior)
        self.stats: Stats = self.app.state.stats
        self._server = ThreadServer(self.app, lifespan="off").start()
        self.port, self.url = self._server.port, self._server.url

    def kill(self) -> None:
        self._server.stop(force=True)

    def revive(self) -> None:
        self._server = ThreadServer(self.app, self.port, lifespan="off").start()

    def stop(self) -> None:
        self._server.stop()


class Cluster:
    """Stub prefill/decode/colocated nodes plus a router in threads, for tests. Use as a context
    manager; everything started is stopped on exit. `router_kw` are RouterConfig fields."""

    def __init__(
        self,
        prefill: int = 1,
        decode: int = 1,
        colocated: int = 0,
        node_kw: dict | None = None,
        **router_kw,
    ):
        self.prefill = [
            StubNode(role="prefill", bootstrap_port=8998 + i, **(node_kw or {}))
            for i in range(prefill)
        ]
        self.decode = [StubNode(role="decode", **(node_kw or {})) for _ in range(decode)]
        self.colocated = [StubNode(role="colocated", **(node_kw or {})) for _ in range(colocated)]
        self.router_kw = router_kw
        self.router: ThreadServer | None = None

    @property
    def nodes(self) -> list[StubNode]:
        return self.prefill + self.decode + self.colocated

    def __enter__(self) -> Cluster:
        from pdserve.router.app import build_app
        from pdserve.router.config import (
            ALWAYS_DISAGGREGATE,
            HealthConfig,
            RouterConfig,
            WorkerSpec,
        )

        try:
            workers = tuple(WorkerSpec(n.url, n.behavior.role) for n in self.nodes)
            kw = {
                "health": HealthConfig(interval_s=0.1, timeout_s=1.0),
                "disagg": ALWAYS_DISAGGREGATE,  # a test of conditional routing passes its own
                **self.router_kw,
            }
            self.config = RouterConfig(workers=workers, **kw)
            self.app = build_app(self.config)
            self.router = ThreadServer(self.app).start()
            self.url = self.router.url
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until the router has probed every node healthy and learnt its model: a request sent
        before routes on part of the cluster (seen on a loaded machine: `n` > 1 choices that
        could not follow choice 0's pair because its prefill node's model was not known yet)."""
        token = self.config.internal_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        deadline = time.monotonic() + timeout_s
        while True:
            r = httpx.get(self.url + "/workers", headers=headers, timeout=5)
            workers = r.json()["workers"]
            if all(w["healthy"] and w["model"] for w in workers):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"stub cluster not ready after {timeout_s} s: {workers}")
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self.router is not None:
            self.router.stop()
        for node in self.nodes:
            node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="stub pdserve node")
    parser.add_argument("--port", type=int, default=0)
    for f in dataclasses.fields(Behavior):
        if f.name in ("role", "model", "fail", "internal_token"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", default=f.default)
        elif f.type in ("int", "float"):
            kind = int if f.type == "int" else float
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    parser.add_argument("--bootstrap-port", type=int, default=None)
    args = parser.parse_args()
    behavior = Behavior(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(Behavior)
            if hasattr(args, f.name)
        }
    )
    sock = bind_loopback(args.port)
    print(f"READY {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(make_app(behavior), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
