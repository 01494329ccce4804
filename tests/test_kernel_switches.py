"""The kernel switches (engine/kernels/switches.py): settings, not environment variables. Their
flags parse into EngineConfig.kernels, a rank built from its spec and an in-process engine make
them the process's before their model loads, the kernel modules follow the current ones (their
cached decisions made again when they change), and "why is it off" names the flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import fields

import pytest

from pdserve.engine import sampling
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels import layer_ops, paged_attention, switches
from pdserve.engine.kernels.switches import KernelSwitches
from pdserve.infra.config_flags import add_flags, config_from_args
from pdserve.runtime.rank.process import build_rank
from pdserve.runtime.rank_spec import RankSpec

NINE = (
    "paged_attention",
    "extend_attention",
    "decode_stack",
    "layer_ops",
    "sampling",
    "packed_weights",
    "packed_bf16",
    "bf16_linear",
    "spare_core",
)


def test_one_switch_per_kernel_with_its_flag():
    assert tuple(f.name for f in fields(KernelSwitches)) == NINE
    default = KernelSwitches()
    assert switches.current() == default
    for name in NINE:
        assert switches.flag(name) == "--kernel-" + name.replace("_", "-")
        assert switches.why_off(name) == (
            "off unless --kernel-packed-bf16" if name == "packed_bf16" else ""
        )
    assert not default.packed_bf16  # the one opt-in
    assert all(getattr(default, n) for n in NINE if n != "packed_bf16")
    with pytest.raises(KeyError):
        switches.flag("nonsense")


def test_the_flags_parse_into_the_engine_config():
    ap = argparse.ArgumentParser()
    add_flags(ap, EngineConfig)
    args = ap.parse_args(["--no-kernel-paged-attention", "--kernel-packed-bf16"])
    cfg = config_from_args(EngineConfig, args)
    assert cfg.kernels == KernelSwitches(paged_attention=False, packed_bf16=True)
    # and they cross to a rank process in its spec's JSON
    again = EngineConfig.from_kwargs(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again.kernels == cfg.kernels


def test_why_off_names_the_flag(kernel_switches):
    kernel_switches(**dict.fromkeys(NINE, False))
    for name in NINE:
        want = f"switched off: --no-kernel-{name.replace('_', '-')}"
        if name == "packed_bf16":
            want = "off unless --kernel-packed-bf16"
        assert switches.why_off(name) == want


def test_use_drops_the_cached_decisions_and_using_restores(kernel_switches):
    assert layer_ops.load() and sampling.kernel_on()  # cached now
    calls = []
    forget = switches.on_change(lambda: calls.append(switches.current()))
    try:
        off = KernelSwitches(layer_ops=False, sampling=False)
        with switches.using(off):
            assert calls == [off]
            assert not layer_ops.load() and not sampling.kernel_on()
            assert layer_ops.why_not() == "switched off: --no-kernel-layer-ops"
            assert sampling.why_kernel_off() == "switched off: --no-kernel-sampling"
            switches.use(off)  # the same switches again: nothing to forget
            assert calls == [off]
        assert calls == [off, KernelSwitches()]
        assert layer_ops.load() and sampling.kernel_on()
    finally:
        switches._forgets.remove(forget)
    with pytest.raises(TypeError):
        switches.use({"layer_ops": False})  # type: ignore[arg-type]


def test_a_rank_makes_its_specs_switches_the_processes(tiny_model, kernel_switches):
    """`build_rank` (a rank process, and the tests' in-process ranks): the spec's switches are the
    process's before its slice loads, so the slice gathers its decode pages."""
    kernels = KernelSwitches(paged_attention=False, layer_ops=False)
    engine = {
        "page_size": 4,
        "chunk_size": 16,
        "max_batch_tokens": 64,
        "max_total_tokens": 256,
        "threads": 1,
        "dtype": "float32",
        "kernels": dataclasses.asdict(kernels),
    }
    spec = RankSpec(model=str(tiny_model), engine=engine, pp_size=1, pp_rank=0, dist_init="")
    parts = build_rank(spec)
    assert parts.cfg.kernels == kernels and switches.current() == kernels
    assert parts.runner.model._in_place is False
    assert paged_attention.why_not() == "switched off: --no-kernel-paged-attention"
    assert not layer_ops.load()
