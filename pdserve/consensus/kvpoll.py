"""KVPoll: the ordered status of one room's KV transfer, and its update rule
(docs/ARCHITECTURE.md section 5).

    Failed(0) < Bootstrapping(1) < WaitingForInput(2) < Transferring(3) < Success(4)

Smaller is worse, so the min over ranks is the slowest rank's progress and any `Failed` makes the
whole room `Failed`. The update rule (`update_status`) is the only way a status should change:

    current      new                      result
    -------      ---                      ------
    None         Bootstrapping / WFI      new              (a room starts here)
    None         Failed                   Failed           (it may fail before it ever started)
    None         Transferring / Success   ValueError       (a room cannot start half-way)
    Failed       anything                 Failed           (terminal)
    any          Failed                   Failed
    any          other                    max(current, new)
                                          (only moves up; a stale lower value is ignored)

`done_for(kind, status)` says whether a status is final *for one vote kind* (see vote.py): a room
whose transfer ended (Success or Failed) is done for the release/transferred votes, a room that
reached WaitingForInput (or later, or Failed) is done for the prealloc vote.
"""

from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


_START = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Failed)


def update_status(current: KVPoll | None, new: KVPoll | int) -> KVPoll:
    """The status a room has after `new` is observed, given its `current` one (None: no entry yet).

    Raises ValueError for an unknown value or a room that would start at Transferring/Success.
    """
    new = KVPoll(new)  # ValueError for an int outside 0..4
    if current is None:
        if new not in _START:
            raise ValueError(
                f"a room starts at Bootstrapping or WaitingForInput (or Failed), not {new.name}"
            )
        return new
    if current == KVPoll.Failed or new == KVPoll.Failed:
        return KVPoll.Failed
    return KVPoll(max(current, new))


def is_transfer_done(status: KVPoll | None) -> bool:
    """The transfer ended, well or badly: Success or Failed."""
    return status is not None and status in (KVPoll.Success, KVPoll.Failed)


def done_for(kind: str, status: KVPoll | None) -> bool:
    """Whether `status` is final for vote `kind` ("release", "transferred", "prealloc")."""
    if status is None:
        return False
    if kind == "prealloc":
        return status != KVPoll.Bootstrapping
    if kind in ("release", "transferred"):
        return is_transfer_done(status)
    raise ValueError(
        f"vote kind {kind!r} has no KVPoll meaning; known: release, transferred, prealloc"
    )
