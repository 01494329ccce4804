"""The router's prefix tree (pdserve/router/routing/prefix_tree.py) against the character radix tree
it replaced (`--base`, a git revision whose pdserve/router/routing/policies.py holds PrefixTree):
one walk of a new 1M-character prompt, and the four walks a PD request makes of one prompt.

    .venv/bin/python bench/bench_prefix_tree.py [--base fae5c49] [--chars 1000000]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.router.routing.prefix_tree import PrefixTree  # noqa: E402


def old_tree(rev: str):
    src = subprocess.run(
        ["git", "show", f"{rev}:pdserve/router/routing/policies.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "old_policies.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_policies", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PrefixTree


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="fae5c49")
    ap.add_argument("--chars", type=int, default=1_000_000)
    args = ap.parse_args()
    rng = random.Random(1)
    text = "".join(rng.choice("abcdefghij ") for _ in range(args.chars))
    prompt = text[: args.chars * 9 // 10] + "zzz"
    for name, tree_cls in (("before", old_tree(args.base)), ("now", PrefixTree)):
        tree = tree_cls(max_chars=10**9)
        tree.insert(text, "w")
        t0 = time.perf_counter()
        for i in range(5):
            tree.match(prompt + str(i))  # a new string each time
        one = (time.perf_counter() - t0) / 5
        t0 = time.perf_counter()
        tree.match(prompt), tree.match(prompt), tree.insert(prompt, "w"), tree.match(prompt)
        four = time.perf_counter() - t0
        print(f"{name}: one walk of a new prompt {one * 1e3:.1f} ms; four of one prompt "
              f"{four * 1e3:.1f} ms ({args.chars:,} characters)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
