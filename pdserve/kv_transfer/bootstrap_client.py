"""HTTP calls to a prefill node's bootstrap server: register (backoff), route query, heartbeat."""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

import httpx

from pdserve.infra.request_signing import signed_auth
from pdserve.kv_transfer.bootstrap import PrefillRankInfo

# One call to a bootstrap server; kv_transfer/bootstrap.py HEARTBEAT_TIMEOUT_S allows for it.
REQUEST_TIMEOUT_S = 2.0
# The most a server's heartbeat timeout is taken to be: a registration proves life for that long.
MAX_HEARTBEAT_TIMEOUT_S = 600.0

logger = logging.getLogger(__name__)


class BootstrapTimeout(RuntimeError):
    pass


class Heartbeat(NamedTuple):
    """A bootstrap server's answer to one beat."""

    dead: list[str]  # the asked-about peers silent there for over timeout_s
    ranks: set[str]  # the sessions of the prefill ranks registered there now
    timeout_s: float  # the server's heartbeat timeout (0 from a server that does not say)


class BootstrapClient:
    """One bootstrap server address ("host:port"); every call has a per-request timeout."""

    def __init__(
        self, addr: str, token: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S
    ):
        self.addr = addr
        self._http = httpx.Client(
            base_url=f"http://{addr}",
            auth=signed_auth(token),  # signed: the secret never crosses the network
            timeout=request_timeout_s,
            trust_env=False,
        )

    def close(self) -> None:
        self._http.close()

    def register(
        self,
        info: PrefillRankInfo,
        deadline: float | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """PUT /route until it answers 200; exponential backoff 0.05 s .. 2 s."""
        delay = 0.05
        while True:
            try:
                r = self._http.put("/route", json=info.to_wire())
                if r.status_code == 200:
                    return
                if r.status_code in (400, 401):
                    raise ValueError(f"bootstrap server {self.addr} refused registration: {r.text}")
                why = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                why = type(e).__name__
            if (deadline is not None and time.monotonic() + delay > deadline) or (
                stop and stop.is_set()
            ):
                raise BootstrapTimeout(
                    f"could not register with bootstrap server {self.addr}: {why}"
                )
            # a starting node's server may be slow to answer for a few seconds: INFO only after
            (logger.info if delay >= 2.0 else logger.debug)(
                "bootstrap server %s not reachable (%s), retrying in %.2fs", self.addr, why, delay
            )
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def route(
        self,
        layer_start: int,
        layer_end: int,
        session: str,
        deadline: float,
        heads: tuple[int, int] | None = None,
    ) -> list[PrefillRankInfo]:
        """Prefill ranks holding layers [layer_start, layer_end) (and KV heads `heads`, if given);
        retries 503 and errors until the deadline."""
        delay = 0.05
        params: dict[str, str | int] = {
            "layer_start": layer_start,
            "layer_end": layer_end,
            "session": session,
        }
        if heads is not None:
            params["head_start"], params["head_end"] = heads
        while True:
            try:
                r = self._http.get("/route", params=params)
                if r.status_code == 200:
                    ranks = [PrefillRankInfo.from_wire(d) for d in r.json()["ranks"]]
                    if not ranks:
                        raise ValueError(
                            f"no prefill rank of {self.addr} holds layers "
                            f"[{layer_start}, {layer_end})"
                        )
                    return ranks
                if r.status_code in (400, 401):
                    raise ValueError(f"bootstrap server {self.addr}: {r.text}")
                why = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                why = type(e).__name__
            if time.monotonic() + delay > deadline:
                raise BootstrapTimeout(
                    f"bootstrap server {self.addr} gave no route in time ({why})"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def heartbeat(self, session: str, peers: list[str]) -> Heartbeat:
        """One try; raises httpx.HTTPError (or ValueError) on failure."""
        r = self._http.post("/heartbeat", json={"session": session, "peers": peers})
        r.raise_for_status()
        body = r.json()
        dead, ranks = body.get("dead"), body.get("ranks")
        timeout_s = body.get("timeout_s", 0.0)
        if (
            not isinstance(dead, list)
            or not isinstance(ranks, list)
            or type(timeout_s) not in (int, float)
        ):
            raise ValueError("bad heartbeat answer")
        return Heartbeat(
            [d for d in dead if isinstance(d, str)],
            {s for s in ranks if isinstance(s, str)},
            min(MAX_HEARTBEAT_TIMEOUT_S, max(0.0, float(timeout_s))),  # NaN: 0
        )
