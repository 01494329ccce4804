"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes. The router has no tokenizer: a node
that serves the model answers (its /tokenize and /detokenize, with the cluster secret;
runtime/front/tokenize.py).

    /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                 {model?, messages, tools?, add_generation_prompt=true,
                  add_special_tokens=false, return_token_strs=false}
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {model?, tokens} -> {"prompt"}

`model` may be left out when the router serves one model, as in vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictBool, StrictStr

from pdserve.router.errors import ApiError
from pdserve.router.openai_api import unimplemented_fields
from pdserve.router.openai_api.field_types import StrictModel, TokenId
from pdserve.router.openai_api.protocol import ChatMessage
from pdserve.router.openai_api.request_parsing import parse_request
from pdserve.router.tools.models import MAX_TOOLS, Tool

if TYPE_CHECKING:
    from pdserve.router.state import Router

MAX_TOKENS = 1 << 18  # ids in one /detokenize (the node's limit too)


class TokenizePrompt(StrictModel):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChat(StrictModel):
    UNSUPPORTED = {
        k: unimplemented_fields.CHAT[k]
        for k in (
            "continue_final_message",
            "chat_template",
            "chat_template_kwargs",
            "mm_processor_kwargs",
        )
    }
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # rendered by the template
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = False


class Detokenize(StrictModel):
    model: StrictStr | None = None
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS)


def parse_tokenize(body: Any) -> TokenizePrompt | TokenizeChat:
    if isinstance(body, dict) and ("prompt" in body) == ("messages" in body):
        raise ApiError(
            400,
            "prompt: give exactly one of prompt, messages",
            param="prompt",
            code="invalid_value",
        )
    cls = TokenizeChat if isinstance(body, dict) and "messages" in body else TokenizePrompt
    return parse_request(cls, body)


def native(req: TokenizePrompt | TokenizeChat | Detokenize) -> dict[str, Any]:
    """The node's body: the request without `model`; messages as the node takes them."""
    body = req.model_dump(exclude={"model"}, exclude_none=True)
    if isinstance(req, TokenizeChat):
        body["messages"] = [m.native() for m in req.messages]
    return body


async def forward(router: Router, path: str, model: str, body: dict[str, Any]) -> Response:
    """The answer of the first node serving `model` that answers (least busy first); a node's 4xx
    is passed through, a node that fails is skipped."""
    workers = sorted(router.registry.serving(model), key=lambda w: w.in_flight)
    if not workers:
        raise ApiError(
            503,
            f"no healthy node serves {model!r}",
            type="server_error",
            code="no_available_workers",
        )
    failures = []
    for worker in workers:
        try:
            resp = await router.clients.get(worker.url).post(
                f"{worker.url}{path}",
                json=body,
                headers=router.dispatcher.node_headers,
                timeout=router.cfg.request_timeout_s,
            )
        except httpx.HTTPError as exc:
            failures.append(f"{worker.url}: {type(exc).__name__}")
            continue
        try:
            answer = resp.json()
        except ValueError:
            answer = None
        # 401/403: the node does not take this router's secret: the cluster's fault, not the
        # client's
        refused = resp.status_code >= 500 or resp.status_code in (401, 403)
        if refused or not isinstance(answer, dict):
            failures.append(f"{worker.url}: {resp.status_code}")
            continue
        return JSONResponse(answer, status_code=resp.status_code)
    raise ApiError(
        502,
        f"no node answered {path}: {'; '.join(failures)}",
        type="server_error",
        code="tokenizer_failed",
    )
