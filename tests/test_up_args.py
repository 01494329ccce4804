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
