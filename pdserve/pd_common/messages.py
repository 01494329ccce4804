"""The messages a PD node adds to the node's protocol (runtime/messages.py); the room's bound."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.runtime.front.prompt import RequestError
from pdserve.runtime.messages import AddRequest, Event, MessageError, StatsExtension, message
from pdserve.runtime.rank_spec import RankSpec

PD_ROLES = ("prefill", "decode")  # what an elastic node (elastic_node/) can be
ROOM_MAX = (1 << 63) - 1  # the router draws rooms in [0, 2^63): the same bound on every channel


def valid_room(room: object) -> bool:
    return type(room) is int and 0 <= room <= ROOM_MAX


def check_room(body: dict[str, Any]) -> int:
    """A /generate body's `bootstrap_room`, or a 400 naming it."""
    room = body.get("bootstrap_room")
    if not valid_room(room):
        raise RequestError(
            400, "'bootstrap_room' must be an integer in [0, 2^63)", "bootstrap_room"
        )
    return room


@message("pd_add")
@dataclass(frozen=True)
class PDAddRequest(AddRequest):
    """A disaggregated request: its room, and (decode) the prefill node's bootstrap server."""

    room: int
    bootstrap_addr: str  # "host:port" on the decode side; "" on the prefill side

    def validate(self) -> None:
        super().validate()
        if not valid_room(self.room):
            raise MessageError(f"PDAddRequest.room: not in [0, {ROOM_MAX}]")


@message("set_role")
@dataclass(frozen=True)
class SetRole:
    """Front -> every rank, in the meta stream: become `role` (docs/ARCHITECTURE.md section 14).
    The ranks stop admitting requests of their old role, drain, and flip together."""

    role: str

    def validate(self) -> None:
        if self.role not in PD_ROLES:
            raise MessageError(f"SetRole.role: one of {PD_ROLES}")


@message("prefill_done")
@dataclass(frozen=True)
class PrefillDoneEvent(Event):
    """The prompt's KV reached the decode node: the release vote found every transfer done."""

    terminal: ClassVar[bool] = True
    rid: str
    prompt_len: int
    cached_len: int


@message("kv_stats")
@dataclass(frozen=True)
class KVRankStats(StatsExtension):
    """A PD rank's transfer counters since start (latencies: those new since the last push)."""

    key = "kv"
    bytes: int
    failures: dict[str, int]
    latencies: list[float]
    dropped: dict[str, int]  # control messages dropped, by reason
    ctrl_port: int | None  # where the rank's KV control socket listens
    room_bytes: list[int] = field(default_factory=list)  # KV bytes of each room in `latencies`
    tokens: int = 0  # prompt tokens whose KV moved (rooms that succeeded)
    skipped_tokens: int = 0  # prompt tokens the decode rank held already, so not moved
    skipped_bytes: int = 0  # the KV bytes of those
    window_skipped_bytes: int = 0  # sliding layers' KV before the window, not moved
    role: str = ""  # the role the rank serves now (an elastic node's flips: elastic_node/)
    leaving: bool = False  # it was told to change role and drains its old one


@dataclass(frozen=True)
class PDRankSpec(RankSpec):
    """A PD rank's spec: where its KV transfer endpoint listens, the node's transfer settings, and
    (prefill) the node's bootstrap server that decode ranks look rooms up in."""

    ranks_listen = True
    transfer_host: str = "127.0.0.1"
    bootstrap_addr: str = ""
    # TransferConfig fields but the rank's own (TransferConfig.to_spec; from_spec on the rank)
    transfer: dict[str, Any] = field(default_factory=dict)
