"""What this build is: the labels of `pdserve_build_info` (router and node fronts)."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version


def build_info() -> dict[str, str]:
    try:
        ours = version("pdserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        ours = "unknown"
    return {"version": ours, "python": platform.python_version()}
