"""Per-token cost of structured output (engine/grammar.py, xgrammar) on this CPU.

    .venv/bin/python bench/bench_grammar.py [--model SmolLM2-135M-Instruct] [--tokens 64]

For each guide kind: the one-off compile time, then the mean cost of one sampling step's mask
(feed the previous token, fill the bitmask, apply it to the logits row) while a greedy walk
through the grammar emits `--tokens` tokens. The walk takes the lowest allowed token id, so it
needs no model forward: only the grammar's own cost is timed.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pdserve.engine.core import Req, SamplingParams
from pdserve.engine.grammar import GrammarSampler
from pdserve.engine.model.loader import load_model_config, resolve_model
from pdserve.engine.model.tokenizer import load_tokenizer

GUIDES = {
    "json_schema": json.dumps(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                "ok": {"type": "boolean"},
            },
            "required": ["name", "tags", "ok"],
        }
    ),
    "json_object": "",
    "regex": "[a-z]{1,20}(-[0-9]{1,5}){1,10}",
    "choice": json.dumps(["alpha", "beta", "gamma", "delta"]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    path = resolve_model(a.model)
    cfg = load_model_config(path)
    tok = load_tokenizer(path)
    print(f"model {path.name}: vocab {cfg.vocab_size}, torch threads {torch.get_num_threads()}")
    gs = GrammarSampler(lambda: tok, cfg.vocab_size, cfg.eos_token_ids)
    t0 = time.perf_counter()
    gs._compile(("regex", "a"))  # builds the tokenizer info once per rank, at the first guide
    print(f"tokenizer info + a trivial grammar: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    print("| guide | compile (ms) | mask per token (µs) | tokens |")
    print("|---|---|---|---|")
    for kind, spec in GUIDES.items():
        req = Req("r", [1], SamplingParams(max_tokens=a.tokens, guide=(kind, spec)))
        logits = torch.zeros(1, cfg.vocab_size)
        t0 = time.perf_counter()
        gs._compile(req.params.guide)
        compile_ms = (time.perf_counter() - t0) * 1e3
        steps, spent = 0, 0.0
        for _ in range(a.tokens):
            row = torch.zeros(1, cfg.vocab_size)
            t0 = time.perf_counter()
            gs.mask(row, [req])
            spent += time.perf_counter() - t0
            steps += 1
            allowed = torch.nonzero(row[0] > float("-inf"))[:, 0]
            nxt = int(allowed[0])
            if nxt in cfg.eos_token_ids:
                break
            req.output_ids.append(nxt)
        del logits
        print(f"| {kind} | {compile_ms:.0f} | {spent / steps * 1e6:.0f} | {steps} |")


if __name__ == "__main__":
    main()
