"""Which of pdserve's own CPU kernels a process uses: settings of the engine (`--no-kernel-*`
flags, EngineConfig.kernels), each on by default where the kernel library builds and the CPU can
run it (`packed_bf16` is opt-in: `--kernel-packed-bf16`). A kernel switched off leaves its work to
the torch path it replaces.

The kernel modules read one process-wide `current()`; an engine makes its config's the current
ones with `use(cfg.kernels)` before it loads its model (engine/engine.py, runtime/rank/process.py),
since what a switch decides is mostly decided at load (which weights are packed, which attention
a slice runs) and kept. A process therefore serves with one set of switches: the last engine
built in it sets them. Tests switch a kernel off for a while with `using(...)`.

No torch here: the fronts build engine configs too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

from pdserve.infra.config_flags import SETTING, setting


@dataclass(frozen=True)
class KernelSwitches:
    paged_attention: bool = setting(
        True,
        flag="--kernel-paged-attention",
        help="decode and extend attention read the KV pool's pages in place "
        "(engine/kernels/paged_attention.py)",
    )
    extend_attention: bool = setting(
        True,
        flag="--kernel-extend-attention",
        help="the paged kernel for prefill chunks too (off: chunks gather their pages)",
    )
    decode_stack: bool = setting(
        True,
        flag="--kernel-decode-stack",
        help="a decode step's layers in one C++ call (engine/kernels/decode_stack.py)",
    )
    layer_ops: bool = setting(
        True,
        flag="--kernel-layer-ops",
        help="fused RMSNorm, rotary and SiLU-multiply (engine/kernels/layer_ops.py)",
    )
    sampling: bool = setting(
        True,
        flag="--kernel-sampling",
        help="greedy and temperature-only rows choose their token in one C++ call per batch "
        "(engine/sampling.py)",
    )
    packed_weights: bool = setting(
        True,
        flag="--kernel-packed-weights",
        help="small batches multiply GGUF weights from their packed block codes "
        "(engine/kernels/packed_linear.py)",
    )
    packed_bf16: bool = setting(
        False,
        flag="--kernel-packed-bf16",
        help="bf16 models pack their weights too (opt-in: engine/kernels/packed_linear.py)",
    )
    bf16_linear: bool = setting(
        True,
        flag="--kernel-bf16-linear",
        help="bf16 small-batch matmuls in C++ (engine/kernels/bf16_linear.py)",
    )
    spare_core: bool = setting(
        True,
        flag="--kernel-spare-core",
        help="a helper thread on the node's I/O core computes shares of prefill matmuls "
        "(engine/kernels/spare_core.py)",
    )


_current = KernelSwitches()
_lock = threading.Lock()
_forgets: list[Callable[[], None]] = []


def current() -> KernelSwitches:
    """The switches this process's kernels follow (the defaults until `use` names others)."""
    return _current


def use(switches: KernelSwitches) -> None:
    """Makes `switches` the current ones. Where they differ from the last, every decision a kernel
    module cached (`on_change`) is dropped, to be made again under these; what a model already
    decided at its load (packed weights, its attention path) stays as it is."""
    global _current
    if not isinstance(switches, KernelSwitches):
        raise TypeError(f"kernel switches are a KernelSwitches, not {type(switches).__name__}")
    with _lock:
        if switches == _current:
            return
        _current = switches
        forgets = list(_forgets)
    for forget in forgets:
        forget()


@contextlib.contextmanager
def using(switches: KernelSwitches) -> Iterator[KernelSwitches]:
    """`use(switches)` for the block, then the switches before it again."""
    before = current()
    use(switches)
    try:
        yield switches
    finally:
        use(before)


def on_change(forget: Callable[[], None]) -> Callable[[], None]:
    """Registers `forget` (it drops a module's cached on/off decision) to run whenever `use`
    changes the switches; returns it, so it can decorate."""
    with _lock:
        _forgets.append(forget)
    return forget


def flag(name: str) -> str:
    """The flag that turns switch `name` on (`--kernel-paged-attention`); `--no-` + that turns a
    default-on one off."""
    for f in fields(KernelSwitches):
        if f.name == name:
            return f.metadata[SETTING].names(name)[0]
    raise KeyError(f"no kernel switch {name!r}")


def why_off(name: str) -> str:
    """Why switch `name` leaves its kernel off in this process, or "" where it is on: the flag a
    node would have been given ("switched off: --no-kernel-paged-attention")."""
    if getattr(current(), name):
        return ""
    on = flag(name)
    default = getattr(KernelSwitches(), name)
    return f"switched off: --no-{on[2:]}" if default else f"off unless {on}"
