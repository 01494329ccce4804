"""One import namespace: an installed pdserve adds only `pdserve` to the top level of
site-packages, so it cannot collide with another distribution's `engine`, `router` or `runtime`."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _repo_top_level_names() -> list[str]:
    """Every name a checkout's root could make importable: its folders and .py files."""
    return sorted(
        p.stem if p.suffix == ".py" else p.name
        for p in ROOT.iterdir()
        if not p.name.startswith(".") and (p.is_dir() or p.suffix == ".py")
    )


def test_the_distribution_declares_one_top_level_name():
    # setuptools writes top_level.txt from the packages it would put in a wheel
    top = importlib.metadata.distribution("pdserve").read_text("top_level.txt")
    assert top is not None and top.split() == ["pdserve"]


def test_only_pdserve_is_importable_outside_the_checkout(tmp_path):
    """From a folder that is not the checkout (as any user of the installed package imports it),
    each of the checkout's top-level names is looked up; only pdserve is found, and from here."""
    names = _repo_top_level_names()
    code = (
        "import importlib.util, json, sys\n"
        "names = json.loads(sys.argv[1])\n"
        "print(json.dumps({n: (s.origin if (s := importlib.util.find_spec(n)) else None)"
        " for n in names}))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code, json.dumps(names)],  # -I: no cwd or PYTHONPATH
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    found = {n: origin for n, origin in json.loads(out).items() if origin}
    assert set(found) == {"pdserve"}, f"importable at the top level: {sorted(found)}"
    assert Path(found["pdserve"]).resolve() == ROOT / "pdserve" / "__init__.py"
