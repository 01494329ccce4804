"""Greedy agreement of the offline engine with Hugging Face transformers on the same weights,
SmolLM2-135M-Instruct (or `--model`, e.g. gemma3-270m), in bf16 and in fp32.

Workload: `--prompts` chat requests (the model's chat template around a user message of English
text, uniform in [32, 512] tokens, from `--corpus`, seeded; the text alone for a model without a
chat template), `--max-tokens` greedy tokens each,
EOS not stopping either side (so every pair compares the same number of tokens).
  engine:        Engine.generate, one continuous batch, one thread, `--dtype` bfloat16 / float32;
  transformers:  AutoModelForCausalLM dequantized from the same GGUF, in fp32 and cast to bf16,
                 one request at a time with its KV cache, argmax of the last position's logits.
For each pair of runs: how many continuations are identical, the share of reference tokens matched
before the first difference, and where the first differences fall. After a first difference the
two continuations follow different texts, so later positions are not compared.

  node:          with `--node-args ARGS`, also `pdserve serve ARGS --dtype D` as a process (a TP
                 layout: `--node-args "--tp 3"`), the same prompts through POST /generate, 16 at a
                 time; `--no-engine` leaves the offline engine out.

  .venv/bin/python bench/bench_agreement.py [--prompts 64] [--max-tokens 64] [--model NAME]
      [--corpus FILE] [--node-args ARGS] [--no-engine] [--out bench/results/agreement.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import EngineConfig, cpu_has_native_bf16  # noqa: E402
from pdserve.engine.core import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.model.loader import resolve_model  # noqa: E402
from pdserve.engine.model.tokenizer import load_tokenizer  # noqa: E402
from tests.reference import hf_greedy  # noqa: E402  (the tests' reference loop)

# aiperf's corpus (the side-by-side workload's text), installed with the test dependencies
CORPUS = ROOT / ".venv/aiperf/lib/python3.11/site-packages/aiperf/dataset/generator/assets"
CORPUS = CORPUS / "shakespeare.txt"


def make_prompts(tok, corpus: Path, n: int, seed: int = 0) -> list[list[int]]:
    words = tok.encode(corpus.read_text(), add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        k = rng.randint(32, 512)
        start = rng.randrange(0, len(words) - k)
        text = tok.decode(words[start : start + k])
        if not tok.chat_template:  # a pretrained model: the text, after its BOS
            prompts.append(tok.encode(text))
            continue
        msgs = [{"role": "user", "content": text}]
        chat = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompts.append(tok.encode(chat, add_special_tokens=False))
    return prompts


def engine_run(
    model: str | None, dtype: str, prompts: list[list[int]], max_new: int
) -> tuple[list[list[int]], float]:
    eng = Engine(EngineConfig(model=model, threads=1, dtype=dtype))
    t = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
    return [c.token_ids for c in outs], time.perf_counter() - t


def node_run(
    model: str | None, flags: str, dtype: str, prompts: list[list[int]], max_new: int
) -> tuple[list[list[int]], float]:
    """`pdserve serve FLAGS --dtype DTYPE` as a process; the prompts' greedy continuations."""
    import shlex
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    sys.path.insert(0, str(ROOT / "bench"))
    from loadgen import free_port, start

    port = free_port()
    cmd = ["serve", *shlex.split(flags), "--dtype", dtype, "--port", str(port)]
    cmd += ["--model", model] if model else []
    log = Path(tempfile.mkdtemp(prefix="bench_agreement_")) / f"node_{dtype}.log"
    with start(cmd, port, log, timeout=600) as (url, _):
        t = time.perf_counter()

        def one(ids: list[int]) -> list[int]:
            params = {"max_tokens": max_new, "ignore_eos": True, "temperature": 0}
            r = httpx.post(
                f"{url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=900
            )
            r.raise_for_status()
            return r.json()["token_ids"]

        with ThreadPoolExecutor(16) as ex:
            outs = list(ex.map(one, prompts))
        return outs, time.perf_counter() - t


def compare(got: list[list[int]], ref: list[list[int]]) -> dict:
    firsts = []
    matched = 0
    for g, r in zip(got, ref, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), len(r))
        matched += k
        if k < len(r):
            firsts.append(k)
    return {
        "identical": len(got) - len(firsts),
        "n": len(got),
        "share": matched / sum(len(r) for r in ref),
        "firsts": sorted(firsts),
    }


def row(name: str, c: dict) -> str:
    f = c["firsts"]
    where = f"min {f[0]}, median {statistics.median(f):g}" if f else "none"
    return f"| {name} | {c['identical']} / {c['n']} | {c['share']:.1%} | {where} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--model", default=None, help="a known name or path (default: SmolLM2)")
    ap.add_argument("--node-args", default="", help="also a `pdserve serve` node with these flags")
    ap.add_argument("--no-engine", action="store_true", help="leave the offline engine out")
    ap.add_argument("--out", default=str(ROOT / "bench/results/agreement.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    prompts = make_prompts(tok, args.corpus, args.prompts)
    runs = {}
    for dtype in ("bfloat16", "float32"):
        if not args.no_engine:
            runs[f"engine {dtype}"], secs = engine_run(args.model, dtype, prompts, args.max_tokens)
            print(f"engine {dtype}: {secs:.1f} s", flush=True)
        if args.node_args:
            got, secs = node_run(args.model, args.node_args, dtype, prompts, args.max_tokens)
            runs[f"node {dtype}"] = got
            print(f"node {dtype}: {secs:.1f} s", flush=True)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    runs["transformers float32"] = hf_greedy(hf, prompts, args.max_tokens)
    runs["transformers bfloat16"] = hf_greedy(hf.to(torch.bfloat16), prompts, args.max_tokens)
    pairs = [
        (f"{run} {dtype}", f"transformers {ref}")
        for run in ("engine", "node")
        for dtype, ref in (
            ("float32", "float32"),
            ("bfloat16", "bfloat16"),
            ("bfloat16", "float32"),
        )
    ] + [("transformers bfloat16", "transformers float32")]
    rows = [row(f"{a} / {b}", compare(runs[a], runs[b])) for a, b in pairs if a in runs]
    node = f" --node-args '{args.node_args}'" if args.node_args else ""
    lens = [len(p) for p in prompts]
    lines = [
        "# Greedy agreement with transformers",
        "",
        f"`bench/bench_agreement.py --prompts {args.prompts} --max-tokens {args.max_tokens}"
        f"{' --model ' + args.model if args.model else ''}{node}"
        f"{' --no-engine' if args.no_engine else ''}`, "
        f"{platform.machine()}, torch {torch.__version__}, bf16 units: "
        f"{'yes' if cpu_has_native_bf16() else 'no'}, {path.name} (the GGUF, dequantized), "
        f"{len(prompts)} {'chat ' if tok.chat_template else 'text '}prompts of "
        f"{min(lens)}-{max(lens)} tokens, {args.max_tokens} greedy tokens each, EOS not stopping.",
        "",
        "| run / reference | identical continuations | reference tokens matched before the "
        "first difference | first difference at token |",
        "|---|---:|---:|---|",
        *rows,
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
