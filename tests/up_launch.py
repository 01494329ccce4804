"""`pdserve up` started without waiting for it, so that a test file can start two clusters (or a
cluster and its transformers reference) at once and wait for each when a test needs it. Like
tests/cluster.py's `pdserve_up`, which this mirrors: the launcher runs in its own process group,
and the whole group is always stopped."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

from cluster import ROOT, kill_group


class Launch:
    """One `pdserve up <args>` process (its output in `log`)."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log = log
        with open(log, "wb") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", "up", *args],
                cwd=ROOT,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ready(self, timeout: float = 240.0) -> subprocess.Popen:
        """Waits until the log says `[up] ready` (within `timeout` seconds); returns the Popen."""
        deadline = time.monotonic() + timeout
        while "[up] ready" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)
        return self.proc

    def stop(self) -> None:
        kill_group(self.proc, grace=20)


@contextlib.contextmanager
def launched(args: list[str], log: Path, env: dict | None = None):
    """A `Launch`, stopped (its whole process group) on the way out."""
    launch = Launch(args, log, env)
    try:
        yield launch
    finally:
        launch.stop()
