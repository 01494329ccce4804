"""Who used the host's cores while aiperf measured: the client, the server, anything else.

The side-by-side runs pin the client to core 1 and both servers compute on core 0, so how much of
core 1 the client leaves is the most a server can gain from it (docs/PERFORMANCE.md section 1).

  cpu_share.py record OUT.jsonl [SECONDS]   samples /proc every 0.5 s until SIGTERM or SECONDS
                                            (default 3600)
  cpu_share.py summarize OUT.jsonl RUN_DIR [RUN_DIR...]
      one markdown row per aiperf level (RUN_DIR/cN/profile_export_aiperf.json), over the window
      aiperf reports (start_time..end_time, warm-up excluded): each core's busy share (/proc/stat)
      and the share the hypervisor stole, and each kind of process's CPU in cores (utime +
      stime): client (aiperf), server (pdserve's processes or vLLM's), other (this sampler
      included, about 0.01-0.02 of a core).
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
    # the client venv lives under pdserve-peers: it must be told apart before the "pdserve" test
    # (aiperf's children run there before they retitle themselves "aiperf ...")
    if "aiperf" in cmdline or "/client-venv/" in cmdline:
        return "client"
    if "pdserve" in cmdline or "vllm" in cmdline.lower():
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
    """The samples; a last line cut short (the sampler killed mid-write, or still writing) is
    left out."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


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
        # user nice system idle iowait irq softirq steal (guest time is inside user and nice):
        # time the hypervisor stole is neither busy for us nor idle, and is reported apart
        d = [y - x for x, y in zip(a["cores"][cpu][:8], b["cores"][cpu][:8], strict=True)]
        total = sum(d)
        row[f"{cpu} busy"] = (total - d[3] - d[4] - d[7]) / total if total else 0.0
        row[f"{cpu} steal"] = d[7] / total if total else 0.0
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


def level_dirs(run: str) -> list[tuple[int, str]]:
    """The aiperf levels of one run folder (cN/), by concurrency."""
    out = []
    for name in os.listdir(run) if os.path.isdir(run) else []:
        if name[:1] == "c" and name[1:].isdigit():
            out.append((int(name[1:]), os.path.join(run, name, "profile_export_aiperf.json")))
    return sorted(out)


def summarize(path: str, runs: list[str]) -> None:
    samples = load(path)
    print(
        "| run | conc | window s | core 0 busy | core 1 busy | steal 0 / 1 | client (cores) "
        "| server (cores) | other (cores) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        name = os.path.basename(run.rstrip("/"))
        for c, p in level_dirs(run):
            r: dict[str, float] = {}
            if os.path.exists(p):
                with open(p) as f:
                    d = json.load(f)
                if d.get("start_time") and d.get("end_time"):
                    # aiperf writes local wall-clock times without a zone
                    start, end = (
                        datetime.datetime.fromisoformat(d[k]).timestamp()
                        for k in ("start_time", "end_time")
                    )
                    r = window(samples, start, end)
            if not r:  # no export, no times in it, or no samples over it (the sampler stopped)
                print(f"| {name} | {c} | no samples or times | | | | | | |")
                continue
            print(
                f"| {name} | {c} | {r['wall_s']:.0f} | {r.get('cpu0 busy', 0):.0%} | "
                f"{r.get('cpu1 busy', 0):.0%} | {r.get('cpu0 steal', 0):.0%} / "
                f"{r.get('cpu1 steal', 0):.0%} | {r['client']:.2f} | {r['server']:.2f} | "
                f"{r['other']:.2f} |"
            )


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        record(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 3600.0)
    elif len(sys.argv) >= 4 and sys.argv[1] == "summarize":
        summarize(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
