"""The request fields of OpenAI's and vLLM's schemas that pdserve does not implement.

Every field of a request is either implemented (a field of the request models in
router/openai_api/protocol.py) or listed here. A listed field is accepted only at a *neutral* value,
one that asks for what pdserve does anyway (`use_beam_search: false`, `functions: []`, always
`null`); any other value is a 400 with code `unsupported_parameter` and `param` naming the field.
A field in neither place (not in OpenAI's or vLLM's schema) is a 400 with the same code. Nothing is
dropped silently. vLLM, for comparison, implements most of these and ignores unknown fields with a
warning in its log; docs/ROUTER.md has the table side by side.
"""

from __future__ import annotations

import json
from typing import Any

UNSUPPORTED_CODE = "unsupported_parameter"

# field -> neutral values besides null. Shared by chat and completions.
COMMON: dict[str, tuple] = {
    # OpenAI
    "metadata": ({},),  # only for stored completions
    "store": (False,),
    "service_tier": ("auto", "default"),  # one tier here
    "prompt_cache_key": (),
    # vLLM's extensions
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "min_tokens": (0,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),  # pdserve always skips them
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "request_id": (),
    "logits_processors": (),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
}

CHAT: dict[str, tuple] = {
    **COMMON,
    # OpenAI
    "functions": ([],),  # deprecated by OpenAI for tools
    "function_call": ("none", "auto"),  # deprecated by OpenAI for tool_choice
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    # vLLM's extensions
    "include_reasoning": (True,),  # the whole output is the answer
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "documents": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "mm_processor_kwargs": ({},),
}

COMPLETION: dict[str, tuple] = {
    **COMMON,
    "echo": (False,),
    "suffix": ("",),
    "add_special_tokens": (True,),
    "prompt_embeds": (),
}

MESSAGE: dict[str, tuple] = {  # fields of one chat message
    "name": (),
    "function_call": (),
    "refusal": (),
    "audio": (),
    "reasoning_content": (),
}

STREAM_OPTIONS: dict[str, tuple] = {
    "include_obfuscation": (False,),  # no obfuscation padding is sent
    "continuous_usage_stats": (False,),  # vLLM: usage on every chunk
}


def is_neutral(value: Any, neutral: tuple) -> bool:
    """Whether `value` is null or one of `neutral` (1 and 1.0 match; true and 1 do not)."""
    return value is None or any(
        value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral
    )


def describe(neutral: tuple) -> str:
    return " or ".join(json.dumps(v) for v in (None, *neutral))


def schema(neutral: tuple) -> dict[str, Any]:
    """The OpenAPI property of an unsupported field: its neutral values, and why."""
    return {
        "enum": [None, *neutral],
        "description": f"not supported: accepted only as {describe(neutral)}; any other value "
        f"is a 400 `{UNSUPPORTED_CODE}`",
    }
