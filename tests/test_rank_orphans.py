"""A rank whose front dies while the rank is still starting does not outlive it. A rank sets its
parent-death signal only after its imports (torch: seconds), so a front killed before then sends
no signal; the rank learns its parent from the front (infra/procs.child_env) and exits when that
parent is gone. Found when a `pdserve up` stopped during start-up left four PP 2 ranks running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from cluster import ROOT, group_alive

# A front in miniature: it starts one rank the way every node does (runtime/serve.py RankSet),
# with front links nobody serves, then dies at once, with no cleanup, while the rank imports.
FRONT = """
import os, sys
from runtime.rank_spec import RankSpec
from runtime.serve import RankSet
tmp, model = sys.argv[1], sys.argv[2]
spec = RankSpec(model=model, engine={}, pp_size=1, pp_rank=0, dist_init="",
                req_addr=f"ipc://{tmp}/req", evt_addr=f"ipc://{tmp}/evt")
RankSet([spec], lambda why: None)
os._exit(0)
"""


def test_a_rank_outlives_no_front_that_died_while_it_started(tiny6, tmp_path):
    front = subprocess.Popen(
        [sys.executable, "-c", FRONT, str(tmp_path), str(tiny6)],
        cwd=ROOT,
        start_new_session=True,  # the rank stays in this group: found, and stopped, through it
    )
    try:
        assert front.wait(timeout=60) == 0
        left = group_alive(front.pid, wait_s=60)  # a rank imports in seconds, then checks
        assert not left, f"rank process(es) {left} outlived the front that started them"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(front.pid, signal.SIGKILL)
