"""The elastic node's front: a decode front (streams, the bootstrap allowlist, decode-local
requests) that also hosts the node's bootstrap server and answers prefill requests while its
ranks serve the prefill role, and takes `POST /role` (cluster secret) to change role.

The role it serves is the one every rank reports in its stats (`KVRankStats.role`): a flip is
the ranks' decision (elastic_node/loop.py), and the front only asks for it. From the ask until
every rank reports the new role the front refuses new requests with 503 `role_change` (the
router sends them elsewhere), while the requests it admitted before finish; or, where the change
names a `grace_s`, those still there when it has passed move on (aborted with `node_draining`:
the router continues a stream on another decode node mid-stream, and retries the others)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request

from pdserve.decode_node.front import DecodeFront
from pdserve.engine.core import SamplingParams
from pdserve.kv_transfer.stats import RECEIVER_FAILURES, SENDER_FAILURES
from pdserve.pd_common.messages import PD_ROLES, KVRankStats, PDAddRequest, SetRole, check_room
from pdserve.pd_common.metrics import DecodeMetrics
from pdserve.prefill_node.front import prefill_answer
from pdserve.runtime.front.answer import Pending
from pdserve.runtime.front.drain import move_on
from pdserve.runtime.front.http_app import read_json
from pdserve.runtime.front.prompt import RequestError
from pdserve.runtime.messages import AddRequest

log = logging.getLogger("pdserve.serve")

ROLE_CHANGE = "role_change"
MAX_GRACE_S = 3600.0


class ElasticMetrics(DecodeMetrics):
    """Both sides' transfer failures: the node sends KV in one role and receives it in the other."""

    failure_reasons = tuple(dict.fromkeys((*SENDER_FAILURES, *RECEIVER_FAILURES)))


