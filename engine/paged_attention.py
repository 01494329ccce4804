"""Decode attention that reads the paged KV pool in place, on the CPU: the C++ kernel in
`engine/csrc/paged_attention.cpp`, built for this machine with `torch.utils.cpp_extension`.

The gather-then-SDPA path (engine/model.py) copies every decode request's KV pages out of the pool
for every layer; at 32 requests of ~350 tokens that copy moves about as many bytes per step as the
weights. The kernel reads each key and value once, where it lies.

Built by `scripts/setup.sh` (`python -m engine.paged_attention build`), once per source, torch
version and CPU (it is compiled with -march=native), under `PDSERVE_EXT_DIR` (default
~/.cache/pdserve/ext). A rank only loads the built library; where none is built it builds it first,
in a child process with a time limit, and where that fails it serves with the gather path and logs
why. `PDSERVE_PAGED_ATTENTION=0` turns the kernel off. Other devices keep the gather path (the same
torch code runs on CUDA).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
NAME = "pdserve_paged_attention"
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd"]
ENV_SWITCH = "PDSERVE_PAGED_ATTENTION"
# Its own root, not PDSERVE_CACHE_DIR's: the tests give every session a fresh model cache, and
# should load the build setup made, not compile the kernel again per session.
ENV_DIR = "PDSERVE_EXT_DIR"
BUILD_TIMEOUT_S = 600.0

_loaded: bool | None = None
_why_not = ""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where this source, torch and CPU's build lives: a new key for any of them, so a library
    built for another CPU (-march=native) or another torch is never loaded."""
    parts = (SOURCE.read_text(), " ".join(CFLAGS), torch.__version__, platform.machine())
    key = hashlib.sha256("|".join((*parts, _cpu_flags())).encode()).hexdigest()[:16]
    root = Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "pdserve" / "ext")
    return root / f"{NAME}-{key}"


def library_path() -> Path:
    return build_dir() / f"{NAME}.so"


def build() -> Path:
    """Compiles the kernel into `build_dir()` (ninja, the C++ compiler); returns the library."""
    from torch.utils import cpp_extension

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    # pip's ninja sits next to this interpreter, which is not on PATH unless the venv is active
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(
        name=NAME,
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        build_directory=str(d),
        is_python_module=False,
        verbose=False,
    )
    return library_path()


def load() -> bool:
    """Whether the kernel is ready in this process: loads the built library, building it first
    in a child process (bounded by BUILD_TIMEOUT_S) when this machine has none. Once per process;
    `why_not()` says why it is off."""
    global _loaded, _why_not
    if _loaded is not None:
        return _loaded
    _loaded = False
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _why_not = f"{ENV_SWITCH}=0"
        return False
    lib = library_path()
    if not lib.exists():
        cmd = [sys.executable, "-m", "engine.paged_attention", "build"]
        root = str(Path(__file__).resolve().parents[1])
        try:
            r = subprocess.run(
                cmd, cwd=root, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            _why_not = f"building it took over {BUILD_TIMEOUT_S:.0f} s"
            return False
        if r.returncode != 0 or not lib.exists():
            _why_not = "building it failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
            return False
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        _why_not = f"loading {lib} failed: {e}"
        return False
    _loaded = True
    return True


def why_not() -> str:
    return _why_not


def decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, heads, head_dim] contiguous; kv a layer's pool view [pages, 2, page_size, kv_heads,
    head_dim]; page_table int64 [B, max_pages]; seq_lens int64 [B] (keys per request).
    Returns [B, heads, head_dim] in q's dtype. Call `load()` first."""
    return torch.ops.pdserve.paged_decode_attention(q, kv, page_table, seq_lens, scale)


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m engine.paged_attention build")
    print(build())
