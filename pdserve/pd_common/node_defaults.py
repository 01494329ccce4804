"""Engine defaults that PD nodes set apart from the colocated node's, with the measurement behind
each (bench/results/HISTORY.md, bench/results/side_by_side_icelake.md runs 6 and 7)."""

from __future__ import annotations

import argparse

# New tokens per forward. 512, against the engine's 2048: a prefill iteration then holds one
# 512-token chunk, so a prompt's release vote (and its answer to the router) waits for at most
# that, and a decode step that also prefills a decode-only request carries at most 512 tokens. It
# served more tok/s than 2048 side by side, and matmuls of 512 rows run about as fast per row as
# 2048 (bench/results/side_by_side_icelake.md, bench/results/linear.md).
PD_MAX_BATCH_TOKENS = 512


def set_pd_defaults(ap: argparse.ArgumentParser) -> None:
    ap.set_defaults(max_batch_tokens=PD_MAX_BATCH_TOKENS)
