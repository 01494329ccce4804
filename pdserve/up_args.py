"""The `pdserve up` command line: its flags, a `--config` file of the same keys, and flags passed
through to the nodes and the router.

- `--node-args`, `--prefill-args`, `--decode-args` and `--router-args` take any value, flags
  included: `--node-args --no-prefix-cache` works as `--node-args=--no-prefix-cache` does (argparse
  alone reads a value that starts with `--` as the next flag and refuses it).
- `--config FILE` (TOML, or YAML for .yaml/.yml) sets any flag by its name (`prefill-pp = 2`, or
  `prefill_pp`); the command line wins over the file. A key that is no flag, or a value of the
  wrong type, is an error naming it. A pass-through flag may be a list of arguments there.
- `--version` prints pdserve's version.
"""

from __future__ import annotations

import argparse
import shlex
import tomllib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pdserve.infra.config_flags import add_flags, config_from_args, setting
from pdserve.infra.logs import FORMAT_ENV, FORMATS, LEVEL_ENV

PASS_THROUGH = ("--node-args", "--prefill-args", "--decode-args", "--router-args")
DESCRIPTION = "a whole local PD cluster: router + prefill + decode nodes"


def pdserve_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


@dataclass(frozen=True)
class UpConfig:
    """`pdserve up`'s settings; each is a flag (infra/config_flags.py) and a --config key."""

    model: tuple[str, ...] = setting(
        (),
        help="GGUF file or Hugging Face folder (default: PDSERVE_MODEL, else "
        "SmolLM2-135M-Instruct); repeat it to serve several models, each on its own prefill and "
        "decode nodes behind the one router, which routes by model",
    )
    host: str = setting("127.0.0.1", env="PDSERVE_ROUTER_HOST", help="router bind address")
    port: int = setting(8000, help="router port")
    # PP 1 + PP 1 by default: on a small host every rank gets a core of its own (measured against
    # PP 2 + PP 2, which puts four ranks on two cores: bench/results/HISTORY.md)
    prefill_pp: int = setting(1, help="pipeline-parallel size of each prefill node")
    decode_pp: int = setting(1, help="pipeline-parallel size of each decode node")
    prefill_tp: int = setting(
        1,
        help="tensor-parallel size of each prefill node's stages: processes per stage, each with "
        "its share of the heads (the model's KV heads must divide by it)",
    )
    decode_tp: int = setting(
        1, help="tensor-parallel size of each decode node's stages (as --prefill-tp)"
    )
    prefill_nodes: int = setting(1, help="prefill nodes per model")
    decode_nodes: int = setting(1, help="decode nodes per model")
    elastic: bool = setting(
        False,
        help="elastic nodes: each may change role at runtime (the router's POST /workers/role; "
        "docs/ROUTER.md)",
    )
    threads: int = setting(
        0,
        help="cores per rank (0: split the host's cores between all ranks, one kept for I/O "
        "when there are more cores than ranks); the plan is printed at start",
    )
    policy: str | None = setting(
        None,
        help="router policy (round_robin, random, power_of_two, least_load, cache_aware)",
    )
    api_key: str | None = setting(
        None,
        env="PDSERVE_API_KEY",
        secret=True,
        help="clients must send 'Authorization: Bearer KEY'",
    )
    node_args: str = setting(
        "", help="extra flags for every node, e.g. --node-args '--max-total-tokens 16384'"
    )
    prefill_args: str = setting("", help="extra flags for the prefill nodes")
    decode_args: str = setting("", help="extra flags for the decode nodes")
    router_args: str = setting("", help="extra flags for the router")
    startup_timeout: float = setting(600.0, help="seconds the nodes and router get to start")
    insecure: bool = setting(
        False,
        help="let the router listen on a non-loopback --host without --api-key: anyone who can "
        "reach it can then use the model",
    )
    # passed on to the router and every node
    log_level: str = setting(
        "INFO", env=LEVEL_ENV, help="INFO, or DEBUG (the router's and every node's)"
    )
    log_format: str = setting(
        "text",
        env=FORMAT_ENV,
        choices=FORMATS,
        help="json: one JSON object per line, with rid and trace_id (every process)",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        help="export OpenTelemetry traces of the router and every node over OTLP/HTTP to this "
        "collector (docs/TRACING.md)",
    )

    def __post_init__(self):
        for name in ("prefill_pp", "decode_pp", "prefill_tp", "decode_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.elastic and max(self.prefill_tp, self.decode_tp) > 1:
            raise ValueError(
                "--elastic: an elastic node has no TP yet (--prefill-tp/--decode-tp 1)"
            )


def add_up_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--version", action="version", version=f"pdserve {pdserve_version()}")
    ap.add_argument(
        "--config",
        default=None,
        help="a TOML (or .yaml) file of these flags by name, e.g. `prefill-pp = 2`; the command "
        "line wins over it",
    )
    add_flags(ap, UpConfig)


def parse_up_args(argv: list[str]) -> UpConfig:
    """The edge: the command line, over the --config file, as an UpConfig."""
    ap = argparse.ArgumentParser(prog="pdserve up", description=DESCRIPTION)
    add_up_args(ap)
    argv = joined_pass_through(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv)[0].config
    if path:
        try:
            ap.set_defaults(**config_defaults(Path(path), ap))
        except (OSError, ValueError, tomllib.TOMLDecodeError) as e:
            ap.error(f"--config {path}: {e}")
    try:
        return config_from_args(UpConfig, ap.parse_args(argv))
    except ValueError as e:
        ap.error(str(e))


def joined_pass_through(argv: list[str]) -> list[str]:
    """`--node-args VALUE` as `--node-args=VALUE`, whatever VALUE starts with."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in PASS_THROUGH and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def config_defaults(path: Path, ap: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's settings as the parser's defaults, each checked against its flag."""
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"not YAML: {e}") from None
    else:
        doc = tomllib.loads(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError("must be a table of flag names and values")
    actions = {a.dest: a for a in ap._actions if a.option_strings}
    out = {}
    for key, value in doc.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None or dest in ("help", "version", "config"):
            raise ValueError(f"unknown setting {key!r}: it is not a `pdserve up` flag")
        out[dest] = _checked(key, value, action)
    return out


def _checked(key: str, value: Any, action: argparse.Action) -> Any:
    flag = action.option_strings[0]
    if flag in PASS_THROUGH and isinstance(value, list):
        value = shlex.join(str(v) for v in value)
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(f"{key!r} must be true or false, not {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"{key!r} must be a string or a list of strings")
        return values
    kind = action.type or str
    wrong = isinstance(value, bool) or not isinstance(value, (str, int, float))
    if wrong or (kind is int and isinstance(value, float)):
        raise ValueError(f"{key!r} must be a {kind.__name__}, not {value!r}")
    try:
        value = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key!r} must be a {kind.__name__}, not {value!r}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{key!r} must be one of {', '.join(map(str, action.choices))}")
    return value
