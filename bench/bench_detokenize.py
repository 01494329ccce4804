"""The front's detokenizer: CPU time per output token, decode stream against re-decoding the output.

For each output length, one request's tokens arrive one at a time (as a streamed answer does) and
the front turns them into text: `IncrementalDetokenizer` (the `tokenizers` decode stream, one step
per token) against the same class forced onto its fallback (re-decoding the whole output per
token, what the front did before). Greedy SmolLM2 ids are replaced by a seeded mix of vocabulary
ids.

  .venv/bin/python bench/bench_detokenize.py [--lengths 64,512,2048]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.engine.model.detokenizer import IncrementalDetokenizer  # noqa: E402
from pdserve.engine.model.loader import resolve_model  # noqa: E402
from pdserve.engine.model.tokenizer import load_tokenizer  # noqa: E402


def per_token_us(tok, ids: list[int], stream: bool) -> float:
    best = float("inf")
    for _ in range(3):
        d = IncrementalDetokenizer(tok, ("</s>",))
        if not stream:
            d._stream = None
        t = time.process_time()
        for i in ids:
            d.add([i])
        d.finish(None)
        best = min(best, time.process_time() - t)
    return best / len(ids) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,512,2048")
    a = ap.parse_args()
    tok = load_tokenizer(resolve_model(None))
    rng = random.Random(0)
    print(
        "| output tokens | decode stream (µs CPU / token) | full re-decode (µs CPU / token) | "
        "ratio |"
    )
    print("|---:|---:|---:|---:|")
    for n in map(int, a.lengths.split(",")):
        ids = [rng.randrange(200, tok.vocab_size) for _ in range(n)]
        s, f = per_token_us(tok, ids, True), per_token_us(tok, ids, False)
        print(f"| {n} | {s:.1f} | {f:.1f} | {f / s:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
