"""Tensor parallelism against pipeline parallelism against neither, on a prefill and a decode node
(docs/ARCHITECTURE.md sections 6 and 15): `pdserve up` with SmolLM2-135M-Instruct at its own
dtype, every request disaggregated (the router's conditional disaggregation off), each layout in
turn, the same requests, all in one run.

Layouts: prefill and decode PP 1 x TP 1 (a process each), PP 3 x TP 1, and PP 1 x TP 3 (three
processes a node, six in all on this host's cores; SmolLM2's 3 KV heads take TP 3, not 2).
Requests: seeded random token ids of 100-250 tokens, `--max-tokens` output tokens with
ignore_eos, through the router's POST /generate with `stream: true`, `--concurrency` levels in
turn; output tok/s, TTFT p50/p99 and ITL p50/p99, as ratios to the PP 1 x TP 1 layout of the same
round.

  .venv/bin/python bench/bench_tp_pd.py [--rounds 1] [--requests 32] [--concurrency 8]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
from bench_tp import compare_layouts, measure  # noqa: E402
from cluster import pdserve_up  # noqa: E402

LAYOUTS = {
    "PP 1 x TP 1": ["--prefill-pp", "1", "--decode-pp", "1"],
    "PP 3 x TP 1": ["--prefill-pp", "3", "--decode-pp", "3"],
    "PP 1 x TP 3": ["--prefill-tp", "3", "--decode-tp", "3"],
}
# every request through the pair (tests/test_smollm2_tp.py ALWAYS_PD)
ALWAYS_PD = (
    "--disagg-min-prompt-tokens 0 --disagg-decode-prefix-fraction 2 "
    "--disagg-local-prefill-cost 0 --disagg-fixed-costs true"
)


def run_layout(flags: list[str], prompts, max_new: int, levels: list[int], log: Path) -> dict:
    port = loadgen.free_port()
    with pdserve_up(["--port", str(port), *flags, "--router-args", ALWAYS_PD], log, 600):
        return measure(f"http://127.0.0.1:{port}", prompts, max_new, levels, flags)


def main() -> int:
    return compare_layouts(
        LAYOUTS,
        run_layout,
        {"rounds": 1, "concurrency": "8", "out": str(ROOT / "bench/results/tp_pd.md")},
        "Tensor parallelism vs pipeline parallelism vs neither (a prefill and a decode node)",
        "`pdserve up` (a layout is each node's), SmolLM2-135M-Instruct at its own dtype "
        "(bf16), every request disaggregated",
        with_rate=False,
    )


if __name__ == "__main__":
    sys.exit(main())
