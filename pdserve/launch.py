"""`pdserve launch ROLE --values FILE`: one process of a deployed cluster, its command line made
from a deployment's values (the Helm chart's values.yaml keys, docs/DEPLOY.md).

The Helm chart, the compose file and the multi-host tests all start their processes through this,
so the flags a deployment gets are written once, here, and a multi-host test breaks when a chart
command would. The values are the chart's own: the chart mounts its merged values as JSON, compose
and the tests pass YAML files (later files override earlier ones key by key, as `helm -f` does).

What each deployment gives on the command line is only where it is: `--host` (the bind address),
`--node-index` (which node of the role) and `--node-rank` (default: the NODE_RANK environment
variable, which the chart sets from the pod's index). The hosts of each node's node-rank 0 are
`leaders.<role>[i]` in the values (the chart fills them in with its service names).

With `autoscaling.enabled` an autoscaler sets each role's node count: the router starts with no
node on its command line (and `--elastic true`, which exports the gauge the autoscaler follows),
and each node's front registers itself and leaves again: `--register join|leave` runs that
(`pdserve register`, pdserve/register_cmd.py) for this pod's node instead of the node, with the
routers at `autoscaling.router` (the chart: a headless Service of the router pods).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

ROLES = ("prefill", "decode", "router")
REGISTER_ACTIONS = ("join", "leave")
# `register leave` may take the drain grace and this: the removal from the routers
# (register_cmd.DEREGISTER_S), the aborts after the grace (runtime/front/drain.py ABORT_WAIT_S)
# and the node's stop
LEAVE_MARGIN_S = 60


class ValuesError(ValueError):
    """The values miss something a command needs, or hold the wrong type: names the key."""


def merge(base: dict, override: dict) -> dict:
    """`override` over `base`, maps merged key by key and anything else replaced (`helm -f`)."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_values(paths: list[Path]) -> dict:
    import yaml  # JSON is YAML: the chart's rendered values load the same way

    values: dict = {}
    for p in paths:
        try:
            doc = yaml.safe_load(Path(p).read_text()) or {}
        except yaml.YAMLError as e:
            raise ValuesError(f"{p}: not YAML: {e}") from e
        if not isinstance(doc, dict):
            raise ValuesError(f"{p}: the values must be a mapping, not {type(doc).__name__}")
        values = merge(values, doc)
    return values


def get(values: dict, dotted: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """values[a][b]... for 'a.b...', type-checked; `default` where missing (None: required)."""
    node: Any = values
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is None:
                raise ValuesError(f"values: `{dotted}` is missing")
            return default
        node = node[part]
    if isinstance(node, bool) and kind is not bool or not isinstance(node, kind):
        raise ValuesError(f"values: `{dotted}` must be {kind}, not {node!r}")
    return node


def _str_list(values: dict, dotted: str) -> list[str]:
    items = get(values, dotted, list, [])
    if not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in items):
        raise ValuesError(f"values: `{dotted}` must be a list of strings, not {items!r}")
    return [str(a) for a in items]


def leader(values: dict, role: str, index: int) -> str:
    """The host of node `index`'s node-rank 0 in `role` (its front, bootstrap and rendezvous)."""
    hosts = _str_list(values, f"leaders.{role}")
    if not 0 <= index < len(hosts):
        raise ValuesError(f"values: `leaders.{role}` has no host for node {index}: {hosts}")
    return hosts[index]


def pods_per_node(values: dict, role: str) -> int:
    pp, per_pod = get(values, f"{role}.pp", int), get(values, f"{role}.ranksPerPod", int)
    if per_pod < 1 or pp % per_pod:
        raise ValuesError(f"values: `{role}.pp` ({pp}) must be a multiple of `{role}.ranksPerPod`")
    return pp // per_pod


def node_argv(values: dict, role: str, index: int, rank: int, host: str) -> list[str]:
    """`pdserve prefill|decode ...` of node `index`, node-rank `rank`, bound to `host`."""
    argv = [role]
    if model := get(values, "model.path", str, ""):
        argv += ["--model", model]
    argv += ["--pp", str(get(values, f"{role}.pp", int)), "--host", host]
    argv += ["--port", str(get(values, f"{role}.port", int))]
    if role == "prefill":
        argv += ["--bootstrap-port", str(get(values, "prefill.bootstrapPort", int))]
    pods = pods_per_node(values, role)
    if not 0 <= rank < pods:
        raise ValuesError(f"node-rank {rank} is not one of the node's {pods} hosts")
    if pods > 1:
        rendezvous = (
            os.environ.get("LWS_LEADER_ADDRESS", "")
            if get(values, "lws.enabled", bool, False)
            else leader(values, role, index)
        )
        if not rendezvous:
            raise ValuesError(
                "lws.enabled: LWS_LEADER_ADDRESS is not set (the LWS controller sets it)"
            )
        dist = f"{rendezvous}:{get(values, f'{role}.distPort', int)}"
        argv += ["--nnodes", str(pods), "--node-rank", str(rank), "--dist-init-addr", dist]
    argv += ["--device", get(values, f"{role}.device", str, "cpu")]
    if threads := get(values, f"{role}.threads", int, 0):
        argv += ["--threads", str(threads)]
    argv += ["--drain-grace", str(get(values, "drain.graceSeconds", int | float, 30))]
    return argv + _str_list(values, f"{role}.extraArgs")


