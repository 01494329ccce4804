"""Per-rank KV page movement between prefill and decode ranks over the Mooncake transfer engine.

Prefill rank:  mgr = PrefillKVManager(cfg, pool, pp_rank, pp_size, bootstrap_addr)
               s = mgr.create_sender(room); s.poll() ... WaitingForInput
               s.send_chunk(page_ids, start, end, last, aux) per chunk
               s.poll() ... Success | Failed
Decode rank:   mgr = DecodeKVManager(cfg, pool, pp_rank, dst_slices, aux_slots)
               r = mgr.create_receiver(room, bootstrap_addr); r.register(page_ids, aux_slot)
               r.poll() ... Success | Failed; r.read_aux()
Prefill front: BootstrapServer(host, port).start(), or mount build_app(BootstrapState()).

Nothing is imported until it is asked for (PEP 562): a node's command line imports
kv_transfer.config (its TransferConfig settings) without this package's zmq, HTTP and Mooncake
modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.kv_transfer.bootstrap import (
        BootstrapServer,
        BootstrapState,
        PrefillRankInfo,
        build_app,
    )
    from pdserve.kv_transfer.config import TransferConfig
    from pdserve.kv_transfer.decode_manager import DecodeKVManager
    from pdserve.kv_transfer.layout import PoolDesc
    from pdserve.kv_transfer.prefill_manager import PrefillKVManager
    from pdserve.kv_transfer.receiver import KVReceiver
    from pdserve.kv_transfer.sender import KVSender
    from pdserve.kv_transfer.stats import TransferStats

_WHERE = {
    "BootstrapServer": "bootstrap",
    "BootstrapState": "bootstrap",
    "PrefillRankInfo": "bootstrap",
    "build_app": "bootstrap",
    "PoolDesc": "layout",
    "TransferConfig": "config",
    "DecodeKVManager": "decode_manager",
    "KVReceiver": "receiver",
    "KVSender": "sender",
    "PrefillKVManager": "prefill_manager",
    "TransferStats": "stats",
}

__all__ = [
    "BootstrapServer",
    "BootstrapState",
    "PrefillRankInfo",
    "build_app",
    "PoolDesc",
    "TransferConfig",
    "DecodeKVManager",
    "KVReceiver",
    "KVSender",
    "PrefillKVManager",
    "TransferStats",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
