"""Plot one side_by_side.sh run: output tok/s against concurrency, and TTFT / ITL p50 and p99, for
vLLM and every pdserve system in OUT_DIR (aiperf's profile_export_aiperf.json per level).
Usage: plot_side_by_side.py OUT_DIR PNG   (needs matplotlib: the project .venv has it)"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(out: str, system: str, metric: str, stat: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for c in (1, 8, 32):
        p = os.path.join(out, system, f"c{c}", "profile_export_aiperf.json")
        if os.path.exists(p):
            xs.append(c)
            with open(p) as f:
                ys.append(json.load(f)[metric][stat])
    return xs, ys


def main() -> int:
    out, png = sys.argv[1], sys.argv[2]
    systems = sorted(s for s in os.listdir(out) if os.path.isdir(os.path.join(out, s)))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("output_token_throughput", "avg", "output tok/s", False),
        ("time_to_first_token", "p50", "TTFT (ms), p50 solid / p99 dashed", True),
        ("inter_token_latency", "p50", "ITL (ms), p50 solid / p99 dashed", True),
    ]
    for ax, (metric, stat, title, with_p99) in zip(axes, panels, strict=True):
        for s in systems:
            xs, ys = series(out, s, metric, stat)
            if not xs:
                continue
            (line,) = ax.plot(xs, ys, marker="o", label=s)
            if with_p99:
                ax.plot(
                    *series(out, s, metric, "p99"),
                    marker="x",
                    linestyle="--",
                    color=line.get_color(),
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 8, 32], ["1", "8", "32"])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        if with_p99:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
