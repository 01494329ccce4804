"""Hugging Face transformers as the correctness reference:
plain greedy decoding, no stopping rules."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuation of each prompt for exactly `max_new` tokens (EOS does not stop it)."""
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        res = model(x, use_cache=True)
        past, toks = res.past_key_values, []
        nxt = int(res.logits[0, -1].argmax())
        for _ in range(max_new):
            toks.append(nxt)
            if len(toks) == max_new:
                break
            res = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
        outs.append(toks)
    return outs


def load_hf(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
