"""What both PD loops share without knowing about the transfer: the consensus ring over the PP group,
the aux payload (first token + logprobs) codec, and the per-request PD record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from consensus.transport import InMemoryRing, PPGroupTransport, RingTransport
from engine.core import Req
from runtime.pp_comm import Msg, PPComm


def vote_transport(comm: PPComm | None, num_slots: int) -> RingTransport:
    """The consensus ring (votes, leader sync) over the PP group, as VOTE-typed messages.

    Sends are committed `num_slots + 1` turns later: PP0 takes the last rank's verdict when it
    harvests the slot (up to L - 1 turns after it was sent), and a gloo send completes only then.
    """
    if comm is None:
        return InMemoryRing(1).transport(0)
    return PPGroupTransport(
        comm.rank,
        comm.size,
        send_obj=lambda dst, data: comm.send_obj(dst, data, Msg.VOTE, commit_after=num_slots + 1),
        recv_obj=lambda src, _timeout: comm.recv(src, Msg.VOTE),
    )


def pack_aux(token: int, logprob: float | None, top: list | None) -> bytes:
    return msgpack.packb([int(token), logprob, [list(p) for p in top] if top else None])


def unpack_aux(data: bytes) -> tuple[int, float | None, list[tuple[int, float]] | None]:
    tok, lp, top = msgpack.unpackb(data, raw=False)
    if not isinstance(tok, int):
        raise ValueError("aux data without a token id")
    return tok, lp, [(int(i), float(v)) for i, v in top] if top else None


@dataclass(eq=False)
class PDReq:
    """One disaggregated request on one rank: its engine request, its room and its transfer end."""

    rid: str
    room: int
    req: Req
    kv: Any  # KVSender (prefill) or KVReceiver (decode)
    sent_upto: int = 0  # prefill: tokens whose KV was handed to the sender
    pages: list[int] = field(default_factory=list)  # decode: preallocated pages
    aux_slot: int | None = None  # decode: where the first token lands
    aborted: bool = False
    reason: str = ""
