"""Builds a tiny random Llama-family model (safetensors + config + tokenizer) for tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a small generated corpus,
and the weights are random with a fixed seed, saved with `save_pretrained`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5-Instruct's chat template (tools in a system prompt, calls in Hermes format), with its
# default system prompt shortened: tiny models with it are served as tool-calling models.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# fmt: off
_WORDS = [
    "the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "was", "with", "as", "be",
    "at", "by", "this", "had", "not", "are", "but", "from", "or", "have", "an", "they", "which",
    "one", "you", "were", "all", "we", "her", "she", "there", "would", "their", "will", "when",
    "who", "him", "been", "has", "more", "if", "no", "out", "so", "said", "what", "up", "its",
    "about", "into", "than", "them", "can", "only", "other", "new", "some", "could", "time",
    "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our", "over",
    "man", "me", "even", "most", "made", "after", "also", "did", "many", "before", "must",
    "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because",
    "each", "just", "those", "people", "prefill", "decode", "pipeline", "cache", "page", "token",
    "layer", "request", "router", "transfer", "rank", "slot",
]
# fmt: on


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 20)
        words = [rng.choice(_WORDS) for _ in range(n)]
        lines.append(
            " ".join(words) + rng.choice([".", "!", "?", ",", ""]) + str(rng.randint(0, 999))
        )
    return lines


def build_tokenizer(out: Path, vocab_size: int = 384, chat_template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(2000, seed=0), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


GEMMA3_WINDOW = 7


def _arch_config(
    arch: str,
    common: dict,
    *,
    rope_scaling: dict | None,
    head_dim: int | None,
    overrides: dict | None = None,
):
    """The transformers config of `arch` ("llama", "qwen2", "qwen3" or "gemma3") with the `common`
    fields."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(rope_theta=10000.0, rope_scaling=rope_scaling, **common)
    elif arch == "qwen2":
        return Qwen2Config(rope_theta=10000.0, use_sliding_window=False, **common)
    elif arch == "qwen3":  # q/k norms, and a head_dim that need not be hidden / heads
        return Qwen3Config(
            rope_theta=10000.0, use_sliding_window=False, head_dim=head_dim or 32, **common
        )
    elif arch == "gemma3":  # a window of 7 tokens (pages of 4 cut it) on three of four layers
        types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
        n = common["num_hidden_layers"]
        fields = dict(
            head_dim=head_dim or 16,
            sliding_window=GEMMA3_WINDOW,
            layer_types=[types[i % len(types)] for i in range(n)],
            query_pre_attn_scalar=24,  # not head_dim: the scale is the model's
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
        return Gemma3TextConfig(**{**fields, **(overrides or {})}, **common)
    else:
        raise ValueError(f"unknown arch {arch}")


def _randomize_weights(model) -> None:
    """Larger-than-default init so that greedy decoding does not collapse to one token."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.02)


def build_tiny_model(
    out: Path,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tie: bool = False,
    arch: str = "llama",
    seed: int = 0,
    rope_scaling: dict | None = None,
    head_dim: int | None = None,
    chat_template: str = CHAT_TEMPLATE,
    config_overrides: dict | None = None,
) -> Path:
    """Writes config.json, model.safetensors and the tokenizer into `out` and returns it;
    `config_overrides`: fields of the transformers config to set (Gemma 3's layer types, ...)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, chat_template=chat_template)
    vocab = len(tok)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        dtype="float32",
    )
    cfg = _arch_config(
        arch, common, rope_scaling=rope_scaling, head_dim=head_dim, overrides=config_overrides
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize_weights(model)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    return out
