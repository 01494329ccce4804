"""The messages a PD node adds to the node's protocol (runtime/messages.py); the room's bound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from runtime.messages import AddRequest, Event, MessageError, message
from runtime.prompt import RequestError

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


@message("prefill_done")
@dataclass(frozen=True)
class PrefillDoneEvent(Event):
    """The prompt's KV reached the decode node: the release vote found every transfer done."""

    terminal: ClassVar[bool] = True
    rid: str
    prompt_len: int
    cached_len: int
