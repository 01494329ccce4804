"""pdserve's C++ CPU kernels (`engine/kernels/csrc/*.cpp`), built for this machine with
`torch.utils.cpp_extension` into one library, and loaded by the ranks that use them:
decode and prefill attention over the paged pool (engine/kernels/paged_attention.py), matmuls
against packed quantized weights (engine/kernels/packed_linear.py) and against blocked bf16 weights
(engine/kernels/bf16_linear.py), the small per-layer ops (engine/kernels/layer_ops.py), a bf16
slice's decode forward in one call (engine/kernels/decode_stack.py) and the choice of a token
per row of logits (engine/sampling.py).

Built by `scripts/setup.sh` (`python -m pdserve.engine.kernels.cpu_kernels build`), once per source,
torch version and CPU (it is compiled with -march=native), under `PDSERVE_EXT_DIR` (default
~/.cache/pdserve/ext). A rank only loads the built library; where none is built it builds it first,
in a child process with a time limit, and where that fails it serves with the torch paths and logs
why. Other devices never load it (the same torch code runs on CUDA).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))  # part of the build's key, not compiled on their own
NAME = "pdserve_cpu_kernels"
# -fopenmp: at::parallel_for splits a kernel's tasks over the rank's threads through the OpenMP
# runtime torch already loaded (libgomp.so.1); without it, the loop runs on one thread
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-Wall"]
LDFLAGS = ["-fopenmp"]
# More flags for this build, from CI's strict and sanitizer builds (Makefile `kernels-strict`,
# `test-sanitizers`): "-Wextra -Werror", or "-fsanitize=address,undefined ...", which the link
# gets too. Part of the build's key, so such a build never stands in for the normal one.
FLAGS_ENV = "PDSERVE_KERNEL_CFLAGS"


def cflags() -> list[str]:
    return CFLAGS + os.environ.get(FLAGS_ENV, "").split()


def ldflags() -> list[str]:
    return LDFLAGS + [f for f in os.environ.get(FLAGS_ENV, "").split() if f.startswith("-fsan")]


# Its own root, not PDSERVE_CACHE_DIR's: the tests give every session a fresh model cache, and
# should load the build setup made, not compile the kernel again per session.
ENV_DIR = "PDSERVE_EXT_DIR"
# A whole compile takes a fraction of it on a 2-core machine and much longer for a sanitizer
# build (-g, instrumented; README, Development): PDSERVE_KERNEL_BUILD_TIMEOUT_S raises it.
ENV_BUILD_TIMEOUT = "PDSERVE_KERNEL_BUILD_TIMEOUT_S"
DEFAULT_BUILD_TIMEOUT_S = 180.0


def build_timeout_s() -> float:
    """The build's time limit: `PDSERVE_KERNEL_BUILD_TIMEOUT_S` (seconds, above 0), else 180 s."""
    raw = os.environ.get(ENV_BUILD_TIMEOUT, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_BUILD_TIMEOUT_S
    except ValueError:
        value = DEFAULT_BUILD_TIMEOUT_S  # load() never raises; a bad value keeps the default
    return value if 0 < value < float("inf") else DEFAULT_BUILD_TIMEOUT_S


_loaded: bool | None = None
_why_not = ""


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature line from /proc/cpuinfo (read once: every weight's copy asks)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where this build of the sources, torch and CPU lives: a new key for any of them, so a
    library built for another CPU (-march=native) or another torch is never loaded."""
    parts = (
        *(s.read_text() for s in SOURCES + HEADERS),
        " ".join(cflags() + ldflags()),
        torch.__version__,
        platform.machine(),
    )
    key = hashlib.sha256("|".join((*parts, cpu_flags())).encode()).hexdigest()[:16]
    root = Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "pdserve" / "ext")
    return root.expanduser().resolve() / f"{NAME}-{key}"


def library_path() -> Path:
    return build_dir() / f"{NAME}.so"


@contextlib.contextmanager
def _build_lock(d: Path, timeout_s: float):
    """Held while a process builds into `d` or checks that a build is whole: an flock, so a
    builder that dies (killed, timed out) releases it with its last descriptor."""
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / "build.flock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another build held {d} for {timeout_s:.0f} s") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def build() -> Path:
    """Compiles the kernels into `build_dir()` (ninja, the C++ compiler) unless it is built;
    returns the library."""
    from torch.utils import cpp_extension

    d, lib = build_dir(), library_path()
    with _build_lock(d, build_timeout_s()):
        if lib.exists():
            return lib
        # torch's own lock file, left by a builder that died: none of ours is alive (we hold
        # the flock), and torch would otherwise wait for it forever
        (d / "lock").unlink(missing_ok=True)
        # pip's ninja sits next to this interpreter, which is not on PATH unless the venv is active
        bindir = str(Path(sys.executable).parent)
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=cflags(),
            extra_ldflags=ldflags(),
            build_directory=str(d),
            is_python_module=False,
            verbose=False,
        )
    return lib


def _build_in_child(d: Path) -> str:
    """Runs `build` in a child process in a session of its own (so a timeout stops its compiler
    too), bounded by `build_timeout_s()`; returns "" or why it failed."""
    limit = build_timeout_s()
    cmd = [sys.executable, "-m", "pdserve.engine.kernels.cpu_kernels", "build"]
    env = {**os.environ, ENV_DIR: str(d.parent)}
    p = subprocess.Popen(
        cmd,
        cwd=str(Path(__file__).resolve().parents[3]),  # the folder holding pdserve/
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return f"building it took over {limit:.0f} s ({ENV_BUILD_TIMEOUT} raises the limit)"
    if p.returncode != 0:
        return "building it failed: " + (err.strip().splitlines() or ["?"])[-1]
    return ""


def load() -> bool:
    """Whether the kernels are ready in this process: loads the built library, building it first
    in a child process (bounded by `build_timeout_s()`) when this machine has none. Once a process;
    `why_not()` says why they are off. Never raises: a kernel that cannot be had is a slower rank,
    not a dead one."""
    global _loaded, _why_not
    if _loaded is not None:
        return _loaded
    _loaded = False
    try:
        d, lib = build_dir(), library_path()
        with _build_lock(d, build_timeout_s()):  # a build in progress is waited for, not read
            built = lib.exists()
        if not built:
            _why_not = _build_in_child(d)
            if _why_not:
                return False
        torch.ops.load_library(str(lib))
    except Exception as e:  # noqa: BLE001  (any failure: serve with the torch paths, say why)
        _why_not = f"{type(e).__name__}: {e}"
        return False
    _loaded = True
    return True


def why_not() -> str:
    return _why_not


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m pdserve.engine.kernels.cpu_kernels build")
    import signal

    # a rank starts this with its stop signals blocked (infra/procs.py exit_on_stop_signals): a
    # blocked mask survives exec, and this process must still stop on SIGTERM
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGHUP})
    print(build())
