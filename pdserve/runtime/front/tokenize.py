"""A node's /tokenize and /detokenize (docs/PROTOCOL.md): the model's tokenizer as a service, in
vLLM's shapes, for the router, which has no tokenizer. Both run in the front's tokenizer thread.

    /tokenize    {"prompt": str} or {"messages": [...], "tools"?: [...]}
    (runtime/front/chat_template.py),
                 optional add_special_tokens
                 (default: true for a prompt, false for messages, whose template adds them),
                 add_generation_prompt (messages, default true), return_token_strs (default false)
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [int]} -> {"prompt": str}, special tokens kept (as vLLM)
"""

from __future__ import annotations

from typing import Any

from pdserve.runtime.front.chat_template import render
from pdserve.runtime.front.process import NodeFront
from pdserve.runtime.front.prompt import RequestError

MAX_DETOKENIZE = 1 << 18  # token ids in one /detokenize (the body limit bounds the rest)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(400, f"'{name}' must be a boolean", name)
    return value


def tokenize(front: NodeFront, body: dict[str, Any]) -> dict[str, Any]:
    tok = front.tok
    if ("prompt" in body) == ("messages" in body):
        raise RequestError(400, "give exactly one of 'prompt', 'messages'", "prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise RequestError(400, "'prompt' must be a string", "prompt")
        text, special = body["prompt"], _flag(body, "add_special_tokens", True)
    else:
        text = render(tok, body, _flag(body, "add_generation_prompt", True))
        special = _flag(body, "add_special_tokens", False)
    ids = list(tok(text, add_special_tokens=special)["input_ids"])
    strs = tok.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
    return {
        "count": len(ids),
        "max_model_len": front.max_context,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(front: NodeFront, body: dict[str, Any]) -> dict[str, Any]:
    ids = body.get("tokens")
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_DETOKENIZE
        or not all(type(t) is int and 0 <= t < front.vocab_size for t in ids)
    ):
        raise RequestError(
            400,
            f"'tokens' must be a list of at most {MAX_DETOKENIZE} integers in "
            f"[0, {front.vocab_size})",
            "tokens",
        )
    return {"prompt": front.tok.decode(ids)}
