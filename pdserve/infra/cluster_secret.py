"""The cluster secret: the one token that the router, every node front and every rank of a cluster
hold, and that every internal endpoint and channel checks.

It reaches a process through its environment (`PDSERVE_INTERNAL_TOKEN`) or a file readable only by
its owner (`PDSERVE_INTERNAL_TOKEN_FILE`), never through a command line, which any local user can
read with `ps`. Children inherit the environment, so rank processes need nothing passed to them.
"""

from __future__ import annotations

import os
import stat

ENV = "PDSERVE_INTERNAL_TOKEN"
FILE_ENV = "PDSERVE_INTERNAL_TOKEN_FILE"


def cluster_secret() -> str | None:
    """The secret from the environment, else from the file it names; None when neither is set."""
    token = os.environ.get(ENV)
    if token:
        return token
    path = os.environ.get(FILE_ENV)
    if not path:
        return None
    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SystemExit(
            f"{FILE_ENV}={path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"chmod 600 it"
        )
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    return token or None
