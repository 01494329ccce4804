"""The soak's verdict per process (RSS growth and fds after the warm-up, alive to the end) and its
markdown report (bench/soak.py)."""

from __future__ import annotations

from soak_procs import ProcSeries


def judge(
    procs: dict[int, ProcSeries], base_t: float, end_t: float, rss_pct: float, fd_slack: int
) -> list[dict]:
    rows = []
    for s in sorted(procs.values(), key=lambda s: s.name):
        base = next((i for i, t in enumerate(s.t) if t >= base_t), None)
        alive = s.gone_at is None and s.t and s.t[-1] >= end_t
        row = {
            "name": s.name,
            "pid": s.pid,
            "rss_start_mib": s.rss_kib[0] / 1024,
            "rss_end_mib": s.rss_kib[-1] / 1024,
            "rss_max_mib": max(s.rss_kib) / 1024,
            "fds_start": s.fds[0],
            "fds_end": s.fds[-1],
            "fds_max": max(s.fds),
            "alive": bool(alive),
        }
        problems = [] if alive else ["exited during the soak"]
        if base is None or base == len(s.t) - 1:
            problems.append("no sample after the warm-up")
        else:
            row["rss_base_mib"], row["fds_base"] = s.rss_kib[base] / 1024, s.fds[base]
            growth = 100.0 * (s.rss_kib[-1] - s.rss_kib[base]) / s.rss_kib[base]
            row["rss_growth_pct"] = round(growth, 1)
            if growth > rss_pct:
                problems.append(f"RSS grew {growth:.1f} % after the warm-up (limit {rss_pct:g} %)")
            if s.fds[-1] > s.fds[base] + fd_slack:
                problems.append(
                    f"fds {s.fds[base]} -> {s.fds[-1]} after the warm-up (slack {fd_slack})"
                )
        row["ok"], row["problems"] = not problems, problems
        rows.append(row)
    return rows


def markdown(report: dict) -> str:
    a, load = report["args"], report["load"]
    lines = [
        f"# Soak: {a['duration']:.0f} s on {report['model']}",
        "",
        f"{report['date']}, {report['host']}, prefill PP {a['prefill_pp']} / decode PP "
        f"{a['decode_pp']}, concurrency {a['concurrency']}, max_tokens <= {a['max_tokens']}, "
        f"{a['cancel_fraction'] * 100:.0f} % cancelled by the client; load average at the end "
        f"{report['loadavg_end']}.",
        "",
        f"Requests: {load['sent']} sent, {load['completed']} completed, "
        f"{load['cancelled']} cancelled, {load['errors']} errors; {load['tokens']} streamed "
        f"chunks. Baseline: idle after {a['warmup']:.0f} s of load; end: idle after the rest. "
        f"Limits: RSS growth <= {a['rss_growth_pct']:g} %, fds <= baseline + {a['fd_slack']}.",
        "",
        "| process | RSS start MiB | RSS baseline | RSS end | RSS max | growth % | fds start | fds "
        "baseline | fds end | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["processes"]:
        verdict = "ok" if r["ok"] else "FAIL: " + "; ".join(r["problems"])
        lines.append(
            f"| {r['name']} | {r['rss_start_mib']:.0f} | {r.get('rss_base_mib', float('nan')):.0f} "
            f"| {r['rss_end_mib']:.0f} | {r['rss_max_mib']:.0f} | {r.get('rss_growth_pct', 'n/a')} "
            f"| {r['fds_start']} | {r.get('fds_base', 'n/a')} | {r['fds_end']} | {verdict} |"
        )
    lines += [
        "",
        f"**{'PASS' if report['passed'] else 'FAIL'}**"
        + ("" if not report["problems"] else ": " + "; ".join(report["problems"])),
        "",
    ]
    return "\n".join(lines)
