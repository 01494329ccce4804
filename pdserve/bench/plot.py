"""An optional PNG of a sweep: TTFT and ITL percentiles, and throughput, against the load."""

from __future__ import annotations

from pdserve.bench.workload import BenchError

_INSTALL = "pip install 'pdserve[bench]'"


def require_matplotlib() -> None:
    """Fails before any request is sent, so a long run is not lost for want of a plot library."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError(
            f"--plot needs matplotlib, which is not installed; install it with: {_INSTALL}"
        ) from None


def write_plot(path: str, summaries: list[dict], title: str) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "concurrency" in summaries[0]["load"]:
        xname, xs = "concurrency", [s["load"]["concurrency"] for s in summaries]
    else:
        xname, xs = "request rate (req/s)", [s["load"]["request_rate"] for s in summaries]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "itl_ms", "ITL (ms)")):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [s[key][q] for s in summaries]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], style, label=q)
        ax.set_title(name)
        ax.set_xlabel(xname)
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[2]
    ax.plot(
        xs,
        [s["output_token_throughput"] for s in summaries],
        "o-",
        color="C0",
        label="output tok/s",
    )
    ax.set_ylabel("output tokens/s", color="C0")
    ax.set_xlabel(xname)
    ax.grid(alpha=0.3)
    rq = ax.twinx()
    rq.plot(xs, [s["request_throughput"] for s in summaries], "s--", color="C1", label="requests/s")
    rq.plot(xs, [s["goodput"] for s in summaries], "^:", color="C2", label="goodput (req/s)")
    rq.set_ylabel("requests/s", color="C1")
    lines = ax.get_legend_handles_labels()
    more = rq.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left")
    ax.set_title("throughput")
    for a in axes:
        a.set_xticks(xs)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