class ElasticFront(DecodeFront):
    finish_reasons = ("stop", "length", "abort", "prefill_done")
    metrics_extension = ElasticMetrics
    metrics_roles = PD_ROLES

    def __init__(self, *a, bootstrap_port: int, start_role: str, **kw):
        super().__init__(*a, **kw)
        self.bootstrap_port = bootstrap_port
        self._start_role = start_role
        self._last_served = start_role
        self.asked: str | None = None  # the role asked for by POST /role, until the ranks have it
        self._prefill_rids: set[str] = set()  # admitted as prefill requests: answered as such
        self._move_on: asyncio.Task | None = None  # the grace of the role change asked last

    @property
    def serving(self) -> str:
        """The role every rank reports now (before the first reports: the start role); "" while
        the ranks disagree, which they do only between the stats pushes around a flip."""
        roles = {
            st.ext.role
            for st in self.rank_stats.values()
            if isinstance(st.ext, KVRankStats) and st.ext.role
        }
        if not roles:
            return self._start_role
        return roles.pop() if len(roles) == 1 else ""

    def metrics_role(self) -> str:
        """The role served now, or while the ranks disagree (around a flip) the last one known:
        what the node did in each role is counted under that role."""
        self._last_served = self.serving or self._last_served
        return self._last_served

    def _ranks_leaving(self) -> bool:
        return any(
            isinstance(st.ext, KVRankStats) and st.ext.leaving for st in self.rank_stats.values()
        )

    def changing_to(self) -> str | None:
        """The role the node is becoming, or None once every rank serves the one asked for and
        none of them drains any more (the stats lag the ranks by up to a push)."""
        if self.asked is not None and self.serving == self.asked and not self._ranks_leaving():
            self.asked = None
        return self.asked

    def set_role(self, body: dict[str, Any]) -> dict[str, Any]:
        role = body.get("role")
        if role not in PD_ROLES:
            raise RequestError(400, f"'role' must be one of {list(PD_ROLES)}", "role")
        grace = body.get("grace_s")
        if grace is not None and (
            isinstance(grace, bool)
            or not isinstance(grace, (int, float))
            or not 0 <= grace <= MAX_GRACE_S
        ):
            raise RequestError(400, f"'grace_s' must be seconds in [0, {MAX_GRACE_S:g}]", "grace_s")
        changing = self.changing_to()
        if role != (changing or self.serving) or (changing is None and self._ranks_leaving()):
            # the ranks act on the last SetRole (back to the role they serve: the drain stops)
            self.asked = role
            self.send(SetRole(role))  # after every request admitted so far: those finish
            if self._move_on is not None:
                self._move_on.cancel()
            self._move_on = None
            if grace is not None:
                self._move_on = asyncio.get_running_loop().create_task(
                    self._move_on_after(role, float(grace)), name="role-change-grace"
                )
        return self.role_status()

    async def _move_on_after(self, role: str, grace_s: float) -> None:
        """Past the grace of a change to `role`, what the node still holds moves on, as after a
        drain's grace (runtime/front/drain.py `move_on`)."""
        await asyncio.sleep(grace_s)
        if self.changing_to() == role and self.pending:
            log.warning("role change to %s: %d request(s) move on", role, len(self.pending))
        await move_on(self, lambda: self.changing_to() == role)

    def role_status(self) -> dict[str, Any]:
        return {"role": self.serving, "changing_to": self.changing_to(), "elastic": True}

    def add_routes(self, app: Any, check_internal: Any) -> None:
        super().add_routes(app, check_internal)

        @app.post("/role")
        async def role(request: Request):
            """Become `role` ("prefill" or "decode"): new requests are refused from now until
            every rank serves it; those admitted before finish first, or with `grace_s`, move on
            once it has passed."""
            check_internal(request)
            return self.set_role(await read_json(request))

    def add_request(
        self, rid: str, ids: list[int], params: SamplingParams, body: dict[str, Any]
    ) -> AddRequest:
        changing = self.changing_to()
        serving = self.serving
        if changing is not None or not serving:
            to = f" to {changing}" if changing else ""
            raise RequestError(503, f"node is changing role{to}", code=ROLE_CHANGE)
        if body.get("pd_side", "decode") not in PD_ROLES:
            raise RequestError(400, f"'pd_side' must be one of {list(PD_ROLES)}", "pd_side")
        if serving == "prefill":
            if self._decode_end(body):
                # a decode request sent on a role this node left: the router retries it on a node
                # of that role
                raise RequestError(503, "node serves the prefill role now", code=ROLE_CHANGE)
            msg = PDAddRequest(rid, ids, params.to_dict(), check_room(body), "")
            self._prefill_rids.add(rid)
            return msg
        if body.get("pd_side") == "prefill":  # the prefill end, sent on a role this node left
            raise RequestError(503, "node serves the decode role now", code=ROLE_CHANGE)
        return super().add_request(rid, ids, params, body)

    def _decode_end(self, body: dict[str, Any]) -> bool:
        """Whether a /generate body is a decode request: decode-local (no room), or the decode end
        of a PD pair. The router names the end (`pd_side`). Without it, a request naming another
        bootstrap port is one; the same port on another host cannot be told apart, since the
        router's host name for a node need not be the node's own."""
        if body.get("bootstrap_room") is None:
            return True
        side = body.get("pd_side")
        if side is not None:
            return side == "decode"
        port = body.get("bootstrap_port")
        return port is not None and port != self.bootstrap_port

    def admit(
        self, body: dict[str, Any], ids: list[int] | None = None, traceparent: str | None = None
    ) -> Pending:
        try:
            return super().admit(body, ids, traceparent)
        except BaseException:
            # refused after add_request: no answer will take it out of the prefill set
            self._prefill_rids.discard(str(body.get("rid")))
            raise

    async def answer(self, p: Pending) -> dict[str, Any] | None:
        if p.rid not in self._prefill_rids:
            return await super().answer(p)
        try:
            return await prefill_answer(self, p)
        finally:
            self._prefill_rids.discard(p.rid)

    async def close(self) -> None:
        if self._move_on is not None:
            self._move_on.cancel()
        await super().close()

    def describe(self) -> str:
        return f"elastic, KV bootstrap server on port {self.bootstrap_port}"

    def server_info(self) -> dict[str, Any]:
        info = super().server_info()
        # the role it was started in: an autoscaler counts the node there, whatever it serves now
        info.update(self.role_status(), bootstrap_port=self.bootstrap_port)
        info["start_role"] = self._start_role
        return info
