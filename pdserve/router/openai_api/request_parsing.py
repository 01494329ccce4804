"""From a client's JSON body to a validated request: `parse_request` (OpenAI bodies, the pydantic
models of router/openai_api/protocol.py; the first bad field becomes a 400 naming it),
`parse_native` (native /generate bodies) and the prompt keys the policies route by."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pdserve.router.errors import ApiError
from pdserve.router.openai_api.unimplemented_fields import UNSUPPORTED_CODE

if TYPE_CHECKING:
    from pdserve.router.openai_api.protocol import _Common


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "function-after"}


def _is_tag(part: Any) -> bool:
    """A union branch or validator name pydantic puts in a location (`str`, `list[int]`,
    `constrained-str`); field names never hold '[' or '-'."""
    return isinstance(part, str) and ("[" in part or "-" in part or part.lower() in _TYPE_TAGS)


def _most_telling(errors: list[dict]) -> dict:
    """Of the errors about the first bad field, the one that says most: for a union, a value
    error in the branch of the right type (`prompt.0: >= 0`) beats "should be a valid string"."""
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    return min(same, key=lambda e: (e["type"].endswith("_type"), -len(e["loc"])))


def parse_request(cls: type[_Common], body: Any) -> _Common:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = _most_telling(exc.errors(include_url=False))
        loc = [str(p) for p in err["loc"] if not _is_tag(p)]
        msg, code = err["msg"].removeprefix("Value error, "), "invalid_value"
        if err["type"] == UNSUPPORTED_CODE:
            loc.append(err["ctx"]["field"])
            code = UNSUPPORTED_CODE
        elif err["type"] == "extra_forbidden":
            msg = "unknown parameter (in neither OpenAI's nor vLLM's schema)"
            code = UNSUPPORTED_CODE
        param = ".".join(loc) or None
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param, code=code) from None


def parse_native(body: Any) -> dict[str, Any]:
    """Checks on a native `/generate` body: an object with exactly one prompt field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompts = [k for k in ("text", "messages", "input_ids") if k in body]
    if len(prompts) != 1:
        raise ApiError(400, "give exactly one of text, messages, input_ids", param="text")
    if "sampling_params" in body and not isinstance(body["sampling_params"], dict):
        raise ApiError(400, "sampling_params must be an object", param="sampling_params")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    return {
        k: v
        for k, v in body.items()
        # the router's own: `resume` is how it moves a stream (router/routing/migration.py)
        if k not in ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room", "resume")
    }


def native_prompt_key(body: dict[str, Any]) -> str:
    if isinstance(body.get("text"), str):
        return body["text"]
    if isinstance(body.get("messages"), list):
        return "".join(
            f"{m.get('role')}\n{m.get('content')}\n"
            for m in body["messages"]
            if isinstance(m, dict)
        )
    ids = body.get("input_ids")
    return " ".join(map(str, ids)) if isinstance(ids, list) else ""
