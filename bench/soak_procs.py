"""The soak's view of a cluster (bench/soak.py): its processes, found by walking /proc from the
launcher's pid, named after their role, and their resident memory (VmRSS) and open file
descriptors sampled over time."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None  # exited while we looked


def process_tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (ppid := parent_of(int(entry))) is not None:
            kids.setdefault(ppid, []).append(int(entry))
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(kids.get(pid, []))
    return seen  # parents before their children


def label(pid: int, names: dict[int, str]) -> str | None:
    """A name for a cluster process: "up", "router", "prefill:PORT front", "prefill:PORT pp1" (a
    rank is named after its node's front, its parent)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    if "pdserve.cli" in argv[:3]:
        cmd = argv[argv.index("pdserve.cli") + 1]
        if cmd in ("prefill", "decode"):
            return f"{cmd}:{argv[argv.index('--port') + 1] if '--port' in argv else '?'} front"
        return cmd
    if "--spec" in argv:
        spec = json.loads(argv[argv.index("--spec") + 1])
        front = names.get(parent_of(pid) or -1, f"{spec.get('role')} ?")
        return f"{front.removesuffix(' front')} pp{spec['pp_rank']}"
    return os.path.basename(argv[0]) if argv else None


def read_proc(pid: int) -> tuple[int, int] | None:
    """(RSS in KiB, open fds) of one process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


@dataclass
class ProcSeries:
    pid: int
    name: str
    t: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    gone_at: float | None = None


class Sampler:
    def __init__(self, root_pid: int):
        self.root = root_pid
        self.t0 = time.monotonic()
        self.procs: dict[int, ProcSeries] = {}

    def sample(self) -> None:
        now = round(time.monotonic() - self.t0, 1)
        pids = process_tree(self.root)
        names = {pid: s.name for pid, s in self.procs.items()}
        for pid in pids:
            got = read_proc(pid)
            if got is None:
                continue
            series = self.procs.get(pid)
            if series is None:
                name = names[pid] = label(pid, names) or f"pid {pid}"
                series = self.procs[pid] = ProcSeries(pid, name)
            series.t.append(now)
            series.rss_kib.append(got[0])
            series.fds.append(got[1])
        for pid, series in self.procs.items():
            if pid not in pids and series.gone_at is None:
                series.gone_at = now
