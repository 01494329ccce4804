"""bench/peers/cpu_share.py: the CPU each kind of process used over an aiperf level's window, from
/proc samples (the side-by-side runs' measure of what the client leaves of the host)."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("cpu_share", ROOT / "bench/peers/cpu_share.py")
cpu_share = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_share)
TICK = cpu_share.TICK


def sample(t, busy0, idle0, procs):
    # /proc/stat fields: user nice system idle iowait irq softirq steal
    return {"t": t, "cores": {"cpu0": [busy0, 0, 0, idle0, 0, 0, 0, 0]}, "procs": procs}


def test_kinds():
    assert cpu_share.kind("/x/client-venv/bin/python /x/aiperf profile -m m") == "client"
    assert cpu_share.kind("aiperf timing_manager") == "client"
    assert cpu_share.kind("/work/.venv/bin/pdserve serve --pp 1") == "server"
    assert cpu_share.kind("VLLM::EngineCore") == "server"
    assert cpu_share.kind("python /x/pdserve-peers/bench/peers/cpu_share.py record o") == "other"
    assert cpu_share.kind("sshd: root") == "other"


def test_window_counts_only_the_samples_inside_and_processes_born_inside():
    s = [
        sample(0.0, 0, 0, {"1": [0, "client"]}),  # before the window: ignored
        sample(10.0, 100, 100, {"1": [5 * TICK, "client"], "2": [1 * TICK, "server"]}),
        # the server process 3 starts inside the window: it counts from 0
        sample(12.0, 250, 150, {"1": [6 * TICK, "client"], "3": [1 * TICK, "server"]}),
        sample(14.0, 400, 200, {"1": [7 * TICK, "client"], "2": [3 * TICK, "server"]}),
        sample(20.0, 900, 300, {"1": [20 * TICK, "client"]}),  # after: ignored
    ]
    r = cpu_share.window(s, 9.0, 15.0)
    assert r["wall_s"] == 4.0
    assert abs(r["cpu0 busy"] - 300 / 400) < 1e-9
    assert abs(r["client"] - 2 / 4) < 1e-9  # 7 - 5 s of CPU over 4 s
    assert abs(r["server"] - (2 + 1) / 4) < 1e-9  # pid 2: 3 - 1; pid 3: 1 - 0 (last seen)
    assert r["other"] == 0
    assert cpu_share.window(s, 10.5, 11.5) == {}  # fewer than two samples: nothing to say


def test_record_sees_a_busy_process(tmp_path):
    """The recorder, run as the script runs it, attributes a spinning child's CPU to it."""
    out = tmp_path / "s.jsonl"
    rec = subprocess.Popen(
        [sys.executable, str(ROOT / "bench/peers/cpu_share.py"), "record", str(out), "60"]
    )
    # the child spins until it has used 1.5 s of CPU, says so, then sleeps until it is killed, so
    # the samples taken after its word all hold its full CPU time, however loaded the host is
    spin = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nwhile time.process_time() < 1.5: pass\nprint('spun', flush=True)\n"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert spin.stdout.readline().strip() == "spun"
        t = time.monotonic()
        seen = 0.0
        while time.monotonic() - t < 30 and seen < 1.4:
            time.sleep(cpu_share.PERIOD_S)
            samples = cpu_share.load(str(out)) if out.exists() else []
            seen = max((sm["procs"].get(str(spin.pid), [0])[0] for sm in samples), default=0)
            seen /= TICK
    finally:
        spin.kill()
        spin.wait(timeout=10)
        rec.terminate()
        rec.wait(timeout=10)
    assert seen >= 1.4, seen  # 1.5 s of CPU, in clock ticks
    assert rec.returncode == 0  # SIGTERM ends the recording cleanly
