"""`pdserve up`'s command line (pdserve/up_args.py): flags passed through whatever they start with,
a --config file of the same keys under the command line, errors that name the bad key, and
--version. Parsing only: starting clusters is tests/test_up.py's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.up_args import parse_up_args


def test_pass_through_flags_take_values_that_are_flags():
    a = parse_up_args(["--node-args", "--no-prefix-cache", "--prefill-args", "--chunk-size 64"])
    assert (a.node_args, a.prefill_args, a.decode_args) == (
        "--no-prefix-cache",
        "--chunk-size 64",
        "",
    )
    assert parse_up_args(["--router-args=--policy random"]).router_args == "--policy random"


def test_a_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "up.toml"
    cfg.write_text(
        'prefill-pp = 2\ndecode_nodes = 3\nmodel = ["a.gguf", "b.gguf"]\ninsecure = true\n'
        'node-args = ["--max-total-tokens", "16384"]\nlog-level = "DEBUG"\n'
    )
    a = parse_up_args(["--config", str(cfg), "--decode-nodes", "1"])
    assert (a.prefill_pp, a.decode_nodes, a.model, a.insecure) == (2, 1, ("a.gguf", "b.gguf"), True)
    assert a.node_args == "--max-total-tokens 16384" and a.log_level == "DEBUG"
    yml = tmp_path / "up.yaml"
    yml.write_text("prefill-pp: 4\n")
    assert parse_up_args(["--config", str(yml)]).prefill_pp == 4


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("prefil-pp = 2\n", "unknown setting 'prefil-pp'"),
        ('prefill-pp = "two"\n', "'prefill-pp' must be a int"),
        ("prefill-pp = 2.5\n", "'prefill-pp' must be a int"),
        ('insecure = "yes"\n', "'insecure' must be true or false"),
        ('log-format = "xml"\n', "'log-format' must be one of"),
        ("prefill-pp = \n", "--config"),
    ],
)
def test_a_bad_config_names_what_is_wrong(tmp_path, capsys, text, named):
    cfg = tmp_path / "up.toml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_up_args(["--config", str(cfg)])
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_version():
    for argv in (["--version"], ["up", "--version"]):
        out = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", *argv], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0 and out.stdout.startswith("pdserve "), out


def test_tp_sizes_plan_a_core_per_rank_and_an_elastic_node_refuses_them(monkeypatch, capsys):
    """--prefill-tp/--decode-tp: the core plan names every rank of every stage, and a node's
    --cpus lists PP x TP of them (runtime/node_ranks.py reads them in that order)."""
    import os

    import pdserve.up_cores as up_cores
    from pdserve.up_args import UpConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(up_cores, "bind_cores", lambda cores: None)
    said: list[str] = []
    cfg = UpConfig(prefill_pp=2, prefill_tp=2, decode_tp=3, threads=1)
    cpus = up_cores.plan_cluster_cores(cfg, 1, say=said.append)
    assert "x PP 2 x TP 2" in said[0] and "x PP 1 x TP 3" in said[0], said
    assert "prefill-0 pp1 tp1" in said[0] and "decode-0 pp0 tp2" in said[0], said
    prefill, decode = cpus("prefill", 4), cpus("decode", 3)
    p_cores, d_cores = prefill[1].split(";"), decode[1].split(";")
    assert len(p_cores) == 4 and len(d_cores) == 3, (prefill, decode)
    assert not set(p_cores) & set(d_cores)  # a core per rank: 7 ranks on 8 cores
    with pytest.raises(SystemExit) as e:
        parse_up_args(["--elastic", "--decode-tp", "3"])
    assert e.value.code == 2 and "an elastic node has no TP" in capsys.readouterr().err
