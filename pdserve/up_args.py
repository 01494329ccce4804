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
import os
import shlex
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pdserve.infra.logs import add_log_args
from pdserve.infra.tracing import add_tracing_arg

PASS_THROUGH = ("--node-args", "--prefill-args", "--decode-args", "--router-args")
DESCRIPTION = "a whole local PD cluster: router + prefill + decode nodes"


def pdserve_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def add_up_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--version", action="version", version=f"pdserve {pdserve_version()}")
    ap.add_argument(
        "--config",
        default=None,
        help="a TOML (or .yaml) file of these flags by name, e.g. `prefill-pp = 2`; the command "
        "line wins over it",
    )
    ap.add_argument(
        "--model",
        action="append",
        default=None,
        help="GGUF file or Hugging Face folder (default: PDSERVE_MODEL, else "
        "SmolLM2-135M-Instruct); repeat it to serve several models, each on its own "
        "prefill and decode nodes behind the one router, which routes by model",
    )
    ap.add_argument(
        "--host",
        default=os.environ.get("PDSERVE_ROUTER_HOST", "127.0.0.1"),
        help="router bind address",
    )
    ap.add_argument("--port", type=int, default=8000, help="router port")
    # PP 1 + PP 1 by default: on a small host every rank gets a core of its own (measured against
    # PP 2 + PP 2, which puts four ranks on two cores: bench/results/HISTORY.md)
    ap.add_argument("--prefill-pp", type=int, default=1)
    ap.add_argument("--decode-pp", type=int, default=1)
    ap.add_argument("--prefill-nodes", type=int, default=1)
    ap.add_argument(
        "--elastic",
        action="store_true",
        help="elastic nodes: each may change role at runtime (the router's POST /workers/role; "
        "docs/ROUTER.md)",
    )
    ap.add_argument("--decode-nodes", type=int, default=1)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="cores per rank (0: split the host's cores between all ranks, one kept for I/O "
        "when there are more cores than ranks); the plan is printed at start",
    )
    ap.add_argument(
        "--policy",
        default=None,
        help="router policy (round_robin, random, power_of_two, least_load, cache_aware)",
    )
    ap.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    ap.add_argument(
        "--node-args",
        default="",
        help="extra flags for every node, e.g. --node-args '--max-total-tokens 16384'",
    )
    ap.add_argument("--prefill-args", default="", help="extra flags for the prefill nodes")
    ap.add_argument("--decode-args", default="", help="extra flags for the decode nodes")
    ap.add_argument("--router-args", default="", help="extra flags for the router")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument(
        "--insecure",
        action="store_true",
        help="let the router listen on a non-loopback --host without --api-key: anyone who can "
        "reach it can then use the model",
    )
    add_log_args(ap)  # passed on to the router and every node
    add_tracing_arg(ap)  # likewise


def parse_up_args(argv: list[str]) -> argparse.Namespace:
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
    return ap.parse_args(argv)


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
