"""Who used the host's cores while aiperf measured: the client, the server, anything else.

The side-by-side runs pin the client to core 1 and both servers compute on core 0, so how much of
core 1 the client leaves is the most a server can gain from it (docs/PERFORMANCE.md, #16's goals).

  cpu_share.py record OUT.jsonl [SECONDS]   samples /proc every 0.5 s until SIGTERM or SECONDS
                                            (default 3600)
  cpu_share.py summarize OUT.jsonl RUN_DIR [RUN_DIR...]
      one markdown row per aiperf level (RUN_DIR/cN/profile_export_aiperf.json), over the window
      aiperf reports (start_time..end_time, warm-up excluded): each core's busy share (/proc/stat)
      and each kind of process's CPU in cores (utime + stime): client (aiperf), server (the
      project's processes or vLLM's), other.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
PERIOD_S = 0.5


def cores() -> dict[str, list[int]]:
    with open("/proc/stat") as f:
        return {
            p[0]: [int(v) for v in p[1:]]
            for p in (line.split() for line in f)
            if p[0].startswith("cpu") and p[0] != "cpu"
        }


def kind(cmdline: str) -> str:
    if "cpu_share.py" in cmdline:  # this sampler
        return "other"
    if "aiperf" in cmdline:
        return "client"
    if "pdserve" in cmdline or "vllm" in cmdline.lower() or "/.venv/" in cmdline:
        return "server"
    return "other"


def processes() -> dict[str, list]:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone between listdir and open
            continue
        out[pid] = [int(fields[11]) + int(fields[12]), kind(cmd)]  # utime + stime (ticks), kind
    return out


def record(path: str, seconds: float) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    deadline = time.monotonic() + seconds
    with open(path, "w") as f:
        while not stop and time.monotonic() < deadline:
            f.write(json.dumps({"t": time.time(), "cores": cores(), "procs": processes()}) + "\n")
            f.flush()
            time.sleep(PERIOD_S)


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def window(samples: list[dict], start: float, end: float) -> dict[str, float]:
    """Cores used over [start, end], from the samples that bracket it (a process that starts or
    ends inside counts from 0 or to its last sample)."""
    inside = [s for s in samples if start <= s["t"] <= end]
    if len(inside) < 2:
        return {}
    a, b = inside[0], inside[-1]
    wall = b["t"] - a["t"]
    row: dict[str, float] = {"wall_s": wall}
    for cpu in sorted(b["cores"]):
        d = [y - x for x, y in zip(a["cores"][cpu], b["cores"][cpu], strict=True)]
        row[f"{cpu} busy"] = 1 - (d[3] + d[4]) / sum(d) if sum(d) else 0.0
    last: dict[str, list] = {}
    first: dict[str, int] = {}
    for s in inside:
        for pid, (ticks, k) in s["procs"].items():
            first.setdefault(pid, ticks if s is a else 0)
            last[pid] = [ticks, k]
    for k in ("client", "server", "other"):
        used = sum(t - first[pid] for pid, (t, kk) in last.items() if kk == k) / TICK
        row[k] = used / wall
    return row


def summarize(path: str, runs: list[str]) -> None:
    samples = load(path)
    print(
        "| run | conc | window s | core 0 busy | core 1 busy | client (cores) | server (cores) "
        "| other (cores) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        for c in (1, 8, 32):
            p = os.path.join(run, f"c{c}", "profile_export_aiperf.json")
            if not os.path.exists(p):
                continue
            with open(p) as f:
                d = json.load(f)
            # aiperf writes local wall-clock times without a zone
            start, end = (
                datetime.datetime.fromisoformat(d[k]).timestamp()
                for k in ("start_time", "end_time")
            )
            r = window(samples, start, end)
            if not r:
                continue
            print(
                f"| {os.path.basename(run.rstrip('/'))} | {c} | {r['wall_s']:.0f} | "
                f"{r.get('cpu0 busy', 0):.0%} | {r.get('cpu1 busy', 0):.0%} | "
                f"{r['client']:.2f} | {r['server']:.2f} | {r['other']:.2f} |"
            )


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        record(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 3600.0)
    elif len(sys.argv) >= 4 and sys.argv[1] == "summarize":
        summarize(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
