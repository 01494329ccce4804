"""How often a resumed request (a migrated stream, router/routing/migration.py) continues exactly
as the undisturbed one, on the engine with the default model: 7 chat prompts, seeded sampling
(temperature 1, seed 3), 40 tokens, each resumed from its first 1, 5, 10, 20, 30 and 39 tokens.

  .venv/bin/python bench/bench_resume_exact.py [--dtype bfloat16|float32] [--batch-invariant]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.core import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a haiku about autumn.",
    "List three prime numbers and say why.",
    "What is the capital of France? Tell me a story about it.",
    "Describe a cat.",
    "How do airplanes fly?",
    "Give me a recipe for pancakes.",
]
CUTS = (1, 5, 10, 20, 30, 39)
PARAMS = dict(max_tokens=40, ignore_eos=True, temperature=1.0, seed=3)


def run(eng: Engine, ids: list[int], resume: list[int] = ()) -> list[int]:
    rid = eng.add_request(ids, SamplingParams.from_dict(PARAMS), resume=list(resume))
    eng._done = {}
    while rid not in eng._done:
        eng.step()
    return eng._done.pop(rid).output_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-invariant", action="store_true")
    args = ap.parse_args()
    eng = Engine(EngineConfig(dtype=args.dtype, threads=2, batch_invariant=args.batch_invariant))
    tok, same, total, t0 = eng.tokenizer, 0, 0, time.perf_counter()
    for p in PROMPTS:
        chat = [{"role": "user", "content": p}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        whole = run(eng, ids)
        for k in CUTS:
            total += 1
            same += run(eng, ids, whole[:k]) == whole
    mode = " --batch-invariant" if args.batch_invariant else ""
    took = time.perf_counter() - t0
    print(f"{args.dtype}{mode}: {same} of {total} resumes continued exactly ({took:.1f} s)")


if __name__ == "__main__":
    main()
