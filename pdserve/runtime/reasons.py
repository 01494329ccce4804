"""Why a request ended without its whole answer: one small enum, decided where the abort or the
failure is decided and carried as a code, never as free text.

The code travels in `AbortRequest.reason` (front or PP0 -> ranks), `ErrorEvent.reason` and
`FinishEvent.reason` (PP0 -> front), is the `reason` label of `pdserve_requests_aborted_total`, and
`describe` gives the client its sentence. Transfer failures have their own, finer set, the label of
`pdserve_kv_transfer_failures_total` (kv_transfer/stats.py); a request that ends because of one is
`bootstrap_failed` or `kv_transfer_failed` here.
"""

from __future__ import annotations

from enum import StrEnum


class AbortReason(StrEnum):
    CLIENT_ABORT = (
        "client_abort"  # POST /abort: the router's client left, or it gave the attempt up
    )
    CLIENT_DISCONNECT = "client_disconnect"  # the connection to this node closed before the answer
    WAITING_TIMEOUT = "waiting_timeout"  # queued longer than --waiting-timeout (PP0 decides)
    RUNNING_TIMEOUT = "running_timeout"  # alive longer than --running-timeout (PP0 decides)
    INVALID_REQUEST = "invalid_request"  # the ranks' checks refused it (a request field at fault)
    BOOTSTRAP_FAILED = "bootstrap_failed"  # PD: the KV hand-shake failed before any KV moved
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # PD: the KV transfer itself failed
    NODE_FAILURE = "node_failure"  # a rank of this node exited
    NODE_DRAINING = "node_draining"  # the node drains (runtime/front/drain.py): it moves on
    ROLE_CHANGE = "role_change"  # an elastic node leaves the role the request needs (SetRole)


ABORT_REASONS: frozenset[str] = frozenset(r.value for r in AbortReason)

_TEXT = {
    AbortReason.CLIENT_ABORT: "aborted by the client",
    AbortReason.CLIENT_DISCONNECT: "client disconnected",
    AbortReason.WAITING_TIMEOUT: "waiting timeout: queued for longer than --waiting-timeout",
    AbortReason.RUNNING_TIMEOUT: "running timeout: alive for longer than --running-timeout",
    AbortReason.INVALID_REQUEST: "invalid request",
    AbortReason.BOOTSTRAP_FAILED: "KV bootstrap failed",
    AbortReason.KV_TRANSFER_FAILED: "KV transfer failed",
    AbortReason.NODE_FAILURE: "node failure",
    AbortReason.NODE_DRAINING: "the node is draining: the request moves to another node",
    AbortReason.ROLE_CHANGE: "the node is changing role: the request moves to another node",
}


def describe(reason: str) -> str:
    """The client's sentence for a reason code."""
    return _TEXT.get(reason, reason)  # type: ignore[call-overload]


def as_reason(text: str | None, default: AbortReason = AbortReason.CLIENT_ABORT) -> AbortReason:
    """The code `text` is, else `default` (an engine abort outside the node loop has no code)."""
    return AbortReason(text) if text in ABORT_REASONS else default


def finish_message(finish) -> tuple[str, AbortReason | None]:
    """(the client's message, the reason code) of an engine FinishReason: an abort's message is
    its code (the slot loop hands AbortRequest.reason to Scheduler.abort)."""
    if finish.kind != "abort":
        return finish.message, None
    code = as_reason(finish.message)
    return describe(code), code


def check_reason(reason: str | None, where: str, optional: bool = False) -> None:
    """Raises ValueError unless `reason` is a code (or None, when `optional`)."""
    if reason is None and optional:
        return
    if reason not in ABORT_REASONS:
        raise ValueError(f"{where}: {reason!r} is not one of {sorted(ABORT_REASONS)}")
