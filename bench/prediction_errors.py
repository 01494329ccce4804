"""The router's latency-model errors from saved `/metrics` text (side_by_side.sh keeps each pdserve
router's as OUT/<system>-router-metrics.txt): per route path, the attempts and the histogram buckets
holding the p50 and p90 of predicted over measured TTFT (dispatch to first token).

    python bench/prediction_errors.py OUT/pd-router-metrics.txt [...]
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

NAME = "pdserve_router_ttft_prediction_ratio_bucket"
LINE = re.compile(NAME + r'\{le="([^"]+)",path="([^"]+)"\} (\S+)')


def buckets(text: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out[m[2]].append((float(m[1]), float(m[3])))
    return {path: sorted(b) for path, b in out.items()}


def quantile_bucket(cum: list[tuple[float, float]], q: float) -> str:
    """The bucket (lo, hi] where the q-quantile falls."""
    total, lo = cum[-1][1], 0.0
    for le, count in cum:
        if count >= q * total:
            return f"({lo:g}, {le:g}]"
        lo = le
    return f"> {lo:g}"


def main(paths: list[str]) -> None:
    print("| run | path | attempts | p50 in | p90 in |\n|---|---|---:|---|---|")
    for p in paths:
        with open(p) as f:
            found = buckets(f.read())
        for path, cum in found.items():
            if cum and cum[-1][1]:
                row = [p, path, f"{cum[-1][1]:.0f}"]
                row += [quantile_bucket(cum, 0.5), quantile_bucket(cum, 0.9)]
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
