"""An elastic node's front tells the two ends of a PD pair apart (elastic_node/front.py): the
router names the end it sends (`pd_side`), so a node serving prefill refuses the decode end even
where it names another host's prefill node on this node's own bootstrap port, and a node serving
decode refuses the prefill end. Both refusals are the retryable 503 `role_change`."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.elastic_node.front import ROLE_CHANGE, ElasticFront
from pdserve.engine.core import SamplingParams
from pdserve.pd_common.messages import PDAddRequest
from pdserve.runtime.front.prompt import RequestError

PORT = 8998


def front(start_role: str) -> ElasticFront:
    f = ElasticFront(
        None,
        model_name="m",
        role="decode",
        pp_size=1,
        max_context=64,
        vocab_size=8,
        bootstrap_port=PORT,
        start_role=start_role,
    )
    f.bootstrap_servers = frozenset({f"10.0.0.2:{PORT}"})
    return f


def body(side: str | None, host: str = "10.0.0.2", port: int = PORT) -> dict:
    out = {"bootstrap_room": 7, "bootstrap_host": host, "bootstrap_port": port}
    return out if side is None else {**out, "pd_side": side}


def refused(f: ElasticFront, b: dict) -> bool:
    try:
        f.add_request("r", [1, 2, 3], SamplingParams(), b)
    except RequestError as e:
        assert e.status == 503 and e.code == ROLE_CHANGE, (e.status, e.code)
        return True
    return False


def test_a_node_serving_prefill_refuses_the_decode_end_on_the_same_port_of_another_host():
    f = front("prefill")
    try:
        # another host's prefill node on this node's bootstrap port: only `pd_side` tells
        assert refused(f, body("decode"))
        msg = f.add_request("r", [1, 2, 3], SamplingParams(), body("prefill"))
        assert isinstance(msg, PDAddRequest)
        assert refused(f, {"max_tokens": 4})  # decode-local
        assert refused(f, body(None, port=PORT + 1))  # no side named: another port is decode
        with pytest.raises(RequestError) as bad:
            f.add_request("r", [1, 2, 3], SamplingParams(), body("both"))
        assert bad.value.status == 400 and bad.value.param == "pd_side"
    finally:
        asyncio.run(f.close())


def test_a_node_serving_decode_refuses_the_prefill_end():
    f = front("decode")
    try:
        assert refused(f, body("prefill"))
        with pytest.raises(RequestError) as bad:  # checked in either role
            f.add_request("r", [1, 2, 3], SamplingParams(), body("both"))
        assert bad.value.status == 400 and bad.value.param == "pd_side"
    finally:
        asyncio.run(f.close())


def test_server_info_names_the_role_the_node_started_in():
    """The router counts an elastic node for its autoscaler by the role it started in
    (router/routing/elastic.py replicas_to_start), whatever it serves now."""
    f = front("prefill")
    try:
        info = f.server_info()
        assert (info["elastic"], info["role"], info["start_role"]) == (True, "prefill", "prefill")
    finally:
        asyncio.run(f.close())
