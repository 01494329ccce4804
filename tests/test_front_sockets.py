"""The node front's request PUSH socket never listens on the network (engine/node_front.py): a
bound PUSH deals its messages round-robin to whoever connects, so a peer without the secret could
otherwise take a share of the requests. Only the stats socket is on `host` (multi-host)."""
from __future__ import annotations

import asyncio

from engine.node_front import NodeFront


def test_request_and_event_sockets_stay_on_loopback():
    async def main():
        front = NodeFront(None, model_name="m", role="colocated", pp_size=2, max_context=16, vocab_size=8,
                          host="0.0.0.0", stats_port=0)
        try:
            assert front.req_addr.startswith("tcp://127.0.0.1:"), front.req_addr
            assert front.evt_addr.startswith("tcp://127.0.0.1:"), front.evt_addr
            assert front.stats_addr.startswith("tcp://0.0.0.0:"), front.stats_addr
        finally:
            await front.close()
    asyncio.run(main())
