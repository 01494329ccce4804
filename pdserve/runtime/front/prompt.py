"""What a node front checks and builds from a request body before anything reaches a rank: the
prompt's token ids (text, chat messages or ids), the sampling params, the context limit, the rid,
its tenant's share, its client errors, and the SSE framing."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.engine.core import ANONYMOUS_SHARE, ParamError, SamplingParams, Share

RID_MAX = 256  # characters of a request id


class RequestError(Exception):
    """A client error, answered with an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        }


def prompt_ids(tok: Any, body: dict[str, Any], vocab_size: int) -> list[int]:
    """The prompt of a /generate body: exactly one of `text`, `messages`, `input_ids`."""
    given = [k for k in ("text", "messages", "input_ids") if body.get(k) is not None]
    if len(given) != 1:
        raise RequestError(
            400, "exactly one of 'text', 'messages', 'input_ids' is required", "text"
        )
    kind = given[0]
    if kind == "text":
        if not isinstance(body["text"], str):
            raise RequestError(400, "'text' must be a string", "text")
        ids = tok(body["text"])["input_ids"]
    elif kind == "messages":
        from pdserve.runtime.front.chat_template import (
            render,  # it raises this module's RequestError
        )

        text = render(tok, body)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
        ):
            raise RequestError(
                400,
                f"'input_ids' must be a list of integers in [0, {vocab_size})",
                "input_ids",
            )
    if not ids:
        raise RequestError(400, f"the prompt ('{kind}') is empty", kind)
    return list(ids)


def sampling_params(body: dict[str, Any], defaults: dict[str, Any]) -> tuple[SamplingParams, bool]:
    """The body's sampling params over the model's `defaults`, and whether it asks for the rest
    of the context (`max_tokens: null`: max_tokens is then 1 until the prompt's length is known)."""
    sp: Any = body.get("sampling_params")  # the client's JSON: from_dict checks it
    to_end = (
        isinstance(sp, dict) and "max_tokens" in sp and sp["max_tokens"] is None
    )  # rest of context
    try:
        params = SamplingParams.from_dict({**sp, "max_tokens": 1} if to_end else sp, defaults)
    except ParamError as e:
        raise RequestError(400, str(e), e.field) from None
    except TypeError as e:
        raise RequestError(400, f"sampling_params: {e}", "sampling_params") from None
    return params, to_end


def check_context(prompt_len: int, max_tokens: int, max_context: int) -> None:
    """Refuses a request whose prompt and max_tokens do not fit in the context."""
    if prompt_len + max_tokens > max_context:
        raise RequestError(
            400,
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context limit of {max_context} tokens",
            "max_tokens",
            "context_length_exceeded",
        )


def request_rid(body: dict[str, Any]) -> str:
    """The body's request id, or a new one if it has none."""
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str) or len(rid) > RID_MAX:
        raise RequestError(400, f"'rid' must be a string of at most {RID_MAX} characters", "rid")
    return rid


@dataclass(frozen=True)
class Resume:
    """Where a request continues when another node generated its start (a migrated stream,
    router/routing/migration.py): the tokens generated there, and how many characters of their
    text the client already has."""

    token_ids: list[int]
    text_chars: int


def request_share(body: dict[str, Any]) -> Share:
    """The request's `tenant`, `tenant_weight` and `priority`, for the node's fair queue
    (engine/fair_queue.py). The router sets all three on every request it sends, over whatever
    its client put there; a caller that sets none is the anonymous tenant."""
    tenant, weight, priority = (body.get(k) for k in ("tenant", "tenant_weight", "priority"))
    if tenant is None and weight is None and priority is None:
        return ANONYMOUS_SHARE
    if tenant is not None and not isinstance(tenant, str):
        raise RequestError(400, "'tenant' must be a string", "tenant")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))):
        raise RequestError(400, "'tenant_weight' must be a number", "tenant_weight")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise RequestError(400, "'priority' must be an integer", "priority")
    share = Share(tenant or "", float(1.0 if weight is None else weight), priority or 0)
    try:
        share.check()
    except ParamError as e:
        raise RequestError(400, str(e), e.field) from None
    return share


def resume_point(body: dict[str, Any], vocab_size: int, max_tokens: int) -> Resume | None:
    """The body's `resume` ({"token_ids": [...], "text_chars": n}), checked; None without one. A
    resume that already ends the request (its last token a stop token, or max_tokens of them)
    finishes at once: the client gets the finish it missed."""
    r = body.get("resume")
    if r is None:
        return None
    if not isinstance(r, dict) or set(r) != {"token_ids", "text_chars"}:
        raise RequestError(
            400, "'resume' must be an object with exactly 'token_ids' and 'text_chars'", "resume"
        )
    ids, chars = r["token_ids"], r["text_chars"]
    if (
        not isinstance(ids, list)
        or not 0 < len(ids) <= max_tokens
        or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
        )
    ):
        raise RequestError(
            400,
            f"'resume.token_ids' must be 1 to max_tokens ({max_tokens}) token ids in "
            f"[0, {vocab_size})",
            "resume.token_ids",
        )
    if not isinstance(chars, int) or isinstance(chars, bool) or chars < 0:
        raise RequestError(400, "'resume.text_chars' must be an integer >= 0", "resume.text_chars")
    return Resume(list(ids), chars)
