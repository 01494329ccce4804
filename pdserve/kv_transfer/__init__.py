"""Per-rank KV page movement between prefill and decode ranks over the Mooncake transfer engine.

Prefill rank:  mgr = PrefillKVManager(cfg, pool, pp_rank, pp_size, bootstrap_addr)
               s = mgr.create_sender(room); s.poll() ... WaitingForInput
               s.send_chunk(page_ids, start, end, last, aux) per chunk
               s.poll() ... Success | Failed
Decode rank:   mgr = DecodeKVManager(cfg, pool, pp_rank, dst_slices, aux_slots)
               r = mgr.create_receiver(room, bootstrap_addr); r.register(page_ids, aux_slot)
               r.poll() ... Success | Failed; r.read_aux()
Prefill front: BootstrapServer(host, port).start(), or mount build_app(BootstrapState()).
"""

from pdserve.kv_transfer.bootstrap import (
    BootstrapServer,
    BootstrapState,
    PrefillRankInfo,
    build_app,
)
from pdserve.kv_transfer.decode_manager import DecodeKVManager
from pdserve.kv_transfer.layout import PoolDesc
from pdserve.kv_transfer.manager import TransferConfig
from pdserve.kv_transfer.prefill_manager import PrefillKVManager
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.sender import KVSender
from pdserve.kv_transfer.stats import TransferStats

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
