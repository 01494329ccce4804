"""The command line is generated from the config dataclasses (infra/config_flags.py) and parsed
once, at the edge: every flag has help, every setting's flag lands in its field, vLLM's spellings
mean the same, a bad value or variable is named, and no module past the edges sees argparse."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path

import pytest

from pdserve.decode_node.serve import add_decode_args
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels.switches import KernelSwitches
from pdserve.infra.config_flags import config_from_args
from pdserve.pd_common.node_config import PDNodeConfig
from pdserve.prefill_node.serve import BOOTSTRAP_PORT, add_prefill_args
from pdserve.runtime.node_config import NodeConfig, add_node_flags, node_config
from pdserve.runtime.node_ranks import engine_dict
from pdserve.up_args import UpConfig, add_up_args, parse_up_args

ROOT = Path(__file__).resolve().parent.parent

# Where a command line is parsed: the `pdserve` entry point, its subcommands' edges, and the
# internal entry points that read one JSON argument (a rank's spec, the zygote's socket).
EDGES = {
    "cli.py",
    "launch.py",
    "trace_cmd.py",
    "register_cmd.py",
    "up_args.py",
    "bench/main.py",
    "router/cli.py",
    "infra/config_flags.py",
    "infra/zygote.py",
    "runtime/node_config.py",
    "runtime/rank/process.py",
    "pd_common/node_config.py",
    "prefill_node/serve.py",
    "decode_node/serve.py",
}


def parsers() -> dict[str, argparse.ArgumentParser]:
    from pdserve.cli import _full_parser

    full = _full_parser()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    out = {name: sub.choices[name] for name in ("generate", "serve", "prefill", "decode")}
    out["router"] = sub.choices["router"]
    up = argparse.ArgumentParser()
    add_up_args(up)
    out["up"] = up
    return out


def test_every_flag_has_help():
    for name, ap in parsers().items():
        for action in ap._actions:
            if action.option_strings and action.dest != "help":
                assert (action.help or "").strip(), f"pdserve {name} {action.option_strings}"


def parse(add, argv: list[str]) -> PDNodeConfig:
    return node_config(PDNodeConfig, add(argparse.ArgumentParser()).parse_args(argv))


def test_defaults_are_the_dataclasses_and_each_role_its_own():
    plain = node_config(
        NodeConfig, add_node_flags(argparse.ArgumentParser(), NodeConfig).parse_args([])
    )
    assert plain == NodeConfig()
    pre, dec = parse(add_prefill_args, []), parse(add_decode_args, [])
    assert (pre.port, pre.bootstrap_port, dec.port, dec.bootstrap_port) == (
        30000,
        BOOTSTRAP_PORT,
        30001,
        None,
    )
    # the PD nodes' own batch default (pd_common/node_config.py); everything else as the engine
    assert pre.engine == dataclasses.replace(EngineConfig(), max_batch_tokens=512) == dec.engine


def test_each_flag_lands_in_its_field_and_vllm_spellings_mean_the_same():
    ours = parse(
        add_decode_args,
        ["--max-running", "7", "--max-context", "999", "--page-size", "32", "--pp", "2"]
        + ["--max-batch-tokens", "1024", "--no-prefix-cache", "--no-kernel-decode-stack"],
    )
    vllm = parse(
        add_decode_args,
        ["--max-num-seqs", "7", "--max-model-len", "999", "--block-size", "32"]
        + ["--pipeline-parallel-size", "2", "--max-num-batched-tokens", "1024"]
        + ["--no-enable-prefix-caching", "--no-kernel-decode-stack"],
    )
    assert ours == vllm
    e = ours.engine
    assert (e.max_running, e.max_context, e.page_size, e.max_batch_tokens) == (7, 999, 32, 1024)
    assert ours.pp == 2 and not e.enable_prefix_cache
    assert e.kernels == KernelSwitches(decode_stack=False)


def test_a_bad_value_is_named(capsys):
    with pytest.raises(ValueError, match="chunk_size"):
        parse(add_prefill_args, ["--chunk-size", "4096", "--max-batch-tokens", "512"])
    with pytest.raises(ValueError, match=r"pp \(3\) must be a multiple of nnodes"):
        parse(add_prefill_args, ["--pp", "3", "--nnodes", "2", "--dist-init-addr", "h:1"])
    with pytest.raises(ValueError, match="needs bootstrap_port"):
        parse(add_decode_args, ["--elastic"])
    from pdserve.cli import main

    assert main(["decode", "--max-running", "0", "--max-batch-tokens", "0"]) == 2
    assert "max_batch_tokens must be >= 1" in capsys.readouterr().err


def test_an_environment_variable_sets_a_default_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv("PDSERVE_THREADS", "3")
    monkeypatch.setenv("PDSERVE_ADVERTISE_HOST", "198.18.0.7")
    cfg = parse(add_prefill_args, [])
    assert (cfg.engine.threads, cfg.advertise_host) == (3, "198.18.0.7")
    assert parse(add_prefill_args, ["--threads", "1"]).engine.threads == 1  # the flag wins
    monkeypatch.setenv("PDSERVE_THREADS", "many")
    with pytest.raises(SystemExit, match="PDSERVE_THREADS='many'"):
        add_prefill_args(argparse.ArgumentParser())


def test_up_repeats_models_and_a_key_from_the_environment_stays_out_of_help(monkeypatch, capsys):
    assert parse_up_args(["--model", "a", "--model", "b"]).model == ("a", "b")
    assert parse_up_args([]) == UpConfig()
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-not-for-help")
    assert parse_up_args([]).api_key == "sk-not-for-help"
    ap = argparse.ArgumentParser()
    add_up_args(ap)
    assert "sk-not-for-help" not in ap.format_help()


def test_the_engine_reaches_a_rank_whole_and_an_unknown_field_is_refused():
    """RankSpec.engine is JSON: what the front sends, the rank rebuilds exactly (nested switches
    and tuples included), and a field it does not know is an error, not dropped."""
    cfg = parse(add_decode_args, ["--seed", "5", "--no-kernel-sampling", "--model", "m.gguf"])
    sent = json.loads(json.dumps(engine_dict(cfg.engine, threads=1, io_cores=(1,))))
    got = EngineConfig.from_kwargs(model="m.gguf", **sent)
    assert got == dataclasses.replace(cfg.engine, threads=1, spare_cores=(1,))
    with pytest.raises(ValueError, match="unknown EngineConfig fields: page_sz"):
        EngineConfig.from_kwargs(page_sz=16)


def test_generate_takes_the_engine_flags():
    args = parsers()["generate"].parse_args(["--max-num-seqs", "2", "--prompt", "hi"])
    assert config_from_args(EngineConfig, args) == EngineConfig(
        max_running=2, max_total_tokens=8192
    )


def test_only_the_edges_parse_a_command_line():
    """Past the edge, a node runs from its config: no other module imports argparse."""
    pkg = ROOT / "pdserve"
    found = set()
    for path in pkg.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if "argparse" in names:
                found.add(str(path.relative_to(pkg)))
    assert found <= EDGES, sorted(found - EDGES)


def test_the_kv_transfer_settings_are_node_flags_and_their_old_variables_set_defaults(monkeypatch):
    """TransferConfig's settings are a PD node's flags (--transfer-*, --kv-*); the variables that
    set them before (PDSERVE_TRANSFER_PROTOCOL, PDSERVE_KV_*_S) set their defaults at the edge;
    they reach each rank in its spec; a bad value is refused, naming the field."""
    from pdserve.kv_transfer.config import TransferConfig
    from pdserve.pd_common.messages import PDRankSpec

    for name in ("PDSERVE_TRANSFER_PROTOCOL", "PDSERVE_KV_TRANSFER_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    assert parse(add_decode_args, []).transfer == TransferConfig()
    cfg = parse(add_prefill_args, ["--transfer-protocol", "tcp", "--kv-transfer-timeout", "5"])
    assert (cfg.transfer.protocol, cfg.transfer.transfer_timeout_s) == ("tcp", 5.0)
    assert cfg.device == "cpu"  # the node's own device is another setting

    monkeypatch.setenv("PDSERVE_KV_TRANSFER_TIMEOUT_S", "7.5")
    monkeypatch.setenv("PDSERVE_TRANSFER_PROTOCOL", "tcp")
    cfg = parse(add_decode_args, [])
    assert (cfg.transfer.protocol, cfg.transfer.transfer_timeout_s) == ("tcp", 7.5)
    assert parse(add_decode_args, ["--kv-transfer-timeout", "2"]).transfer.transfer_timeout_s == 2

    # to a rank: JSON in its spec, without the rank's own address and the cluster secret
    spec = json.loads(json.dumps(cfg.transfer.to_spec()))
    assert "host" not in spec and "auth_token" not in spec
    rank = TransferConfig.from_spec(spec, "10.0.0.2", "secret")
    assert rank == dataclasses.replace(cfg.transfer, host="10.0.0.2", auth_token="secret")
    assert "transfer" in {f.name for f in dataclasses.fields(PDRankSpec)}

    with pytest.raises(
        ValueError, match=r"transfer_timeout_s \(--kv-transfer-timeout\) must be > 0"
    ):
        parse(add_decode_args, ["--kv-transfer-timeout", "0"])
    monkeypatch.setenv("PDSERVE_TRANSFER_PROTOCOL", "udp")
    with pytest.raises(SystemExit, match="PDSERVE_TRANSFER_PROTOCOL='udp'"):
        add_decode_args(argparse.ArgumentParser())


def test_every_vllm_spelling_is_listed_in_the_router_doc():
    """docs/ROUTER.md lists the flags named as vLLM's: every alias a config declares is there."""
    from pdserve.infra.config_flags import settings_of
    from pdserve.router.config import RouterConfig

    doc = (ROOT / "docs" / "ROUTER.md").read_text()
    aliases = {
        alias
        for cls in (PDNodeConfig, RouterConfig)
        for _, entry in settings_of(cls)
        for alias in entry.spec.aliases
    }
    assert {"--max-num-seqs", "--max-model-len", "--pipeline-parallel-size"} <= aliases
    assert sorted(a for a in aliases if f"`{a}`" not in doc and f"`{a} " not in doc) == []


def test_tp_is_bounded_by_what_a_front_takes_stats_from():
    """--tp at most MAX_TP (64): the front takes no rank's stats past it (runtime/messages.py),
    so a node of more would report stages it cannot read; the flag says so at once."""
    from pdserve.runtime.messages import MAX_TP

    assert NodeConfig(tp=MAX_TP).tp == 64
    with pytest.raises(ValueError, match="tp must be at most 64, got 65"):
        node_config(
            NodeConfig,
            add_node_flags(argparse.ArgumentParser(), NodeConfig).parse_args(["--tp", "65"]),
        )
