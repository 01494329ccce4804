"""Control messages between prefill and decode ranks (ZMQ, msgpack; never pickle).

decode -> prefill  KVRegister  one per (room, decode rank, overlapping prefill rank)
prefill -> decode  KVStatus    terminal states only: Success (after the KV and the aux data landed)
                               or Failed
either way         KVAbort     the room is over on the sending side; the receiver fails it too

`decode_message` validates strictly (exact keys, exact types, ranges) and raises MessageError;
callers drop and count what it rejects.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import msgpack

from pdserve.consensus.kvpoll import KVPoll
from pdserve.kv_transfer.layout import PoolDesc

MAX_ROOM = 1 << 63
MAX_STR = 256
MAX_RANKS = 4096  # decode ranks (PP x TP) a registration may list


class MessageError(ValueError):
    """A control message that is not one of ours or breaks its schema."""


@dataclass(frozen=True)
class KVRegister:
    room: int
    dst_rank: (
        int  # the decode rank's place in its node (KVManagerBase.rank: its PP rank without TP)
    )
    # ((layer_start, layer_end, head_start, head_end), ...) of every decode rank, by rank
    dst_slices: tuple
    ctrl_host: str  # where the decode rank's control socket listens
    ctrl_port: int
    session_id: str  # Mooncake target "host:rpc_port"
    pool: PoolDesc  # the decode rank's KV pool
    page_ids: tuple  # decode page table of the request (page i = tokens [i*ps, (i+1)*ps))
    aux_ptr: int  # the room's aux slot in the decode rank's registered aux buffer
    aux_len: int  # (0, 0): no aux data for this room
    aux_base: int  # the decode rank's whole aux buffer: the slot must lie inside it
    aux_size: int
    # Prompt tokens the decode rank already holds (its prefix cache), a multiple of its page size:
    # `page_ids[0]` is then the page of token `prefix_tokens`, and nothing before it is sent.
    prefix_tokens: int = 0
    # A windowed pool's sliding layers (kv_transfer/targets.py): their own buffer and table, from
    # page `sliding_first_page` on; `pool` then holds the other layers. None: `pool` holds all.
    sliding_pool: PoolDesc | None = None
    sliding_page_ids: tuple = ()
    sliding_first_page: int = 0


@dataclass(frozen=True)
class KVStatus:
    room: int
    src_rank: int  # the prefill rank's place in its node (KVManagerBase.rank)
    status: int  # KVPoll.Success or KVPoll.Failed
    reason: str
    num_tokens: int  # tokens sent (Success)
    aux_bytes: int  # aux payload bytes written to the decode rank's slot (0: none)
    checksum: int | None  # crc32 of the sent KV when the checksum debug flag is on


@dataclass(frozen=True)
class KVAbort:
    room: int
    side: str  # "prefill" | "decode"
    rank: int
    reason: str


Message = KVRegister | KVStatus | KVAbort
_KIND = {KVRegister: "reg", KVStatus: "status", KVAbort: "abort"}
_BY_KIND = {v: k for k, v in _KIND.items()}


def _is_int(v) -> bool:
    return type(v) is int


def _int(v, lo: int = 0, hi: int = 1 << 64) -> int:
    if not _is_int(v) or not lo <= v < hi:
        raise MessageError(f"expected an int in [{lo}, {hi}), got {type(v).__name__}")
    return v


def _str(v) -> str:
    if type(v) is not str or len(v) > MAX_STR:
        raise MessageError(f"expected a short str, got {type(v).__name__}")
    return v


def _ints(v) -> tuple:
    if type(v) is not list or not all(_is_int(x) and x >= 0 for x in v):
        raise MessageError("expected a list of non-negative ints")
    return tuple(v)


def _slices(v) -> tuple:
    if type(v) is not list or not v or len(v) > MAX_RANKS:
        raise MessageError(f"expected a list of 1 to {MAX_RANKS} decode slices")
    out = []
    for s in v:
        if (
            type(s) is not list
            or len(s) != 4
            or not all(_is_int(x) for x in s)
            or not (0 <= s[0] < s[1] and 0 <= s[2] < s[3])
        ):
            raise MessageError(f"bad decode slice {s!r} (layer start, end, head start, end)")
        out.append((s[0], s[1], s[2], s[3]))
    return tuple(out)


def _pool(v) -> PoolDesc:
    names = set(PoolDesc.__dataclass_fields__)
    if type(v) is not dict or set(v) != names:
        raise MessageError("bad pool description")
    for k in names - {"dtype", "sliding", "held"}:
        _int(v[k])
    _str(v["dtype"])
    v = {**v, "sliding": _ints(v["sliding"])}
    if v["held"] is not None:
        v["held"] = _ints(v["held"])
    try:
        return PoolDesc.from_wire(v)
    except ValueError as e:
        raise MessageError(str(e)) from None


def _status(v) -> int:
    if v not in (KVPoll.Success, KVPoll.Failed) or not _is_int(v):
        raise MessageError(f"status must be Success or Failed, got {v!r}")
    return int(v)


def _side(v) -> str:
    if v not in ("prefill", "decode"):
        raise MessageError(f"side must be prefill or decode, got {v!r}")
    return v


def _opt_int(v):
    return None if v is None else _int(v, 0, 1 << 32)


_CHECK = {
    "room": lambda v: _int(v, 0, MAX_ROOM),
    "dst_rank": _int,
    "src_rank": _int,
    "rank": _int,
    "dst_slices": _slices,
    "ctrl_host": _str,
    "ctrl_port": lambda v: _int(v, 1, 65536),
    "session_id": _str,
    "pool": _pool,
    "page_ids": _ints,
    "aux_ptr": _int,
    "aux_len": _int,
    "aux_base": _int,
    "aux_size": _int,
    "prefix_tokens": lambda v: _int(v, 0, 1 << 32),
    "sliding_pool": lambda v: None if v is None else _pool(v),
    "sliding_page_ids": _ints,
    "sliding_first_page": lambda v: _int(v, 0, 1 << 32),
    "status": _status,
    "reason": _str,
    "num_tokens": _int,
    "aux_bytes": _int,
    "checksum": _opt_int,
    "side": _side,
}


def encode_message(msg: Message) -> bytes:
    d = {"t": _KIND[type(msg)]}
    for f in fields(msg):
        v = getattr(msg, f.name)
        if isinstance(v, PoolDesc):
            v = v.to_wire()
        elif isinstance(v, tuple):
            v = [list(x) if isinstance(x, tuple) else x for x in v]
        d[f.name] = v
    return msgpack.packb(d, use_bin_type=True)


def decode_message(data: bytes) -> Message:
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage; all mean "not ours"
        raise MessageError(f"not msgpack: {type(e).__name__}") from None
    if type(d) is not dict or d.get("t") not in _BY_KIND:
        raise MessageError("not a kv_transfer control message")
    cls = _BY_KIND[d["t"]]
    names = [f.name for f in fields(cls)]
    if set(d) != set(names) | {"t"}:
        raise MessageError(
            f"{d['t']}: expected keys {sorted(names)}, got {sorted(k for k in d if k != 't')}"
        )
    return cls(**{n: _CHECK[n](d[n]) for n in names})
