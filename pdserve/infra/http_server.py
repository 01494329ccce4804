"""The uvicorn set-up every pdserve HTTP server uses (router, node fronts, bootstrap servers): the
limits uvicorn does not have.

uvicorn closes a connection idle between requests (`timeout_keep_alive`), but it waits for request
headers forever and lets a response wait forever for a client that stopped reading. So each
connection here also has:
  * a header timeout: from the connection's first byte (or the end of the previous response) to the
    end of the request's headers, at most PDSERVE_HTTP_HEADER_TIMEOUT_S (10 s), and at most
    MAX_HEADER_BYTES of headers; a slowloris connection is closed, and a silent one too;
  * a write timeout: once the client's receive window is full (uvicorn pauses writing), the client
    must read within PDSERVE_HTTP_WRITE_TIMEOUT_S (30 s) or the connection is dropped, which ends
    the response (the app sees a disconnect, and a stream releases what it holds).
Both work on the protocol class (h11 or httptools):
a thin subclass that only arms and disarms timers.

What uvicorn has, and why it is not enough: `timeout_keep_alive` starts only after a response;
`h11_max_incomplete_event_size` bounds headers with h11 only (httptools, which uvicorn picks when it
is installed, has no bound: hence the byte count here); `limit_concurrency` answers 503 once that
many connections are open, so 500 slow connections would lock out every real client.
"""

from __future__ import annotations

import asyncio
import os
import signal

import uvicorn


def header_timeout_s() -> float:
    """The header timeout, from the environment when a connection opens (not at import: a process
    forked from a zygote imported this module under another environment)."""
    return float(os.environ.get("PDSERVE_HTTP_HEADER_TIMEOUT_S", "10"))


def write_timeout_s() -> float:
    """The write timeout, read like header_timeout_s."""
    return float(os.environ.get("PDSERVE_HTTP_WRITE_TIMEOUT_S", "30"))


KEEP_ALIVE_S = 5  # the router's node pools expire idle connections before this
MAX_HEADER_BYTES = 64 * 1024


def _base_protocol() -> type:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # uvicorn without its [standard] extra
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


# the base is picked at import time (httptools or h11): no static type for mypy
class _Bounded(_base_protocol()):  # type: ignore[misc]
    """A uvicorn HTTP protocol with the header and write timeouts described above."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._seen_cycle = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(
                header_timeout_s(), self._drop, "headers too slow"
            )

    def _drop(self, why: str) -> None:
        self.logger.debug("closing %s: %s", self.client, why)
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        awaiting_headers = self.cycle is None or self.cycle.response_complete
        if awaiting_headers:
            self._arm_header_timer()
            self._header_bytes += len(data)
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._seen_cycle:  # headers complete
            self._seen_cycle = self.cycle
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
        elif (
            awaiting_headers
            and self._header_bytes > MAX_HEADER_BYTES
            and not self.transport.is_closing()
        ):
            self._drop("headers too large")

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                write_timeout_s(), self._drop, "client stopped reading"
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def connection_lost(self, exc) -> None:
        for timer in (self._header_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._write_timer = None
        super().connection_lost(exc)


def server_config(app, **kw) -> uvicorn.Config:
    """uvicorn.Config with pdserve's connection limits; `kw` as for uvicorn.Config. uvicorn
    installs no log handlers of its own: its records go through the process's (infra/logs.py)."""
    kw.setdefault("log_config", None)
    return uvicorn.Config(
        app,
        http=_Bounded,
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        **kw,
    )


def run_server(server: uvicorn.Server) -> int | None:
    """`server.run()`, from the main thread; returns the signal (SIGINT, SIGTERM) that stopped it,
    or None. After its graceful shutdown, uvicorn raises a signal it caught once more, under the
    handler that was in place before it started. Under the default handler that killed the process
    there, before the caller's `finally`: a node's ranks were left to die with it, unstopped, and
    its rank zygote's folder stayed in /tmp (found after SIGTERM, 2026-12-02). A handler that only
    records the signal is in place while uvicorn runs, so the caller cleans up, then returns."""
    caught: list[int] = []
    stops = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda sig, _frame: caught.append(sig)) for s in stops}
    try:
        server.run()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    return caught[0] if caught else None
