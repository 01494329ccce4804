"""Why a request's last output token ends it: a pure function of the request and the model's stop
tokens, apart from the scheduler so the stop rules read in one place."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.core import FinishReason, Req


def stop_reason(
    req: Req,
    eos_token_ids: tuple[int, ...],
    detokenize: Callable[[list[int]], str] | None,
    max_context: int,
) -> FinishReason | None:
    """Why the request's last output token ends it, if it does."""
    p, tok = req.params, req.output_ids[-1]
    reason = None
    if tok in p.stop_token_ids or not p.ignore_eos and tok in eos_token_ids:
        reason = FinishReason("stop", matched=tok)
    elif p.stop and detokenize is not None:
        tail = detokenize(req.output_ids[-(max(len(s) for s in p.stop) + 8) :])
        hit = next((s for s in p.stop if s in tail), None)
        if hit is not None:
            reason = FinishReason("stop", matched=hit)
    if reason is None and (len(req.output_ids) >= p.max_tokens or req.seq_len >= max_context):
        reason = FinishReason("length")
    return reason
