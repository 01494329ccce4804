"""The node front's request and event sockets never listen on a TCP port (runtime/front/process.py):
a bound PUSH deals its messages round-robin to whoever connects, so any process that reached it, on
the network or on this host, could take a share of the requests without the secret. They are unix
sockets in a directory only the node's user may enter; only the stats socket is on `host`
(multi-host), and what arrives there is sealed."""

from __future__ import annotations

import asyncio
import os
import stat

from pdserve.runtime.front.process import NodeFront


def test_request_and_event_sockets_are_private_unix_sockets():
    async def main():
        front = NodeFront(
            None,
            model_name="m",
            role="colocated",
            pp_size=2,
            max_context=16,
            vocab_size=8,
            host="0.0.0.0",
            stats_port=0,
        )
        folder = front._ipc_dir
        try:
            assert front.req_addr == f"ipc://{folder}/req", front.req_addr
            assert front.evt_addr == f"ipc://{folder}/evt", front.evt_addr
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
            assert sorted(os.listdir(folder)) == ["evt", "req"]
            assert front.stats_addr.startswith("tcp://0.0.0.0:"), front.stats_addr
        finally:
            await front.close()
        assert not os.path.exists(folder), "the socket folder is removed when the front closes"

    asyncio.run(main())
