"""A rank whose front dies while the rank is still starting does not outlive it. Ranks are forked
by a rank zygote (infra/zygote.py), not by their front: a forked rank watches its front through a
pidfd, and dies with its zygote (parent-death signal). Found, before the zygote, when a `pdserve up`
stopped during start-up left four PP 2 ranks running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
from cluster import ROOT, group_alive

from pdserve.infra.zygote import ENV

# A front in miniature: it starts one rank the way every node does (runtime/serve.py RankSet),
# with front links nobody serves, then dies, with no cleanup: at once (the zygote may not have
# forked yet) or once the zygote has forked the rank (reading its pid waits for that).
FRONT = """
import os, sys
from pdserve.runtime.rank_spec import RankSpec
from pdserve.runtime.serve import RankSet
tmp, model, after_fork = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
spec = RankSpec(model=model, engine={}, pp_size=1, pp_rank=0, dist_init="",
                req_addr=f"ipc://{tmp}/req", evt_addr=f"ipc://{tmp}/evt")
ranks = RankSet([spec], lambda why: None)
if after_fork:
    pid = ranks.procs[0].pid
    print("rank", pid, os.getpgid(pid) if pid else -1, flush=True)
os._exit(0)
"""


@pytest.mark.parametrize(
    "shared,after_fork",
    [(True, True), (True, False), (False, True)],
    ids=["shared-zygote-after-fork", "shared-zygote-at-once", "own-zygote"],
)
def test_a_rank_outlives_no_front_that_died_while_it_started(tiny6, tmp_path, shared, after_fork):
    env = dict(os.environ)
    if not shared:
        env.pop(ENV)  # the front starts its own zygote, which dies with it
    out = tmp_path / "front.out"  # a file, not a pipe: the rank writes to it too
    with open(out, "w") as f:
        front = subprocess.Popen(
            [sys.executable, "-c", FRONT, str(tmp_path), str(tiny6), "1" if after_fork else "0"],
            cwd=ROOT,
            env=env,
            stdout=f,
            process_group=0,  # the zygote's children join it: found, and stopped, through it
        )
    try:
        assert front.wait(timeout=120) == 0
        if after_fork:  # forked, and in the front's group (the zygote is not) before its pid came
            _, pid, pgid = out.read_text().split()
            assert int(pid) > 0 and int(pgid) == front.pid, out.read_text()
        left = group_alive(front.pid, wait_s=30)
        assert not left, f"process(es) {left} outlived the front that started them"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(front.pid, signal.SIGKILL)