def autoscaled(values: dict) -> bool:
    return get(values, "autoscaling.enabled", bool, False)


def router_argv(values: dict, host: str) -> list[str]:
    """`pdserve router ...` over every prefill and decode node of the values (none when they are
    autoscaled: they register themselves)."""
    argv = ["router", "--host", host, "--port", str(get(values, "router.port", int))]
    if autoscaled(values):
        argv += ["--elastic", "true"]
    else:
        boot = get(values, "prefill.bootstrapPort", int)
        for i in range(get(values, "prefill.replicas", int)):
            url = f"http://{leader(values, 'prefill', i)}:{get(values, 'prefill.port', int)}"
            argv += ["--prefill", url, str(boot)]
        for i in range(get(values, "decode.replicas", int)):
            url = f"http://{leader(values, 'decode', i)}:{get(values, 'decode.port', int)}"
            argv += ["--decode", url]
    if policy := get(values, "router.policy", str, ""):
        argv += ["--policy", policy]
    return argv + _str_list(values, "router.extraArgs")


def argv_for(values: dict, role: str, index: int, rank: int, host: str) -> list[str]:
    if role == "router":
        return router_argv(values, host)
    if autoscaled(values):  # the autoscaler counts the nodes; none is named in `leaders`
        if pods_per_node(values, role) > 1 and not get(values, "lws.enabled", bool, False):
            raise ValuesError(f"autoscaling {role} nodes of several pods needs `lws.enabled`")
    else:
        replicas = get(values, f"{role}.replicas", int)
        if not 0 <= index < replicas:
            raise ValuesError(f"--node-index {index}: the values have {replicas} {role} node(s)")
    return node_argv(values, role, index, rank, host)


def leave_deadline(values: dict) -> int | float:
    return get(values, "drain.graceSeconds", (int, float), 30) + LEAVE_MARGIN_S


def register_argv(values: dict, role: str, action: str, rank: int, host: str) -> list[str]:
    """`pdserve register join|leave ...` of this pod's node; `host`: its front's address here."""
    if role == "router" or not autoscaled(values):
        raise ValuesError("--register is for prefill and decode nodes with `autoscaling.enabled`")
    if rank != 0:
        raise ValuesError(f"node-rank {rank}: only node-rank 0, the node's front, registers")
    router = f"http://{get(values, 'autoscaling.router', str)}:{get(values, 'router.port', int)}"
    node = f"http://{host}:{get(values, f'{role}.port', int)}"
    argv = ["register", action, "--router", router, "--node", node]
    if action == "leave":
        return argv + ["--deadline", str(leave_deadline(values))]
    argv += ["--role", role]
    if role == "prefill":
        argv += ["--bootstrap-port", str(get(values, "prefill.bootstrapPort", int))]
    argv += ["--wait", str(get(values, "autoscaling.waitSeconds", int, 600))]
    return argv + ["--every", str(get(values, "autoscaling.intervalSeconds", int, 30))]


def add_launch_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("role", choices=ROLES)
    ap.add_argument(
        "--values",
        action="append",
        required=True,
        type=Path,
        help="the deployment's values (YAML or JSON, the Helm chart's keys); repeat to override",
    )
    ap.add_argument("--host", required=True, help="the address this process listens on")
    ap.add_argument("--node-index", type=int, default=0, help="which node of the role")
    ap.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this host's rank within its node (default: $NODE_RANK, else 0)",
    )
    ap.add_argument(
        "--register",
        choices=REGISTER_ACTIONS,
        help="instead of the node: its front joins or leaves the routers (autoscaling.enabled)",
    )
    ap.add_argument("--print", action="store_true", help="print the command and exit")


def launch_main(args: argparse.Namespace) -> int:
    rank = args.node_rank
    try:
        if rank is None:
            rank = int(os.environ.get("NODE_RANK", "0"))
        values = load_values(args.values)
        argv = (
            register_argv(values, args.role, args.register, rank, args.host)
            if args.register
            else argv_for(values, args.role, args.node_index, rank, args.host)
        )
    except (OSError, ValueError) as e:  # ValuesError, a bad NODE_RANK, YAML errors
        print(f"pdserve launch: error: {e}", file=sys.stderr)
        return 2
    print(f"pdserve launch: pdserve {shlex.join(argv)}", file=sys.stderr, flush=True)
    if args.print:
        return 0
    from pdserve.cli import main

    return main(argv)
